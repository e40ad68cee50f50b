"""Batched copies out of and into a paged KV cache (``nexuskv.dataplane.batch_copy``).

Acceptance: a batched gather gives, for every block, exactly the payload a per-block copy gives
(each layer's block in its tensor's logical order, layers in order) — for vLLM's CPU layout (block
dimension 0), FlashAttention's (block dimension 1) and a non-contiguous (permuted) cache; a scatter
writes exactly the given blocks, one layer per call, and nothing else; staging buffers go back to
their pool; bad input is refused by name. (These run on the host path; the CUDA path is the same
code with streams and events, run by ``benchmarks/gpu_check.sh`` on a machine with CUDA.)
"""

from __future__ import annotations

import pytest
import torch

from nexuskv.dataplane.backend import BufferPool
from nexuskv.dataplane.batch_copy import PagedKV, PagedLayer

BLOCKS = 12


def _layers(tensors: dict[str, torch.Tensor], dims: dict[str, int]) -> list[PagedLayer]:
    out, offset = [], 0
    for name, t in tensors.items():
        one = t.select(dims[name], 0)
        nbytes = one.numel() * one.element_size()
        out.append(PagedLayer(name, t, dims[name], nbytes, offset))
        offset += nbytes
    return out


def _reference_payload(layers: list[PagedLayer], block: int) -> torch.Tensor:
    """One block's payload the plain way: every layer's block made contiguous, layers in order."""
    return torch.cat([layer.tensor.select(layer.block_dim, block).contiguous().view(-1).view(torch.uint8)
                      for layer in layers])


def _random(shape, dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = {
    # vLLM's CPU attention: (blocks, heads, tokens, 2*dim), two dtypes of different widths
    "cpu": lambda: ({"l0": _random((BLOCKS, 2, 4, 16), torch.bfloat16, 1),
                     "l1": _random((BLOCKS, 2, 4, 16), torch.float32, 2)}, {"l0": 0, "l1": 0}),
    # FlashAttention: (2, blocks, tokens, heads, dim)
    "flash": lambda: ({"l0": _random((2, BLOCKS, 4, 2, 8), torch.bfloat16, 3),
                       "l1": _random((2, BLOCKS, 4, 2, 8), torch.bfloat16, 4)}, {"l0": 1, "l1": 1}),
    # a cache allocated in another physical order and permuted to the logical one (HND storage)
    "permuted": lambda: ({"l0": _random((2, BLOCKS, 2, 4, 8), torch.float16, 5).permute(0, 1, 3, 2, 4),
                          "l1": _random((BLOCKS, 2, 4, 16), torch.float16, 6)}, {"l0": 1, "l1": 0}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_batched_gather_gives_each_blocks_payload(case):
    tensors, dims = CASES[case]()
    layers = _layers(tensors, dims)
    kv = PagedKV(layers)
    ids = [7, 0, 11, 3, 3]  # any order, repeats allowed
    gathered = kv.gather(ids)
    assert gathered.ready()
    payloads = gathered.payloads()
    assert payloads.shape == (len(ids), kv.block_bytes) and payloads.is_contiguous()
    for row, block in zip(payloads, ids):
        assert torch.equal(row, _reference_payload(layers, block)), block
    gathered.release()


@pytest.mark.parametrize("case", CASES)
def test_a_scatter_writes_those_blocks_one_layer_at_a_time_and_nothing_else(case):
    tensors, dims = CASES[case]()
    source = _layers(tensors, dims)
    payloads = torch.stack([_reference_payload(source, b) for b in (2, 5, 9)])
    targets = {name: torch.zeros_like(t) for name, t in tensors.items()}
    layers = _layers(targets, dims)
    kv = PagedKV(layers)
    scatter = kv.scatter(payloads, [4, 1, 10])
    assert all(not t.any() for t in targets.values())  # nothing is written before put
    scatter.put(0)
    first, second = layers
    for dst, src in zip((4, 1, 10), (2, 5, 9)):
        assert torch.equal(first.tensor.select(first.block_dim, dst), source[0].tensor.select(first.block_dim, src))
    assert not second.tensor.any() and scatter.missing_layers() == ["l1"] and not scatter.complete
    scatter.put()
    assert scatter.complete
    for layer, src_layer in zip(layers, source):
        for dst, src in zip((4, 1, 10), (2, 5, 9)):
            assert torch.equal(layer.tensor.select(layer.block_dim, dst), src_layer.tensor.select(layer.block_dim, src))
        untouched = [b for b in range(BLOCKS) if b not in (4, 1, 10)]
        assert not layer.tensor.index_select(layer.block_dim, torch.tensor(untouched)).any()
    scatter.release()


def test_gather_then_scatter_round_trips_a_cache():
    tensors, dims = CASES["cpu"]()
    kv = PagedKV(_layers(tensors, dims))
    ids = list(range(BLOCKS))
    payloads = kv.gather(ids).payloads()
    copies = {name: torch.zeros_like(t) for name, t in tensors.items()}
    back = PagedKV(_layers(copies, dims))
    back.scatter(payloads, ids).put()
    assert all(torch.equal(copies[n], tensors[n]) for n in tensors)


def test_staging_buffers_go_back_to_the_pool():
    tensors, dims = CASES["flash"]()
    pool = BufferPool(pin=False, max_bytes=1 << 20)
    kv = PagedKV(_layers(tensors, dims), pool=pool)
    gathered = kv.gather([1, 2, 3])
    gathered.payloads()
    gathered.release()
    gathered.release()  # twice is harmless
    assert pool.idle_bytes() == 3 * kv.block_bytes
    again = kv.gather([4, 5, 6])  # takes the same buffer back
    assert pool.idle_bytes() == 0
    again.release()
    with pytest.raises(ValueError, match="released"):
        gathered.payloads()


def test_bad_input_is_refused_by_name():
    tensors, dims = CASES["cpu"]()
    kv = PagedKV(_layers(tensors, dims))
    with pytest.raises(ValueError, match="no blocks"):
        kv.gather([])
    with pytest.raises(ValueError, match="payloads of shape"):
        kv.scatter(torch.zeros((2, kv.block_bytes + 1), dtype=torch.uint8), [0, 1])
    with pytest.raises(ValueError, match="block_dim must be 0 or 1"):
        PagedLayer("x", tensors["l0"], 2, 1, 0)
    with pytest.raises(ValueError, match="leading K/V dimension"):
        PagedLayer("x", tensors["l0"], 1, 1, 0)
    with pytest.raises(ValueError, match="at least one layer"):
        PagedKV([])
    assert kv.layer_index("l1") == 1 and kv.layer_index("nope") is None


def test_buffers_made_in_inference_mode_are_reusable_by_a_thread_outside_it():
    """vLLM steps under ``torch.inference_mode()``; the loaders and the writer run on other threads."""
    import threading

    tensors, dims = CASES["cpu"]()
    pool = BufferPool(pin=False, max_bytes=1 << 20)
    kv = PagedKV(_layers(tensors, dims), pool=pool)
    with torch.inference_mode():
        gathered = kv.gather([0, 1, 2])  # the step thread: a fresh pool buffer
    payloads = gathered.payloads()
    gathered.release()
    errors: list[BaseException] = []

    def load() -> None:  # a loader thread reuses that buffer for a scatter
        try:
            kv.scatter(payloads, [3, 4, 5]).put()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    t = threading.Thread(target=load)
    t.start()
    t.join()
    assert errors == []
    assert torch.equal(tensors["l0"][3:6], tensors["l0"][0:3])
