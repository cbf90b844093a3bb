"""The engine benchmark's harness: target-only vs specpair vs transformers assisted generation.

``specpair-runtime bench`` runs it from a checkout of the repo (``make bench``
through ``bench/bench_engine.py``); the runtime image does not ship it.

All modes run on the same loaded pair, the same prompts and in the same
process, so the ratios compare like with like. Within a round every mode is
set up and warmed first, then each prompt goes through every mode before the
next prompt (``run_interleaved``): the engine modes together, one step of
each in turn (``Lockstep``), and HF assisted (on both kernels) right before
or after them, in turn. So the two sides of a ratio between engine modes ran
within a second or two of each other, and against HF within the same half
minute, and a slow spell of a shared machine hits both.
With ``runs`` > 1 the rounds run one after the other; each ratio is computed
within a round and the table shows the median over rounds with its spread
(min-max).
Speed is measured, never asserted; greedy identity with target-only decoding
is reported per mode.

HF assisted generation runs twice per round: on transformers' stock CPU
kernels and on the same oneDNN kernels as specpair, so both baselines are
shown side by side. The loader switched the linears to oneDNN and kept the
plain weights (``keep_plain``); the stock baseline runs a twin of the models
that shares every tensor and runs PyTorch's default kernels
(``engine/cpu/onednn.default_kernel_copy``). Both
run transformers' own generation loop and modeling code over the loaded
models, whose q/k/v and gate/up projections the loader fused
(``engine/fused_projections.py``): HF's forward runs each fused GEMM once, as
the engine's own loop does, so the fusion speeds up both sides and the ratio
shows only what the engine does differently.

The structured-output rows decode the same prompts under one JSON schema
(``STRUCTURED_SCHEMA``, through ``engine/grammar.py``): target-only and the
default knobs, each under the grammar, so their ratio is speculation's gain
where every verified position and every draft proposal is masked. Their
mask cost is the grammar processors' host time (computing masks, applying
them to logits) per target pass and per masked position.

Within an engine mode the prompts run one after the other on one engine, so
each reuses what the one before left in the KV slot (``engine/prefix_reuse.py``):
with the chat template, the shared system prompt, as a server does for a
deployment's system prompt. transformers' ``generate`` starts every call from
an empty cache. So the default also runs with prefix reuse off (its own row),
and the untimed warm-up reads the first prompt with a first token that no
prompt starts with: the same shapes, and no prefix for the timed prompts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import Engine, LogitsProcessor, SamplingParams
from specpair_runtime.engine.constraint_processors import GrammarProcessor
from specpair_runtime.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.oneshot import Completion, RequestDriver, run_request
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.pair import LoadedPair
from specpair_runtime.engine.prompting import encode_prompt
from specpair_runtime.hardware import cpu_info

log = logging.getLogger(__name__)

# Support-chat prompts that draw answers longer than the usual token budget, so every
# mode decodes the full max_new_tokens (a two-word answer measures mostly prefill).
DEFAULT_PROMPTS = (
    "Write a polite reply to a customer whose order #4417 is a week late, "
    "and explain the next steps.",
    "Explain step by step how to return a pair of shoes that I bought online.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
)
TARGET_ONLY = "target-only"
HF_ASSISTED = "hf-assisted"
HF_ASSISTED_ONEDNN = "hf-assisted (onednn)"
DEFAULT_MODE = "specpair default"
NO_REUSE_SUFFIX = ", no prefix reuse"
JSON_SUFFIX = ", json schema"
# The structured-output rows' schema: what a coding or support answer would fill in.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"enum": ["code", "order", "return", "other"]},
        "answer": {"type": "string"},
        "steps": {"type": "array", "items": {"type": "string"}},
        "code": {"type": "string"},
    },
    "required": ["topic", "answer", "steps"],
}
FIXED_DEPTH_PREFIX = "specpair k="


@dataclass(frozen=True)
class BenchSettings:
    prompts: list[str] | None = None  # None: DEFAULT_PROMPTS
    chat: bool = True
    max_new_tokens: int = 32
    depths: list[int] = field(default_factory=lambda: [4])
    adaptive: bool = True
    hf_assisted: bool = True
    repeats: int = 1
    runs: int = 1  # rounds of all modes; ratios are medians over rounds
    structured: bool = True  # the JSON-schema rows (target-only and default, constrained)

    @property
    def prompt_texts(self) -> list[str]:
        return list(self.prompts) if self.prompts else list(DEFAULT_PROMPTS)


@dataclass
class ModeResult:
    """One decoding mode over all prompts (and repeats)."""

    mode: str
    depth: int | None  # fixed depth, or the cap for adaptive; None for target-only
    tokens: int = 0
    seconds: float = 0.0
    drafted: int | None = 0  # None where the mode does not report it (HF assisted)
    accepted: int | None = 0
    target_passes: int = 0
    identical: bool = True  # token ids equal target-only's on every prompt
    outputs: list[list[int]] = field(default_factory=list)
    run_rates: list[float] = field(default_factory=list)  # tokens/s of each round
    mask_seconds: float = 0.0  # grammar processors' host time (structured rows)
    masked_positions: int = 0

    @property
    def tokens_per_second(self) -> float:
        """The median over rounds (one round: tokens / seconds)."""
        if self.run_rates:
            return statistics.median(self.run_rates)
        return self.tokens / self.seconds if self.seconds else 0.0

    def add_counts(self, run: ModeResult) -> None:
        """Add the tokens, time and counts of another result of the same mode."""
        self.tokens += run.tokens
        self.seconds += run.seconds
        self.target_passes += run.target_passes
        self.mask_seconds += run.mask_seconds
        self.masked_positions += run.masked_positions
        if run.drafted is not None and self.drafted is not None:
            self.drafted += run.drafted
        if run.accepted is not None and self.accepted is not None:
            self.accepted += run.accepted

    def add_prompt(self, one: ModeResult) -> None:
        """Add one prompt's result of the same mode: its counts, and its output in order."""
        self.add_counts(one)
        self.outputs += one.outputs

    def absorb(self, run: ModeResult) -> None:
        """Add one round's result of the same mode."""
        self.add_counts(run)
        self.run_rates.append(run.tokens / run.seconds if run.seconds else 0.0)

    @property
    def acceptance_rate(self) -> float | None:
        if self.drafted is None or self.accepted is None:
            return None
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.tokens / self.target_passes if self.target_passes else 0.0

    @property
    def mask_ms_per_pass(self) -> float | None:
        """The grammar's host time per target pass (None without a grammar)."""
        if not self.masked_positions or not self.target_passes:
            return None
        return self.mask_seconds / self.target_passes * 1e3

    @property
    def mask_us_per_position(self) -> float | None:
        if not self.masked_positions:
            return None
        return self.mask_seconds / self.masked_positions * 1e6


def baseline_of(mode: str) -> str:
    """The target-only row a mode's speed compares with: the one under the same constraint."""
    return TARGET_ONLY + JSON_SUFFIX if mode.endswith(JSON_SUFFIX) else TARGET_ONLY


@dataclass
class BenchResult:
    settings: BenchSettings
    modes: list[ModeResult]
    machine: dict[str, object]

    def mode(self, name: str) -> ModeResult | None:
        return next((m for m in self.modes if m.mode == name), None)

    def ratios(self, mode: ModeResult, baseline: str) -> list[float]:
        """Per-round ratios of tokens/s (mode over baseline, same round)."""
        base = self.mode(baseline)
        if base is None:
            return []
        return [m / b for m, b in zip(mode.run_rates, base.run_rates, strict=False) if b]

    def ratio(self, mode: ModeResult, baseline: str) -> float | None:
        values = self.ratios(mode, baseline)
        return statistics.median(values) if values else None

    def spread(self, mode: ModeResult, baseline: str) -> tuple[float, float] | None:
        values = self.ratios(mode, baseline)
        return (min(values), max(values)) if values else None

    def fixed_depth_modes(self) -> list[ModeResult]:
        return [m for m in self.modes if m.mode.startswith(FIXED_DEPTH_PREFIX)]

    def best_fixed_depth(self) -> str | None:
        """The fixed-depth mode with the highest median tokens/s: the bar of the default.

        Ratios to it are taken within each round, like every other ratio, so a
        fast or slow spell of a shared machine moves both sides alike.
        """
        best = max(self.fixed_depth_modes(), key=lambda m: m.tokens_per_second, default=None)
        return best.mode if best is not None else None

    def to_dict(self) -> dict[str, object]:
        best = self.best_fixed_depth()
        rows = []
        for m in self.modes:
            rows.append(
                {
                    "mode": m.mode,
                    "depth": m.depth,
                    "tokens": m.tokens,
                    "seconds": m.seconds,
                    "tokens_per_second": m.tokens_per_second,
                    "drafted_tokens": m.drafted,
                    "accepted_tokens": m.accepted,
                    "acceptance_rate": m.acceptance_rate,
                    "target_passes": m.target_passes,
                    "tokens_per_target_pass": m.tokens_per_target_pass,
                    "tokens_per_second_per_round": m.run_rates,
                    "vs_target_only": self.ratio(m, baseline_of(m.mode)),
                    "vs_target_only_per_round": self.ratios(m, baseline_of(m.mode)),
                    "mask_ms_per_target_pass": m.mask_ms_per_pass,
                    "mask_us_per_position": m.mask_us_per_position,
                    "vs_hf_assisted": self.ratio(m, HF_ASSISTED),
                    "vs_hf_assisted_per_round": self.ratios(m, HF_ASSISTED),
                    "vs_hf_assisted_onednn": self.ratio(m, HF_ASSISTED_ONEDNN),
                    "vs_hf_assisted_onednn_per_round": self.ratios(m, HF_ASSISTED_ONEDNN),
                    "vs_best_fixed_depth": self.ratio(m, best) if best else None,
                    "vs_best_fixed_depth_per_round": self.ratios(m, best) if best else [],
                    "identical_to_target_only": m.identical,
                }
            )
        settings = asdict(self.settings)
        settings["prompts"] = self.settings.prompt_texts
        return {
            "settings": settings,
            "machine": self.machine,
            "best_fixed_depth": best,
            "modes": rows,
        }


def machine_info(pair: LoadedPair) -> dict[str, object]:
    draft = pair.draft
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **cpu_info(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""),
        "device": str(pair.target.device),
        **(
            {"device_name": torch.cuda.get_device_name(pair.target.device)}
            if pair.target.device.type == "cuda"
            else {}
        ),
        "target": f"{pair.target.name} ({_dtype_name(pair.target.dtype)})",
        "draft": (
            f"{draft.name} ({_dtype_name(draft.dtype)}, quantization {draft.quantization})"
            if draft is not None
            else "none"
        ),
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _CallCounter:
    """Counts forward calls of a module (target passes for HF assisted generation)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def stop_token_ids(pair: LoadedPair) -> list[int]:
    """EOS ids for HF generate: the tokenizer's plus the generation config's."""
    ids: set[int] = set()
    if pair.target.tokenizer.eos_token_id is not None:
        ids.add(int(pair.target.tokenizer.eos_token_id))
    configured = getattr(pair.target.model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return sorted(ids)


def run_hf_assisted(
    pair: LoadedPair, prompt_ids: list[int], max_new_tokens: int, name: str = HF_ASSISTED
) -> ModeResult:
    """transformers' assisted generation (``assistant_model=``) with library defaults."""
    from transformers import GenerationConfig

    assert pair.draft is not None
    target = pair.target
    ids = torch.tensor([prompt_ids], device=target.device)
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_token_ids(pair),
        pad_token_id=target.tokenizer.pad_token_id
        if target.tokenizer.pad_token_id is not None
        else stop_token_ids(pair)[0],
    )
    counter = _CallCounter(target.model)
    try:
        started = time.perf_counter()
        with torch.inference_mode():
            output = target.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=pair.draft.model,
                generation_config=config,
            )
        seconds = time.perf_counter() - started
    finally:
        counter.close()
    new_ids = [int(i) for i in output[0, len(prompt_ids) :].tolist()]
    return ModeResult(
        name,
        None,
        tokens=len(new_ids),
        seconds=seconds,
        drafted=None,
        accepted=None,
        target_passes=counter.calls,
        outputs=[new_ids],
    )


def warm_up_prompt(prompts: list[list[int]]) -> list[int]:
    """The first prompt's shapes, starting with a token no prompt starts with.

    So the warm-up leaves no prefix of a timed prompt in the KV slot to reuse.
    """
    starts = {p[0] for p in prompts}
    first = next(token for token in itertools.count() if token not in starts)
    return [first, *prompts[0][1:]]


class PromptRunner(Protocol):
    """What ``run_interleaved`` runs: one or more modes, one prompt at a time."""

    def run(self, prompt: list[int]) -> None:
        """Decode ``prompt`` once in each mode and add the results to the modes' totals."""


class ModeRunner:
    """One mode of a round: set up and warmed once, then timed one prompt at a time."""

    def __init__(self, result: ModeResult, decode: Callable[[list[int]], ModeResult]) -> None:
        self.result = result
        self._decode = decode

    def run(self, prompt: list[int]) -> None:
        """Decode ``prompt`` once and add its tokens, time and counts to ``result``."""
        self.result.add_prompt(self._decode(prompt))


class GrammarMeter:
    """Builds each request's grammar processor and sums their mask costs."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.made: list[GrammarProcessor] = []

    def processor(self) -> LogitsProcessor:
        self.made.append(GrammarProcessor(self.grammar))
        return self.made[-1]

    def take(self) -> tuple[float, int]:
        """(seconds, positions) of the processors built since the last call."""
        seconds = sum(p.seconds for p in self.made)
        positions = sum(p.positions for p in self.made)
        self.made.clear()
        return seconds, positions


@dataclass
class EngineMode:
    """One engine configuration of a round, warmed up; ``Lockstep`` times its steps."""

    result: ModeResult
    engine: Engine
    params: SamplingParams
    meter: GrammarMeter | None = None  # the structured rows' grammar


def engine_mode(
    pair: LoadedPair,
    mode: str,
    knobs: SpeculationKnobs | None,
    prompts: list[list[int]],
    settings: BenchSettings,
    *,
    prefix_reuse: bool = True,
    grammar: CompiledGrammar | None = None,
) -> EngineMode:
    """A fresh engine for one configuration (None: target-only), warmed up, decoding greedily.

    ``grammar``: every request decodes under it (the structured rows).
    """
    # KV storage for one request at a time (the default sizes a serving batch).
    length = max(len(p) for p in prompts) + settings.max_new_tokens
    options = EngineOptions(max_slots=1, max_length=length, prefix_reuse=prefix_reuse)
    engine = pair.engine(speculate=knobs is not None, knobs=knobs, options=options)
    meter = GrammarMeter(grammar) if grammar is not None else None
    processors = (meter.processor,) if meter is not None else ()
    warm = SamplingParams(max_new_tokens=2, logits_processors=processors)
    run_request(engine, warm_up_prompt(prompts), warm)  # untimed
    if meter is not None:
        meter.take()
    depth = knobs.max_depth if knobs is not None else None
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, logits_processors=processors)
    return EngineMode(ModeResult(mode, depth), engine, params, meter)


class Lockstep:
    """Engine modes decoding one prompt together, one step of each in turn.

    Each engine gets the prompt, then every tick runs one step of every engine
    whose request is unfinished, in an order that rotates by one each tick, and
    each mode's time is the sum of its own steps. The two sides of a ratio
    between engine modes so ran within one tick of each other (a second or
    two), where a prompt at a time left them up to half a minute apart; the
    machine's spells last seconds to minutes (docs/benchmarks.md). The models'
    weights are shared and far larger than the CPU's caches, so a step costs
    what it costs alone.
    """

    def __init__(
        self,
        modes: list[EngineMode],
        *,
        shift: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.modes = modes
        self._ticks = shift
        self._clock = clock

    def run(self, prompt: list[int]) -> None:
        seconds = [0.0] * len(self.modes)
        drivers = []
        for index, mode in enumerate(self.modes):
            started = self._clock()
            drivers.append(RequestDriver(mode.engine, prompt, mode.params))
            seconds[index] += self._clock() - started
        pending = list(range(len(self.modes)))
        while pending:
            first = self._ticks % len(pending)
            self._ticks += 1
            for index in pending[first:] + pending[:first]:
                started = self._clock()
                drivers[index].step()
                seconds[index] += self._clock() - started
            pending = [index for index in pending if not drivers[index].finished]
        for mode, driver, spent in zip(self.modes, drivers, seconds, strict=True):
            one = engine_result(mode.result.mode, driver.completion(), spent)
            if mode.meter is not None:
                one.mask_seconds, one.masked_positions = mode.meter.take()
            mode.result.add_prompt(one)


def engine_result(mode: str, completion: Completion, seconds: float) -> ModeResult:
    """One prompt's result of an engine mode."""
    stats = completion.stats
    return ModeResult(
        mode,
        None,
        tokens=len(completion.token_ids),
        seconds=seconds,
        drafted=stats.drafted_tokens,
        accepted=stats.accepted_tokens,
        target_passes=stats.target_passes,
        outputs=[completion.token_ids],
    )


def hf_mode(
    pair: LoadedPair, prompts: list[list[int]], settings: BenchSettings, name: str
) -> ModeRunner:
    """transformers' assisted generation on the kernels the models have now, warmed up."""
    run_hf_assisted(pair, prompts[0], 2)  # warm-up, untimed
    return ModeRunner(
        ModeResult(name, None, drafted=None, accepted=None),
        lambda prompt: run_hf_assisted(pair, prompt, settings.max_new_tokens, name),
    )


def run_interleaved(runners: Sequence[PromptRunner], prompts: list[list[int]], shift: int) -> None:
    """Each prompt through every runner before the next prompt, in an order that rotates.

    So the modes that a ratio compares ran seconds apart, not minutes: a shared
    machine's speed moves in spells (docs/benchmarks.md), and a spell then hits
    both sides of a ratio. The rotation (``shift`` + the prompt's index) gives
    no runner a fixed place in the order.
    """
    for index, prompt in enumerate(prompts):
        first = (shift + index) % len(runners)
        for runner in [*runners[first:], *runners[:first]]:
            runner.run(prompt)


def linears_patched(model: torch.nn.Module) -> bool:
    """True when some nn.Linear runs a per-instance forward (e.g. the engine's oneDNN route)."""
    return any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def stock_kernels(pair: LoadedPair) -> LoadedPair:
    """The pair on PyTorch's default kernels: a twin sharing every tensor, or the pair itself.

    The loader switches CPU linears to oneDNN; the twin's linears run the
    stock kernels over the plain weights that ``keep_plain`` kept.
    """
    if not linears_patched(pair.target.model):
        return pair
    from specpair_runtime.engine.cpu.onednn import default_kernel_copy

    def twin(loaded: LoadedModel) -> LoadedModel:
        return dataclasses.replace(loaded, model=default_kernel_copy(loaded.model))

    draft = twin(pair.draft) if pair.draft is not None else None
    return dataclasses.replace(pair, target=twin(pair.target), draft=draft)


def structured_grammar(pair: LoadedPair) -> CompiledGrammar:
    """``STRUCTURED_SCHEMA`` compiled for the pair's tokenizer (untimed)."""
    engine = pair.engine(speculate=False, options=EngineOptions(max_slots=1, max_length=16))
    compiler = GrammarCompiler(pair.target.tokenizer, engine.target.vocab, engine.eos_ids)
    try:
        return compiler.compile(GrammarSpec.json_schema(STRUCTURED_SCHEMA))
    finally:
        compiler.close()


def _one_round(
    pair: LoadedPair,
    stock: LoadedPair,
    prompts: list[list[int]],
    settings: BenchSettings,
    shift: int,
    grammar: CompiledGrammar | None = None,
) -> list[ModeResult]:
    """Every mode over every prompt once, each prompt through every mode in turn."""
    timed = [p for _ in range(settings.repeats) for p in prompts]
    engines = [engine_mode(pair, TARGET_ONLY, None, prompts, settings)]
    for depth in settings.depths:
        knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
        name = f"{FIXED_DEPTH_PREFIX}{depth}"
        engines.append(engine_mode(pair, name, knobs, prompts, settings))
    if settings.adaptive:
        default = SpeculationKnobs()
        name = f"{DEFAULT_MODE} (adaptive<={default.max_depth})"
        engines.append(engine_mode(pair, name, default, prompts, settings))
        engines.append(
            engine_mode(
                pair, name + NO_REUSE_SUFFIX, default, prompts, settings, prefix_reuse=False
            )
        )
    if grammar is not None:
        default = SpeculationKnobs()
        name = f"{DEFAULT_MODE} (adaptive<={default.max_depth})" + JSON_SUFFIX
        target = TARGET_ONLY + JSON_SUFFIX
        engines.append(engine_mode(pair, target, None, prompts, settings, grammar=grammar))
        engines.append(engine_mode(pair, name, default, prompts, settings, grammar=grammar))
    # The engine modes in lockstep, and HF on either kernels before or after them.
    runners: list[PromptRunner] = [Lockstep(engines, shift=shift)]
    hf: list[ModeRunner] = []
    if settings.hf_assisted:
        hf.append(hf_mode(stock, prompts, settings, HF_ASSISTED))
        if stock is not pair:  # the engine's kernels are not the stock ones
            hf.append(hf_mode(pair, prompts, settings, HF_ASSISTED_ONEDNN))
    run_interleaved([*runners, *hf], timed, shift)
    modes = [mode.result for mode in engines] + [runner.result for runner in hf]
    for mode in modes:
        log.info("%s: %.2f tokens/s", mode.mode, mode.tokens_per_second)
    return modes


def run_bench(pair: LoadedPair, settings: BenchSettings) -> BenchResult:
    """Run every mode on the same prompts, ``settings.runs`` rounds; identity vs target-only.

    On the CPU the pair must keep its plain weights (``load_pair(keep_plain=True)``)
    for HF's stock-kernel baseline.
    """
    tokenizer = pair.target.tokenizer
    prompts = [encode_prompt(tokenizer, text, chat=settings.chat) for text in settings.prompt_texts]
    machine = machine_info(pair)
    stock = stock_kernels(pair) if settings.hf_assisted else pair
    grammar = structured_grammar(pair) if settings.structured else None
    merged: dict[str, ModeResult] = {}
    for index in range(settings.runs):
        # The rotation goes on across rounds, so each mode leads a different prompt.
        round_modes = _one_round(
            pair, stock, prompts, settings, shift=index * len(prompts), grammar=grammar
        )
        references = {m.mode: m.outputs for m in round_modes}
        for mode in round_modes:
            total = merged.setdefault(
                mode.mode,
                ModeResult(mode.mode, mode.depth, drafted=mode.drafted, accepted=mode.accepted),
            )
            if total.drafted is not None and not total.run_rates:
                total.drafted = total.accepted = 0
            total.absorb(mode)
            baseline = baseline_of(mode.mode)
            total.identical = total.identical and (
                mode.mode == baseline or mode.outputs == references[baseline]
            )
            if not total.outputs:
                total.outputs = mode.outputs
    if settings.hf_assisted:
        machine["hf_assisted_kernels"] = "stock transformers; onednn: the engine's kernels"
    order = [TARGET_ONLY]
    names = [n for n in merged if n not in (TARGET_ONLY, HF_ASSISTED, HF_ASSISTED_ONEDNN)]
    names.sort(key=lambda n: n.endswith(JSON_SUFFIX))  # the structured rows last
    order += names + [n for n in (HF_ASSISTED, HF_ASSISTED_ONEDNN) if n in merged]
    return BenchResult(settings, [merged[n] for n in order], machine)


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def _ratio_cell(result: BenchResult, mode: ModeResult, baseline: str) -> str:
    median = result.ratio(mode, baseline)
    spread = result.spread(mode, baseline)
    if median is None or spread is None:
        return "n/a"
    if spread[0] == spread[1]:
        return f"{median:.2f}x"
    return f"{median:.2f}x [{spread[0]:.2f}-{spread[1]:.2f}]"


def format_table(result: BenchResult) -> str:
    """A plain-text table: tokens/s, acceptance, tokens per target pass and the ratios."""
    header = (
        "mode",
        "tokens",
        "tok/s",
        "accept",
        "tok/pass",
        "vs target",
        "vs HF",
        "vs HF onednn",
        "vs best k",
        "identical",
    )
    best = result.best_fixed_depth()
    rows = [header]
    for m in result.modes:
        rows.append(
            (
                m.mode,
                str(m.tokens),
                f"{m.tokens_per_second:.2f}",
                _fmt(m.acceptance_rate, ".2f"),
                f"{m.tokens_per_target_pass:.2f}",
                _ratio_cell(result, m, baseline_of(m.mode)),
                _ratio_cell(result, m, HF_ASSISTED),
                _ratio_cell(result, m, HF_ASSISTED_ONEDNN),
                _ratio_cell(result, m, best) if best else "n/a",
                "yes" if m.identical else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = result.settings
    lines[:0] = [
        f"{len(s.prompt_texts)} prompts x {s.repeats} repeats, {s.max_new_tokens} new tokens, "
        f"greedy, chat template {'on' if s.chat else 'off'}; {s.runs} rounds: "
        "tok/s and ratios are medians over rounds [min-max of the per-round ratios]",
        ", ".join(f"{key}: {value}" for key, value in result.machine.items()),
        f"vs best k: against {best or 'no fixed depth'}, the fixed depth with the most tok/s",
        "",
    ]
    lines += _structured_lines(result)
    return "\n".join(lines)


def _structured_lines(result: BenchResult) -> list[str]:
    """The structured rows' summary: the ratio under the grammar, acceptance, mask cost."""
    rows = [m for m in result.modes if m.mode.endswith(JSON_SUFFIX) and m.mask_ms_per_pass]
    if not rows:
        return []
    lines = ["", "json schema rows: vs target = against target-only under the same grammar"]
    for m in rows:
        lines.append(
            f"  {m.mode}: {_ratio_cell(result, m, baseline_of(m.mode))}, acceptance "
            f"{_fmt(m.acceptance_rate, '.2f')}, mask cost {_fmt(m.mask_ms_per_pass, '.2f')} ms "
            f"per target pass ({_fmt(m.mask_us_per_position, '.0f')} us per masked position)"
        )
    return lines


def plot(result: BenchResult, path: Path) -> None:
    """tokens/s and acceptance per fixed depth, with the baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must come before pyplot
    import matplotlib.pyplot as plt

    fixed = result.fixed_depth_modes()
    depths = [m.depth or 0 for m in fixed]
    figure, speed_axis = plt.subplots(figsize=(7, 4.5))
    speed_axis.plot(depths, [m.tokens_per_second for m in fixed], "o-", label="specpair tokens/s")
    styles = {TARGET_ONLY: "--", HF_ASSISTED: ":"}
    for m in result.modes:
        if m.mode in styles or m.mode.startswith(DEFAULT_MODE):
            speed_axis.axhline(
                m.tokens_per_second, linestyle=styles.get(m.mode, "-."), color="gray", alpha=0.8
            )
            speed_axis.annotate(
                m.mode, (depths[0] if depths else 1, m.tokens_per_second), fontsize=8
            )
    speed_axis.set_xlabel("draft depth k (tokens drafted per step)")
    speed_axis.set_ylabel("tokens/s")
    speed_axis.set_ylim(bottom=0)
    speed_axis.set_xticks(depths)
    acceptance_axis: Any = speed_axis.twinx()
    acceptance_axis.plot(
        depths,
        [m.acceptance_rate or 0.0 for m in fixed],
        "s-",
        color="tab:orange",
        label="acceptance",
    )
    acceptance_axis.set_ylabel("acceptance (accepted / drafted)", color="tab:orange")
    acceptance_axis.set_ylim(0, 1.05)
    speed_axis.set_title("specpair: speed and acceptance per depth")
    figure.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
