"""What a workload with its own training loop (RL learners, JAX) gets from the shared layer.

``run_custom`` opens the run exactly as the PyTorch launcher does (folder, config snapshot,
checkpoint check, MLflow run), then calls ``workload.train_fn(cfg, session)``. The workload logs,
checkpoints and restores through the :class:`Session`, and never imports Ray or MLflow itself.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional

from raysys import console, storage
from raysys.checkpoint import CheckpointStore, record_final
from raysys.lifecycle import StopPoller, reached_end, stop_requested
from raysys.console import Sink
from raysys.train.failures import record_event
from raysys.train.launcher import OpenRun, RunResult, open_run, recorded_final
from raysys.train.runtime import init_ray, set_threads
from raysys.workload import _FromTask


class Session:
    """``rank``/``world_size``: this process's place among data-parallel workers (0 of 1 unless
    :mod:`raysys.train.custom` runs the loop on several). Only rank 0 logs and writes checkpoints;
    every rank restores the same checkpoint."""

    def __init__(self, run: OpenRun, keep_checkpoints: int = 2, report=None, rank: int = 0, world_size: int = 1,
                 sink: Optional[Sink] = None, stop: Any = None):
        self.run = run
        self.run_dir = run.run_dir
        self.store: CheckpointStore = run.store(keep_checkpoints)
        self._report = report  # e.g. ray.tune.report inside a Tune trial
        self._t0 = time.monotonic()
        self.last_metrics: dict[str, float] = {}
        self.last_step = 0
        self.rank, self.world_size = rank, world_size
        self.sink = sink or Sink()  # the driver's console, wherever this process runs
        self._stop = StopPoller(stop)
        self.halted: Optional[str] = None
        """Why this run was halted while others go on (a population member found unstable), or None."""
        self.logged = False
        self.kept_final = False
        """True when ``finish`` kept the final metrics the run recorded before (resumed after its end)."""
        self.resumed = False  # a checkpoint was restored: events.log has this resume
        self.restored_step: Optional[int] = None  # the step of the checkpoint restored
        self.saw_stop = False  # should_stop() said True: the loop may have ended before its end
        self.shapes: Optional[tuple[Any, int]] = None
        """(the program's shape check, this member's index) for a member of a population."""
        self.pbt: Any = None
        """A population member's PBT rounds (raysys.train.pbt.Exploit) when its sweep runs them, else None."""
        self.member: Optional[int] = None  # this member's index in ``pbt``
        self.carry: dict[str, Any] = {}
        """The shared layer's own state of this run, saved in each checkpoint's meta (a member's PBT knobs)."""
        self.extra_metrics: dict[str, float] = {}
        """Logged with every ``log`` (a member's current PBT knobs, so MLflow charts its schedule)."""
        self.restored_meta: Optional[dict] = None  # the meta of the checkpoint restored

    def halt(self, reason: str) -> None:
        """Stop training this run only (a population masks it); ``should_stop`` stays for the whole program."""
        if self.halted is None:
            self.halted = reason
            self.message(f"{self.run.name}: halted ({reason})")

    def should_stop(self) -> bool:
        """True once the run was asked to stop (SIGINT/SIGTERM of the driver). A loop that checks it at a
        step boundary saves a checkpoint there and returns; the run is then marked KILLED and can be
        resumed. With several workers, agree on it collectively (e.g. an all-reduce) before acting."""
        stop = self._stop() is not None
        self.saw_stop = self.saw_stop or stop
        return stop

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, metrics: Mapping[str, float], step: int, progress: Optional[str] = None,
            bar: Optional[tuple[float, float]] = None, unit: str = "step") -> None:
        """Record step metrics (MLflow, and Tune when inside a sweep) and update the progress display:
        ``progress`` is its text, ``bar`` = (done, total) in ``unit`` (default: ``step`` of unknown total)."""
        metrics = {**numbers(metrics, f"{self.run.wl.name}: session.log"), **self.extra_metrics}
        if self.pbt is not None:
            self.pbt.saw(self.member, metrics)
        self.last_metrics.update(metrics)
        self.last_step = step
        self.logged = True
        if not self.is_main:
            return
        self.run.logger.log_metrics(metrics, step)
        if progress is not None:
            done, total = bar if bar is not None else (step, None)
            self.sink.progress(self.run.wl.name, done, total, progress, unit)
        if self._report is not None and self.halted is None:
            verdict = self._report({**metrics, "step": step})
            if isinstance(verdict, str):  # a population's reporter: this member is unstable
                self.halt(verdict)

    def finish(self, final: Mapping[str, Any]) -> dict:
        """The run's final metrics: the last logged ones updated by what ``train_fn`` returned.
        Returned values that were never logged (e.g. ``eval/quality``) go to MLflow at the last
        step, so the run's summary is in the UI and not only in ``final_metrics.json``.
        A run resumed after its end that logged nothing keeps the final metrics it recorded then."""
        kept = None if self.logged else recorded_final(self.run_dir)
        if kept is not None:
            self.kept_final = True
            self.message("nothing left to train (it had reached its end; raise its length to continue): "
                         "its recorded final metrics and config are kept")
            return kept
        final = numbers(final, f"{self.run.wl.name}: what its train_fn returned")
        new = {k: v for k, v in final.items() if self.last_metrics.get(k) != v}
        if new and self.is_main:
            self.run.logger.log_metrics(new, self.last_step)
        return {**self.last_metrics, **final}

    def message(self, text: str) -> None:
        """A line for the user's console (rank 0 only): resumes, compile times, notable events."""
        if self.is_main:
            self.sink.message(f"[{self.run.wl.name}] {text}")

    def checkpoint(self, state: dict, step: int) -> None:
        if not isinstance(state, Mapping):
            from raysys.config import ConfigError

            raise ConfigError(f"{self.run.wl.name}: session.checkpoint: the state is a {type(state).__name__}; "
                              "it must be a dict (name -> array or number)")
        if self.shapes is not None:
            self.shapes[0].saw(self.shapes[1], state, step)
        if step == self.restored_step:  # nothing trained since the restore: the checkpoint there stays as it was
            return  # (a resume that changed a setting would otherwise write the old model with the new setting)
        if self.is_main:  # with the metrics logged so far: a resume after the end still has them
            self.store.save(state, step, extra_meta={"last_metrics": self.last_metrics, "last_step": self.last_step,
                                                     **self.carry})

    def restore(self) -> Optional[dict]:
        """The latest checkpoint's state, or None for a fresh run. The first restore of a run is its
        resume: recorded in ``events.log``, as the shared loop records a task's."""
        latest = self.store.latest()
        if latest is None:
            return None
        state, meta = self.store.load(latest)
        if not self.logged:
            self.last_metrics = dict(meta.get("last_metrics") or {})
            self.last_step = int(meta.get("last_step") or meta.get("step") or 0)
        if self.is_main and not self.resumed:
            record_event(self.run_dir, f"resumed step={meta.get('step')} from={latest.name}")
        self.resumed = True
        self.restored_step, self.restored_meta = meta.get("step"), meta
        return state

    def artifact_text(self, text: str, name: str) -> None:
        if not self.is_main:
            return
        storage.write_text(self.run_dir / name, text)
        self.run.logger.log_text(text, name)


def run_custom(wl, cfg: Any, parent_run_id: Optional[str] = None, tags: Optional[dict] = None, report=None) -> RunResult:
    if cfg.launch.workers > 0:
        from raysys.train.custom import distributed_kind, run_distributed

        if distributed_kind(wl) is None:
            from raysys.config import ConfigError

            if wl.config("default").launch.workers == 0:  # its config says so: the workers were asked for
                raise ConfigError(f"{wl.name} trains in this process (it has no multi-worker launcher): "
                                  f"launch.workers={cfg.launch.workers} cannot be; pass --workers 0 or leave it out")
            raise ConfigError(f"{wl.name} has no multi-worker launcher, and launch.workers is {cfg.launch.workers} "
                              "(LaunchConfig's default is 1): pass --workers 0, or give its config "
                              "launch: LaunchConfig = field(default_factory=lambda: LaunchConfig(workers=0))")

        return run_distributed(wl, cfg, parent_run_id, tags)
    prepare = wl.extra.get("prepare")
    run = open_run(wl, cfg, prepare, parent_run_id, tags)
    if wl.extra.get("needs_ray", False):
        init_ray(run.cfg.launch.address)
    set_threads(run.cfg.launch)
    session = Session(run, report=report)
    with run.tracked() as outcome, console.live(remote=False):  # the progress bar ends before the summary
        returned = wl.train_fn(run.cfg, session)
        if not session.saw_stop:  # it trained to its end without asking should_stop() after a signal
            reached_end()
        final = session.finish(returned if returned is not None else {})
        _judge(outcome, final, session)
        outcome.trained_nothing = session.kept_final
    return _result(run, final, session, outcome.failure)


def _say_alike(wl, cfgs: list, finals: list, lead: "Session", pbt: bool) -> str:
    """One note where members whose knobs differ ended with the very same metrics: a sign that the program
    gives every member one of those values (the lead's), which nothing else would show (a sweep then ranks
    configurations that never trained). Returned too ('' for none): a sweep says it on its own console."""
    from raysys.config import flatten, to_dict

    if pbt:  # exploit copies one member's state into another: alike ends are PBT's doing
        return ""
    knobs = [{k: v for k, v in flatten(to_dict(c)).items() if k in wl.population.member_knobs} for c in cfgs]
    first: dict[tuple, int] = {}  # each ending (metrics but speed) -> the first member that ended so
    for i, f in enumerate(finals):
        ending = tuple(sorted((m, x) for m, x in f.items() if not m.startswith("perf/")))
        j = first.setdefault(ending, i) if ending else i
        if knobs[j] != knobs[i]:
            differ = ", ".join(k for k in knobs[i] if knobs[i][k] != knobs[j].get(k))
            note = (f"two members that differ in {differ} ended with the very same metrics; does its "
                    "Population.train_fn give each member its own value of it?")
            lead.message(f"note: {note}")
            return f"{wl.name}: {note}"
    return ""


def _per_member(wl, outs: Any, n: int) -> list:
    """What a population's ``train_fn`` returned, one result per member: None is no results (as a lone
    ``train_fn``'s), anything else not a list of ``n`` is its mistake, said in one line (zip cut the last
    members off, and a sweep read them as interrupted: it could never finish)."""
    from raysys.config import ConfigError

    if outs is None:
        return [None] * n
    if not isinstance(outs, (list, tuple)) or len(outs) != n:
        got = type(outs).__name__ + (f" of {len(outs)}" if hasattr(outs, "__len__") else "")
        raise ConfigError(f"{wl.name}: its Population.train_fn returned a {got}, not a list of {n} results (a dict "
                          "of final metrics, or None, for each member, in the order of its cfgs)")
    return list(outs)


def numbers(metrics: Any, what: str) -> dict[str, float]:
    """Metrics as Python floats: ints, floats, bools and the one-element numbers of numpy, JAX and torch
    (a loop's ``np.float32`` loss, a 0-d ``jax.Array``) are taken; anything else is the workload's mistake,
    said in one line naming the key."""
    from raysys.config import ConfigError

    if not isinstance(metrics, Mapping):
        raise ConfigError(f"{what}: a {type(metrics).__name__}; it must be a dict of metric name -> number")
    out = {}
    for k, v in metrics.items():
        x = v
        if hasattr(x, "item") and not isinstance(x, (str, bytes)):
            try:
                x = x.item()  # numpy/JAX/torch: a scalar or a one-element array; more elements raise
            except (TypeError, ValueError, RuntimeError):
                pass
        if not isinstance(x, (int, float)):
            shape = getattr(v, "shape", None)
            kind = f"{type(v).__name__} of shape {tuple(shape)}" if shape is not None else type(v).__name__
            raise ConfigError(f"{what}: metric {k!r} is a {kind} ({str(v)[:40]!r}), not a number")
        out[str(k)] = float(x)
    return out


def _judge(outcome, final: dict, session: Session) -> None:
    """Diverged, or without the quality its workload declares: FAILED (``_Outcome.check``). raysys's default
    ``eval/quality`` binds no one outside a sweep; inside one (``report``) the trial's own tracker marks the
    run unstable instead, against the space's objectives."""
    metric = session.run.wl.quality_metric
    declared = not isinstance(metric, _FromTask) and session._report is None
    outcome.check(final, quality=metric if declared else None)


def _result(run: OpenRun, final: dict, session: Session, failure: str = "") -> RunResult:
    """A closed run's result; its final metrics are written unless it was stopped (then it resumes) or
    it kept those it recorded before."""
    if stop_requested() is None and not session.kept_final:
        record_final(session.store, final)
    return RunResult(run.name, run.run_dir, run.run_id, run.tracking_uri, final, stopped_by=stop_requested(),
                     resume_command=run.resume_command(), failure=failure)


def run_population(wl, cfgs: list, parent_run_id: Optional[str] = None, tags: Optional[list] = None,
                   reports: Optional[list] = None, pbt: Any = None) -> list[RunResult]:
    """K configurations of ``wl`` as one program (``wl.population``): each opens its own run (folder,
    config snapshot, checkpoints, MLflow run), exactly as ``run_custom`` would open it alone. ``pbt``
    (a :class:`raysys.train.pbt.PBTConfig`): the members' sessions carry its rounds for the program."""
    from contextlib import ExitStack

    from raysys.train.population import SameShapes

    if len({wl.population.program_key(cfg) for cfg in cfgs}) > 1:
        from raysys.config import ConfigError

        raise ConfigError(f"{wl.name}: these configurations differ in more than {', '.join(wl.population.member_knobs)} "
                          "and cannot train as one program")
    tags, reports = tags or [None] * len(cfgs), reports or [None] * len(cfgs)
    prepare = wl.extra.get("prepare")
    runs = [open_run(wl, cfg, prepare, parent_run_id, t) for cfg, t in zip(cfgs, tags)]
    set_threads(runs[0].cfg.launch)
    sessions = [Session(run, report=r) for run, r in zip(runs, reports)]
    shapes = SameShapes([run.cfg for run in runs], wl.population.member_knobs)
    for i, s in enumerate(sessions):
        s.shapes = (shapes, i)
    if pbt is not None:
        from raysys.train.pbt import Exploit

        Exploit(pbt, sessions, [run.name for run in runs])  # each session's .pbt
    with ExitStack() as stack:
        outcomes = [stack.enter_context(run.tracked()) for run in runs]
        stack.enter_context(console.live(remote=False))  # the progress bar ends before the summary
        stack.enter_context(shapes.active())  # the carriers' shape check names the knob
        outs = wl.population.train_fn(shapes.cfgs, sessions)
        if pbt is not None and sessions[0].pbt.chunks == 0 and any(s.logged for s in sessions):
            sessions[0].message(f"{wl.name}: its train_population never called pbt.after_chunk, so no PBT round ran "
                                "(docs/your-workload.md: the three calls)")
        finals = [s.finish(out or {}) for s, out in zip(sessions, _per_member(wl, outs, len(sessions)))]
        alike = _say_alike(wl, shapes.cfgs, finals, sessions[0], pbt is not None)
        for outcome, final, s in zip(outcomes, finals, sessions):
            _judge(outcome, final, s)
            outcome.trained_nothing = s.kept_final
    return [dataclasses.replace(_result(run, final, s, o.failure), note=alike)
            for run, final, s, o in zip(runs, finals, sessions, outcomes)]
