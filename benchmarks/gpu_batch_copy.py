"""The worker side's batched copies on CUDA: correct against the host path, and timed against torch.

Only on a machine with CUDA (``benchmarks/gpu_check.sh`` runs it; it exits with a message and
status 0 elsewhere). A paged KV cache of ``--layers`` layers in FlashAttention's layout
``(2, blocks, 16, heads, dim)`` bf16 on the device, ``--blocks`` random block ids:

* **correct** — :meth:`PagedKV.gather` (side stream, one ``index_select`` per layer, one copy to
  pinned host memory, an event) then :meth:`Gathered.payloads` equals the per-block payloads made
  the plain way (``select(...).contiguous().cpu()``), and :meth:`PagedKV.scatter` + ``put`` (one
  upload and ``index_copy_`` per layer on the side stream) writes exactly those blocks back into a
  zeroed cache; any difference fails the run (status 1);
* **timed** — ours: ``gather`` + ``payloads`` (the bytes in host memory, block-major); baseline:
  torch's plain way to the same bytes, ``torch.cat([t.index_select(1, ids).cpu() ...])`` (a
  batched gather per layer and a synchronous pageable copy each; the same bytes, layer-major rather
  than block-major). GB/s medians of ``--repeats``.

Writes ``benchmarks/results/gpu_batch_copy_gather.json``.
Run: ``python -m benchmarks.gpu_batch_copy [--layers 32] [--blocks 256] [--repeats 10]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per save")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_batch_copy: no CUDA device here (torch.cuda.is_available() is False): nothing measured")
        return 0
    from nexuskv.dataplane.batch_copy import PagedKV, PagedLayer

    from benchmarks._result import Run, write_result

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (2, args.num_blocks, 16, args.heads, args.dim)
    caches = [torch.randn(shape, generator=gen, device=dev).to(torch.bfloat16) for _ in range(args.layers)]
    nbytes = caches[0].select(1, 0).numel() * 2
    layers = [PagedLayer(f"model.layers.{i}.attn", t, 1, nbytes, i * nbytes) for i, t in enumerate(caches)]
    kv = PagedKV(layers)
    ids = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(1))[:args.blocks].tolist()

    # -- correct --
    got = kv.gather(ids).payloads()
    plain = torch.stack([torch.cat([t.select(1, b).contiguous().view(-1).view(torch.uint8).cpu() for t in caches])
                         for b in ids])
    if not torch.equal(got, plain):
        print("gpu_batch_copy: FAIL: batched gather differs from the per-block copies")
        return 1
    targets = [torch.zeros_like(t) for t in caches]
    back = PagedKV([PagedLayer(la.name, t, 1, la.nbytes, la.offset) for la, t in zip(layers, targets)])
    scatter = back.scatter(got, ids)
    scatter.put()
    torch.cuda.current_stream().synchronize()
    idx = torch.tensor(ids, device=dev)
    for t, src in zip(targets, caches):
        if not torch.equal(t.index_select(1, idx), src.index_select(1, idx)):
            print("gpu_batch_copy: FAIL: batched scatter did not write the blocks back")
            return 1
    scatter.release()
    print(f"gpu_batch_copy: correct ({args.blocks} blocks x {args.layers} layers, {kv.block_bytes} bytes per block)")

    # -- timed --
    total = args.blocks * kv.block_bytes
    runs = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g = kv.gather(ids)
        g.payloads()
        g.release()
        ours = time.perf_counter() - t0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cat([t.index_select(1, idx).cpu().view(-1).view(torch.uint8) for t in caches])
        base = time.perf_counter() - t0
        runs.append(Run(total / ours / 1e9, total / base / 1e9))
    o = statistics.median(r.value for r in runs)
    b = statistics.median(r.baseline for r in runs)
    print(f"gather to host: ours {o:.2f} GB/s, torch plain {b:.2f} GB/s, ratio {statistics.median(r.ratio for r in runs):.2f}")
    if not args.no_write:
        path = write_result("gpu_batch_copy_gather", f"batched save gather device->pinned host, {args.blocks} blocks x "
                            f"{args.layers} layers, payloads block-major in host memory", "GB/s", runs,
                            "torch index_select per layer + .cpu() (pageable), same bytes layer-major",
                            f"python -m benchmarks.gpu_batch_copy --layers {args.layers} --blocks {args.blocks} "
                            f"--repeats {args.repeats}", details={"device": torch.cuda.get_device_name(),
                                                                   "block_bytes": kv.block_bytes})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
