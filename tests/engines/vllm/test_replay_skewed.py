"""``nexuskv replay --shape skewed`` on real vLLM, with the arms NexusKV is measured against.

The skewed shape: a few hot conversations behind one shared prefix, their openers one at a time,
then a burst of their turns (:mod:`streams.app.replay.workload`). Three runs on the same stream:

* ``affinity`` — vLLM behind the router that follows each engine's cache from vLLM's own ZMQ KV
  events and routes by Dynamo's cost rule: every opener after the first goes where the shared
  prefix already is (that is what concentrates the hot histories on one worker);
* ``equal-bytes`` — vLLM alone with each engine's cache grown by its share of NexusKV's tier bytes;
* ``nexuskv`` — NexusKV saving to the shared remote tier (a Mooncake Store started for the run),
  which every engine's connector reads.

Asserted: every request of every run served; greedy outputs identical across the three; the
affinity router applied the engines' events and kept the openers together; the equal-bytes
engines had the larger cache; NexusKV's connectors loaded from the shared tier and every load they
planned completed (or fell back, counted, never a wrong token: the outputs say so). Speed is the
benchmark's (``python -m benchmarks.bench_replay --shape skewed``), not this test's.
"""

from __future__ import annotations

import duckdb
import pytest

from analytics.replay_figures import replay_figures
from nexuskv.config import Settings
from streams.app.replay.session import ReplayConfig, equal_bytes_blocks, run_replay
from streams.app.replay.workload import WorkloadShape

from benchmarks.trace_events import CONVERSATION_SLICE

pytestmark = [pytest.mark.vllm, pytest.mark.tansu, pytest.mark.slow, pytest.mark.timeout(900)]

HOT = 8


def test_skewed_replay_with_affinity_and_equal_bytes_arms(tmp_path):
    shape = WorkloadShape(max_requests=100, hot=HOT, warmup=4, shared_prefix_blocks=16, opener_gap_s=2.0,
                          burst_gap_s=0.2, max_output_tokens=2)
    config = ReplayConfig(trace=CONVERSATION_SLICE, out=tmp_path / "replay", shape=shape, workers=2,
                          engine_blocks=96, save_tier="remote", runs=("affinity", "equal-bytes", "nexuskv"),
                          engine_reports=True,
                          model_cache=tmp_path / "models", remote_tier_bytes=512 << 20)
    settings = Settings(broker=None, data_dir=str(tmp_path / "data"))
    outcome = run_replay(config, settings, progress=False, say=lambda _line: None)

    for run in config.runs:
        errors = [s.completion.error for s in outcome.runs[run].served if s.completion.error]
        assert not errors, f"{run}: {errors[:3]}"
    with duckdb.connect(str(outcome.db), read_only=True) as con:
        fig = replay_figures(con, outcome.replay_id)
        blocks = dict(con.execute("SELECT run, CAST(json_extract(config_json, '$.engine_blocks') AS BIGINT) "
                                  "FROM replay_runs WHERE replay_id = ?", [outcome.replay_id]).fetchall())
    assert fig is not None and set(fig.measured) == set(config.runs)
    assert fig.differing_by_run == {"affinity": 0, "equal-bytes": 0}, fig.differing_by_run  # greedy, every arm

    # The affinity router followed vLLM's own events and kept the shared prefix's openers together.
    affinity = outcome.runs["affinity"]
    assert affinity.router_stats.get("stored", 0) > 0, affinity.router_stats  # blocks vLLM said it cached
    openers = [s for s in affinity.served if not s.request.warmup][:HOT]
    assert len({s.engine for s in openers[1:]} | {openers[0].engine}) == 1, [s.engine for s in openers]
    assert any(s.completion.cached_tokens >= 16 * 32 for s in openers[1:])  # the prefix was a hit there

    assert blocks["equal-bytes"] == equal_bytes_blocks(config, outcome.workload) > blocks["affinity"] == 96

    # NexusKV's router read the engines' own gauges (vLLM's /metrics) throughout its run.
    polled = outcome.runs["nexuskv"].router_stats
    assert polled.get("load_scrapes", 0) > 20 and polled.get("load_scrapes_failed") == 0, polled

    # NexusKV read the shared tier, and the loads its connectors planned completed.
    assert fig.tokens_loaded_by_tier.get("remote", 0) > 0, fig
    assert fig.transfers_planned > 0
    assert fig.transfers_completed + fig.transfers_fell_back == fig.transfers_planned, fig
