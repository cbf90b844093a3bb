"""The runtime config file: the contract between the operator and the runtime.

The operator renders this file into a ConfigMap; the runtime loads it with
``specpair-runtime serve --config FILE``. This module is a *contract module*:
it must never import torch, transformers, kopf or kubernetes.

YAML keys are lowerCamelCase (Kubernetes style); Python attributes are
snake_case. Unknown keys are rejected so that a typo names its field.

Every serving and engine option is defined once here (``Option``): its
default, its default per device type, its bounds and its text. The runtime
config's fields, the operator's CRD (``specpair_operator/api.py``) and the
engine's options (``engine/options.py``) all read that one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["none", "int8-dynamic", "int4-weight"]
PrefillOrder = Literal["shortest-first", "arrival"]


# Upper bounds of the serving options: far beyond any sensible value, and safe for a
# CRD (int32, so the apiserver needs no int64 format).
MAX_REQUEST_BODY_BYTES = 2**30
MAX_SERVING_TIMEOUT_SECONDS = 3600.0


def _words(value: object) -> str:
    """A default as the docs write it: true/false, 1e+03 -> 1000, text as it is."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Option:
    """One serving or engine option: what it does, its default(s), its bounds.

    ``default`` applies where ``per_device`` names no default for the device
    type; ``unset`` says in words what an unset value means where that is not
    one plain value. ``bounds`` are pydantic's (``ge``, ``gt``, ``le``).
    """

    description: str
    default: Any = None
    per_device: Mapping[str, Any] = field(default_factory=dict)
    unset: str = ""
    bounds: Mapping[str, float] = field(default_factory=dict)

    def for_device(self, value: Any, device_type: str) -> Any:
        """``value``, or where it is unset the default for ``device_type``."""
        if value is not None:
            return value
        return self.per_device.get(device_type, self.default)

    def default_text(self) -> str:
        return self.unset or _words(self.default)

    def field(self, *, optional: bool = False, note: str = "", **bounds: float) -> Any:
        """A pydantic field for this option.

        ``optional``: unset (None) means the runtime's default, as in the CRD,
        where an unset option stays out of the revision hash. Otherwise the
        field holds the default itself (None where it depends on the device).
        The description says what unset means wherever the field can be unset.
        ``note`` adds what a consumer does with the value; ``bounds`` override.
        """
        default = None if optional or self.per_device else self.default
        text = " ".join(part for part in (self.description, note) if part)
        if default is None:  # what unset means; a plain default is the schema's own
            text = f"{text} Unset: {self.default_text()}."
        limits = {**self.bounds, **bounds}
        return Field(
            default=default,
            description=text,
            ge=limits.get("ge"),
            gt=limits.get("gt"),
            le=limits.get("le"),
        )


PORT = Option("The port the server listens on.", 8000, bounds={"ge": 1, "le": 65535})
MAX_BATCH_SIZE = Option(
    "Max running requests (one KV slot each); more wait in the queue.",
    8,
    bounds={"ge": 1, "le": 1024},
)
MAX_MODEL_LENGTH = Option(
    "Prompt plus output tokens per request (positions per KV slot).",
    2048,
    bounds={"ge": 16, "le": 1048576},
)
MAX_WAITING_REQUESTS = Option(
    "Queued requests beyond which the server answers 429.",
    64,
    bounds={"ge": 0, "le": 1000000},
)
# Where the measured budget starts: on the CPU one prefill token of a 1.5B model
# costs about what one decode row does; a GPU is memory-bound far longer (vLLM's
# default for chunked prefill).
STEP_TOKENS_START = {"cpu": 32, "cuda": 2048}
MAX_STEP_TOKENS = Option(
    "Chunked-prefill budget: tokens per engine step over all running requests. "
    "Decoding streams always get theirs; prompts enter in chunks that fill the rest. "
    "Smaller keeps inter-token latency flat while prompts arrive, larger gives a "
    "shorter time to first token.",
    per_device=STEP_TOKENS_START,
    unset=(
        f"measured by the runtime (engine/budget.py), starting at {STEP_TOKENS_START['cpu']} "
        f"on the CPU and {STEP_TOKENS_START['cuda']} on CUDA, so that a step with prompt "
        "chunks takes at most a quarter longer than a plain decode step"
    ),
    bounds={"ge": 1, "le": 1048576},
)
CUDA_GRAPHS = Option(
    "On CUDA, replay decode and verify steps as CUDA graphs, every shape captured "
    "before the server turns ready (seconds); ignored on the CPU.",
    True,
)
CUDA_GRAPH_COMPILE = Option(
    "With cudaGraphs: record torch.compile's fused step (mode reduce-overhead) instead "
    "of capturing the eager one. Its compiles take minutes at start-up.",
    False,
)
PREFILL_ORDER = Option(
    "Which waiting prompt reads its chunk first when several are entering: "
    "shortest-first (the fewest tokens left; each step a prompt waits counts as one "
    "token read, so a long one is passed by later, shorter ones for at most as many "
    "steps as it has tokens) or arrival (oldest first: long prompts enter sooner, "
    "short ones wait behind them).",
    "shortest-first",
)
PREFIX_REUSE = Option(
    "A new request starts after the longest prefix of its prompt (a shared system "
    "prompt, an earlier chat turn) whose keys and values a KV slot still holds, so "
    "its time to first token shrinks by the reused part; usage reports that part as "
    "prompt_tokens_details.cached_tokens. Turn it off where tenants must not learn "
    "about each other: with reuse on, a request's time to first token reveals "
    "whether another request recently sent the same prompt prefix (why vLLM added "
    "a cache salt).",
    True,
)
CPU_THREADS = Option(
    "Threads for the runtime's CPU kernels (1 to 1024).",
    unset=(
        "OMP_NUM_THREADS when set, else torch's default (one per core the process "
        "sees) capped by the cgroup's CPU quota, so that the container is not throttled"
    ),
    bounds={"ge": 1, "le": 1024},
)
MAX_REQUEST_BODY_BYTES_OPTION = Option(
    "Largest request body in bytes (1Ki to 1Gi); larger ones get 413 before they are read.",
    unset="64Ki + 96 bytes x maxModelLength",
    bounds={"ge": 1024, "le": MAX_REQUEST_BODY_BYTES},
)
HEADER_TIMEOUT_SECONDS = Option(
    "A request's headers must arrive within this many seconds, else 408 and the connection closes.",
    10.0,
    bounds={"gt": 0.0, "le": MAX_SERVING_TIMEOUT_SECONDS},
)
BODY_TIMEOUT_SECONDS = Option(
    "A request's body must arrive within this many seconds, else 408 and the connection closes.",
    30.0,
    bounds={"gt": 0.0, "le": MAX_SERVING_TIMEOUT_SECONDS},
)
DRAIN_TIMEOUT_SECONDS = Option(
    "On SIGTERM, how long in-flight requests may finish.",
    30.0,
    bounds={"gt": 0.0, "le": MAX_SERVING_TIMEOUT_SECONDS},
)

# Each option by the name of its field in ServingOptions and in the CRD's ServingSpec.
SERVING_OPTIONS: dict[str, Option] = {
    "port": PORT,
    "max_batch_size": MAX_BATCH_SIZE,
    "max_model_length": MAX_MODEL_LENGTH,
    "max_waiting_requests": MAX_WAITING_REQUESTS,
    "max_step_tokens": MAX_STEP_TOKENS,
    "cuda_graphs": CUDA_GRAPHS,
    "cuda_graph_compile": CUDA_GRAPH_COMPILE,
    "prefill_order": PREFILL_ORDER,
    "prefix_reuse": PREFIX_REUSE,
    "cpu_threads": CPU_THREADS,
    "max_request_body_bytes": MAX_REQUEST_BODY_BYTES_OPTION,
    "header_timeout_seconds": HEADER_TIMEOUT_SECONDS,
    "body_timeout_seconds": BODY_TIMEOUT_SECONDS,
    "drain_timeout_seconds": DRAIN_TIMEOUT_SECONDS,
}


def recommended_draft_quantization(device_type: str) -> Quantization:
    """What the demo and the benchmarks run the draft with on a device of this type.

    int4-weight on the CPU: cheaper than fp32 and accepted nearly as often
    (engine/cpu/int4.py has the numbers), also where oneDNN has no native
    bf16 (on an AVX2-only AMD EPYC the int4 draft made the engine 1.71x
    target-only, the fp32 draft 1.33x); nothing on CUDA, where the draft's
    bf16 forward is cheap already.
    """
    return "int4-weight" if device_type == "cpu" else "none"


# The draft-confidence stop (transformers' assisted generation stops drafting at 0.4 by
# default) is off unless set: on the CPU, with the adaptive depth below, a measured
# break-even bar made the engine no faster with a good draft and no faster with a bad one
# (docs/architecture.md, "Which depth mechanisms stayed").
DRAFT_CONFIDENCE = Option(
    "A request stops drafting in a step once the product of the draft's probabilities "
    "of its drafts so far is below this (0 disables).",
    0.0,
    unset="off",
    bounds={"ge": 0.0, "le": 1.0},
)
# A step that reads a prompt chunk speculates, except on the CPU: there such a step
# is bound by its arithmetic, and every verify token costs about what a prompt token does.
DURING_PREFILL = Option(
    "Speculate in steps that also read a prompt chunk (chunked prefill).",
    True,
    per_device={"cpu": False},
    unset=(
        "on, except on the CPU, where such a step is bound by its arithmetic: there the "
        "verify tokens slow the prompts' reading about as much as they speed up the "
        "decoding requests, so the decoding requests take one token per step until the "
        "waiting prompts are read"
    ),
)


def resolved_draft_confidence(knobs: SpeculationKnobs) -> float:
    """The confidence stop's threshold (0 = never)."""
    return float(knobs.draft_confidence or DRAFT_CONFIDENCE.default)


def resolved_during_prefill(knobs: SpeculationKnobs, device_type: str) -> bool:
    """Whether steps that read a prompt chunk speculate: the knob, else all but the CPU."""
    return bool(DURING_PREFILL.for_device(knobs.during_prefill, device_type))


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
    draft_confidence: float | None = DRAFT_CONFIDENCE.field(optional=True)
    disable_above_batch_size: int | None = Field(
        default=None, ge=1, description="Pause speculation while the running batch is larger."
    )
    during_prefill: bool | None = DURING_PREFILL.field(optional=True)
    acceptance_floor: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Rolling acceptance below this turns speculation off (0 disables).",
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
    port: int = PORT.field()
    max_batch_size: int = MAX_BATCH_SIZE.field()
    max_model_length: int = MAX_MODEL_LENGTH.field()
    max_waiting_requests: int = MAX_WAITING_REQUESTS.field()
    max_step_tokens: int | None = MAX_STEP_TOKENS.field()
    cuda_graphs: bool = CUDA_GRAPHS.field()
    cuda_graph_compile: bool = CUDA_GRAPH_COMPILE.field()
    prefill_order: PrefillOrder = PREFILL_ORDER.field()
    prefix_reuse: bool = PREFIX_REUSE.field()
    cpu_threads: int | None = CPU_THREADS.field()
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
    drain_timeout_seconds: float = DRAIN_TIMEOUT_SECONDS.field()
    max_request_body_bytes: int | None = MAX_REQUEST_BODY_BYTES_OPTION.field()
    header_timeout_seconds: float = HEADER_TIMEOUT_SECONDS.field()
    body_timeout_seconds: float = BODY_TIMEOUT_SECONDS.field()

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


class GateConfig(ContractModel):
    """The gate sidecar beside an engine that is not specpair's own (``specpair-runtime gate``).

    It checks the pair's alignment from the model files, then runs the golden
    prompts through the engine's OpenAI API, and reports the outcome on its
    ``/readyz`` (the pod's readiness), as the runtime's own server does.
    """

    pair: PairInfo
    engine_url: str = Field(
        default="http://127.0.0.1:8000", description="The engine's OpenAI server in the pod."
    )
    served_model_name: str = Field(min_length=1, description="The model name the engine serves.")
    target: ModelSpec
    draft: ModelSpec | None = Field(
        default=None, description="The draft, when the engine speculates with it."
    )
    golden_prompts_file: str | None = Field(
        default=None, description="Golden-prompt file checked before /readyz turns ready."
    )
    host: str = Field(default="0.0.0.0", description="Address of the gate's own HTTP server.")
    port: int = Field(default=8001, ge=1, le=65535, description="Port of the gate's server.")
    cuda: bool = Field(
        default=True, description="The engine runs on CUDA (sets the default near-tie margin)."
    )
    engine_start_timeout_seconds: float = Field(
        default=1800.0, gt=0, description="How long the engine may take to answer /health."
    )
    request_timeout_seconds: float = Field(
        default=300.0, gt=0, description="One golden request's time limit."
    )
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the engine's API key, if any."
    )


def dump_gate_config(config: GateConfig) -> str:
    return yaml.safe_dump(config.to_wire(), sort_keys=False)


def load_gate_config(path: Path) -> GateConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read gate config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    try:
        return GateConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None
