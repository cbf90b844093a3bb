"""Build the tiny demo pair baked into the CPU runtime image, and the demo sample.

    python -m tools.make_demo_models --output /opt/specpair/models/demo
        writes a tiny random Llama target and a noisy copy as its draft (Hugging
        Face layout, with a tokenizer and chat template) to OUTPUT/target and
        OUTPUT/draft. Deterministic: the same files on every build.
    python -m tools.make_demo_models --sample crds/samples/cpu-pair.yaml
        prints that SpeculativePair with its target and draft pointed at the
        baked demo models (with their real size hints) and small CPU resources,
        for a cluster that runs the CPU image (`make images`).

The models come from tools/tiny_models.py, the same ones the tests
use: no download, nothing from a model hub. They say nothing sensible; they
show the machinery (placement, rollout, streaming, metrics) on a laptop.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_OUTPUT = Path("/opt/specpair/models/demo")
SEED = 0
DRAFT_NOISE = 0.08


def size_hints(model: Any) -> dict[str, int]:
    """The planner's size block of a transformers model."""
    config = model.config
    return {
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "layers": int(config.num_hidden_layers),
        "kvHeads": int(config.num_key_value_heads),
        "headDim": int(config.hidden_size // config.num_attention_heads),
    }


def build(output: Path) -> dict[str, dict[str, int]]:
    """Write the pair under ``output``; return the size hints of target and draft."""
    from tools.tiny_models import build_pair, save_model

    pair = build_pair("llama", SEED, DRAFT_NOISE)
    save_model(pair.target, pair.tokenizer, output / "target")
    save_model(pair.draft, pair.tokenizer, output / "draft")
    return {"target": size_hints(pair.target), "draft": size_hints(pair.draft)}


def demo_sample(
    sample: dict[str, Any],
    sizes: dict[str, dict[str, int]],
    root: Path,
    runtime_image: str | None = None,
) -> dict[str, Any]:
    """``sample`` with the demo models, float32, and resources a laptop has."""
    spec = sample["spec"]
    if runtime_image:
        spec["runtimeImage"] = runtime_image
    for role in ("target", "draft"):
        model = spec[role]
        model["source"] = str(root / role)
        model["dtype"] = "float32"
        model["size"] = sizes[role]
        model.pop("revision", None)
    spec["version"] = f"{spec['version']}-demo"
    spec["resources"] = {"gpus": 0, "cpu": "1", "memory": "2Gi"}
    return sample


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Where to write.")
    parser.add_argument(
        "--sample", type=Path, help="Print this SpeculativePair pointed at the demo models."
    )
    parser.add_argument("--runtime-image", help="With --sample: the runtime image to run.")
    args = parser.parse_args(argv)
    if args.sample is not None:
        try:
            sample = yaml.safe_load(args.sample.read_text())
        except OSError as error:
            print(f"error: --sample {args.sample}: {error.strerror}", file=sys.stderr)
            return 2
        if not isinstance(sample, dict) or not isinstance(sample.get("spec"), dict):
            print(f"error: --sample {args.sample}: not a SpeculativePair", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as scratch:
            sizes = build(Path(scratch))
        demo = demo_sample(sample, sizes, args.output, args.runtime_image)
        print(yaml.safe_dump(demo, sort_keys=False), end="")
        return 0
    sizes = build(args.output)
    print(f"wrote {args.output}/target and {args.output}/draft: {sizes}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
