"""Mooncake traces turned into KV lifecycle events of simulated workers (reusable by replays).

``load_trace`` reads a Mooncake FAST'25 JSONL trace (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``: one id per 512-token block, each id standing for the block *and
its prefix*). :class:`TraceReplay` routes each request to one of N simulated workers and yields
the ``nexuskv.kv-events`` batches that worker's engine would publish.

Choices (say them when quoting a figure):

* **Block size.** Each 512-token hash id is expanded to 32 blocks of 16 tokens (vLLM's default
  block). A hash id's 512 tokens are drawn from a generator seeded with the id, so equal ids give
  equal tokens and the chained canonical keys reproduce the trace's prefix sharing. The last,
  partial hash id of a request contributes its full 16-token blocks only (vLLM caches full blocks).
* **Routing.** Request -> worker by the request's second hash id (the first is the shared system
  prompt of the conversation trace), so a conversation's turns meet their own earlier blocks;
  a caller that routes by its own policy names the worker (:meth:`TraceReplay.step`).
* **Workers.** Each has an LRU GPU cache of ``gpu_blocks`` blocks and, if ``host_blocks`` > 0, an
  LRU host tier. A request's missing blocks are stored on the GPU (one ``stored`` run with tokens
  and the parent's engine hash); its blocks are then the most recently used, deepest first to go
  (vLLM frees a request's blocks in reverse order). GPU evictions first offload to the host tier
  (a token-less tier event) and then emit ``removed``; host evictions emit ``removed`` for host.
  Prompts longer than the GPU cache are truncated to it.
* **Engine hashes** are per worker (a seeded 64-bit mix of the block's trace position), as vLLM
  engines with different hash seeds produce: they only mean something inside one publisher.

The simulation is the ground truth: :meth:`TraceReplay.resident` says which canonical blocks
each worker holds in each tier after the batches produced so far.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nexuskv.contracts.kv_events import BlockRemoved, BlockStored, KvEvent, KvEventBatch, PublisherIdentity
from nexuskv.descriptor import Tier
from nexuskv.identity import BlockKeyer, IdentityScope
from streams.app.traces import HASH_BLOCK_TOKENS, TraceRequest
from streams.app.traces import load_trace as _load_trace

__all__ = ["TraceRequest", "load_trace", "TraceReplay", "CONVERSATION_TRACE", "CONVERSATION_SLICE", "SYNTHETIC_TRACE",
           "HASH_BLOCK_TOKENS", "BLOCK_TOKENS"]

_SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
_SLICES = Path(__file__).resolve().parent / "data"
#: The full conversation trace when the workspace has it, else the 1,000-request slice kept in
#: ``benchmarks/data`` (a clean checkout has no ``../shared``).
CONVERSATION_TRACE = (_SHARED_TRACES / "conversation_trace.jsonl"
                      if (_SHARED_TRACES / "conversation_trace.jsonl").is_file()
                      else _SLICES / "conversation_trace_head1000.jsonl")
#: The first 1,000 requests of the conversation trace, always available (tests use this).
CONVERSATION_SLICE = _SLICES / "conversation_trace_head1000.jsonl"
SYNTHETIC_TRACE = (_SHARED_TRACES / "synthetic_trace.jsonl"
                   if (_SHARED_TRACES / "synthetic_trace.jsonl").is_file()
                   else _SLICES / "synthetic_trace_head400.jsonl")
BLOCK_TOKENS = 16
PER_HASH = HASH_BLOCK_TOKENS // BLOCK_TOKENS
MAX_BLOCKS_PER_BATCH = 2048  # keeps a batch's payload well under the producer's 1 MiB
VOCAB = 128_000

Block = tuple[int, int]  # (hash id, 16-token block within it)


def load_trace(path: Path = CONVERSATION_TRACE, *, limit: int | None = None) -> list[TraceRequest]:
    """:func:`streams.app.traces.load_trace`, defaulting to the conversation trace."""
    return _load_trace(path, limit=limit)


def _tokens_of(hash_id: int) -> np.ndarray:
    return np.random.default_rng(hash_id).integers(0, VOCAB, HASH_BLOCK_TOKENS, dtype=np.uint32)


class _Worker:
    def __init__(self, name: str, seed: int, gpu_blocks: int, host_blocks: int) -> None:
        self.name = name
        self.seed = seed
        self.gpu: OrderedDict[Block, None] = OrderedDict()
        self.host: OrderedDict[Block, None] = OrderedDict()
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self.seq = 0

    def ehash(self, block: Block) -> int:
        raw = hashlib.blake2b(f"{self.seed}/{block[0]}/{block[1]}".encode(), digest_size=8).digest()
        return int.from_bytes(raw, "big")


class TraceReplay:
    """Workers with LRU caches replaying a trace; yields their kv-events batches in order."""

    def __init__(self, requests: list[TraceRequest], *, workers: int = 8, gpu_blocks: int = 8192,
                 host_blocks: int = 16384, identity: PublisherIdentity | None = None, incarnation: int = 1,
                 prefix: str = "trace-worker") -> None:
        self.requests = requests
        self.identity = identity or PublisherIdentity(
            tenant_namespace="trace", model="mooncake/conversation", model_revision="fast25",
            tokenizer_revision="fast25", descriptor_id="sd1-" + "0" * 32)
        self.incarnation = incarnation
        self.workers = [_Worker(f"{prefix}-{i}", seed=i, gpu_blocks=gpu_blocks, host_blocks=host_blocks)
                        for i in range(workers)]
        self._by_name = {w.name: w for w in self.workers}
        self._tokens: dict[int, np.ndarray] = {}
        self.block_ops = 0

    @property
    def scope(self) -> IdentityScope:
        i = self.identity
        return IdentityScope(tenant_namespace=i.tenant_namespace, model=i.model, model_revision=i.model_revision,
                             tokenizer_revision=i.tokenizer_revision, descriptor_id=i.descriptor_id)

    def blocks_of(self, request: TraceRequest) -> list[Block]:
        out: list[Block] = []
        for i, h in enumerate(request.hash_ids):
            tokens_here = min(HASH_BLOCK_TOKENS, request.input_length - i * HASH_BLOCK_TOKENS)
            out.extend((h, j) for j in range(tokens_here // BLOCK_TOKENS))
        return out

    def tokens(self, blocks: list[Block]) -> np.ndarray:
        parts = []
        for h, j in blocks:
            toks = self._tokens.get(h)
            if toks is None:
                if len(self._tokens) > 65536:
                    self._tokens.clear()
                toks = self._tokens[h] = _tokens_of(h)
            parts.append(toks[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS])
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)

    def route(self, request: TraceRequest) -> _Worker:
        ids = request.hash_ids
        return self.workers[ids[min(1, len(ids) - 1)] % len(self.workers)]

    def batches(self) -> Iterator[KvEventBatch]:
        for request in self.requests:
            yield from self.step(request)

    def worker(self, name: str) -> _Worker:
        """The simulated worker called ``name`` (KeyError if there is none)."""
        return self._by_name[name]

    def step(self, request: TraceRequest, worker: str | None = None) -> list[KvEventBatch]:
        """Serve one request on ``worker`` (default: :meth:`route`'s choice): the batches it publishes."""
        w = self.route(request) if worker is None else self._by_name[worker]
        blocks = self.blocks_of(request)[: w.gpu_blocks]
        if not blocks:
            return []
        hit = 0
        while hit < len(blocks) and blocks[hit] in w.gpu:
            hit += 1
        events: list[KvEvent] = []
        for start in range(hit, len(blocks), MAX_BLOCKS_PER_BATCH):
            run = blocks[start:start + MAX_BLOCKS_PER_BATCH]
            events.append(BlockStored(
                engine_hashes=tuple(w.ehash(b) for b in run),
                parent=w.ehash(blocks[start - 1]) if start else None,
                token_ids=tuple(self.tokens(run).tolist()), block_size=BLOCK_TOKENS, tier=Tier.GPU,
            ))
        for b in reversed(blocks):  # block 0 ends most recently used: the deepest go first
            w.gpu[b] = None
            w.gpu.move_to_end(b)
        gpu_out: list[int] = []
        host_in: list[int] = []
        host_out: list[int] = []
        while len(w.gpu) > w.gpu_blocks:
            b, _ = w.gpu.popitem(last=False)
            if w.host_blocks:
                if b not in w.host:
                    host_in.append(w.ehash(b))
                w.host[b] = None
                w.host.move_to_end(b)
            gpu_out.append(w.ehash(b))
        while len(w.host) > w.host_blocks:
            b, _ = w.host.popitem(last=False)
            host_out.append(w.ehash(b))
        for i in range(0, len(host_in), MAX_BLOCKS_PER_BATCH):
            events.append(BlockStored(engine_hashes=tuple(host_in[i:i + MAX_BLOCKS_PER_BATCH]),
                                      block_size=BLOCK_TOKENS, tier=Tier.HOST))
        for tier, hashes in ((Tier.GPU, gpu_out), (Tier.HOST, host_out)):
            for i in range(0, len(hashes), MAX_BLOCKS_PER_BATCH):
                events.append(BlockRemoved(engine_hashes=tuple(hashes[i:i + MAX_BLOCKS_PER_BATCH]), tier=tier))
        out = []
        chunk: list[KvEvent] = []
        size = 0
        for ev in events:  # at most MAX_BLOCKS_PER_BATCH blocks per batch
            if chunk and size + len(ev.engine_hashes) > MAX_BLOCKS_PER_BATCH:
                out.append(self._batch(w, request, chunk))
                chunk, size = [], 0
            chunk.append(ev)
            size += len(ev.engine_hashes)
        if chunk:
            out.append(self._batch(w, request, chunk))
        return out

    def _batch(self, w: _Worker, request: TraceRequest, events: list[KvEvent]) -> KvEventBatch:
        batch = KvEventBatch(publisher=w.name, incarnation=self.incarnation, seq=w.seq,
                             ts=request.timestamp_ms / 1000.0, identity=self.identity, events=tuple(events))
        w.seq += 1
        self.block_ops += batch.block_operations
        return batch

    def resident(self, secret: bytes = b"") -> dict[tuple[str, Tier, int], set[tuple[IdentityScope, int]]]:
        """Ground truth: the canonical blocks each worker holds, per tier (as ``GlobalIndex.facts``)."""
        scope = self.scope
        keys = self._all_prefix_keys(BlockKeyer(scope, BLOCK_TOKENS, secret))
        out: dict[tuple[str, Tier, int], set[tuple[IdentityScope, int]]] = {}
        for w in self.workers:
            for tier, cache in ((Tier.GPU, w.gpu), (Tier.HOST, w.host)):
                if cache:
                    out[(w.name, tier, 0)] = {(scope, keys[b]) for b in cache}
        return out

    def _all_prefix_keys(self, keyer: BlockKeyer) -> dict[Block, int]:
        keys: dict[Block, int] = {}
        for request in self.requests:
            blocks = self.blocks_of(request)
            if not blocks or all(b in keys for b in blocks):
                continue
            for b, k in zip(blocks, keyer.keys(self.tokens(blocks))):
                keys.setdefault(b, k)
        return keys
