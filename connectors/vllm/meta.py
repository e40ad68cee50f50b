"""What crosses between the connector's scheduler side and its worker side, each step.

vLLM runs the scheduler in its engine-core process and each model runner in a worker process
(its default multiprocess engine; vLLM CPU always uses one) and pickles the connector's
metadata between them. So everything here is a plain frozen dataclass defined at module level,
importable without vLLM in any process (:mod:`connectors.vllm.shell` wraps them in vLLM's
``KVConnectorMetadata`` / ``KVConnectorWorkerMetadata`` classes, also at module level).

Scheduler -> worker (:class:`ConnectorMeta`): the step's loads, its saves of blocks filled this
step, and its prefill work (what the worker's timing of the step measured). Worker -> scheduler
(:class:`WorkerReport`): the timings the cold-start cost model learns from.
"""

from __future__ import annotations

from dataclasses import dataclass

from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation

__all__ = ["LoadSpec", "SaveSpec", "PrefillWork", "ConnectorMeta", "PrefillTiming", "CopyTiming", "WorkerReport"]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks one request loads this step: canonical keys, where they come from, where they land."""

    request_id: str
    source: EntryLocation | None  # None: the scheduler could not honour the allocation: fail them all
    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_block: int  # the prompt's block index of keys[0]
    load_async: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Full blocks of one request, computed by this step, to write to this worker's ``tier``.

    ``parent`` is the canonical key of the block before ``keys[0]`` (None from block 0) and
    ``token_ids`` the blocks' tokens: the tier's publisher announces them with their tokens, so the
    index keys them without the engine's own events.
    """

    request_id: str
    tier: Tier
    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    first_block: int
    parent: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """One request's prefill this step: ``uncached`` tokens computed in a context of ``context`` tokens."""

    request_id: str
    uncached: int
    context: int


@dataclass(frozen=True, slots=True)
class ConnectorMeta:
    """What the scheduler side hands the worker side for one step."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    prefills: tuple[PrefillWork, ...] = ()
    decodes: int = 0  # other requests of the step (decoding): a step with any is no clean prefill timing


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """A step that computed one prefill and nothing else took ``duration_s`` (loads excluded)."""

    uncached: int
    context: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class CopyTiming:
    """``pages`` blocks copied from ``source`` to ``destination`` in ``duration_s``."""

    source: Tier
    destination: Tier
    pages: int
    duration_s: float
    ok: bool = True


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """The worker's measurements since its last report (vLLM aggregates one per worker)."""

    gemm_flops_per_s: float | None = None  # the device's GEMM rate, measured once at registration
    gemm_label: str = ""
    prefills: tuple[PrefillTiming, ...] = ()
    copies: tuple[CopyTiming, ...] = ()
    loads_done: tuple[str, ...] = ()  # requests whose loads ended, every block in place
    loads_failed: tuple[str, ...] = ()  # requests with blocks that failed to load (vLLM recomputes them)
    # A repeated GEMM probe: FLOPs of one run and each run's seconds (nexuskv.priors.GemmProbe judges
    # its spread); preferred to gemm_flops_per_s, a single figure whose spread is unknown.
    gemm_flops: float | None = None
    gemm_samples_s: tuple[float, ...] = ()

    def merged(self, other: WorkerReport) -> WorkerReport:
        mine = bool(self.gemm_samples_s)
        return WorkerReport(self.gemm_flops_per_s or other.gemm_flops_per_s, self.gemm_label or other.gemm_label,
                            self.prefills + other.prefills, self.copies + other.copies,
                            self.loads_done + other.loads_done, self.loads_failed + other.loads_failed,
                            self.gemm_flops if mine else other.gemm_flops,
                            self.gemm_samples_s if mine else other.gemm_samples_s)

    def __bool__(self) -> bool:
        return bool(self.gemm_flops_per_s or self.gemm_samples_s or self.prefills or self.copies or self.loads_done
                    or self.loads_failed)
