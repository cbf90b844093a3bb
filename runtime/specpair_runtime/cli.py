"""The ``specpair-runtime`` command line: generate, check, bench (and serve).

stdout carries only the result (text, or one JSON object with ``--json``);
logs and progress go to stderr. Bad arguments get one line on stderr naming
the problem and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, get_args

from specpair_runtime.config import ConfigError, ModelSpec, Quantization, SpeculationKnobs
from specpair_runtime.openmp import apply_openmp_defaults
from specpair_runtime.termination import write_termination_message

if TYPE_CHECKING:
    from specpair_runtime.engine.pair import LoadedPair

log = logging.getLogger("specpair_runtime")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
MAX_DEPTH = 16  # SpeculationKnobs.max_depth's upper bound


class UsageError(Exception):
    """A bad argument found after parsing (a model dir without config.json, ...)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# --- argument types: each names what is wrong with the value -----------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def depth(text: str) -> int:
    value = positive_int(text)
    if value > MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DEPTH}, got {value}")
    return value


def depth_list(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of depths, got {text!r}")
    return sorted({depth(part) for part in parts})


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 means greedy), got {value}")
    return value


def top_p(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def probability(text: str) -> float:
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def model_source(text: str) -> str:
    """A path that exists, or a pvc:// / hf:// source (checked when loading)."""
    if text.startswith(("hf://", "pvc://")):
        return text
    if "://" in text:
        raise argparse.ArgumentTypeError(f"unknown scheme in {text!r} (use a path, pvc://, hf://)")
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such directory or .gguf file: {text}")
    return text


def existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def output_png(text: str) -> Path:
    path = Path(text).expanduser()
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"must be a .png file name, got {text!r}")
    if not path.parent.resolve().is_dir():
        raise argparse.ArgumentTypeError(f"directory does not exist: {path.parent}")
    return path


# --- shared option groups ------------------------------------------------------

DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_model_options(parser: argparse.ArgumentParser, *, draft_required: bool) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target", required=True, type=model_source, metavar="SRC",
        help="target model: HF directory, .gguf file, pvc://claim/path or hf://org/name[@rev]",
    )  # fmt: skip
    group.add_argument(
        "--draft", required=draft_required, type=model_source, metavar="SRC",
        help="draft model, same forms as --target",
    )  # fmt: skip
    group.add_argument("--device", help="torch device (default: cuda if present, else cpu)")
    group.add_argument(
        "--dtype", choices=DTYPES, default="auto",
        help="target dtype (auto: float32 on cpu, bfloat16 on cuda)",
    )  # fmt: skip
    group.add_argument(
        "--draft-dtype", choices=DTYPES, default=None, help="draft dtype (default: --dtype)"
    )
    group.add_argument(
        "--draft-quantization", choices=get_args(Quantization), default="none",
        help="a cheaper draft on the cpu: int4-weight (int4 weights, bf16 activations) or "
        "int8-dynamic (int8 activations too: lower acceptance); "
        "the target is never quantized, so the output does not change",
    )  # fmt: skip


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculation")
    group.add_argument(
        "--depth", type=depth, default=4, metavar="K", help="max tokens drafted per step (1-16)"
    )
    group.add_argument(
        "--fixed-depth", action="store_true", help="always draft --depth tokens (no adaptive depth)"
    )
    group.add_argument(
        "--draft-confidence",
        type=probability,
        default=None,
        metavar="P",
        help="stop a row's drafts below this draft probability (0 = off; default "
        "on the CPU with adaptive depth: the break-even acceptance from the measured "
        "costs, 0.5 until measured; off on CUDA)",
    )


def add_sampling_options(parser: argparse.ArgumentParser, *, default_max_new: int) -> None:
    group = parser.add_argument_group("decoding")
    group.add_argument("--max-new-tokens", type=positive_int, default=default_max_new, metavar="N")
    group.add_argument(
        "--temperature", type=temperature, default=0.0, metavar="T", help="0 = greedy"
    )
    group.add_argument("--top-p", type=top_p, default=1.0, metavar="P")
    group.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="0 = off")
    group.add_argument("--seed", type=int, default=None, metavar="S")
    group.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )


def model_specs(
    args: argparse.Namespace, *, with_draft: bool
) -> tuple[ModelSpec, ModelSpec | None]:
    target = ModelSpec(source=args.target, dtype=args.dtype)
    if not with_draft or args.draft is None:
        return target, None
    draft = ModelSpec(
        source=args.draft,
        dtype=args.draft_dtype or args.dtype,
        quantization=args.draft_quantization,
    )
    return target, draft


def knobs_from(args: argparse.Namespace) -> SpeculationKnobs:
    return SpeculationKnobs(
        max_depth=args.depth,
        min_depth=args.depth if args.fixed_depth else 1,
        adaptive=not args.fixed_depth,
        draft_confidence=args.draft_confidence,
    )


def load(args: argparse.Namespace, *, with_draft: bool, keep_plain: bool = False) -> LoadedPair:
    from specpair_runtime.cpu_threads import apply_cpu_threads
    from specpair_runtime.engine.pair import load_pair

    threads, why = apply_cpu_threads(None)  # a pod's CPU quota caps torch's default
    log.debug("cpu threads: %d (%s)", threads, why)
    target, draft = model_specs(args, with_draft=with_draft)
    return load_pair(target, draft, knobs_from(args), args.device, keep_plain=keep_plain)


def write_json(document: object) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


# --- generate --------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from specpair_runtime.engine.api import SamplingParams
    from specpair_runtime.engine.oneshot import run_request
    from specpair_runtime.engine.options import EngineOptions
    from specpair_runtime.engine.prompting import encode_prompt

    if args.draft is None and not args.no_speculation:
        raise UsageError("argument --draft: required unless --no-speculation is given")
    pair = load(args, with_draft=not args.no_speculation)
    if pair.speculation_refused and not args.no_speculation:
        log.warning("speculation refused: %s", pair.speculation_refused)
    prompt_ids = encode_prompt(pair.target.tokenizer, args.prompt, chat=args.chat)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    # KV storage for this one request only (the default sizes a serving batch).
    options = EngineOptions(max_slots=1, max_length=len(prompt_ids) + args.max_new_tokens)
    engine = pair.engine(speculate=not args.no_speculation, options=options)
    on_text = None if args.json else _stream_stdout
    completion = run_request(engine, prompt_ids, params, on_text=on_text)
    stats = completion.stats
    summary = {
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "target_passes": stats.target_passes,
        "tokens_per_second": stats.tokens_per_second,
    }
    if args.json:
        write_json({"text": completion.text, "token_ids": completion.token_ids, "stats": summary})
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(
            f"[{len(completion.token_ids)} tokens, {stats.tokens_per_second:.2f} tokens/s, "
            f"acceptance {stats.acceptance_rate:.2f} ({stats.accepted_tokens}/"
            f"{stats.drafted_tokens}), {stats.target_passes} target passes, "
            f"finish: {completion.finish_reason}]",
            file=sys.stderr,
        )
    return EXIT_OK


def _stream_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# --- check -----------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from specpair_runtime.golden import load_golden

    golden = load_golden(args.golden) if args.golden is not None else None
    pair = load(args, with_draft=True)
    assert pair.alignment is not None
    report: dict[str, Any] = pair.alignment.to_dict()
    passed = pair.alignment.aligned
    if golden is not None:
        from specpair_runtime.engine.golden_check import run_golden

        golden_report = run_golden(golden, pair)
        report["near_tie_margin"] = golden_report.near_tie_margin
        report["prompts"] = [result.to_dict() for result in golden_report.results]
        passed = passed and golden_report.passed
    report["passed"] = passed
    if args.json:
        write_json(report)
    else:
        print_check(report)
    return EXIT_OK if passed else EXIT_FAILED


def print_check(report: dict[str, Any]) -> None:
    print(f"aligned: {'yes' if report['aligned'] else 'no'}")
    for problem in report["problems"]:
        print(f"  problem: {problem}")
    for note in report["notes"]:
        print(f"  note: {note}")
    for result in report.get("prompts", []):
        status = "pass" if result["passed"] else "FAIL"
        print(f"golden {result['name']}: {status} ({len(result['token_ids'])} tokens)")
        for failure in result["failures"]:
            print(f"  {failure}")
        for note in result.get("notes", []):
            print(f"  note: {note}")
    print("PASSED" if report["passed"] else "FAILED")


# --- bench -----------------------------------------------------------------------


CHECKOUT = Path(__file__).resolve().parents[2]
BENCH_HARNESS = "bench.engine_harness"


def bench_harness() -> Any:
    """The benchmark harness (``bench/engine_harness.py``) of the checkout this runs from.

    The harness is not part of the product package, so the runtime image has
    no ``bench``: it measures, it does not serve.
    """
    if not (CHECKOUT / "bench" / "engine_harness.py").is_file():
        raise UsageError(
            "bench runs from a checkout of the specpair repo (bench/engine_harness.py); "
            "this installation has none"
        )
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(BENCH_HARNESS)


def cmd_bench(args: argparse.Namespace) -> int:
    harness = bench_harness()
    pair = load(args, with_draft=True, keep_plain=True)  # plain weights: HF's stock kernels
    if pair.speculation_refused:
        raise UsageError(f"cannot benchmark speculation: {pair.speculation_refused}")
    settings = harness.BenchSettings(
        prompts=args.prompt or None,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        depths=args.depths,
        adaptive=not args.no_adaptive,
        hf_assisted=not args.no_hf_assisted,
        repeats=args.repeats,
        runs=args.runs,
        structured=not args.no_structured,
    )
    result = harness.run_bench(pair, settings)
    if args.json:
        write_json(result.to_dict())
    else:
        print(harness.format_table(result))
    if args.plot is not None:
        harness.plot(result, args.plot)
        log.info("wrote %s", args.plot)
    return EXIT_OK


# --- parser ----------------------------------------------------------------------


def add_serve_command(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``serve`` when the server package is present; imported lazily."""
    if importlib.util.find_spec("specpair_runtime.server.command") is None:
        return
    from specpair_runtime.server import command

    command.add_parser(subparsers)


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="specpair-runtime",
        description="Speculative decoding with a target/draft model pair.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logs on stderr (-vv: debug)"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = subparsers.add_parser("generate", help="decode one prompt")
    add_model_options(generate, draft_required=False)
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument(
        "--chat", action="store_true", help="apply the chat template (prompt = user message)"
    )
    add_sampling_options(generate, default_max_new=64)
    add_speculation_options(generate)
    generate.add_argument(
        "--no-speculation", action="store_true", help="decode with the target only"
    )
    generate.add_argument("--json", action="store_true", help="print one JSON object")
    generate.set_defaults(handler=cmd_generate)

    check = subparsers.add_parser("check", help="alignment and golden prompts; exit 0 if all pass")
    add_model_options(check, draft_required=True)
    check.add_argument("--golden", type=existing_file, metavar="FILE", help="golden-prompt YAML")
    add_speculation_options(check)
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(handler=cmd_check)

    add_bench_command(subparsers)
    add_serve_command(subparsers)
    from specpair_runtime.sidecar import command as gate_command

    gate_command.add_parser(subparsers)
    return parser


def add_bench_command(subparsers: argparse._SubParsersAction[Any]) -> None:
    """``bench``: the engine benchmark (from a checkout, ``bench/engine_harness.py``)."""
    bench = subparsers.add_parser(
        "bench", help="target-only vs specpair vs transformers assisted generation"
    )
    add_model_options(bench, draft_required=True)
    bench.add_argument(
        "--prompt", action="append", default=[], help="prompt (repeatable; default: 3 built in)"
    )
    bench.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True,
        help="apply the chat template (default: on)",
    )  # fmt: skip
    bench.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N")
    bench.add_argument(
        "--depths", type=depth_list, default=[4], metavar="K,K,...",
        help="fixed depths to sweep, e.g. 1,2,4",
    )  # fmt: skip
    bench.add_argument(
        "--no-adaptive",
        action="store_true",
        help="skip the run with the default knobs (adaptive depth)",
    )
    bench.add_argument("--no-hf-assisted", action="store_true", help="skip HF assisted generation")
    bench.add_argument(
        "--no-structured",
        action="store_true",
        help="skip the JSON-schema rows (target-only and default under one grammar)",
    )
    bench.add_argument("--repeats", type=positive_int, default=1, metavar="N")
    bench.add_argument(
        "--runs",
        type=positive_int,
        default=1,
        metavar="N",
        help="rounds of all modes; ratios are medians over rounds with their spread",
    )
    bench.add_argument("--plot", type=output_png, metavar="FILE.png", help="tokens/s per depth")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(handler=cmd_bench, depth=4, fixed_depth=False, draft_confidence=None)


def configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if verbosity == 0:
        # transformers' own warnings and weight-loading bars would drown the result.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


def _usage_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "bad input": one line, exit 2."""
    from specpair_runtime.engine.loading import LoadError
    from specpair_runtime.engine.prompting import PromptError

    return (UsageError, ConfigError, LoadError, PromptError)


def main(argv: Sequence[str] | None = None) -> int:
    # Before any command imports torch: libgomp reads its settings once, on load.
    apply_openmp_defaults()
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    prog = f"{parser.prog} {args.command}"
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_FAILED
    except Exception as error:
        if args.command == "serve":  # in a pod: the reason shows in the pod's status
            write_termination_message(f"{prog}: {type(error).__name__}: {error}")
        if isinstance(error, _usage_errors()):
            print(f"{prog}: error: {error}", file=sys.stderr)
            return EXIT_USAGE
        if args.verbose >= 2:
            raise
        print(f"{prog}: failed: {type(error).__name__}: {error} (-vv shows the traceback)",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
