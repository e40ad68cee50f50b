"""``nexuskv replay TRACE``: vLLM alone vs vLLM + NexusKV on the same trace, side by side.

The same request stream (:mod:`~streams.app.replay.workload`) is served twice by the same engines
on the same machine (:mod:`~streams.app.replay.runs`): **baseline** = vLLM with its own prefix
caching behind a plain load balancer; **nexuskv** = the same engines with NexusKV's connector,
event bridges, index, planner (routing included) and tiers
(:mod:`~streams.app.replay.nexuskv_run`). Both runs land in one decision store, each request with
its run (``replay_requests``), NexusKV's decisions beside them, so the observed Effective Gain of a
request is its baseline TTFT minus its NexusKV TTFT (``replay_comparison``); the report
(:mod:`~streams.app.replay.report`) prints both runs' figures and plots them. With ``--trace-to``
every request of both runs is one OpenTelemetry trace, vLLM's own request span included
(:mod:`~streams.app.replay.tracing`), and the report names the traces to open first.

The engines are vLLM's CPU build serving a random Llama written locally
(:mod:`streams.app.tiny_model`) unless ``--model DIR`` names one. ``--engine reference`` (the
``engine`` of :class:`~streams.app.replay.session.ReplayConfig`) replays the same workload on
NexusKV's reference engine instead (:mod:`~streams.app.replay.reference_run`: the attention
families vLLM's CPU build cannot run, MLA and recurrent), a single NexusKV run without a baseline.
"""

from __future__ import annotations

from streams.app.replay.session import ReplayConfig, ReplayOutcome, default_replay_dir, run_replay
from streams.app.replay.workload import WorkloadShape

__all__ = ["ReplayConfig", "ReplayOutcome", "WorkloadShape", "default_replay_dir", "run_replay"]
