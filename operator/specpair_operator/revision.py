"""The pair revision: one hash of everything that must move together.

One pod template carries the whole pair, so a new revision rolls both models
out at once. The hash covers (camelCase spec paths):

- ``version``;
- ``target`` and ``draft``: ``source``, ``revision``, ``ggufFile``, ``dtype``,
  ``quantization``. The tokenizer and the chat template live in the model
  directory, so the source and its revision pin them;
- ``runtimeImage``;
- ``serving`` and ``goldenPrompts``: they are in the runtime config file,
  which the runtime reads only at start. An optional field left unset (the
  runtime's default applies) stays out of the hash (see `_set_fields`), so a
  pair that does not use a field added in a later release keeps its revision
  when the operator is upgraded, instead of rolling all its pods;
- whether the draft is loaded at all (the placement: ``Colocated`` loads it,
  ``TargetOnly`` does not), because that changes what the pod loads.

It leaves out what can change without moving the models: ``replicas``,
``rollout``, ``resources``, ``scheduling``, the size hints, and the live
``speculation`` knobs, which the runtime applies without a restart.

With ``engine: vllm`` the hash also covers what vLLM reads only at start:
its image and extra arguments, the tensor-parallel size, and the
speculative config (depth, depth table, or none). vLLM takes no knob live,
so a depth change is a new revision, gated and rolled out as one unit. A
specpair pair's inputs have no engine entry, so its revisions do not move.
"""

from __future__ import annotations

import hashlib
import json

from specpair_operator.api import RUNTIME_SERVING_OPTIONS, PairModel, SpeculativePairSpec
from specpair_runtime.config import ContractModel

REVISION_LENGTH = 10
_MODEL_FIELDS = {"source", "revision", "gguf_file", "dtype", "quantization"}


def _model_identity(model: PairModel) -> dict[str, object]:
    return model.model_dump(include=_MODEL_FIELDS, by_alias=True, mode="json")


def _set_fields(model: ContractModel, optional: tuple[str, ...]) -> dict[str, object]:
    """The model's camelCase dump without those ``optional`` fields that are unset (None)."""
    unset = {name for name in optional if getattr(model, name) is None}
    return model.model_dump(exclude=unset, by_alias=True, mode="json")


def _vllm_inputs(spec: SpeculativePairSpec, *, draft_loaded: bool) -> dict[str, object]:
    from specpair_operator.engines.vllm import image
    from specpair_operator.engines.vllm_args import speculative_config

    tp = max(spec.resources.gpus, 1)
    speculate = draft_loaded and spec.speculation.enabled
    return {
        "name": "vllm",
        "image": image(spec),
        "extraArgs": list(spec.vllm.extra_args) if spec.vllm is not None else [],
        "tensorParallelSize": tp,
        "speculativeConfig": speculative_config(spec, tp) if speculate else None,
    }


def revision_inputs(spec: SpeculativePairSpec, *, draft_loaded: bool) -> dict[str, object]:
    """The exact document that is hashed (defaults filled in by the model)."""
    golden = spec.golden_prompts
    engine = _vllm_inputs(spec, draft_loaded=draft_loaded) if spec.engine == "vllm" else None
    return {
        **({"engine": engine} if engine is not None else {}),
        "version": spec.version,
        "target": _model_identity(spec.target),
        "draft": _model_identity(spec.draft),
        "runtimeImage": spec.runtime_image,
        "serving": _set_fields(spec.serving, RUNTIME_SERVING_OPTIONS),
        "goldenPrompts": None if golden is None else _set_fields(golden, ("near_tie_margin",)),
        "draftLoaded": draft_loaded,
    }


def compute_revision(spec: SpeculativePairSpec, *, draft_loaded: bool) -> str:
    """A short, stable hex hash (a valid label value and name suffix)."""
    canonical = json.dumps(
        revision_inputs(spec, draft_loaded=draft_loaded), sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]
