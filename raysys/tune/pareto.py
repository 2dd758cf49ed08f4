"""Pareto front of (throughput, quality), and the recommended configuration. Throughput is
maximised; quality too, or minimised where the sweep's ``quality_mode`` is 'min' (``score``).

Only stable, complete trials with finite objectives take part: an unstable trial's throughput is
not a speed anyone can use, and an incomplete one has no final quality to judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

OK, UNSTABLE, ERROR, INCOMPLETE = "ok", "unstable", "error", "incomplete"


@dataclass
class TrialRecord:
    trial_id: str
    knobs: dict[str, Any]
    status: str = OK
    """ok | unstable | error | incomplete (stopped by the budget or an interruption)."""
    throughput: Optional[float] = None
    quality: Optional[float] = None
    reason: str = ""
    run_name: str = ""
    seconds: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)
    higher_is_better: bool = True
    """The sweep's quality_mode: False where a lower quality is better (a loss, an error rate)."""

    @property
    def score(self) -> float:
        """Quality, oriented so that higher is better."""
        return self.quality if self.higher_is_better else -self.quality

    @property
    def eligible(self) -> bool:
        return (self.status == OK and self.throughput is not None and self.quality is not None
                and math.isfinite(self.throughput) and math.isfinite(self.quality))


def dominates(a: TrialRecord, b: TrialRecord) -> bool:
    """a is at least as good in both objectives and strictly better in one."""
    return (a.throughput >= b.throughput and a.score >= b.score
            and (a.throughput > b.throughput or a.score > b.score))


def pareto_front(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Non-dominated eligible trials, fastest first. Exact ties are all kept (none dominates)."""
    pool = [r for r in records if r.eligible]
    front = [r for r in pool if not any(dominates(o, r) for o in pool)]
    return sorted(front, key=lambda r: (-r.throughput, -r.score, r.trial_id))


def recommend(records: Sequence[TrialRecord], tolerance: float) -> Optional[TrialRecord]:
    """The fastest eligible trial whose quality is within ``tolerance`` (absolute, in the quality
    metric's units) of the best quality; ties go to the better quality. Always on the front: a
    trial dominating it would also be within tolerance and at least as fast."""
    pool = [r for r in records if r.eligible]
    if not pool:
        return None
    best = best_of(pool).score
    within = [r for r in pool if r.score >= best - tolerance - rounding(best, tolerance)]
    return max(within, key=lambda r: (r.throughput, r.score, _neg_id(r.trial_id)))


def rounding(value: float, tolerance: float) -> float:
    """The slack that makes a difference of exactly ``tolerance`` from ``value`` count as within it: 0.2 - 0.02
    is 0.18000000000000002 in floats, which would leave out a trial at 0.18 (and take one at 0.78 from 0.8)."""
    return 1e-9 * max(1.0, abs(value), tolerance)


def best_of(records: Sequence[TrialRecord]) -> TrialRecord:
    """The eligible record of best quality (highest, or lowest where lower is better)."""
    return max(records, key=lambda r: (r.score, _neg_id(r.trial_id)))


def _neg_id(trial_id: str) -> tuple:
    # deterministic last tie-break: the alphabetically smaller trial id wins under max()
    return tuple(-ord(c) for c in trial_id)
