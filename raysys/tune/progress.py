"""What runs on the driver while Tune works: the stability stopper and concise progress lines."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from ray.tune import Callback
from ray.tune.stopper import Stopper

from raysys import storage
from raysys.tune import objectives as obj
from raysys.tune.population import POPULATION, PREFIX, member_ids, member_results

PROGRESS_EVERY_S = 20.0
OBJECTIVES_DIR = "objectives"  # in the sweep's folder: ObjectiveLog's files


MISSING_OBJECTIVE = "never reported (an objective of the space)"
"""A trial's verdict when it ended without one of the space's objectives (``ObjectiveTracker``)."""


def objective_never_reported(records) -> Optional[str]:
    """The first trial's reason when every trial that ended did so without an objective of the space (a metric
    the workload never reports: the command's config error, exit 2, its parent run FAILED); else None.
    Trials a stop cut (incomplete) say nothing either way."""
    from raysys.tune.pareto import INCOMPLETE

    ended = [r for r in records if r.status != INCOMPLETE]
    missing = [r.reason for r in ended if MISSING_OBJECTIVE in r.reason]
    return missing[0] if ended and len(missing) == len(ended) else None


SESSION_BUDGET: dict[str, Optional[float]] = {"ends": None}
"""When this command's ``--budget`` ends (``time.monotonic()``; None: no budget). A value of the process, not of
the pickled stopper, so a resumed sweep runs for the budget its resume gives (Tune's own ``time_budget_s`` is
restored spent, and a resume of a sweep that used it up ran nothing, for ever)."""


class StabilityStopper(Stopper):
    """End a trial as soon as one of its reports carries the unstable verdict. An unstable trial is a
    result (recorded as such), not a failure: the sweep goes on, unless a trial ended without an
    objective of the space at all. Every trial would (the workload never logs it): the sweep stops
    then, not after spending its whole budget on trials it cannot rank. It also ends the session at its
    ``--budget`` (``SESSION_BUDGET``)."""

    def __init__(self):
        self.missing = False

    def __call__(self, trial_id: str, result: dict) -> bool:
        if MISSING_OBJECTIVE in str(result.get(obj.REASON, "")):
            self.missing = True
        return bool(result.get(obj.UNSTABLE))

    def stop_all(self) -> bool:
        ends = SESSION_BUDGET["ends"]
        # getattr: a sweep restored from an older raysys has no `missing`
        return getattr(self, "missing", False) or (ends is not None and time.monotonic() >= ends)


def trial_dirname(trial) -> str:
    """Tune's trial folder is named by the trial id only (the default repeats the whole config)."""
    return trial.trial_id


def short_names(keys: list[str]) -> dict[str, str]:
    """'train.batch_size' -> 'batch_size', unless two knobs would then share a name."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def format_knobs(knobs: dict[str, Any]) -> str:
    names = short_names(sorted(knobs))
    return " ".join(f"{names[k]}={_fmt(knobs[k])}" for k in sorted(knobs))


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


class ObjectiveLog(Callback):
    """Every report's objectives and step, appended to ``<folder>/<trial id>.jsonl`` as it arrives:
    the history each trial's MLflow run gets at the end of the sweep. Tune's own per-trial files may
    lose what came before a killed driver (they reach the sweep's folder only when Tune syncs them),
    so a resumed trial's history would start where it resumed."""

    KEYS = ("step", obj.THROUGHPUT, obj.QUALITY, obj.MEASURED_THROUGHPUT, obj.MEASURED_QUALITY, obj.UNSTABLE, obj.REASON)

    def __init__(self, folder: str):
        self.folder = folder

    # Tune pickles this callback with the sweep (tuner.pkl) and a resumed sweep unpickles it. A remote
    # sweep's folder is in a temporary working copy of the session that started it (storage.working_copy),
    # gone by then: the folder travels as (storage, sweep, subfolder) and is found again in this process's
    # copy, the one the runner pulled the earlier rows into and pushes at the end.
    def __getstate__(self):
        folder = Path(self.folder)
        owner = storage.remote_of(folder.parent)
        return {**self.__dict__, "folder": (owner[0].uri, owner[1], folder.name) if owner else self.folder}

    def __setstate__(self, state):
        if isinstance(state["folder"], tuple):
            uri, name, sub = state["folder"]
            state = {**state, "folder": str(storage.working_copy(storage.Remote(uri), name) / sub)}
        self.__dict__.update(state)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        def kept(key: str) -> bool:  # a member's keys are members/<member id>/<key>
            own = key.split("/", 2)[2] if key.startswith(f"{PREFIX}/") and key.count("/") >= 2 else key
            return own in self.KEYS or key in ("training_iteration", "timestamp")

        row = {k: v for k, v in result.items() if kept(k)}
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"{trial.trial_id}.jsonl"), "a") as f:
            f.write(json.dumps(row, default=float) + "\n")


def objective_history(folder, trial_id: str):
    """What :class:`ObjectiveLog` wrote for a trial, as a dataframe (None if nothing)."""
    import pandas as pd

    path = os.path.join(folder, f"{trial_id}.jsonl") if folder else None
    if not path or not os.path.exists(path):
        return None
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line the killed driver left half-written
                pass
    return pd.DataFrame(rows) if rows else None


_SESSION_START = time.time()


def _logged_at(line: str) -> float:
    """The time of an events.log line (``2026-11-29T12:30:53 ...``, local time); 0 if it has none."""
    try:
        return time.mktime(time.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return 0.0


class Progress(Callback):
    """One line when a trial starts or ends, and a short one per running trial every ~20 s."""

    def __init__(self, total: int, throughput_metric: str, quality_metric: str, max_failures: int = 0,
                 log: Optional[ObjectiveLog] = None):
        self.total, self.tm, self.qm, self.max_failures = total, throughput_metric, quality_metric, max_failures
        self.log = log  # the sweep's ObjectiveLog: where a resumed trial's earlier sessions are found (it pickles itself)
        self.last_line: dict[str, float] = {}
        self.spike_hint = False  # the hint on loss spikes, said once per sweep

    def _print(self, msg: str) -> None:
        print(f"[raysys.tune {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # Counts come from Tune's trial list, not from counters here: a resumed sweep restores this
    # callback as it was pickled when the sweep began.
    def on_trial_start(self, iteration, trials, trial, **info):
        n = sum(t.status != "PENDING" or t is trial for t in trials)
        members = trial.config.get(POPULATION)
        if members is None:
            self._print(f"trial {trial.trial_id} started ({n}/{self.total}): {format_knobs(trial.config)}")
            return
        self._print(f"trials {trial.trial_id}_0..{len(members) - 1} started as one program:" if len(members) > 1
                    else f"trial {trial.trial_id}_0 started (a program of its own: no other configuration agrees with it outside the member knobs):")
        for mid, knobs in zip(member_ids(trial.trial_id, len(members)), members):
            self._print(f"  trial {mid}: {format_knobs(knobs)}")

    def _restarts(self, trial_id: str) -> None:
        """The restarts of a trial's own training (``launch.max_failures``: a Ray Train worker lost), which its
        run's events.log records in the trial's process: said here, once each (a local sweep's folder only)."""
        log = getattr(self, "log", None)
        if log is None:
            return
        sweep = Path(log.folder).parent
        try:
            lines = (sweep / "runs" / f"{sweep.name}-{trial_id}" / "events.log").read_text().splitlines()
        except OSError:
            return
        restarts = [ln for ln in lines if " restart " in ln and " after: " in ln]
        said = self.__dict__.setdefault("restarts_said", {})
        if trial_id not in said:  # an earlier session of the sweep (a --resume) said those before it
            said[trial_id] = sum(1 for ln in restarts if _logged_at(ln) < _SESSION_START)
        for line in restarts[said.get(trial_id, 0):]:
            count, cause = line.split(" restart ", 1)[1].split(" after: ", 1)
            n, _, of = count.partition("/")
            self._print(f"trial {trial_id}: its training failed ({cause.strip()[:200]}); restarting from its last "
                        f"checkpoint (restart {n} of {of}, launch.max_failures)")
        said[trial_id] = len(restarts)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        now = time.monotonic()
        if result.get(obj.FAILED):  # on_trial_complete says it
            return
        if POPULATION not in trial.config:
            self._restarts(trial.trial_id)
        if result.get(obj.UNSTABLE):
            reason = str(result.get(obj.REASON))
            hint = ""
            if "loss spikes" in reason and not self.spike_hint:  # a noisy small-batch loss may be healthy: say how
                self.spike_hint = True
                hint = ("\n  (a spike is a loss above train.spike_factor x its recent median; a noisy run that learns "
                        "may need `stability: {max_loss_spikes: N}` in the space, or a larger train.spike_factor)")
            self._print(f"trial {trial.trial_id} UNSTABLE: {reason} -> stopping it{hint}")
            return
        if now - self.last_line.get(trial.trial_id, 0.0) < PROGRESS_EVERY_S:
            return
        self.last_line[trial.trial_id] = now
        members = trial.config.get(POPULATION)
        if members is not None:
            unstable = [mid for mid, _, m in member_results(result, trial.config, trial.trial_id) if m.get(obj.UNSTABLE)]
            self._print(f"trials {trial.trial_id}_*: {len(members) - len(unstable)} of {len(members)} members training"
                        + (f" (masked as unstable: {', '.join(unstable)})" if unstable else "")
                        + (f", best {self.qm.split('/')[-1]} {result[obj.QUALITY]:.4g}"
                           if isinstance(result.get(obj.QUALITY), float) and math.isfinite(result[obj.QUALITY]) else ""))
            return
        parts = [f"step {result.get('step', '?')}"]
        if isinstance(result.get("train/loss"), (int, float)):
            parts.append(f"loss {result['train/loss']:.4g}")
        if isinstance(result.get(obj.MEASURED_THROUGHPUT), float):
            parts.append(f"{self.tm.split('/')[-1]} {result[obj.MEASURED_THROUGHPUT]:.4g}")
        if isinstance(result.get(obj.MEASURED_QUALITY), float) and self.qm != "train/loss":  # said above already
            parts.append(f"{self.qm.split('/')[-1]} {result[obj.MEASURED_QUALITY]:.4g}")
        self._print(f"trial {trial.trial_id} " + ", ".join(parts))

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        if POPULATION in trial.config:
            members = member_results(r, trial.config, trial.trial_id)
            for mid, _, m in members:
                self._print(_failed(mid, m) if m.get(obj.FAILED) else
                            f"trial {mid} done in {self._seconds(mid, trial.trial_id, r):.0f}s (one program): "
                            f"{self._verdict(m)}")
            self._unwatched(next((m for _, _, m in members if m.get(obj.UNWATCHED)), {}))
            for note in dict.fromkeys(m[obj.NOTE] for _, _, m in members if m.get(obj.NOTE)):
                self._print(f"note: trial {trial.trial_id}'s program: {note}")
            return
        self._print((_failed(trial.trial_id, r) if r.get(obj.FAILED) else
                     f"trial {trial.trial_id} done in {self._seconds(trial.trial_id, trial.trial_id, r):.0f}s: "
                     f"{self._verdict(r)}")
                    + f" [{_done(trials, trial)}/{self.total} done]")
        self._unwatched(r)

    def _unwatched(self, r: dict) -> None:
        """A stability rule on a metric the run never reported, said once a sweep (every trial is alike)."""
        if r.get(obj.UNWATCHED) and not getattr(self, "unwatched_said", False):
            self.unwatched_said = True
            self._print(f"note: a stability rule of the space checks nothing: {r[obj.UNWATCHED]} (a typo in "
                        "`stability:`?)")

    def _seconds(self, trial_id: str, tune_trial_id: str, r: dict) -> float:
        """The trial's run time: Tune's clock, or, for a trial resumed with the sweep, every session's (Tune's
        clock counts only the last; a member's sessions are its program's)."""
        log = getattr(self, "log", None)  # None in a sweep begun before it was kept
        if log is not None:
            from raysys.tune.trial import report_times, run_seconds

            took = run_seconds(Path(log.folder).parent, trial_id, report_times(log.folder, tune_trial_id),
                               resumed_only=True)
            if took is not None:
                return took
        return r.get("time_total_s") or 0.0

    def _verdict(self, r: dict) -> str:
        if r.get(obj.UNSTABLE):
            verdict = f"unstable ({r.get(obj.REASON)})"
        elif r.get(obj.FINAL):
            verdict = (f"{self.tm.split('/')[-1]} {r.get(obj.MEASURED_THROUGHPUT, float('nan')):.4g}, "
                       f"{self.qm.split('/')[-1]} {r.get(obj.MEASURED_QUALITY, float('nan')):.4g}")
        else:
            verdict = "stopped before the end"
        return verdict

    def on_trial_recover(self, iteration, trials, trial, **info):
        what = f"trials {trial.trial_id}_*" if POPULATION in trial.config else f"trial {trial.trial_id}"
        self._print(f"{what} failed: {_last_failure(trial)}; starting again from the last checkpoint "
                    f"(restart {trial.num_failures} of {self.max_failures}; details: {trial.path}/error.txt)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._print(f"trial {trial.trial_id} FAILED: {_last_failure(trial)} (the sweep goes on) "
                    f"[{_done(trials, trial)}/{self.total} done]; details: {trial.path}/error.txt")


def _failed(trial_id: str, r: dict) -> str:
    return f"trial {trial_id} FAILED: {r[obj.FAILED]} (not restarted: a restart cannot fix this; the sweep goes on)"


def _last_failure(trial) -> str:
    """The cause of the trial's latest failure in one line, from the error.txt Tune has just appended to."""
    from raysys.tune.trial import error_summary

    try:
        text = open(trial.error_file).read()
    except (OSError, TypeError):
        return "see error.txt"
    return error_summary(text.rsplit("Failure # ", 1)[-1].split("\n", 1)[-1])


def _done(trials, trial) -> int:
    """Finished trials, counting this one (Tune updates its status after the callbacks)."""
    return sum(t.status in ("TERMINATED", "ERROR") or t is trial for t in trials)
