"""Vectorized sweeps (``python -m raysys.tune --vectorize K``): K configurations per Tune trial.

The searcher still proposes one configuration at a time; :class:`PopulationSearcher` asks it for K,
splits them by what changes the program's shapes (every knob not in the workload's
``Population.member_knobs``) and hands each group to Tune as one trial. The trial
(:func:`run_population_trial`) trains the group as one program through the workload's
``Population.train_fn``; every member has its own run (folder, checkpoints, MLflow child run with
its params and metric histories, ``<trial id>_<j>`` as its trial id), its own objective tracker and
stability verdict. An unstable member is masked, the others go on. The trial's reports carry each
member's objectives under ``members/<member id>/``; the searcher, the table, the front, the plot
and the MLflow records get one trial per member back from them (:func:`member_results`).
"""

from __future__ import annotations

import json
import math
import pickle
import signal
import zlib
from typing import Any, Optional, Sequence

from ray.tune.search import Searcher

from raysys.train import pbt
from raysys.tune import objectives as obj
from raysys.workload import program_key

POPULATION = "population"
"""The config key of a vectorized trial: the list of its members' knobs."""
PREFIX = "members"
KEPT = (obj.THROUGHPUT, obj.QUALITY, obj.MEASURED_THROUGHPUT, obj.MEASURED_QUALITY, obj.UNSTABLE, obj.REASON,
        obj.FINAL, obj.FAILED, "step", obj.RUN_SECONDS, obj.UNWATCHED, obj.NOTE)


def member_ids(trial_id: str, k: int) -> list[str]:
    return [f"{trial_id}_{j}" for j in range(k)]


class PopulationSearcher(Searcher):
    """Wraps a searcher: one Tune trial per group of up to ``k`` of its configurations of one shape."""

    def __init__(self, inner: Searcher, k: int, total: int, member_knobs: Sequence[str]):
        super().__init__(metric=inner.metric, mode=inner.mode)
        self.inner, self.k, self.total, self.member_knobs = inner, k, total, tuple(member_knobs)
        self.asked = 0
        self.queue: list[list[tuple[str, dict]]] = []  # groups proposed, not yet handed to Tune
        self.members: dict[str, list[str]] = {}  # Tune trial id -> the inner searcher's ids of its members

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return self.inner.set_search_properties(metric, mode, config, **spec)

    def suggest(self, trial_id: str):
        if not self.queue:
            batch = []
            while len(batch) < min(self.k, self.total - self.asked):
                iid = f"{trial_id}~{len(batch)}"
                knobs = self.inner.suggest(iid)
                if knobs is None or knobs == Searcher.FINISHED:
                    break
                batch.append((iid, knobs))
            if not batch:
                return Searcher.FINISHED if self.asked >= self.total else None
            self.asked += len(batch)
            groups: dict[str, list] = {}
            for iid, knobs in batch:
                groups.setdefault(program_key(knobs, self.member_knobs), []).append((iid, knobs))
            self.queue.extend(groups.values())
        group = self.queue.pop(0)
        self.members[trial_id] = [iid for iid, _ in group]
        return {POPULATION: [knobs for _, knobs in group]}

    def on_trial_complete(self, trial_id: str, result: Optional[dict] = None, error: bool = False) -> None:
        for mid, iid in zip(member_ids(trial_id, len(self.members.get(trial_id, []))), self.members.pop(trial_id, [])):
            values = {m: (result or {}).get(f"{PREFIX}/{mid}/{m}") for m in (obj.THROUGHPUT, obj.QUALITY)}
            complete = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values.values())
            # a member that took another's weights (PBT) ended as no proposal of the searcher would: left out
            complete = complete and not (result or {}).get(f"{PREFIX}/{mid}/{pbt.EXPLOITS}")
            self.inner.on_trial_complete(iid, values if complete and not error else None,
                                         error=error or not complete)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def member_results(result_metrics: dict, config: dict, trial_id: str) -> list[tuple[str, dict, dict]]:
    """One vectorized trial's last report -> [(member id, knobs, that member's metrics)]."""
    knobs = list((config or {}).get(POPULATION) or [])
    out = []
    for mid, k in zip(member_ids(trial_id, len(knobs)), knobs):
        head = f"{PREFIX}/{mid}/"
        out.append((mid, dict(k), {key[len(head):]: v for key, v in result_metrics.items() if key.startswith(head)}))
    return out


def ended_knobs(knobs: dict, metrics: dict) -> dict:
    """A member's knobs as PBT left them (its last ``pbt/<knob>`` values), else as proposed."""
    out = dict(knobs)
    for key in knobs:
        v, was = metrics.get(pbt.PREFIX + key), knobs[key]
        if isinstance(v, (int, float)):  # an int stays one where the value is whole (a randint), else the float
            out[key] = bool(v) if isinstance(was, bool) else int(v) if isinstance(was, int) and float(v).is_integer() else v
    return out


def member_frame(df, mid: str):
    """A vectorized trial's metrics dataframe -> the one member's columns, named as a lone trial's."""
    head = f"{PREFIX}/{mid}/"
    cols = {c: c[len(head):] for c in df.columns if c.startswith(head)}
    keep = [c for c in ("training_iteration", "timestamp") if c in df.columns]
    return df[keep + list(cols)].rename(columns=cols)


class Reports:
    """Gathers the members' reports of one chunk into one Tune report, sent once every member still
    training has reported (or, should one have ended unseen, once a member reports twice: a new chunk
    began). Each member's report passes its own :class:`ObjectiveTracker`."""

    def __init__(self, ids: list[str], trackers: list, send):
        self.ids, self.trackers, self._send = ids, trackers, send
        self.training: set[int] = set()
        """The members the program trains, less those halted: a chunk is whole once each has reported.
        Sending it then, not at the next chunk's first report, keeps a stopped program's last chunk
        (the step its checkpoints hold) in the sweep's records."""
        self.pending: dict[int, dict] = {}
        self.latest: dict[int, dict] = {}  # each member's last report sent
        self.ended: Optional[BaseException] = None
        """What Tune's report raised once Tune ended the trial (a sweep's Ctrl-C, its end)."""

    def send(self, out: dict) -> None:
        """Tune's report. When Tune ends the trial, its report raises (SystemExit) inside the program's loop:
        the program is asked to stop as Ctrl-C stops a run instead, at its next step boundary with every
        member's checkpoint, and nothing more is sent (``run_population_trial`` raises it afterwards)."""
        if self.ended is not None:
            return
        try:
            self._send(out)
        except BaseException as e:
            from raysys import lifecycle

            self.ended = e
            lifecycle.request_stop(signal.SIGINT)

    def reporter(self, j: int):
        def report(metrics: dict) -> Optional[str]:
            if j in self.pending:  # a member that ended unseen (a shorter train.steps) held the chunk back
                self.training &= set(self.pending)
                self.flush()
            self.pending[j] = self.trackers[j].update(metrics)
            if self.trackers[j].reason is not None:  # halted: it reports no more
                self.training.discard(j)
            if self.training and self.training <= set(self.pending):
                self.flush()
            return self.trackers[j].reason  # a reason halts this member's session
        return report

    def fail(self, j: int, reason: str) -> None:
        """Member j's last report: it failed with an error no restart can fix."""
        if j in self.pending:
            self.flush()
        self.pending[j] = self.trackers[j].failed(reason)

    def finish(self) -> None:
        """The trial's last report: every member's last state, also of members that ended earlier (a
        shorter train.steps, a halt). Tune, the searcher and the sweep's records read each member's end
        from this one report; a member missing from it was taken for one stopped before its end."""
        if self.pending or self.latest:
            self.pending = {**self.latest, **self.pending}
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        fresh = list(self.pending)
        if all(t.unstable for t in self.trackers):  # Tune's stopper ends the trial on this report: it must hold
            self.pending = {**self.latest, **self.pending}  # every member's last state, as finish's would
        self.latest.update(self.pending)
        out: dict[str, Any] = {}
        for j, m in self.pending.items():
            out |= {f"{PREFIX}/{self.ids[j]}/{k}": v for k, v in m.items() if k in KEPT or k.startswith(pbt.PREFIX)}
        # Tune checks the searcher's metrics at the top level, and its stopper reads the verdict there:
        # the population's best objectives, unstable only once every member is
        done = [t for t in self.trackers if t.throughput is not None]
        out[obj.THROUGHPUT] = max((t.throughput for t in done if not t.unstable), default=math.nan)
        qs = [t.quality for t in done if not t.unstable and t.quality is not None]
        out[obj.QUALITY] = max(qs, key=lambda q: q * self.trackers[0].sign) if qs else math.nan  # the best, either mode
        out[obj.UNSTABLE] = float(all(t.unstable for t in self.trackers))
        if out[obj.UNSTABLE]:
            out[obj.REASON] = "every member unstable, the last: " + str(self.trackers[fresh[-1]].reason)
        if all(obj.FINAL in m for m in self.pending.values()) and len(self.pending) == len(self.ids):
            out[obj.FINAL] = 1.0
        out["members_live"] = float(sum(not t.unstable for t in self.trackers))
        self.pending = {}
        self.send(out)


def run_population_trial(config: dict, setup) -> None:
    """The Tune function trainable of a vectorized trial: ``config[POPULATION]`` lists its members' knobs."""
    from ray import tune

    from raysys import workload as registry
    from raysys.config import ConfigError
    from raysys.session import run_population
    from raysys.tune.trial import (begin_trial, fail_permanently, finished_final, log_event, permanent_reason,
                                   release_trial_memory, reused_final, trial_config, training)

    trial_id = tune.get_context().get_trial_id()
    begin_trial()
    setup.attach_storage()
    wl = registry.get(setup.workload)
    all_knobs = [dict(k) for k in config[POPULATION]]
    ids = member_ids(trial_id, len(all_knobs))
    trackers = [setup.tracker() for _ in ids]
    reports = Reports(ids, trackers, tune.report)
    todo = []
    for j, (mid, knobs) in enumerate(zip(ids, all_knobs)):
        if (final := finished_final(setup, mid)) is not None:  # finished before the sweep was interrupted
            reports.reporter(j)(reused_final(setup, mid, final))
        else:
            todo.append(j)
    verdicts = unstable_before(setup, trial_id)
    for j in list(todo):  # found unstable in an earlier session of the sweep: it stays halted, with its verdict
        if (why := verdicts.get(ids[j])) is not None:
            trackers[j].reason = why
            reports.reporter(j)({})
            todo.remove(j)
    cfgs = {}
    for j in list(todo):  # a member whose knobs together are no valid config fails alone, as its lone trial would
        try:
            cfgs[j] = trial_config(setup, all_knobs[j], ids[j])
        except ConfigError as e:
            reason = permanent_reason(e) or str(e)
            log_event(setup.sweep_dir, f"fail {ids[j]} {reason}")
            reports.fail(j, reason)
            todo.remove(j)
    if not todo:
        reports.finish()
        return
    # a stop of the trial waits for the members' checkpoints (trial.trainable); the sweep's signal stops
    # them at their step boundary first, and the trial stays unfinished (trial.training)
    with training(setup, trial_id):
        try:
            for j in todo:
                log_event(setup.sweep_dir, f"start {ids[j]} run={cfgs[j].launch.name} resume={cfgs[j].launch.resume} "
                                           f"population={trial_id}")
            schedule = None
            if setup.pbt is not None:  # each program its own random stream, reproducible with the sweep's --seed:
                # from its members' proposals (the searcher's, seeded), not from Tune's random trial id
                proposals = json.dumps(all_knobs, sort_keys=True, default=str).encode()
                schedule = pbt.PBTConfig(**{**setup.pbt, "seed": [setup.pbt["seed"], zlib.crc32(proposals)]})
            reports.training = set(todo)
            results = run_population(wl, [cfgs[j] for j in todo], parent_run_id=setup.parent_run_id,
                                     tags=[setup.run_tags(ids[j], all_knobs[j]) for j in todo],
                                     reports=[reports.reporter(j) for j in todo], pbt=schedule)
            if reports.ended is not None:  # Tune ended the trial; its members stopped with their checkpoints
                raise reports.ended
        except Exception as e:  # the program failed, so every member did; a permanent error is not retried
            if not fail_permanently(setup, trial_id, e, lambda reason: [reports.fail(j, reason) for j in todo],
                                    runs=[ids[j] for j in todo]):
                raise
            results = []
        finally:
            release_trial_memory()
    reports.training = set()  # the members' last reports go as one, the trial's last (finish)
    for j, res in zip(todo, results):
        if res.stopped_by is None:
            reports.reporter(j)({**res.metrics, "done": 1.0, **({obj.NOTE: res.note} if res.note else {})})
            log_event(setup.sweep_dir, f"end {ids[j]}")
    reports.finish()


def unstable_before(setup, trial_id: str) -> dict[str, str]:
    """{member id: the unstable verdict an earlier session of the sweep reported for it} (the sweep's
    objective log). Those members were frozen then; a resumed trial keeps them so instead of training
    them afresh under rules (a collapse, loss spikes) whose history their new trackers would not have."""
    from pathlib import Path

    from raysys.tune.progress import OBJECTIVES_DIR, objective_history

    rows = objective_history(Path(setup.sweep_dir) / OBJECTIVES_DIR, trial_id)
    out, tail = {}, f"/{obj.UNSTABLE}"
    for flag in [c for c in rows.columns if c.startswith(f"{PREFIX}/") and c.endswith(tail)] if rows is not None else []:
        if (rows[flag] == 1).any():
            head = flag[:-len(tail)]
            reasons = rows[f"{head}/{obj.REASON}"].dropna() if f"{head}/{obj.REASON}" in rows else []
            out[head[len(PREFIX) + 1:]] = (str(reasons.iloc[-1]) if len(reasons)
                                          else "unstable (found in an earlier session of the sweep)")
    return out


def pool_throughput(records: list, member_knobs: Sequence[str]) -> None:
    """A configuration's speed is its program's: trials whose knobs differ only in ``member_knobs`` run
    the same compiled program, so (in place) each finished trial's throughput becomes the median of its
    program's finished trials, and its own measurement is kept as ``extra['measured_throughput']``. One
    trial per configuration then ranks configurations of one shape by quality alone, as a vectorized
    sweep (one measured speed per program) does, instead of by the noise of trials that shared the
    machine with different neighbours."""
    from statistics import median

    groups: dict[str, list] = {}
    for r in records:
        if r.eligible:
            groups.setdefault(program_key(r.knobs, member_knobs), []).append(r)
    for group in groups.values():
        if len(group) > 1:
            pooled = median(r.throughput for r in group)
            for r in group:
                r.extra["measured_throughput"], r.throughput = r.throughput, pooled
