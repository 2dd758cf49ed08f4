"""Population-based training inside one program (``python -m raysys.tune --vectorize K --scheduler pbt``).

PBT (Jaderberg et al., 2017) as Ray Tune's ``PopulationBasedTraining`` does it between trials, done
here between the members of one vectorized program, where it costs nothing: every ``interval``
chunks the live members are ranked by the mean of a metric over those chunks, and each member of
the worst ``quantile`` *exploits* a random member of the best ``quantile`` (takes its weights and
optimizer state) and *explores* (takes that member's explored knobs, each perturbed within the
sweep's bounds). The explored knobs are the workload's shape-free hyper-parameters
(``Population.explore_knobs``), inputs of its compiled program, so nothing is recompiled.

A workload's population loop opts in with three calls (``Population.explore_knobs`` says it does):
:func:`of` for the sweep's schedule (None when it asked for none), :meth:`Exploit.resume` before its
program is built (a resumed member continues with the knobs it had), and :meth:`Exploit.after_chunk`
after each chunk's logs. Each member's knobs are logged with its metrics (``pbt/<knob>``: its MLflow
run charts the schedule) and saved with each of its checkpoints, so a resumed sweep and a
``raysys train --resume`` of a member's run both continue with the knobs its weights were trained with.
No Ray and no MLflow here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

PREFIX = "pbt/"
"""Metric prefix of a member's current explored knobs (``pbt/optim.lr``) and its exploit count."""
EXPLOITS = PREFIX + "exploits"
META = "pbt"
"""The key of a member's PBT state in its checkpoints' meta."""
CLOCK = "pbt_clock"
"""The program's chunk and round counts in its members' checkpoints' meta."""


@dataclass(frozen=True)
class PBTConfig:
    """One sweep's PBT schedule (``python -m raysys.tune --scheduler pbt``), the same for every program."""

    explore: dict = field(default_factory=dict)
    """knob -> its sweep domain as ``{"kind", "values", "low", "high"}`` (raysys.tune.space.Domain)."""
    metric: str = ""
    """What members are ranked by: its mean over the reports since the last round."""
    mode: str = "max"
    """'max' where a higher ``metric`` is better, 'min' where lower is."""
    interval: int = 4
    """Chunks (each member's reports) between two rounds."""
    quantile: float = 0.25
    """The share of the ranked members that exploits (the worst) and is exploited (the best); at least one."""
    resample: float = 0.25
    """The chance that a choice knob is drawn afresh from its values instead of moved to a neighbouring one."""
    factors: tuple = (0.8, 1.2)
    """A range knob is multiplied by one of these (clipped to the domain's bounds)."""
    seed: Any = 0
    """An int or a sequence of ints (numpy's SeedSequence entropy): the rounds' random stream."""


def of(sessions: Sequence) -> Optional["Exploit"]:
    """The PBT schedule the members' sessions were given (``raysys.session.run_population``), or None."""
    return getattr(sessions[0], "pbt", None) if sessions else None


def plan(scores: Sequence[float], quantile: float, mode: str, rng: np.random.Generator) -> list[tuple[int, int]]:
    """[(dst, src)]: each of the worst ``quantile`` of the members with a finite score takes a random one
    of the best ``quantile``'s; none where fewer than two are ranked or a pair scores the same."""
    ranked = [i for i in np.argsort([s if mode == "max" else -s for s in scores], kind="stable")
              if math.isfinite(scores[i])]  # worst first
    if len(ranked) < 2:
        return []
    n = min(max(1, int(len(ranked) * quantile)), len(ranked) // 2)
    worst, best = ranked[:n], ranked[-n:]
    moves = []
    for dst in worst:
        src = int(rng.choice(best))
        if scores[src] != scores[dst]:
            moves.append((int(dst), src))
    return moves


def explore(knobs: dict, domains: dict, rng: np.random.Generator, factors: Sequence[float] = (0.8, 1.2),
            resample: float = 0.25) -> dict:
    """``knobs`` (a member's explored values) perturbed: a range knob times a factor within its bounds
    (randint rounded, and moved by one where rounding would keep it), a choice knob drawn afresh with
    probability ``resample``, else moved to a neighbouring value."""
    out = {}
    for key, v in knobs.items():
        d = domains[key]
        kind = d["kind"]
        if kind in ("choice", "grid"):
            values = list(d["values"])
            if rng.random() < resample:
                out[key] = values[int(rng.integers(len(values)))]
                continue
            at = min(range(len(values)), key=lambda j: abs(float(values[j]) - float(v)))
            out[key] = values[int(np.clip(at + rng.choice([-1, 1]), 0, len(values) - 1))]
            continue
        f = float(rng.choice(list(factors)))
        new = min(max(float(v) * f, d["low"]), d["high"])
        if kind == "randint":  # moved by one where rounding would keep it (the other way at a bound)
            step, way = int(round(new)), 1 if f > 1 else -1
            if step == int(v):
                step = next((int(v) + m for m in (way, -way) if d["low"] <= int(v) + m <= d["high"]), int(v))
            new = step
        out[key] = new
    return out


class Exploit:
    """The rounds of one program: ``sessions[i]`` is member i's (its checkpoints carry its PBT state)."""

    def __init__(self, config: PBTConfig, sessions: Sequence, names: Sequence[str]):
        self.c, self.sessions, self.names = config, list(sessions), list(names)
        self.seen: list[list[float]] = [[] for _ in sessions]
        self.chunks = 0
        self.rounds = 0
        self.history: list[list[str]] = [[] for _ in sessions]
        self.exploits = [0] * len(sessions)
        self.knobs: list[dict] = [{} for _ in sessions]
        for i, s in enumerate(self.sessions):
            s.pbt, s.member = self, i

    # --- the workload's calls -------------------------------------------------------------------

    def resume(self, cfgs: list) -> list:
        """The members' configs with the knobs each had at its restored checkpoint (a resumed sweep):
        call after the sessions restored and before the program is built. Fresh members keep theirs."""
        from raysys.config import apply_overrides, flatten, to_dict

        out = list(cfgs)
        clocks = [(getattr(s, "restored_meta", None) or {}).get(CLOCK) or {} for s in self.sessions]
        # the rounds go on where they were: the same cadence, and the random stream where it was
        self.chunks = max((int(c.get("chunks", 0)) for c in clocks), default=0)
        self.rounds = max((int(c.get("rounds", 0)) for c in clocks), default=0)
        self.seen = [[float(v) for v in c.get("seen", [])] if int(c.get("chunks", -1)) == self.chunks else []
                     for c in clocks]  # the scores toward the next round, where the member saved with the program
        for i, (cfg, s) in enumerate(zip(cfgs, self.sessions)):
            saved = (getattr(s, "restored_meta", None) or {}).get(META) or {}
            now = flatten(to_dict(cfg))
            knobs = {k: saved.get("knobs", {}).get(k, now[k]) for k in self.c.explore}
            if saved.get("knobs"):
                out[i] = apply_overrides(cfg, knobs)
                self.history[i] = list(saved.get("history", []))
                self.exploits[i] = int(saved.get("exploits", 0))
                if knobs != {k: now[k] for k in self.c.explore}:
                    s.message(f"{self.names[i]}: PBT had it at {_fmt(knobs)}; it goes on with them")
            self._set(i, knobs)
        return out

    def after_chunk(self, program: Any, cfgs: list, live: Sequence[int],
                    inherit: Optional[Callable[[Any, Any], Any]] = None) -> list[tuple[int, int]]:
        """After every chunk's logs. At a round, each exploiting member ``dst`` of the ``live`` ones gets
        ``inherit(its state, src's state)`` (default: src's whole state) through ``program.put``, and
        ``cfgs[dst]`` its new knobs (in place), which ``program.retune(cfgs)`` hands to the program.
        -> the (dst, src) pairs of this call (none between rounds)."""
        self.chunks += 1
        due = self.chunks % self.c.interval == 0
        self.rounds += due
        moves = self._round(program, cfgs, live, inherit) if due else []
        for i, s in enumerate(self.sessions):  # saved with the members' next checkpoints
            s.carry[CLOCK] = {"chunks": self.chunks, "rounds": self.rounds, "seen": list(self.seen[i])}
        return moves

    def _round(self, program: Any, cfgs: list, live: Sequence[int], inherit: Optional[Callable]) -> list:
        from raysys.config import apply_overrides

        live = [int(i) for i in live if not self.sessions[int(i)].halted]
        scores = [float(np.mean(self.seen[i])) if self.seen[i] else math.nan for i in live]
        self.seen = [[] for _ in self.sessions]
        seeds = list(self.c.seed) if isinstance(self.c.seed, (list, tuple)) else [self.c.seed]
        rng = np.random.default_rng([*seeds, self.rounds])
        moves = [(live[d], live[s]) for d, s in plan(scores, self.c.quantile, self.c.mode, rng)]
        lines = []
        for dst, src in moves:
            state = program.state(src) if inherit is None else inherit(program.state(dst), program.state(src))
            program.put(dst, state)
            knobs = explore(self.knobs[src], self.c.explore, rng, self.c.factors, self.c.resample)
            cfgs[dst] = apply_overrides(cfgs[dst], knobs)
            step = self.sessions[dst].last_step
            self.exploits[dst] += 1
            self.history[dst].append(f"step {step}: took {self.names[src]}'s weights; {_fmt(knobs)}")
            lines.append(f"{self.names[dst]} <- {self.names[src]} ({_fmt(knobs)})")
            self._set(dst, knobs)
            self.sessions[dst].run.logger.set_tags({"raysys.pbt": " | ".join(self.history[dst])[-5000:]})
        if moves:
            program.retune(cfgs)
            self.sessions[0].message(f"PBT round {self.rounds}: " + "; ".join(lines))
        return moves

    # --- the sessions' side ------------------------------------------------------------------------

    def saw(self, i: int, metrics: dict) -> None:
        """A report of member i (``Session.log``): its rank metric counts toward the next round."""
        v = metrics.get(self.c.metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            self.seen[i].append(float(v))

    def _set(self, i: int, knobs: dict) -> None:
        self.knobs[i] = dict(knobs)
        s = self.sessions[i]
        s.carry[META] = {"knobs": dict(knobs), "history": self.history[i], "exploits": self.exploits[i]}
        s.extra_metrics = {**{PREFIX + k: float(v) for k, v in knobs.items()}, EXPLOITS: float(self.exploits[i])}


def checkpoint_knobs(run_dir: Path, workload: str) -> dict:
    """The explored knobs a run's newest checkpoint was trained with by PBT ({} for any other run)."""
    from raysys.checkpoint import newest_meta

    return dict((newest_meta(run_dir, workload)[1].get(META) or {}).get("knobs") or {})


def _fmt(knobs: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items())
