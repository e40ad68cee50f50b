"""The gate: which options may act, and which one does.

An option acts only if ``EG > 0`` and its lower bound ``EG - z*sd(EG) > min_gain_s``; the largest
EG among those wins (ties: the cheaper action kind, then worker and source names); otherwise the
baseline recompute. A movement is refused outright when GPU is not an allowed target, when the
index lags past the policy's limit (no movement on facts that old) or when it would break a
budget (:class:`~nexuskv.planner.Headroom`); the refusal is the option's recorded reason.

Exploration (:func:`explore`): a gate that acts only on a positive lower bound freezes an uncertain
fit, since no load runs and so the fit is never observed. When the gate chose the baseline
recompute, a decision whose :func:`exploration_draw` (a hash of the request id: deterministic,
uniform on [0, 1)) falls below the policy's ``explore_share`` takes instead the best option whose
*expected* EG is positive although its lower bound is not, provided the least-observed fit that
option rests on has fewer than ``explore_max_observations`` observations (the per-fit cap: once a
fit has seen that many, its uncertainty is what it is and the gate alone decides). The decision
record says it explored.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from nexuskv.contracts.decisions import Action
from nexuskv.planner.options import Option
from nexuskv.planner.query import Headroom

__all__ = ["choose", "explorable", "explore", "exploration_draw", "gate_reason", "movement_refusal", "rank"]

_RECOMPUTE = Action.RECOMPUTE
_ACTION_ORDER = {a: i for i, a in enumerate(
    (Action.FULL_REUSE, Action.PARTIAL_REUSE, Action.ROUTE_TO_STATE, Action.PREFETCH, Action.TRANSFER,
     Action.RECOMPUTE))}


def rank(o: Option) -> tuple:
    """Sort key: larger EG first, then the cheaper action kind, then names (deterministic)."""
    eg = o.eg_s if o.eg_s is not None else -math.inf
    src = f"{o.source.worker}/{o.source.tier.value}" if o.source else ""
    return (-eg, _ACTION_ORDER[o.action], o.worker, src)


def movement_refusal(target_ok: bool, lag_ms: float, max_lag_ms: float, lagging: bool,
                     headroom: Headroom | None, nbytes: int, window_s: float) -> str | None:
    """Why a planned copy may not happen at all (None: it may, if it passes the gate)."""
    if not target_ok:
        return "policy: gpu is not an allowed target tier"
    if lagging:
        return f"index lag {lag_ms:.0f} ms > {max_lag_ms:.0f} ms: no movement is planned on facts that old"
    if headroom is not None:
        return headroom.refusal(nbytes, window_s)
    return None


def choose(options: Sequence[Option], baseline_worker: str, min_gain: float) -> Option:
    """The winning option: the best that passes the gate, else the baseline recompute."""
    winner = None
    for o in options:
        if o.rejected is None and o.action is not _RECOMPUTE and o.eg_s is not None and o.eg_s > 0 \
                and o.eg_lower_s is not None and o.eg_lower_s > min_gain:
            if winner is None or o.eg_s > winner.eg_s or (o.eg_s == winner.eg_s and rank(o) < rank(winner)):
                winner = o
    if winner is None:
        winner = next(o for o in options if o.action is _RECOMPUTE and o.worker == baseline_worker)
    return winner


def exploration_draw(request_id: str) -> float:
    """A uniform number in [0, 1) from the request id: the same request always draws the same."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"nexuskv-explore").digest()
    return int.from_bytes(digest, "big") / 18446744073709551616.0  # 2**64


def explorable(o: Option, min_gain: float, max_observations: int) -> bool:
    """An option the gate declined only for its uncertainty: E[EG] above ``min_gain`` (and so > 0), its
    lower bound not, and the least-observed fit it rests on below the per-fit cap."""
    return (o.rejected is None and o.action is not _RECOMPUTE and o.eg_s is not None and o.eg_s > 0
            and o.eg_s > min_gain
            and o.eg_lower_s is not None and o.eg_lower_s <= min_gain
            and o.fit_observations is not None and o.fit_observations < max_observations)


def explore(options: Sequence[Option], min_gain: float, max_observations: int) -> Option | None:
    """The option an exploring decision takes: the explorable one with the largest EG (None: none)."""
    best = None
    for o in options:
        if explorable(o, min_gain, max_observations) and (best is None or rank(o) < rank(best)):
            best = o
    return best


def gate_reason(opt: Option, chosen: Option, min_gain: float) -> str:
    """Why ``opt`` lost to ``chosen``."""
    if opt.rejected is not None:
        return opt.rejected
    if opt.action is Action.RECOMPUTE:
        return (f"recompute on {opt.worker}: {opt.ttft_s:.4f}s to first token vs {chosen.action.value} on "
                f"{chosen.worker}")
    if opt.eg_s is None or opt.eg_s <= 0:
        return f"EG {opt.eg_s:.4f}s <= 0"
    if opt.eg_lower_s is None or opt.eg_lower_s <= min_gain:
        return f"EG lower bound {opt.eg_lower_s:.4f}s <= {min_gain}s: not sure enough to act"
    return f"EG {opt.eg_s:.4f}s below the chosen {chosen.eg_s:.4f}s"
