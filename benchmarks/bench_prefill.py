"""Reference-runtime prefill time against prompt length: recompute versus reuse, and the fit.

For each variant (GQA, MLA, hybrid) with 16-token blocks (hybrid: checkpoints every 64 tokens)
and each prompt length, interleaved in the same run:

* **recompute** — ``prefill(prompt, reuse=False)``: every token computed;
* **reuse** — a fresh runtime loads the first 3/4 of the prompt's state from the host tier
  (``load``: read each page into place and verify its checksum) and prefills the rest
  (``prefill``): the whole time to first logits along the cache path. The hybrid reuses only up
  to its last checkpoint boundary below 3/4.

Every prefill's ``PrefillObservation`` (uncached tokens e, context tokens s, duration) is what
the calibration agent fits; here ``T = c0 + c1*e + c2*e*s`` is fitted by least squares to the
same observations, and its coefficients and error are reported.

Writes ``benchmarks/results/runtime_prefill_<variant>.json``: value = the reuse path at the
longest length, baseline = recompute at that length (ratio < 1: reuse is faster); details hold
every length and the fit. CPU only, fp32, tiny models: the figures calibrate the reference
runtime, not a production engine.
Run: ``python -m benchmarks.bench_prefill [--lengths 128,256,512,1024] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from nexuskv.contracts.observations import ObservationRecord, PrefillObservation
from nexuskv.dataplane import DescriptorRegistry, HostMemoryBackend
from nexuskv.reference_engine import ReferenceEngine, ReferenceModelSpec, TinyModel

from benchmarks._result import Run, write_result

SPECS = {
    "gqa": ReferenceModelSpec.gqa(block_size=16),
    "mla": ReferenceModelSpec.mla(block_size=16),
    "hybrid": ReferenceModelSpec.hybrid(block_size=16, checkpoint_interval=64),
}


def _fit(samples: list[tuple[int, int, float]]) -> dict:
    """Least squares ``T = c0 + c1*e + c2*e*s`` over (e, s, seconds); coefficients and errors."""
    e = np.array([x[0] for x in samples], dtype=float)
    s = np.array([x[1] for x in samples], dtype=float)
    t = np.array([x[2] for x in samples], dtype=float)
    design = np.stack([np.ones_like(e), e, e * s], axis=1)
    coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    pred = design @ coef
    rel = np.abs(pred - t) / t
    return {"c0_s": coef[0], "c1_s_per_token": coef[1], "c2_s_per_token2": coef[2],
            "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max()), "samples": len(samples)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,256,512,1024", help="prompt lengths in tokens; the longest is the figure")
    ap.add_argument("--repeats", type=int, default=5,
                    help="repeats per length, each a full recompute then a load and reuse; one run each (default 5)")
    ap.add_argument("--variants", default=",".join(SPECS))
    ap.add_argument("--no-write", action="store_true")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_grad_enabled(False)
    print(f"torch threads {torch.get_num_threads()}; medians of {args.repeats}; times in ms")
    for name in args.variants.split(","):
        spec = SPECS[name]
        model = TinyModel(spec)
        observed: list[PrefillObservation] = []

        def sink(record, observed=observed) -> None:
            if isinstance(record, ObservationRecord) and isinstance(record.observation, PrefillObservation):
                observed.append(record.observation)

        registry = DescriptorRegistry()
        rows = {}
        print(f"{name:<8}{'tokens':>8}{'recompute':>11}{'reuse':>9}{'(load':>8}{'prefill)':>10}{'reused':>8}{'ratio':>7}")
        for n in lengths:
            prompt = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            cached = n * 3 // 4
            host = HostMemoryBackend(1 << 30)
            writer = ReferenceEngine(spec, model=model, registry=registry, num_pages=n // spec.block_size + 8)
            writer.prefill(prompt[:cached])
            writer.save(prompt[:cached], host)
            compute = ReferenceEngine(spec, model=model, registry=registry, publisher=sink,
                                       num_pages=n // spec.block_size + 8)
            reader = ReferenceEngine(spec, model=model, registry=registry, publisher=sink,
                                      num_pages=n // spec.block_size + 8)
            compute.prefill(prompt, reuse=False)  # warm-up
            rec, total, load_t, pre_t, reused = [], [], [], [], 0
            for _ in range(args.repeats):
                rec.append(compute.prefill(prompt, reuse=False).duration_s)
                reader.reset()
                t0 = time.perf_counter()
                loaded = reader.load(prompt, host)
                result = reader.prefill(prompt)
                total.append(time.perf_counter() - t0)
                load_t.append(loaded.duration_s)
                pre_t.append(result.duration_s)
                reused = result.reused_tokens
            r, u = statistics.median(rec), statistics.median(total)
            rows[n] = {"recompute_s": r, "reuse_s": u, "load_s": statistics.median(load_t),
                       "reuse_prefill_s": statistics.median(pre_t), "reused_tokens": reused,
                       "recompute_runs": rec, "reuse_runs": total}
            print(f"{'':<8}{n:>8}{r * 1e3:>11.2f}{u * 1e3:>9.2f}{rows[n]['load_s'] * 1e3:>8.2f}"
                  f"{rows[n]['reuse_prefill_s'] * 1e3:>10.2f}{reused:>8}{u / r:>7.2f}")
        fit = _fit([(o.uncached_tokens, o.context_tokens, o.duration_s) for o in observed])
        print(f"  fit T = {fit['c0_s'] * 1e3:.3f} ms + {fit['c1_s_per_token'] * 1e6:.3f} us*e + "
              f"{fit['c2_s_per_token2'] * 1e9:.4f} ns*e*s  (median rel. error {fit['median_rel_error']:.1%}, "
              f"max {fit['max_rel_error']:.1%}, {fit['samples']} observations)")
        if args.no_write:
            continue
        longest = max(rows)
        path = write_result(f"runtime_prefill_{name}", f"reference engine ({name}) time to first logits, {longest}-token prompt, 3/4 of it reused from the host tier", "s", [Run(u, r) for u, r in zip(rows[longest]["reuse_runs"], rows[longest]["recompute_runs"])], "full recompute of the same prompt", f"python -m benchmarks.bench_prefill --lengths {args.lengths} --repeats {args.repeats} --variants {name}", details={"lengths": {str(k): v for k, v in rows.items()}, "fit": fit,
                     "spec": {"block_size": spec.block_size, "checkpoint_interval": spec.checkpoint_interval,
                              "d_model": spec.d_model, "n_layers": spec.n_layers},
                     "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
