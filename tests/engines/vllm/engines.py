"""Starting real vLLM engines for the tests: the driver process, its environment, its answers.

:class:`Engine` runs :mod:`tests.engines.vllm.driver` in a process group of its own (stopped as a
whole: vLLM's multiprocess engine has children) bound to the test process (``PR_SET_PDEATHSIG``),
with the CPU settings vLLM's CPU build needs applied here (:func:`cpu_env`), and turns its JSON
replies into dicts; everything else it prints goes to a log file whose tail is in every error.

The CPU settings: vLLM CPU refuses to start unless told how much memory its KV cache may take
(``kv_cache_memory_bytes``, or the legacy ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB; otherwise it
wants 92% of RAM free), needs a block size that is a multiple of 32 (its CPU_ATTN backend), and
pins one OpenMP thread per core it is given. Each engine is ~1-4 GiB of RSS; the tests never run
more than two at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
MARK = "@@nexuskv-driver@@ "

__all__ = ["ROOT", "Engine", "EngineError", "cpu_env"]


class EngineError(RuntimeError):
    pass


def _own_group_bound_to_parent() -> None:  # in the child, between fork and exec
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def cpu_env(*, multiprocess: bool, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM CPU engine started by the tests."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the engines are given kv_cache_memory_bytes instead
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
    })
    env.update(extra or {})
    return env


class Engine:
    """One driver process: ``call`` a command, get its reply; ``close`` stops it and its children."""

    def __init__(self, spec: Mapping[str, Any], *, multiprocess: bool, log_path: Path,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 180.0) -> None:
        self.spec = dict(spec)
        self.multiprocess = multiprocess
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._replies: queue.Queue[dict] = queue.Queue()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.vllm.driver", json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            cwd=ROOT, env=cpu_env(multiprocess=multiprocess, extra=env), preexec_fn=_own_group_bound_to_parent)
        self._reader = threading.Thread(target=self._read, name="vllm-driver-reader", daemon=True)
        self._reader.start()
        ready = self._wait(start_timeout_s, "start")
        self.start_s = float(ready.get("start_s", 0.0))

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
                self._log.flush()
        self._replies.put({"error": f"the engine exited with {self._proc.wait()}"})

    def _wait(self, timeout_s: float, what: str) -> dict:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise EngineError(f"vLLM engine: no answer to {what} in {timeout_s:.0f} s\n{self.log_tail()}") from None
        if "error" in reply:
            raise EngineError(f"vLLM engine: {what}: {reply['error']}\n{reply.get('traceback', '')}\n{self.log_tail()}")
        return reply

    def call(self, op: str, timeout_s: float = 120.0, **args: Any) -> dict:
        if self._proc.poll() is not None:
            raise EngineError(f"vLLM engine exited with {self._proc.returncode}\n{self.log_tail()}")
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._proc.stdin.flush()
        return self._wait(timeout_s, op)

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 8, cache_salt: str | None = None) -> list[dict]:
        return self.call("generate", prompts=prompts, max_tokens=max_tokens, cache_salt=cache_salt)["outputs"]

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the driver to quit, then stop its whole process group (vLLM's engine processes too)."""
        proc = self._proc
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break  # the group is gone
            time.sleep(2.0 if sig is signal.SIGTERM else 0.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self._log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
