"""Background startup: load the pair, check it, then start serving.

Runs in its own thread after the server listens, so /healthz answers and
/readyz says what is happening while the models load.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specpair_runtime.config import ConfigError
from specpair_runtime.engine.device_plan import drop_draft, plan_on_device
from specpair_runtime.engine.golden_check import run_golden
from specpair_runtime.engine.grammar import GrammarCompiler
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.pair import LoadedPair, load_pair
from specpair_runtime.golden import load_golden
from specpair_runtime.server.memory import MemoryProbe
from specpair_runtime.server.readiness import Readiness
from specpair_runtime.server.reload import ConfigWatcher
from specpair_runtime.server.scheduler import Scheduler
from specpair_runtime.server.state import ServerState

if TYPE_CHECKING:
    from specpair_runtime.engine.speculative import SpeculativeEngine

log = logging.getLogger("specpair.startup")


def model_length_limit(pair: LoadedPair, configured: int) -> int:
    """The configured max model length, capped by the target's position table."""
    positions = getattr(pair.target.model.config, "max_position_embeddings", None)
    return min(configured, int(positions)) if positions else configured


def golden_failure(state: ServerState, pair: LoadedPair) -> str | None:
    """Run the configured golden prompts; the reason they fail, or None."""
    path = state.config.serving.golden_prompts_file
    if path is None:
        return None
    try:
        golden = load_golden(Path(path))
    except ConfigError as error:
        return f"golden prompts file invalid: {error}"
    state.readiness.set("golden_prompts", f"running {len(golden.prompts)} golden prompts")
    report = run_golden(golden, pair)
    for note in report.notes():  # divergences at a near-tie: numerics, not a bug
        log.warning("golden prompts: %s", note)
    if report.passed:
        log.info("golden prompts passed (%d)", len(report.results))
        return None
    return "golden prompts failed: " + "; ".join(report.failures())


def apply_device_plan(state: ServerState, pair: LoadedPair) -> str | None:
    """On CUDA, drop the draft when it does not fit the measured free memory; say why.

    Returns the target-only reason, or None when the pair speculates (always on the CPU).
    """
    plan = plan_on_device(pair, state.config.serving)
    if plan is None:
        return None
    state.metrics.device_plan(plan.mode)
    if plan.speculate:
        log.info("device plan: %s", plan.reason)
        return None
    log.warning("device plan: %s", plan.reason)
    drop_draft(pair)
    return plan.reason


def warm_up_graphs(readiness: Readiness, engine: SpeculativeEngine) -> None:
    """Capture every graph step shape before /readyz says ready (CUDA graphs only).

    Compiled lazily, the first requests of a new pod would wait minutes.
    """
    if engine.target.graphs is None:
        return
    what = "compiling and recording" if engine.target.graphs.compiles else "capturing"
    readiness.set("warming_up", f"{what} CUDA graphs for every step shape")
    start = time.perf_counter()
    shapes = engine.warm_up_graphs()
    log.info("captured %d graph step shapes in %.1f s", shapes, time.perf_counter() - start)


def load_and_serve(state: ServerState, watch_interval_seconds: float = 2.0) -> None:
    """Load, check and start the engine thread; readiness says how far it got."""
    config = state.config
    try:
        state.readiness.set("loading", "loading the target and draft models")
        options = EngineOptions.from_serving(config.serving)  # KV sizing, step budget
        pair = load_pair(
            config.target, config.draft, config.speculation, state.device, options=options
        )
        state.readiness.set("checking_alignment", "checking the draft against the target")
        refused = pair.speculation_refused
        if refused is not None:
            state.readiness.set("failed", refused)
            log.error("not ready: %s", refused)
            return
        target_only = apply_device_plan(state, pair)
        failure = golden_failure(state, pair)
        if failure is not None:
            state.readiness.set("failed", failure)
            log.error("not ready: %s", failure)
            return
        if state.probe is None:
            state.probe = MemoryProbe(str(pair.target.device))
        state.max_model_length = model_length_limit(pair, config.serving.max_model_length)
        state.tokenizer = pair.target.tokenizer
        engine = pair.engine()
        warm_up_graphs(state.readiness, engine)
        state.vocab_size = engine.target.vocab
        build_grammar_compiler(state, engine)
        scheduler = Scheduler(
            engine=engine,
            knobs=config.speculation,
            metrics=state.metrics,
            probe=state.probe,
            max_batch_size=config.serving.max_batch_size,
            max_waiting=config.serving.max_waiting_requests,
        )
        freeze_long_lived_objects()
        scheduler.start()
        state.scheduler = scheduler
        if state.config_path is not None:
            state.watcher = ConfigWatcher(
                state.config_path, config, scheduler.update_knobs, watch_interval_seconds
            )
            state.watcher.start()
        state.readiness.set("ready", "serving" if target_only is None else f"serving {target_only}")
        log.info("ready: pair %s version %s", config.pair.name, config.pair.version)
    except Exception as error:
        log.exception("startup failed")
        state.readiness.set("failed", f"startup failed: {error}")


def build_grammar_compiler(state: ServerState, engine: SpeculativeEngine) -> None:
    """Structured outputs: llguidance's index of the tokenizer, built once (seconds for
    150k tokens). A tokenizer it cannot read leaves the server serving everything else;
    constrained requests then get 400 with the reason."""
    try:
        state.grammars = GrammarCompiler(state.tokenizer, engine.target.vocab, engine.eos_ids)
    except Exception as error:  # llguidance's own failure on this tokenizer
        state.grammars_unavailable = f"{type(error).__name__}: {error}"
        log.warning("structured outputs unavailable: %s", state.grammars_unavailable)


def freeze_long_lived_objects() -> None:
    """Take what is alive now (modules, models, tokenizer) out of the garbage collector's scans.

    They are hundreds of thousands of objects: one full collection over them
    took 146 ms with the 1.5B pair loaded, a stall of every running stream at
    random moments (it set the p99 inter-token latency of the server
    benchmark). Frozen, they are never scanned again; as vLLM does.
    """
    gc.collect()
    gc.freeze()


def start_loader(state: ServerState, watch_interval_seconds: float = 2.0) -> threading.Thread:
    thread = threading.Thread(
        target=load_and_serve, args=(state, watch_interval_seconds), name="loader", daemon=True
    )
    state.loader = thread
    thread.start()
    return thread


def stop_serving(state: ServerState) -> None:
    """Stop the watcher and the engine thread (after the HTTP side drained)."""
    if state.watcher is not None:
        state.watcher.stop()
    if state.scheduler is not None:
        state.scheduler.stop()
    if state.grammars is not None:
        state.grammars.close()
    gc.unfreeze()  # a process that serves again (tests do) must not keep today's objects frozen
