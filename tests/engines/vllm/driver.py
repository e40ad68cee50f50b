"""One real vLLM engine in a process of its own, driven over stdin/stdout by the tests.

``python -m tests.engines.vllm.driver SPEC_JSON`` builds ``vllm.LLM`` (vLLM's CPU build here)
from the spec — model folder, block size, KV cache bytes, optionally NexusKV's connector
(``kv_transfer_config``) and vLLM's ZMQ KV events (``kv_events_config``) — then answers one JSON
command per stdin line with one JSON line on stdout prefixed by :data:`MARK` (vLLM logs on the
same streams). The engine is vLLM's multiprocess engine (engine core and worker in processes of
their own) unless the environment sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (everything in this
process). Commands:

* ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens": 8, "cache_salt": null}`` —
  greedy; per prompt its output token ids, the chosen tokens' logprobs and vLLM's
  ``num_cached_tokens``;
* ``{"op": "reset"}`` — ``LLM.reset_prefix_cache()``;
* ``{"op": "metrics"}`` — vLLM's prefix-cache counters (local and external queries and hits);
* ``{"op": "cached_blocks"}`` — the block hashes in vLLM's prefix cache as its KV events name them
  (in-process engine only: the scheduler lives in this process);
* ``{"op": "connector"}`` — the NexusKV connector's counters (in-process engine only);
* ``{"op": "quit"}``.

A separate process per engine because a fresh engine process is what the tests need (a restart,
a second engine), and because vLLM spawns its engine processes (hence the ``__main__`` guard).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

MARK = "@@nexuskv-driver@@ "


def _reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _build(spec: dict):
    from vllm import LLM

    kwargs = dict(model=spec["model"], block_size=spec.get("block_size", 32), enforce_eager=True, dtype="bfloat16",
                  max_model_len=spec.get("max_model_len", 4096), enable_prefix_caching=True,
                  prefix_caching_hash_algo="sha256_cbor", seed=0, disable_log_stats=False,
                  kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 8 << 20),
                  max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096))
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("kv_events_config"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    return LLM(**kwargs)


def _generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), logprobs=cmd.get("logprobs", 1),
                        ignore_eos=True)
    salt = {"cache_salt": cmd["cache_salt"]} if cmd.get("cache_salt") else {}
    prompts = [{"prompt_token_ids": list(p), **salt} for p in cmd["prompts"]]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append({"token_ids": list(c.token_ids),
                        "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
                        "num_cached_tokens": o.num_cached_tokens})
    _drain(llm)
    return {"outputs": results}


def _scheduler(llm):
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    return getattr(core, "scheduler", None)


def _drain(llm) -> None:
    """In-process engine: step until no finished request holds blocks (vLLM steps only on demand)."""
    sched = _scheduler(llm)
    if sched is None:
        return
    for _ in range(100):
        if not sched.has_finished_requests():
            return
        llm.llm_engine.step()


def _metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                      "vllm:external_prefix_cache_hits"):
            out[m.name.removeprefix("vllm:")] = out.get(m.name.removeprefix("vllm:"), 0) + m.value
    return out


def _cached_blocks(llm) -> dict:
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    sched = _scheduler(llm)
    if sched is None:
        raise RuntimeError("cached_blocks needs the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    cache = sched.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    return {"hashes": sorted(int(maybe_convert_block_hash(get_block_hash(k))) for k in cache)}


def _connector_stats(llm) -> dict:
    """The NexusKV connector's counters (in-process engine: both sides live in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = _scheduler(llm)
    if sched is None:
        raise RuntimeError("connector stats need the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    scheduler_side = sched.connector._scheduler
    worker = get_kv_transfer_group()._worker
    worker.flush()
    model = scheduler_side.cost_model()
    compute = model.compute_for(scheduler_side.descriptor.model, scheduler_side.profile)
    cold = scheduler_side.cold_start
    return {"scheduler": dict(scheduler_side.stats), "worker": dict(worker.stats),
            "publisher": dict(worker.publisher.stats) if worker.publisher is not None else None,
            "cost_model": model.version, "compute": list(compute.params.mean) if compute else None,
            "prefills": [list(o) for o in cold.compute._fit.obs] if cold is not None and cold.compute else [],
            "decisions": scheduler_side.stats["decisions"]}


def main() -> int:
    import logging
    import os

    if os.environ.get("NEXUSKV_LOG_LEVEL"):
        logging.basicConfig(level=os.environ["NEXUSKV_LOG_LEVEL"], stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(sys.argv[1])
    t0 = time.monotonic()
    llm = _build(spec)
    _reply({"ready": True, "start_s": time.monotonic() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "quit":
                _reply({"ok": True})
                break
            if op == "generate":
                out = _generate(llm, cmd)
            elif op == "reset":
                _drain(llm)
                out = {"reset": llm.reset_prefix_cache()}
            elif op == "metrics":
                out = _metrics(llm)
            elif op == "cached_blocks":
                out = _cached_blocks(llm)
            elif op == "connector":
                out = _connector_stats(llm)
            else:
                raise ValueError(f"unknown op {op!r}")
            _reply(out)
        except Exception as exc:  # the test sees the engine's error, not a hang
            _reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
