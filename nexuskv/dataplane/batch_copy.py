"""Batched copies between an engine's paged KV cache and host payload buffers.

An engine keeps its KV in one tensor per layer, a block dimension in each (vLLM's CPU attention:
``(blocks, heads, tokens, 2*dim)``, block dimension 0; FlashAttention's ``(2, blocks, tokens,
heads, dim)``, block dimension 1). A block's *payload* is its bytes in every layer, in layer
order: each layer's block in the tensor's logical order (``tensor.select(block_dim, b)``, made
contiguous), one after the other. :class:`PagedKV` moves many blocks at once:

* **Gather** (a save): one ``index_select`` per layer over a tensor of block ids, written straight
  into a *layer-major* host buffer (layer 0's blocks, then layer 1's, ...) — no per-block copy,
  no Python loop over blocks. Where CUDA is present the gathers run on a side stream into device
  scratch that is copied once into *pinned* host memory (``non_blocking``), ended by an event;
  the engine's stream waits for that event before its next kernels, so a block vLLM reuses is
  never overwritten under the copy, and the calling thread never waits for it. The payloads
  (block-major, what the tiers store and checksum) are made from the host buffer by
  :meth:`Gathered.payloads`, which waits for the event first: call it on the writer thread.
* **Scatter** (a load): the payloads (read and verified into a block-major host buffer) are turned
  into a layer-major buffer off the engine's thread (:meth:`PagedKV.scatter`, pinned where CUDA
  is present), then put in place one layer at a time (:meth:`Scatter.put`): one ``index_copy_``
  per layer; with CUDA, each layer's upload and ``index_copy_`` run on the side stream, ended by
  one event per layer, and :meth:`Scatter.wait` makes the engine's stream wait for that layer's
  event only, so the copy of layer *i* overlaps the compute of the layers before it.

Without CUDA every copy is a synchronous host copy on the calling thread (the same code path, the
same buffers, no streams). Staging buffers come from a :class:`~nexuskv.dataplane.backend.BufferPool`
and go back to it (:meth:`Gathered.release`, :meth:`Scatter.release`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nexuskv.dataplane.backend import BufferPool

__all__ = ["PagedLayer", "PagedKV", "Gathered", "Scatter"]

#: Every buffer is made and written outside inference mode: vLLM runs its step under
#: ``torch.inference_mode()``, and a pool buffer first allocated there would be an inference
#: tensor that a worker thread (not in inference mode) may not write into when it reuses it.
_normal = torch.inference_mode(False)


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """One layer of a paged KV cache: its tensor, where its block dimension is, its share of a payload."""

    name: str
    tensor: torch.Tensor
    block_dim: int  # 0 or 1 (``(2, blocks, ...)``)
    nbytes: int  # bytes of one block of this layer
    offset: int  # where this layer's bytes start in a block's payload

    def __post_init__(self) -> None:
        if self.block_dim not in (0, 1):
            raise ValueError(f"layer {self.name}: block_dim must be 0 or 1, got {self.block_dim}")
        if self.block_dim == 1 and self.tensor.shape[0] != 2:
            raise ValueError(f"layer {self.name}: block dimension 1 needs a leading K/V dimension of 2, "
                             f"got shape {tuple(self.tensor.shape)}")

    def shaped(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        """``flat`` (uint8, ``n * nbytes``) viewed as ``n`` blocks of this layer in its tensor's logical order."""
        shape = list(self.tensor.shape)
        shape[self.block_dim] = n
        return flat.view(self.tensor.dtype).view(shape)


class PagedKV:
    """A paged KV cache's layers, and batched copies of whole blocks out of and into them."""

    def __init__(self, layers: Sequence[PagedLayer], *, pool: BufferPool | None = None) -> None:
        if not layers:
            raise ValueError("a paged KV cache needs at least one layer")
        self.layers = tuple(layers)
        self.block_bytes = sum(layer.nbytes for layer in self.layers)
        self.device = self.layers[0].tensor.device
        self.cuda = self.device.type == "cuda"
        self.pool = pool or BufferPool(pin=self.cuda, max_bytes=256 << 20)
        self._index = {layer.name: i for i, layer in enumerate(self.layers)}
        self._local = threading.local()

    def layer_index(self, name: str) -> int | None:
        """The position of layer ``name`` (None: not a registered layer)."""
        return self._index.get(name)

    def stream(self) -> torch.cuda.Stream:
        """This thread's side stream for copies (CUDA only)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)
        return stream

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if self.cuda:
            return ids.pin_memory().to(self.device, non_blocking=True)
        return ids

    def _layer_part(self, buf: torch.Tensor, index: int, n: int) -> torch.Tensor:
        layer = self.layers[index]
        return buf[layer.offset * n:(layer.offset + layer.nbytes) * n]

    # -- saves --------------------------------------------------------------------------------

    @_normal
    def gather(self, block_ids: Sequence[int]) -> Gathered:
        """Copy blocks ``block_ids`` out of every layer into one layer-major host buffer.

        Without CUDA the copy is done when this returns; with CUDA it is enqueued on this
        thread's side stream after the engine's work so far, and the engine's stream waits for
        it before anything it enqueues later. Either way :meth:`Gathered.payloads` waits for it.
        """
        n = len(block_ids)
        if n == 0:
            raise ValueError("gather: no blocks")
        host = self.pool.take(n * self.block_bytes)
        if not self.cuda:
            ids = self._ids(block_ids)
            for i, layer in enumerate(self.layers):
                torch.index_select(layer.tensor, layer.block_dim, ids, out=layer.shaped(self._layer_part(host, i, n), n))
            return Gathered(self, host, n, None)
        engine = torch.cuda.current_stream(self.device)
        stream = self.stream()
        stream.wait_stream(engine)  # the blocks were written by the engine's kernels enqueued so far
        with torch.cuda.stream(stream):
            ids = self._ids(block_ids)
            scratch = torch.empty(n * self.block_bytes, dtype=torch.uint8, device=self.device)
            for i, layer in enumerate(self.layers):
                torch.index_select(layer.tensor, layer.block_dim, ids,
                                   out=layer.shaped(self._layer_part(scratch, i, n), n))
            host.copy_(scratch, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        engine.wait_event(done)  # vLLM may reuse these blocks in its next step: not before they are copied
        return Gathered(self, host, n, done)

    # -- loads --------------------------------------------------------------------------------

    @_normal
    def staging(self, n: int) -> torch.Tensor:
        """A block-major host buffer of ``n`` payloads (``(n, block_bytes)``: read one payload per row)."""
        return torch.empty((n, self.block_bytes), dtype=torch.uint8)

    @_normal
    def scatter(self, payloads: torch.Tensor, block_ids: Sequence[int]) -> Scatter:
        """Blocks ``block_ids`` to put in place from ``payloads`` (``(n, block_bytes)``, verified).

        Makes the layer-major copy (pinned where CUDA is present): call it off the engine's thread.
        Nothing is written into the cache until :meth:`Scatter.put`.
        """
        n = len(block_ids)
        if payloads.dim() != 2 or payloads.shape[0] < n or payloads.shape[1] != self.block_bytes:
            raise ValueError(f"scatter: payloads of shape {tuple(payloads.shape)} for {n} blocks of "
                             f"{self.block_bytes} bytes")
        host = self.pool.take(n * self.block_bytes)
        for i, layer in enumerate(self.layers):
            part = self._layer_part(host, i, n)
            rows = payloads[:n, layer.offset:layer.offset + layer.nbytes]
            if layer.block_dim == 0:
                part.view(n, layer.nbytes).copy_(rows)
            else:  # payload rows are (K, V) of one block; the tensor holds K of every block, then V
                half = layer.nbytes // 2
                part.view(2, n, half).copy_(rows.view(n, 2, half).transpose(0, 1))
        return Scatter(self, host, block_ids)


class Gathered:
    """Blocks copied (or being copied) out of a paged KV cache into a layer-major host buffer."""

    def __init__(self, kv: PagedKV, host: torch.Tensor, n: int, done: torch.cuda.Event | None) -> None:
        self.kv, self.n = kv, n
        self._host: torch.Tensor | None = host
        self._done = done

    @property
    def nbytes(self) -> int:
        return self.n * self.kv.block_bytes

    def ready(self) -> bool:
        """True once the copy has completed (always, without CUDA)."""
        return self._done is None or self._done.query()

    @_normal
    def payloads(self) -> torch.Tensor:
        """The blocks' payloads, block-major (``(n, block_bytes)``, one contiguous row per block), in
        host memory of their own; waits for the copy first (an event, not the whole device)."""
        host = self._host
        if host is None:
            raise ValueError("payloads of a released gather")
        if self._done is not None:
            self._done.synchronize()
        kv, n = self.kv, self.n
        out = torch.empty((n, kv.block_bytes), dtype=torch.uint8)
        for i, layer in enumerate(kv.layers):
            part = kv._layer_part(host, i, n)
            dst = out[:, layer.offset:layer.offset + layer.nbytes]
            if layer.block_dim == 0:
                dst.copy_(part.view(n, layer.nbytes))
            else:
                half = layer.nbytes // 2
                dst.view(n, 2, half).copy_(part.view(2, n, half).transpose(0, 1))
        return out

    def release(self) -> None:
        """Give the staging buffer back (after :meth:`payloads`, or to drop the save)."""
        host, self._host = self._host, None
        if host is None:
            return
        if self._done is not None:
            self._done.synchronize()  # the DMA may still be writing it
        self.kv.pool.give(host)


class Scatter:
    """Verified payloads of some blocks, layer-major in host memory, put into the cache layer by layer."""

    def __init__(self, kv: PagedKV, host: torch.Tensor, block_ids: Sequence[int]) -> None:
        self.kv = kv
        self.block_ids = tuple(block_ids)
        self._host: torch.Tensor | None = host
        self._put = [False] * len(kv.layers)
        self._events: list[torch.cuda.Event | None] = [None] * len(kv.layers)
        self._ids: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        """Every layer put in place (or enqueued to be, with CUDA)."""
        return all(self._put)

    def missing_layers(self) -> list[str]:
        return [layer.name for layer, put in zip(self.kv.layers, self._put) if not put]

    def _put_layer(self, index: int, ids: torch.Tensor) -> None:
        kv, n = self.kv, len(self.block_ids)
        layer = kv.layers[index]
        src = kv._layer_part(self._host, index, n)
        if kv.cuda:
            src = src.to(kv.device, non_blocking=True)
        layer.tensor.index_copy_(layer.block_dim, ids, layer.shaped(src, n))
        self._put[index] = True

    @_normal
    def put(self, index: int | None = None) -> None:
        """Put layer ``index`` in place (None: every layer not put yet).

        Without CUDA the copy is done when this returns. With CUDA the first call enqueues every
        layer's upload and ``index_copy_`` on the side stream (in layer order, one event each) and
        the engine's stream waits for layer ``index``'s event (None: for the last layer's).
        """
        if self._host is None:
            raise ValueError("put of a released scatter")
        kv = self.kv
        if not kv.cuda:
            if self._ids is None:
                self._ids = kv._ids(self.block_ids)
            for i in (range(len(kv.layers)) if index is None else (index,)):
                if not self._put[i]:
                    self._put_layer(i, self._ids)
            return
        if self._events[0] is None:
            engine = torch.cuda.current_stream(kv.device)
            stream = kv.stream()
            stream.wait_stream(engine)  # after whatever the engine enqueued on these blocks before
            with torch.cuda.stream(stream):
                ids = kv._ids(self.block_ids)
                for i in range(len(kv.layers)):
                    self._put_layer(i, ids)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self._events[i] = event
        self.wait(len(kv.layers) - 1 if index is None else index)

    def wait(self, index: int) -> None:
        """With CUDA: the engine's stream waits for layer ``index``'s copy (the host does not)."""
        event = self._events[index]
        if event is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(event)

    def ready(self) -> bool:
        """True once no enqueued copy still reads the host buffer (always, without CUDA)."""
        return all(e is None or e.query() for e in self._events)

    def synchronize(self) -> None:
        """Block the calling thread until every enqueued layer is in place (asynchronous loads)."""
        for event in self._events:
            if event is not None:
                event.synchronize()

    def release(self) -> None:
        host, self._host = self._host, None
        if host is None:
            return
        self.synchronize()  # an upload may still read it
        self.kv.pool.give(host)
