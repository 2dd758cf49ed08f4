"""The two objectives of a sweep and the stability verdict that counts against quality.

Every report a trial makes passes through an :class:`ObjectiveTracker`, which adds:

* ``objective/throughput`` and ``objective/quality``: what the searcher optimises (throughput
  maximised, quality by the sweep's ``quality_mode``, 'max' or 'min'; NaN until first measured).
  For an unstable trial they are ``0`` and the space's ``quality_penalty``, so that any stable
  trial dominates it and Optuna learns to avoid its region. Without a penalty (the default where
  lower quality is better, as no value is worst for every metric) it is NaN: left out of the study.
* ``objective/measured_throughput`` / ``objective/measured_quality``: the raw values, for tables.
* ``stability/unstable`` (0/1, sticky) and ``stability/reason`` (why), which the sweep's stopper
  reads to end the trial early.
* ``sweep/final`` = 1 on the report that closes a run normally.
* ``sweep/failed``: on a trial's last report, why it failed with an error no restart can fix (a
  config error from its knobs, an unusable checkpoint, a full disk); Tune's restarts
  (``--max-failures``) are then not spent on it.

The rules are in ``docs/objectives.md``; this module only evaluates them (no Ray, no MLflow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from raysys.metrics import is_loss
from raysys.tune.pareto import rounding

THROUGHPUT = "objective/throughput"
QUALITY = "objective/quality"
MEASURED_THROUGHPUT = "objective/measured_throughput"
MEASURED_QUALITY = "objective/measured_quality"
UNSTABLE = "stability/unstable"
REASON = "stability/reason"
FINAL = "sweep/final"
FAILED = "sweep/failed"
UNWATCHED = "stability/unwatched"
"""On a run's final report: the space's bounds/collapse metrics it never reported (a typo checks nothing)."""
NOTE = "sweep/note"
"""On a population member's final report: a note on its program (members that differ ended alike)."""
RUN_SECONDS = "sweep/run_seconds"
"""A reused run's own wall time (``trial.reused_final``), in place of Tune's clock, which only saw the reuse."""
DEFAULT_TOLERANCE = 0.02
DEFAULT_QUALITY_PENALTY = -1.0


@dataclass
class StabilityRules:
    """When a trial counts as unstable. Every rule looks only at metrics the run reports anyway."""

    max_nonfinite_losses: int = 0
    """More non-finite losses than this (``stability/nonfinite_loss``) -> unstable."""
    max_loss_spikes: int = 3
    """More loss spikes than this within 50 consecutive steps (``stability/loss_spikes``: the most spikes
    in any 50 steps so far, a spike being a loss > spike_factor x the running median)."""
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)
    """metric -> {min: a, max: b}: a reported value outside [a, b] -> unstable (e.g. train/loss max,
    charts/entropy min for a collapsed RL policy)."""
    collapse: dict[str, Any] = field(default_factory=dict)
    """metric -> drop (or {drop: d, mode: max|min}): the metric getting worse than its best so far by more
    than ``drop`` -> unstable (e.g. an RL episode return that collapses after learning). Its best is its
    highest, or its lowest where lower is better: ``mode``, else the sweep's quality_mode for its quality
    metric, else 'min' for a loss and 'max' for the rest."""
    collapse_mode: dict[str, str] = field(default_factory=dict)
    """Set by ``from_dict``: the modes given in ``collapse``."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StabilityRules":
        rules = cls(**dict(d))  # TypeError names an unknown key
        if not isinstance(rules.bounds, Mapping) or not isinstance(rules.collapse, Mapping):
            raise ValueError("bounds and collapse map metric names to limits")
        for metric, b in rules.bounds.items():
            if not isinstance(b, Mapping) or not b or set(b) - {"min", "max"}:
                raise ValueError(f"bounds '{metric}' must be {{min: a}}, {{max: b}} or both, got {b!r}")
            rules.bounds[metric] = {k: float(v) for k, v in b.items()}
            if b.get("min", -math.inf) > b.get("max", math.inf):  # an empty interval: every report out of it
                raise ValueError(f"bounds '{metric}': min {b['min']:g} is above max {b['max']:g}")
        drops = {}
        for metric, v in rules.collapse.items():
            if isinstance(v, Mapping):
                if set(v) - {"drop", "mode"} or "drop" not in v or v.get("mode", "max") not in ("max", "min"):
                    raise ValueError(f"collapse '{metric}' must be a drop or {{drop: d, mode: max|min}}, got {v!r}")
                if "mode" in v:
                    rules.collapse_mode[metric] = v["mode"]
                v = v["drop"]
            drops[metric] = float(v)
        rules.collapse = drops
        if any(not v > 0 for v in rules.collapse.values()):
            raise ValueError("collapse drops must be > 0")
        for name in ("max_nonfinite_losses", "max_loss_spikes"):  # counts: -1 would make every trial unstable
            v = getattr(rules, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {v!r}")
        return rules

    def check(self, m: Mapping[str, Any], best: Mapping[str, float], lower: frozenset = frozenset()) -> Optional[str]:
        """The reason this report makes the trial unstable, or None. ``lower``: the collapse metrics whose
        best is their lowest."""
        for key, loss in m.items():
            if is_loss(key) and _num(loss) and not math.isfinite(loss):
                return f"non-finite loss ({loss})" if key == "train/loss" else f"non-finite loss ({key} = {loss})"
        if _num(m.get("stability/diverged")) and m["stability/diverged"] >= 1:
            return "diverged (the run stopped itself after consecutive non-finite losses)"
        nonfinite = m.get("stability/nonfinite_loss")
        if _num(nonfinite) and nonfinite > self.max_nonfinite_losses:
            return f"{int(nonfinite)} non-finite losses (allowed {self.max_nonfinite_losses})"
        spikes = m.get("stability/loss_spikes")
        if _num(spikes) and spikes > self.max_loss_spikes:
            return f"{int(spikes)} loss spikes (allowed {self.max_loss_spikes})"
        for metric, b in self.bounds.items():
            v = m.get(metric)
            if not _num(v):
                continue
            if not math.isfinite(v):
                return f"{metric} is not finite ({v})"
            if "min" in b and v < b["min"]:
                return f"{metric} = {v:.4g} below its floor {b['min']:.4g}"
            if "max" in b and v > b["max"]:
                return f"{metric} = {v:.4g} above its ceiling {b['max']:.4g}"
        for metric, drop in self.collapse.items():
            v = m.get(metric)
            if not (_num(v) and metric in best):
                continue
            slack = rounding(best[metric], drop)  # a change of exactly `drop` is allowed
            if metric in lower and v > best[metric] + drop + slack:
                return f"{metric} rose to {v:.4g} from its best (lowest) {best[metric]:.4g} (allowed rise {drop:.4g})"
            if metric not in lower and v < best[metric] - drop - slack:
                return f"{metric} collapsed to {v:.4g} from its best {best[metric]:.4g} (allowed drop {drop:.4g})"
        return None

    def lower_is_better(self, quality_metric: str, quality_mode: str) -> frozenset:
        """The collapse metrics whose best is their lowest (see ``collapse``)."""
        def mode(metric: str) -> str:
            given = getattr(self, "collapse_mode", {})  # rules pickled before modes existed have none
            if metric in given:
                return given[metric]
            if metric in (quality_metric, "eval/quality"):
                return quality_mode
            return "min" if is_loss(metric) else "max"

        return frozenset(m for m in self.collapse if mode(m) == "min")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class ObjectiveTracker:
    """Per-trial state across reports: last throughput, last quality, best values, the verdict."""

    def __init__(self, throughput_metric: str, quality_metric: str, rules: Optional[StabilityRules] = None,
                 quality_penalty: Optional[float] = DEFAULT_QUALITY_PENALTY, quality_mode: str = "max"):
        self.throughput_metric, self.quality_metric = throughput_metric, quality_metric
        self.rules = rules or StabilityRules()
        self.quality_penalty = math.nan if quality_penalty is None else quality_penalty
        self.sign = 1.0 if quality_mode == "max" else -1.0
        """+1 where higher quality is better, -1 where lower is."""
        self.throughput: Optional[float] = None
        self.quality: Optional[float] = None
        self.best: dict[str, float] = {}
        self.reason: Optional[str] = None
        self.seen: set[str] = set()  # every metric the run reported: named when an objective never came

    @property
    def unstable(self) -> bool:
        return self.reason is not None

    def update(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of one report with the objectives and the verdict added."""
        out = {k: v for k, v in metrics.items() if k != "done"}  # Tune reserves 'done'
        final = bool(metrics.get("done"))
        if _num(metrics.get(self.throughput_metric)):
            # a speed that is not finite (a timing window of no length) measures nothing: the last one stands
            if math.isfinite(metrics[self.throughput_metric]) or self.throughput is None:
                self.throughput = float(metrics[self.throughput_metric])
        if _num(metrics.get(self.quality_metric)):
            self.quality = float(metrics[self.quality_metric])
        if self.reason is None:
            self.reason = self.rules.check(metrics, self.best, self._lower())
        self.seen.update(k for k, v in metrics.items() if _num(v) and k != "done")
        if self.reason is None and final:
            missing = [m for m, v in ((self.throughput_metric, self.throughput), (self.quality_metric, self.quality))
                       if v is None]
            if missing:
                self.reason = f"{' and '.join(missing)} never reported (an objective of the space); {self._reported(missing)}"
            elif not math.isfinite(self.quality):
                self.reason = f"no finite quality at the end ({self.quality_metric} = {self.quality})"
            elif not math.isfinite(self.throughput):
                self.reason = f"no finite throughput ({self.throughput_metric} = {self.throughput})"
        for metric in self.rules.collapse:
            v = metrics.get(metric)
            if _num(v) and math.isfinite(v):
                self.best[metric] = (min if metric in self._lower() else max)(self.best.get(metric, v), v)

        if self.throughput is not None:
            out[MEASURED_THROUGHPUT] = self.throughput
        if self.quality is not None:
            out[MEASURED_QUALITY] = self.quality
        if self.unstable:
            out[THROUGHPUT], out[QUALITY] = 0.0, self.quality_penalty
            out[REASON] = self.reason
        else:
            # Tune wants both objectives in every report; NaN until measured. Optuna only reads the
            # last report, and refuses a NaN there: a trial cut short before its first evaluation is
            # then left out of the study instead of being scored as bad.
            out[THROUGHPUT] = self.throughput if self.throughput is not None else math.nan
            out[QUALITY] = self.quality if self.quality is not None else math.nan
        out[UNSTABLE] = float(self.unstable)
        if final:
            out[FINAL] = 1.0
            unwatched = [m for m in (*self.rules.bounds, *self.rules.collapse) if m not in self.seen]
            if unwatched:
                out[UNWATCHED] = f"{', '.join(unwatched)}: never reported; {self._reported(unwatched)}"
        return out

    def _lower(self) -> frozenset:
        """The collapse metrics whose best is their lowest, found once (also for a tracker pickled before it)."""
        if not hasattr(self, "lower"):
            self.lower = self.rules.lower_is_better(self.quality_metric, "max" if self.sign > 0 else "min")
        return self.lower

    def _reported(self, missing: list[str]) -> str:
        """The run's metrics nearest the missing ones (same prefix), a few: what the space may have meant."""
        prefixes = {m.split("/")[0] + "/" for m in missing if "/" in m}
        near = sorted(m for m in self.seen if any(m.startswith(p) for p in prefixes)) or sorted(self.seen)
        if not near:
            return "this run reports no metric"
        return "this run reports " + ", ".join(near[:6]) + (f" and {len(near) - 6} more" if len(near) > 6 else "")

    def failed(self, reason: str) -> dict[str, Any]:
        """The last report of a trial that failed permanently: what it measured so far, the reason, and
        NaN objectives, so that the searcher leaves it out of its study as it does a failed trial."""
        out = {**self.update({}), FAILED: reason, THROUGHPUT: math.nan, QUALITY: math.nan}
        out.pop(FINAL, None)
        return out
