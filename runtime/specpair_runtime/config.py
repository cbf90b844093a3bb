"""The runtime config file: the contract between the operator and the runtime.

The operator renders this file into a ConfigMap; the runtime loads it with
``specpair-runtime serve --config FILE``. This module is a *contract module*:
it must never import torch, transformers, kopf or kubernetes.

YAML keys are lowerCamelCase (Kubernetes style); Python attributes are
snake_case. Unknown keys are rejected so that a typo names its field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["none", "int8-dynamic", "int4-weight"]
PrefillOrder = Literal["shortest-first", "arrival"]


def recommended_draft_quantization(device_type: str) -> Quantization:
    """What the demo and the benchmarks run the draft with on a device of this type.

    int4-weight on the CPU: cheaper than fp32 and accepted nearly as often
    (engine/int4_linears.py has the numbers), also where oneDNN has no native
    bf16 (an AVX2-only AMD EPYC: 1.71x target-only against 1.33x for the fp32
    draft, docs/benchmarks-history.md); nothing on CUDA, where the draft's bf16
    forward is cheap already.
    """
    return "int4-weight" if device_type == "cpu" else "none"


# The draft-confidence stop (transformers' assisted generation stops drafting at 0.4 by
# default): on by default on the CPU only. On CUDA the check reads the draft's
# probabilities back once per draft forward, which breaks the step's single host sync.
# Unset with adaptive depth, the threshold follows the measured costs
# (``CostModel.break_even_confidence``); this value serves until they are measured.
DEFAULT_DRAFT_CONFIDENCE = {"cpu": 0.5}


def resolved_draft_confidence(knobs: SpeculationKnobs, device_type: str) -> float:
    """The confidence stop's fixed threshold (0 = never), or its start-up value.

    Unset, it is the device's default with adaptive depth, and 0 with a fixed
    depth (a fixed depth drafts exactly ``maxDepth`` tokens).
    """
    if knobs.draft_confidence is not None:
        return knobs.draft_confidence
    return DEFAULT_DRAFT_CONFIDENCE.get(device_type, 0.0) if knobs.adaptive else 0.0


def measured_draft_confidence(knobs: SpeculationKnobs, device_type: str) -> bool:
    """True when the threshold follows the measured costs: unset, with adaptive depth,
    on a device where the stop is on by default."""
    return knobs.draft_confidence is None and resolved_draft_confidence(knobs, device_type) > 0


def resolved_during_prefill(knobs: SpeculationKnobs, device_type: str) -> bool:
    """Whether steps that read a prompt chunk speculate: the knob, else all but the CPU."""
    if knobs.during_prefill is not None:
        return knobs.during_prefill
    return device_type != "cpu"


class ContractModel(BaseModel):
    """Base for contract models: camelCase aliases, no unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    def to_wire(self) -> dict[str, object]:
        """The camelCase dict that goes into YAML/JSON."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


class PairInfo(ContractModel):
    name: str = Field(min_length=1, description="Name of the SpeculativePair.")
    version: str = Field(min_length=1, description="The pair's version label.")


class ModelSpec(ContractModel):
    """Where one model of the pair comes from and how it is loaded."""

    source: str = Field(
        min_length=1,
        description=(
            "A local directory in Hugging Face layout, a .gguf file, "
            "pvc://claim/path (mounted at /models/<claim>/<path>), or hf://org/name."
        ),
    )
    revision: str | None = Field(default=None, description="Model revision (hf:// only).")
    gguf_file: str | None = Field(
        default=None, description="GGUF file name inside `source` when it is a directory."
    )
    dtype: Dtype = Field(
        default="auto",
        description="Weights dtype; auto picks float32 on the CPU and bfloat16 on CUDA.",
    )
    quantization: Quantization = Field(
        default="none",
        description=(
            "Weight quantization, CPU only. int4-weight keeps the activations in bf16 "
            "(int4 weights in groups of 32; the draft keeps most of its acceptance); int8-dynamic "
            "quantizes activations too (lower acceptance, the more rows share a call). "
            "Only allowed for the draft, so the target's output never changes."
        ),
    )


class SpeculationKnobs(ContractModel):
    """Knobs the runtime applies live, without a restart."""

    enabled: bool = Field(default=True, description="Speculate at all.")
    max_depth: int = Field(default=4, ge=1, le=16, description="Max tokens drafted per step.")
    min_depth: int = Field(default=1, ge=1, le=16, description="Min depth for adaptive depth.")
    adaptive: bool = Field(default=True, description="Depth follows the measured acceptance.")
    draft_confidence: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description=(
            "A request stops drafting in a step once the product of the draft's "
            "probabilities of its drafts so far is below this (0 disables). Default on "
            "the CPU with adaptive depth: the break-even acceptance of one more draft "
            "token from the measured step costs (0.5 until measured); off on CUDA and "
            "with a fixed depth."
        ),
    )
    disable_above_batch_size: int | None = Field(
        default=None, ge=1, description="Pause speculation while the running batch is larger."
    )
    during_prefill: bool | None = Field(
        default=None,
        description=(
            "Speculate in steps that also read a prompt chunk (chunked prefill). Default: "
            "on, except on the CPU, where such a step is bound by its arithmetic: there "
            "the verify tokens slow the prompts' reading about as much as they speed up "
            "the decoding requests, so the decoding requests take one token per step "
            "until the waiting prompts are read."
        ),
    )
    acceptance_floor: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Rolling acceptance over acceptanceWindow speculation steps below this turns "
            "speculation off until the knobs change or the runtime restarts: the "
            "acceptance_floor fallback in /metrics (0 disables)."
        ),
    )
    acceptance_window: int = Field(
        default=64, ge=1, description="Speculation steps in the rolling acceptance window."
    )
    memory_pressure_threshold: float = Field(
        default=0.95,
        gt=0.0,
        le=1.0,
        description="Above this fraction of device memory in use, stop speculating.",
    )

    @model_validator(mode="after")
    def _depth_order(self) -> SpeculationKnobs:
        if self.min_depth > self.max_depth:
            raise ValueError(f"minDepth ({self.min_depth}) must be <= maxDepth ({self.max_depth})")
        return self


class OutputFilter(ContractModel):
    """A deny-list applied to verified text only."""

    deny_patterns: list[str] = Field(
        default_factory=list, description="Regexes; a match ends the response (content_filter)."
    )


class ServingOptions(ContractModel):
    host: str = Field(default="127.0.0.1", description="Address to bind.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port to bind.")
    max_batch_size: int = Field(default=8, ge=1, description="Max running requests.")
    max_model_length: int = Field(default=2048, ge=16, description="Prompt + output tokens.")
    max_waiting_requests: int = Field(default=64, ge=0, description="Queue bound; then 429.")
    max_step_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Tokens per engine step over all running requests; a long prompt enters in "
            "chunks that fit beside the running decodes. Default: measured (engine/budget.py), "
            "starting at 32 on the CPU and 2048 on CUDA."
        ),
    )
    cuda_graphs: bool = Field(
        default=True,
        description=(
            "On CUDA, replay decode/verify steps as CUDA graphs, each shape recorded before "
            "the pod turns ready (seconds)."
        ),
    )
    cuda_graph_compile: bool = Field(
        default=False,
        description=(
            "With cudaGraphs: record torch.compile's fused step (mode reduce-overhead) "
            "instead of capturing the eager step. Compiles take minutes at start-up."
        ),
    )
    prefill_order: PrefillOrder = Field(
        default="shortest-first",
        description=(
            "Which waiting prompt reads its chunk first: shortest-first (the fewest tokens "
            "left, each step waited counting as one token read) or arrival (oldest first)."
        ),
    )
    prefix_reuse: bool = Field(
        default=True,
        description=(
            "A new request skips the longest prefix of its prompt (a shared system prompt, "
            "an earlier chat turn) whose keys and values a KV slot still holds. Off: every "
            "prompt is read in full, so no request's timing depends on another's prompt."
        ),
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description=(
            "Threads for torch's CPU kernels. Default: OMP_NUM_THREADS when set, else "
            "torch's default capped by the cgroup's CPU quota (cpu_threads.py)."
        ),
    )
    api_key_file: str | None = Field(
        default=None,
        description=(
            "File holding the Bearer key, or a YAML list of keys with a name and a "
            "priority class each; re-read when it changes."
        ),
    )
    golden_prompts_file: str | None = Field(
        default=None, description="Golden-prompt file checked before /readyz turns ready."
    )
    output_filter: OutputFilter | None = Field(default=None, description="Verified-text filter.")
    drain_timeout_seconds: float = Field(
        default=30.0, gt=0, description="SIGTERM: how long in-flight requests may finish."
    )
    max_request_body_bytes: int | None = Field(
        default=None,
        ge=1024,
        description=(
            "Largest request body; larger ones get 413 before they are read. "
            "Default: derived from maxModelLength (see request_body_limit)."
        ),
    )
    header_timeout_seconds: float = Field(
        default=10.0, gt=0, description="A request's headers must arrive within this time (408)."
    )
    body_timeout_seconds: float = Field(
        default=30.0, gt=0, description="A request's body must arrive within this time (408)."
    )

    @property
    def request_body_limit(self) -> int:
        """The body limit in bytes: the configured one, else one that fits any usable prompt.

        A token is rarely longer than 16 characters and a character takes at most
        6 bytes in JSON (a ``\\uXXXX`` escape); 64 KiB covers the other fields.
        """
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return 64 * 1024 + self.max_model_length * 16 * 6


class RuntimeConfig(ContractModel):
    """The whole runtime config file."""

    pair: PairInfo
    target: ModelSpec
    draft: ModelSpec
    speculation: SpeculationKnobs = Field(default_factory=SpeculationKnobs)
    serving: ServingOptions = Field(default_factory=ServingOptions)

    @model_validator(mode="after")
    def _target_unquantized(self) -> RuntimeConfig:
        if self.target.quantization != "none":
            raise ValueError(
                "target.quantization must be 'none': only the draft may be quantized, "
                "so the output keeps the target's distribution"
            )
        return self


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the field."""


def describe_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One clause per problem, each naming its field path in camelCase after ``prefix``.

    A model-level problem (empty path) is named by the prefix itself, or "(root)".
    """
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"])
        path = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or "(root)")
        message = str(item["msg"]).removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return "; ".join(lines)


def parse_runtime_config(data: object) -> RuntimeConfig:
    """Validate a decoded YAML/JSON document; raise ConfigError naming the field."""
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def load_runtime_config(path: Path) -> RuntimeConfig:
    """Read and validate a runtime config file."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_runtime_config(data)


def dump_runtime_config(config: RuntimeConfig) -> str:
    """Render the config as YAML (what the operator writes into a ConfigMap)."""
    return yaml.safe_dump(config.to_wire(), sort_keys=False)
