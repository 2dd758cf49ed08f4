"""One sweep trial: the Tune function trainable and the three ways it trains.

* PyTorch workload, ``launch.workers == 0`` (the default on small machines): the shared loop runs
  in a child process of the trial (see :mod:`raysys.tune.child` for why), reports come back
  through a pipe.
* PyTorch workload, ``launch.workers > 0``: ``run_training`` fits a Ray Train V2 ``TorchTrainer``
  in a thread of the trial (the Train V2 + Tune pattern; Train's workers get their own placement
  group beside the trial's); its controller queues every report, which the trial's own thread
  forwards with ``tune.report``.
* Workload with its own loop (``train_fn``): ``run_custom`` in the trial, ``report=tune.report``.

Every report passes through an :class:`ObjectiveTracker` first. Each trial's training run is
named ``<sweep>-<trial id>`` under ``<sweep dir>/runs/``: a resumed sweep restarts an unfinished
trial with the same name, so its run continues from its own last checkpoint.

An error no restart can fix (``failures.PERMANENT``: a config error from the trial's knobs, an
unusable checkpoint, a full disk) ends the trial at once with a last report naming it
(``sweep/failed``), instead of a raise that Tune would retry ``--max-failures`` times.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ray.train import UserCallback

from raysys.tune.objectives import FAILED, RUN_SECONDS, ObjectiveTracker, StabilityRules

CHILD_STOP_GRACE_S = 30.0
WIND_DOWN_S = 600
"""How long Tune lets a trial's function finish before its process takes the next trial (below)."""
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b")


def error_summary(err: BaseException | str) -> str:
    """One line for a failed trial: the last 'XError: message' line of Ray's wrapped traceback."""
    lines = [l.strip() for l in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if l.strip()]
    errors = [l for l in lines if ERROR_LINE.match(l)]
    line = errors[-1] if errors else lines[-1] if lines else type(err).__name__
    if "worker process has died" in line:  # Ray's paragraph on a dead actor: what it means, in short
        line = "the trial's process died (killed, or out of memory)"
    # cut at a word, marked: the whole message is in the trial's run (raysys.error, error.txt)
    return line if len(line) <= 300 else line[:300].rsplit(" ", 1)[0] + " …"


@dataclass(frozen=True)
class TrialSetup:
    """What every trial needs besides its knobs (passed once through ``tune.with_parameters``)."""

    workload: str
    base_config: dict
    """The preset + fixed overrides, data prepared (absolute paths), as a plain dict."""
    sweep_name: str
    sweep_dir: str
    """The sweep folder (on remote storage: the driver's working copy; its files are pushed)."""
    runs_storage: str
    """Where the trials' runs live: ``<sweep>/runs``, a folder or a storage URI."""
    tracking_uri: str
    experiment: str
    parent_run_id: str
    throughput_metric: str
    quality_metric: str
    stability: dict
    quality_penalty: Optional[float]
    """What an unstable trial scores as quality; None: NaN (left out of the searcher's study)."""
    quality_mode: str = "max"
    """'max' or 'min': which way quality is better."""
    sweep_storage: str = ""
    """The sweeps' storage URI when remote ('' for a local folder)."""
    stop_actor: str = ""
    """The name of the sweep's :class:`SweepStop` actor ('' outside a sweep driver's Ray)."""
    train_flags: tuple = ()
    """Launch options a trial's `raysys train` command carries to run where the sweep's runs were: a remote
    --storage-path, a --tracking-uri other than the working directory's."""
    preset: str = ""
    """The space's base preset, recorded on each trial's run with its equivalent train command."""
    fixed: tuple = ()
    """The space's fixed overrides as (key, value) pairs, for that command."""
    pbt: Optional[dict] = None
    """``--scheduler pbt``: raysys.train.pbt.PBTConfig's fields but the seed; None: no PBT."""

    @property
    def runs_dir(self) -> Path:
        """Trial scratch files (the child's payload and log), local to the trial's node."""
        return Path(self.sweep_dir) / "runs"

    def run_exists(self, trial_id: str, file: str = "") -> bool:
        """Whether the trial's run (or one of its files) is in the runs storage."""
        from raysys import storage

        name = self.run_name(trial_id)
        if storage.is_remote(self.runs_storage):
            remote = storage.Remote(self.runs_storage)
            return remote.kind(name, file) == "file" if file else bool(remote.listdir(name))
        path = Path(self.runs_storage) / name
        return (path / file).is_file() if file else path.is_dir() and any(path.iterdir())

    def latest_checkpoint(self, trial_id: str) -> str:
        """The name of the trial's run's newest checkpoint folder, '' if it has none."""
        from raysys import storage

        name = self.run_name(trial_id)
        if storage.is_remote(self.runs_storage):
            names = storage.Remote(self.runs_storage).listdir(name, "checkpoints")
        else:
            folder = Path(self.runs_storage) / name / "checkpoints"
            names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
        steps = sorted(n for n in names if n.startswith("step_"))  # zero-padded: in step order
        return steps[-1] if steps else ""

    def run_file_time(self, trial_id: str, file: str) -> Optional[float]:
        """When one of the trial's run files was last written (epoch seconds), None if unknown."""
        from raysys import storage

        name = self.run_name(trial_id)
        try:
            if storage.is_remote(self.runs_storage):
                remote = storage.Remote(self.runs_storage)
                mtime = remote.fs.get_file_info(remote.path(name, file)).mtime
                return mtime.timestamp() if mtime is not None else None
            return (Path(self.runs_storage) / name / file).stat().st_mtime
        except OSError:
            return None

    def read_run_file(self, trial_id: str, file: str) -> str:
        from raysys import storage

        name = self.run_name(trial_id)
        if storage.is_remote(self.runs_storage):
            remote = storage.Remote(self.runs_storage)
            with remote.fs.open_input_stream(remote.path(name, file)) as f:
                return f.read().decode()
        return (Path(self.runs_storage) / name / file).read_text()

    def attach_storage(self) -> None:
        """In a trial's process: the sweep's files it writes (its log) go to the same remote folder."""
        if self.sweep_storage:
            from raysys import storage

            storage.register(Path(self.sweep_dir), self.sweep_storage, self.sweep_name)

    def run_name(self, trial_id: str) -> str:
        return f"{self.sweep_name}-{trial_id}"

    def display_name(self, trial_id: str, knobs: dict[str, Any]) -> str:
        """What the MLflow UI shows: the trial id first (names stay apart even when cut), then its knobs."""
        from raysys.tune.progress import format_knobs

        return f"{trial_id} {format_knobs(knobs)}"[:240]

    def run_tags(self, trial_id: str, knobs: dict[str, Any]) -> dict[str, str]:
        from raysys.tune.report import commands

        return {"raysys.sweep": self.sweep_name, "raysys.trial_id": trial_id, "raysys.kind": "sweep_trial",
                "mlflow.runName": self.display_name(trial_id, knobs), "raysys.preset": self.preset,
                "raysys.command": commands(self.workload, self.preset, dict(self.fixed), knobs,
                                                   self.train_flags)[0][:5000]}

    def tracker(self, trial_id: Optional[str] = None) -> ObjectiveTracker:
        """A trial's tracker; a trial resumed after its sweep stopped starts from its last measured objectives
        (its ObjectiveLog rows), not from NaN: a run resumed mid-epoch has no new quality until its next
        evaluation, and the one it had still holds."""
        t = ObjectiveTracker(self.throughput_metric, self.quality_metric,
                             StabilityRules.from_dict(self.stability), self.quality_penalty, self.quality_mode)
        if trial_id is not None:
            from raysys.tune.objectives import MEASURED_QUALITY, MEASURED_THROUGHPUT
            from raysys.tune.progress import OBJECTIVES_DIR, objective_history

            rows = objective_history(Path(self.sweep_dir) / OBJECTIVES_DIR, trial_id)
            for key, attr in ((MEASURED_THROUGHPUT, "throughput"), (MEASURED_QUALITY, "quality")):
                seen = rows[key].dropna() if rows is not None and key in rows else []
                if len(seen):
                    setattr(t, attr, float(seen.iloc[-1]))
        return t


def trial_config(setup: TrialSetup, knobs: dict[str, Any], trial_id: str) -> Any:
    """The trial's full config: base + knobs + its own run name/folder/store; resume if it ran before."""
    from raysys import workload as registry
    from raysys.config import apply_overrides, from_dict

    wl = registry.get(setup.workload)
    started_before = setup.run_exists(trial_id)
    return apply_overrides(from_dict(wl.config_cls, setup.base_config), {
        **knobs, "launch.name": setup.run_name(trial_id), "launch.storage_path": setup.runs_storage,
        "launch.tracking_uri": setup.tracking_uri, "launch.experiment": setup.experiment,
        "launch.resume": started_before})


def log_event(sweep_dir: str | Path, line: str) -> None:
    """Append to <sweep>/trial_events.log (one line per trial start/end; tests and users audit it)."""
    from raysys import storage

    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    storage.append_line(Path(sweep_dir) / "trial_events.log", f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def run_seconds(sweep_dir: str | Path, trial_id: str, reports: Sequence[float] = (),
                resumed_only: bool = False, ended_at: Optional[float] = None) -> Optional[float]:
    """The seconds a trial ran, from <sweep>/trial_events.log, if it ended: every session of it, each from
    its ``start`` to its ``end``. A session that was cut (the sweep stopped or its driver killed, then
    ``--resume``) counts up to its last report (``reports``: their epoch times), not the time the sweep was
    down. ``resumed_only``: None for a trial that ran in one session (Tune's clock then says it).
    ``ended_at``: when its run recorded its end, for a last session whose ``end`` line the driver's death
    kept out of the log."""
    from datetime import datetime

    from raysys import storage

    try:
        log = Path(sweep_dir) / "trial_events.log"
        storage.pull(log)  # a sweep on remote storage: the trials' processes wrote it there, not here
        lines = log.read_text().splitlines()
    except OSError:
        return None
    sessions: list[list] = []  # [start, end or None], epoch seconds
    for line in lines:
        words = line.split()
        if len(words) < 3 or words[2] != trial_id or words[1] not in ("start", "end"):
            continue
        try:
            t = datetime.fromisoformat(words[0]).timestamp()
        except ValueError:  # a line cut by a kill
            continue
        if words[1] == "start":
            sessions.append([t, None])
        elif sessions and sessions[-1][1] is None:
            sessions[-1][1] = t
    if sessions and sessions[-1][1] is None and ended_at is not None and ended_at >= sessions[-1][0]:
        sessions[-1][1] = ended_at
    if not sessions or sessions[-1][1] is None or (resumed_only and len(sessions) < 2):
        return None
    bounds = [s[0] for s in sessions[1:]] + [float("inf")]
    return sum((end if end is not None else max([start, *(r for r in reports if start <= r < nxt)])) - start
               for (start, end), nxt in zip(sessions, bounds))


def report_times(objectives_dir: str | Path, trial_id: str) -> list[float]:
    """The epoch times of a Tune trial's reports, as ``progress.ObjectiveLog`` kept them."""
    try:
        lines = (Path(objectives_dir) / f"{trial_id}.jsonl").read_text().splitlines()
    except OSError:
        return []
    times = []
    for line in lines:
        try:
            t = json.loads(line).get("timestamp")
        except (ValueError, AttributeError):  # a line a killed driver left half-written
            continue
        if isinstance(t, (int, float)):
            times.append(float(t))
    return times


def finished_final(setup: TrialSetup, trial_id: str) -> Optional[dict]:
    """What the trial's run recorded when it ended (its ``final_metrics.json``), or None: not ended, or the
    file cannot be read (the run is then resumed, which records its end again)."""
    if not setup.run_exists(trial_id, "final_metrics.json"):
        return None
    try:
        final = json.loads(setup.read_run_file(trial_id, "final_metrics.json"))
    except (OSError, ValueError):
        return None
    return final if isinstance(final, dict) else None


def reused_final(setup: TrialSetup, trial_id: str, final: dict) -> dict:
    """The last report of a trial whose run had already ended (the driver died before Tune recorded
    that): what the run recorded (``finished_final``), and its own wall time, not that of this reuse."""
    log_event(setup.sweep_dir, f"reuse {trial_id} run={setup.run_name(trial_id)}")
    final = {**final, "done": 1.0}
    if (ended := setup.latest_checkpoint(trial_id)) and "step" not in final:
        final["step"] = int(ended.split("_")[1])  # its objectives belong to the step it ended at
    took = run_seconds(setup.sweep_dir, trial_id, ended_at=setup.run_file_time(trial_id, "final_metrics.json"))
    return final if took is None else {**final, RUN_SECONDS: took}


class ChildFailed(RuntimeError):
    """The child process of a trial ended with an error no restart can fix (its message)."""


def permanent_reason(e: BaseException) -> Optional[str]:
    """One line naming the error in ``e`` that a restart cannot fix, or None if a restart might."""
    from raysys.train.failures import permanent_cause

    if isinstance(e, ChildFailed):
        return str(e)
    cause = permanent_cause(e)
    return None if cause is None else error_summary(f"{type(cause).__name__}: {cause}")


def repeated_failure(setup: TrialSetup, trial_id: str, e: BaseException, runs: Optional[list] = None) -> Optional[str]:
    """One line if the trial failed before with this error from the same checkpoints of its ``runs``
    (default: its own): an error of its code, which Tune's next restart would only repeat, as
    ``raysys train`` stops restarting (``fit_with_restarts``). Else None, and the failure is noted in
    <sweep>/trial_events.log for the next time."""
    from raysys import storage

    line = error_summary(e)
    at = ",".join(setup.latest_checkpoint(t) or "none" for t in (runs or [trial_id]))
    mark = f"error {trial_id} from={at} {line}"
    log = Path(setup.sweep_dir) / "trial_events.log"
    storage.pull(log)
    try:
        seen = [ln.split(" ", 1)[-1] for ln in log.read_text().splitlines()]
    except OSError:
        seen = []
    if mark in seen:
        return f"{line} (again from the same checkpoint: an error of the training code)"
    log_event(setup.sweep_dir, mark)
    return None


def tracking_outage(e: BaseException) -> bool:
    """``e`` is (or, from a trial's child process, names) a ``tracking.TrackingOutageError``: the trial waited for
    its sweep's tracking server for the whole wait, which is no error of its code however often it repeats."""
    from raysys.train.failures import find_cause
    from raysys.tracking import TrackingOutageError

    return (find_cause(e, (TrackingOutageError,)) is not None
            or error_summary(e).split(":", 1)[0].endswith(TrackingOutageError.__name__)
            or f"{TrackingOutageError.__name__}: " in str(e))


def lost_to_ray(e: BaseException) -> bool:
    """``e`` is the loss of the trial's process or its node (killed, crashed, a raylet or a node that died),
    as Tune records it once its restarts are spent: no error of the trial's code, so a --resume runs it again.
    Ray's out-of-memory kill is not among them: the same trial would be killed again."""
    import ray.exceptions as rex

    from raysys.train.failures import find_cause

    return find_cause(e, (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError,
                          rex.OwnerDiedError)) is not None


def fail_permanently(setup: TrialSetup, trial_id: str, e: BaseException, report, runs: Optional[list] = None) -> bool:
    """If ``e`` is permanent, or repeats the trial's last failure (``repeated_failure``): log it and send
    the trial's last report (``report(reason)``); else False. A tracking outage is neither: Tune retries the
    trial, and one it ends as failed runs again on the sweep's --resume (``runner._lost_not_failed``)."""
    if tracking_outage(e):
        log_event(setup.sweep_dir, f"outage {trial_id} {error_summary(e)}")
        return False
    reason = permanent_reason(e) or repeated_failure(setup, trial_id, e, runs)
    if reason is None:
        return False
    log_event(setup.sweep_dir, f"fail {trial_id} {reason}")
    report(reason)
    return True


def begin_trial() -> None:
    """A trial's first step. Its process may have trained a trial before and may take the next one
    (Tune's ``reuse_actors``)."""
    from raysys import lifecycle

    lifecycle.reset()  # none of the previous trial's stop state stays
    # Tune hands this process the next trial once this trial's function has returned, and waits
    # TUNE_FUNCTION_THREAD_TIMEOUT_S for that (2 s by default). A trial stopped as unstable first
    # stops its run cleanly (a checkpoint; the child's grace is CHILD_STOP_GRACE_S): a shorter wait
    # failed the next trial with "Trainable runner reuse requires reset_config()" (and hung a sweep).
    # Read when the process is reset, so set here, where it holds on any cluster too.
    os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", str(WIND_DOWN_S))


_TRAINING: list[threading.Event] = []
"""One event per training of this process still running (set once it has ended), for ``trainable``."""
_CHILDREN: set = set()
"""The training child processes of this trial process (``_train_in_child``), told of a sweep's stop."""


class SweepStop:
    """A sweep's Ctrl-C/SIGTERM as its trials see it (an actor of the driver). Tune ends a sweep by
    stopping its trials and force-kills those not gone within 5 s, often mid-step: the driver asks here
    first, each trial's training stops at its step boundary with a checkpoint (as Ctrl-C stops a run),
    and Tune is told once none is still training. A trial whose training stopped stays unfinished."""

    def __init__(self):
        self.asked, self.training = False, set()

    def ask(self) -> None:
        self.asked = True

    def begin(self, trial_id: str) -> bool:
        self.training.add(trial_id)
        return self.asked

    def end(self, trial_id: str) -> None:
        self.training.discard(trial_id)

    def state(self) -> tuple[bool, list]:
        return self.asked, sorted(self.training)


def _idle() -> None:
    """A trial stopped by its sweep's signal waits for Tune to end it: returning would finish it."""
    while True:
        time.sleep(60)


@contextlib.contextmanager
def training(setup: Optional[TrialSetup] = None, trial_id: str = ""):
    """A trial's training, which a stop of the trial lets reach its next step boundary (``trainable``),
    and which a stop of the whole sweep asks to stop at its next one (``SweepStop``)."""
    from raysys import lifecycle

    actor = None
    if setup is not None and setup.stop_actor:
        import ray

        try:
            actor = ray.get_actor(setup.stop_actor)
        except ValueError:  # a sweep restored by an older driver: Tune's own stop only
            actor = None
    if actor is not None and ray.get(actor.begin.remote(trial_id)):
        actor.end.remote(trial_id)
        _idle()  # the sweep is stopping: this trial starts nothing
    ended, swept = threading.Event(), threading.Event()
    _TRAINING.append(ended)
    if actor is not None:
        def watch() -> None:
            while not ended.wait(0.5):
                try:
                    asked = ray.get(actor.state.remote(), timeout=10)[0]
                except Exception:  # the driver is gone: Tune's own stop follows
                    return
                if asked:
                    swept.set()
                    lifecycle.request_stop(signal.SIGINT)  # this process's runs and their Ray workers
                    for proc in list(_CHILDREN):  # a Task trained in a child process
                        with contextlib.suppress(OSError):
                            proc.send_signal(signal.SIGINT)
                    return

        threading.Thread(target=watch, daemon=True, name="raysys-sweep-stop").start()
    try:
        yield
    finally:
        ended.set()
        _TRAINING.remove(ended)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.get(actor.end.remote(trial_id), timeout=10)
            if swept.is_set():  # stopped by the sweep's signal, not by Tune (its stopper, its end)
                _idle()


def trainable(fn) -> type:
    """``fn`` as Tune's function trainable whose stop waits (up to WIND_DOWN_S) for the training it
    started. Tune stops a trial (a sweep's Ctrl-C, its end) by ending its session and returning at once;
    the trial's process is then ended within a second, and training in Tune's thread with it, mid-step
    or mid-save. Told by its report, the training stops at its next step boundary with a checkpoint,
    as Ctrl-C stops a run; this waits for that."""
    from ray.tune.trainable.function_trainable import wrap_function

    class WindsDown(wrap_function(fn)):
        def cleanup(self):
            try:
                super().cleanup()  # ends the session: the training's next report raises
            finally:
                deadline = time.monotonic() + WIND_DOWN_S
                for ended in list(_TRAINING):
                    ended.wait(max(0.0, deadline - time.monotonic()))

    return WindsDown


def run_trial(config: dict, setup: TrialSetup) -> None:
    """The Tune function trainable. ``config`` holds exactly the sampled knobs."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    begin_trial()
    setup.attach_storage()
    tracker = setup.tracker(trial_id)
    try:
        with training(setup, trial_id):
            _run_trial(config, setup, trial_id, tracker)
    except Exception as e:
        if not fail_permanently(setup, trial_id, e, lambda reason: tune.report(tracker.failed(reason))):
            raise
    finally:
        release_trial_memory()


def release_trial_memory() -> None:
    """The trial's process may take the next trial (Tune's ``reuse_actors``): drop what this one compiled
    and allocated, so a long sweep's processes do not grow trial after trial. Without the heap trim a
    hackmatrix_ppo trial process grew ~25 MB a trial; with it, ~7 MB."""
    import ctypes
    import gc

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc: give freed heap pages back to the OS
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _run_trial(config: dict, setup: TrialSetup, trial_id: str, tracker: ObjectiveTracker) -> None:
    from ray import tune

    from raysys import lifecycle
    from raysys import workload as registry

    cfg = trial_config(setup, dict(config), trial_id)
    wl = registry.get(setup.workload)
    tags = setup.run_tags(trial_id, dict(config))
    if cfg.launch.resume and (final := finished_final(setup, trial_id)) is not None:
        # Its run already ended (the driver died before Tune recorded that): report what the run
        # recorded instead of "resuming" a finished run, whose speed window would be empty.
        tune.report(tracker.update(reused_final(setup, trial_id, final)))
        return
    log_event(setup.sweep_dir, f"start {trial_id} run={cfg.launch.name} resume={cfg.launch.resume}")

    if wl.task is not None and cfg.launch.workers == 0:
        _train_in_child(setup, cfg, tracker, tags)
    elif wl.task is not None:
        _train_with_ray_train(setup, cfg, trial_id, tracker, tags)
    else:
        from raysys.session import run_custom

        result = run_custom(wl, cfg, parent_run_id=setup.parent_run_id, tags=tags,
                            report=lambda m: tune.report(tracker.update(m)))
        if result.stopped_by is not None:  # the sweep's signal: unfinished, resumed with the sweep
            return
        tune.report(tracker.update({**result.metrics, "done": 1.0}))
    if lifecycle.stop_requested() is None:
        log_event(setup.sweep_dir, f"end {trial_id}")


class QueueReports(UserCallback):
    """Puts each report of a Ray Train run on a queue that the trial's own thread reads (it runs in
    Train's controller). Not Ray's ``TuneReportCallback``: its reports reach Tune through a second
    queue beside the trial thread's own, and a report of the trial thread (its failure) met one of
    those in flight: each waited on the other and the sweep hung for good."""

    def __init__(self, queue: Any):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        if metrics:
            self.queue.put(dict(metrics[0]))


def _train_with_ray_train(setup: TrialSetup, cfg: Any, trial_id: str, tracker: ObjectiveTracker, tags: dict) -> None:
    """``run_training`` in a thread; this (Tune's) thread forwards its reports, then ends as it did.

    Every report passes through the tracker here. On the first unstable one the run is asked to stop
    at its next step boundary with a checkpoint (its ``StopFlag``, as Ctrl-C would), and nothing more is
    forwarded: Tune stops the trial on that report. When Tune ends the trial (its ``tune.report`` then
    raises), the run is asked to stop the same way, and given ``WIND_DOWN_S`` to."""
    from ray import tune
    from ray.util.queue import Empty, Queue

    from raysys import lifecycle
    from raysys.train.launcher import run_training

    stop = lifecycle.stop_flag_actor()  # the flag run_training's workers poll
    reports = Queue(actor_options={"num_cpus": 0})  # unbounded: Train's controller never waits on Tune
    ended: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            run_training(setup.workload, cfg, callbacks=[QueueReports(reports)],
                         parent_run_id=setup.parent_run_id, tags=tags)
        except BaseException as e:  # raised below, in Tune's thread
            ended["error"] = e

    thread = threading.Thread(target=fit, name="raysys-trial-fit", daemon=True)
    thread.start()
    try:
        while True:
            running = thread.is_alive()  # read before the queue: a finished run has put all it will
            try:
                m = reports.get(timeout=0.2)
            except Empty:
                if running:
                    continue
                break
            if tracker.unstable:
                continue
            out = tracker.update(m)
            if tracker.unstable:
                stop.set.remote(signal.SIGINT)
            tune.report(out)
    except BaseException:  # Tune ended the trial (its stopper, the sweep's end, a signal)
        with contextlib.suppress(Exception):  # Ray going away: its workers are too
            stop.set.remote(signal.SIGINT)
        thread.join(WIND_DOWN_S)
        if not thread.is_alive() and "error" not in ended:
            log_event(setup.sweep_dir, f"end {trial_id}")
        raise
    finally:  # the loop above ends once the run has ended, or joined it itself
        with contextlib.suppress(Exception):
            reports.shutdown()
    if "error" in ended:
        raise ended["error"]


def _train_in_child(setup: TrialSetup, cfg: Any, tracker: ObjectiveTracker, tags: dict) -> None:
    from ray import tune

    from raysys.config import to_dict

    setup.runs_dir.mkdir(parents=True, exist_ok=True)
    stem = setup.runs_dir / cfg.launch.name
    payload_path = stem.with_name(stem.name + ".trial.json")
    payload_path.write_text(json.dumps({"workload": setup.workload, "config": to_dict(cfg), "parent_pid": os.getpid(),
                                        "parent_run_id": setup.parent_run_id, "tags": tags}))
    log_path = stem.with_name(stem.name + ".log")
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    # The trial reserved whole CPUs for this child: size torch's thread pool to them, not to the host.
    env["OMP_NUM_THREADS"] = str(max(1, int(cfg.launch.cpus_per_worker)))
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with open(log_path, "a") as log:
        # Own session: a terminal's Ctrl-C reaches the sweep's driver only, which then stops trials in
        # order (Tune saves its state first); the child follows its trial, never the terminal.
        proc = subprocess.Popen([sys.executable, "-m", "raysys.tune.child", str(payload_path), str(write_fd)],
                                pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    _CHILDREN.add(proc)  # a sweep's stop reaches it (training)
    os.close(write_fd)
    permanent = None
    try:
        with os.fdopen(read_fd) as reports:
            for line in reports:
                m = json.loads(line)
                if FAILED in m:  # the child's last word: an error no restart can fix
                    permanent = m[FAILED]
                    continue
                tune.report(tracker.update(m))
                if tracker.unstable:  # the stopper ends the trial too; stop the run cleanly first
                    break
    finally:
        # The loop above ended with an error (Tune ending the trial, say): ask the child to stop at its
        # next step with a checkpoint, as Ctrl-C stops a run, rather than wait on a child nobody reads
        # (Ray kills a worker's child processes with it, so this is a chance, not a promise)
        rc = _stop(proc) if tracker.unstable or sys.exc_info()[0] is not None else proc.wait()
    if rc != 0 and not tracker.unstable:
        if permanent is not None:
            raise ChildFailed(permanent)
        if rc < 0:  # its log's last line is whatever it printed before the kill, not why it ended
            raise RuntimeError(f"training failed: its process was killed ({_signal_name(-rc)}; out of memory, "
                               f"or a kill) (log: {log_path})")
        raise RuntimeError(f"training failed (exit {rc}): {_last_error(log_path)} (log: {log_path})")


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _stop(proc: subprocess.Popen) -> Optional[int]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=CHILD_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _last_error(path: Path) -> str:
    """The last 'SomethingError: message' line of the child's log (one line for tables and tags)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [l.strip() for l in lines if ERROR_LINE.match(l.strip())]
    return (errors[-1] if errors else (lines[-1].strip() if lines else "no output"))[:300]
