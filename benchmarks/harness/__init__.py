"""The evaluation harness (whitepaper §10): workloads, a simulated cluster that drives the real
planner, baselines and ablations side by side, and the reproducibility record.

Run it: ``python -m benchmarks.harness [--trace conversation|synthetic|shapes] [--requests N]
[--workers 8] [--ablations] [--out DIR]``. From code: ``run_harness(HarnessConfig(...))``.
"""

from benchmarks.harness.run import HarnessConfig, HarnessResult, build_workload, run_harness

__all__ = ["HarnessConfig", "HarnessResult", "run_harness", "build_workload"]
