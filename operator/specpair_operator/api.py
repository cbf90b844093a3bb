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

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from specpair_runtime.config import (
    ContractModel,
    ModelSpec,
    SpeculationKnobs,
    describe_validation_error,
)
from specpair_runtime.golden import GoldenPrompt

GROUP = "specpair.dev"
VERSION = "v1alpha1"
KIND = "SpeculativePair"
PLURAL = "speculativepairs"
SINGULAR = "speculativepair"
SHORT_NAME = "spair"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_RUNTIME_IMAGE = "ghcr.io/specpair/runtime:0.1.0"

# A positive Kubernetes quantity (no sign, no exponent form): 80Gi, 81920Mi, 500m, 2.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE])?$"
# metav1.Condition's reason: CamelCase identifier.
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry, attached at ``path`` (dotted, from the root)."""

    path: str
    rule: str
    message: str


CEL_RULES: tuple[CelRule, ...] = (
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
        "spec.resources",
        "!has(self.gpuMemory) || !has(self.gpus) || self.gpus > 0",
        "resources.gpuMemory needs resources.gpus >= 1",
    ),
)


class SizeHints(ContractModel):
    """Model geometry for the VRAM planner (from the model's config.json)."""

    parameters: int = Field(
        ge=1,
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
        default=1, ge=0, le=16, description="nvidia.com/gpu per pod; 0 runs on the CPU."
    )
    gpu_memory: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description=(
            "Memory of one GPU, e.g. 80Gi. If unset, the smallest nvidia.com/gpu.memory "
            "node label (MiB) among the nodes the pair may run on is used."
        ),
    )
    headroom_fraction: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description="Fraction of device memory the plan keeps free.",
    )
    cpu: str | None = Field(
        default=None, pattern=QUANTITY_PATTERN, description="CPU request and limit, e.g. 4."
    )
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Memory request and limit, e.g. 32Gi; with gpus 0 it is the planned device.",
    )


class Rollout(ContractModel):
    """How a new revision replaces the old one (old pods serve until new ones are ready)."""

    max_surge: int = Field(
        default=1, ge=1, description="Extra pods during a rollout (maxUnavailable is always 0)."
    )
    progress_deadline_seconds: int = Field(
        default=1800,
        ge=10,
        description=(
            "A new revision not ready within this is rolled back to the last good one "
            "(Degraded, RolloutFailed)."
        ),
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=30,
        description="Time the startupProbe allows for loading the models and golden prompts.",
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
        description="Drafted tokens an observation needs before it counts (the sample size).",
    )


class ConfigMapKeyRef(ContractModel):
    """A key of a ConfigMap in the pair's namespace."""

    name: str = Field(min_length=1, max_length=253, description="ConfigMap name.")
    key: str = Field(default="golden.yaml", min_length=1, description="Key holding the file.")


class SecretKeyRef(ContractModel):
    """A key of a Secret in the pair's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, description="Key holding the value.")


class GoldenPromptsSpec(ContractModel):
    """Golden prompts checked before a pod turns ready: inline or from a ConfigMap."""

    inline: list[GoldenPrompt] | None = Field(
        default=None, min_length=1, description="The golden prompts themselves."
    )
    config_map_ref: ConfigMapKeyRef | None = Field(
        default=None, description="A ConfigMap key holding a golden-prompt file."
    )


class ServingSpec(ContractModel):
    """The OpenAI-compatible HTTP server of the runtime."""

    port: int = Field(default=8000, ge=1024, le=65535, description="Container and Service port.")
    max_batch_size: int = Field(default=8, ge=1, le=1024, description="Max running requests.")
    max_model_length: int = Field(
        default=2048, ge=16, le=1048576, description="Prompt plus output tokens per request."
    )
    max_waiting_requests: int = Field(
        default=64, ge=0, description="Queued requests beyond which the server answers 429."
    )
    api_key_secret: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the Bearer API key; unset means no auth."
    )


class Toleration(ContractModel):
    """A core/v1 Toleration."""

    key: str | None = Field(default=None, description="Taint key; empty matches all keys.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Match operator.")
    value: str | None = Field(default=None, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


class Scheduling(ContractModel):
    """Where the pods may run."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a node must have."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints tolerated.")
    affinity: dict[str, Any] | None = Field(
        default=None, description="A core/v1 Affinity, passed to the pod unchanged."
    )


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

    # The CEL rules, for apiservers that ignore them (keep in sync with CEL_RULES;
    # test_cel_rules.py checks both on the same objects).
    @model_validator(mode="after")
    def _cel_rules(self) -> SpeculativePairSpec:
        if self.draft.source == self.target.source:
            raise ValueError("draft.source must differ from target.source")
        if self.target.quantization != "none":
            raise ValueError("target.quantization must be 'none': only the draft may be quantized")
        golden = self.golden_prompts
        if golden is not None and (golden.inline is None) == (golden.config_map_ref is None):
            raise ValueError("goldenPrompts needs exactly one of inline or configMapRef")
        if self.resources.gpu_memory is not None and self.resources.gpus == 0:
            raise ValueError("resources.gpuMemory needs resources.gpus >= 1")
        return self


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


class SpeculativePairStatus(ContractModel):
    """The observed state, written by the operator through /status."""

    observed_generation: int | None = Field(
        default=None, description="The .metadata.generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded, HeadroomSufficient."
    )
    current_revision: str | None = Field(
        default=None, description="Revision hash of the pair the Deployment now runs."
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


def parse_spec(data: object) -> SpeculativePairSpec:
    """Validate a ``.spec`` dict; raise SpecError naming each bad field."""
    try:
        return SpeculativePairSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, prefix="spec.")) from None
