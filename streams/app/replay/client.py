"""One request against an engine's OpenAI completions endpoint, timed as a user sees it.

The prompt goes as token ids (the trace has no text), greedy (``temperature=0``), with
``ignore_eos`` so every request generates its full ``max_tokens`` in both runs, streamed: TTFT is
the time from sending the request to the first streamed token, end-to-end the time to the last
byte. The engine's own ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens
it did not compute (its prefix cache plus what a KV connector loaded).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

__all__ = ["Completion", "complete"]


@dataclass(frozen=True, slots=True)
class Completion:
    sent_at: float  # time.time() when the request left
    ttft_s: float
    e2e_s: float
    output_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    engine_request_id: str | None = None  # the id the engine gave the request (the ``id`` of its chunks)


async def complete(session: aiohttp.ClientSession, url: str, model: str, tokens: tuple[int, ...], max_tokens: int,
                   *, request_id: str, timeout_s: float = 300.0,
                   on_first_token: Callable[[], None] | None = None,
                   headers: Mapping[str, str] | None = None) -> Completion:
    """``headers`` go with the request (the trace context: vLLM continues a W3C ``traceparent``)."""
    body = {"model": model, "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    sent_at = time.time()
    start = time.perf_counter()
    ttft = None
    output: list[int] = []
    usage: dict = {}
    engine_id: str | None = None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers={**(headers or {}), "X-Request-Id": request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                text = await resp.text()
                return Completion(sent_at, 0.0, time.perf_counter() - start, (), len(tokens), 0,
                                  f"HTTP {resp.status}: {text[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                engine_id = engine_id or chunk.get("id")
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or ()
                    if ids and ttft is None:
                        ttft = time.perf_counter() - start
                        if on_first_token is not None:
                            on_first_token()
                    output.extend(ids)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Completion(sent_at, 0.0, time.perf_counter() - start, tuple(output), len(tokens), 0,
                          f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return Completion(sent_at, ttft if ttft is not None else e2e, e2e, tuple(output),
                      int(usage.get("prompt_tokens", len(tokens))), int(details.get("cached_tokens") or 0),
                      None if ttft is not None else "no token streamed", engine_id)
