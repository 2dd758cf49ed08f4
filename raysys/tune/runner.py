"""Drive a sweep: validate, size it to the cluster, run Tune with Optuna, resume, summarise.

Searcher: ``OptunaSearch`` with both objectives on the searcher (``metric=[...]``, ``mode=[...]``,
multi-objective TPE). Scheduler: Tune's default FIFO; the only early stop is
:class:`StabilityStopper`, which ends trials the stability rules call unstable. No ASHA: it would
stop trials on one metric and hand Optuna their truncated values as if complete, which biases the
Pareto front (see docs/tune.md). ``--scheduler pbt`` runs population-based training inside each
vectorized program instead (raysys.train.pbt), where every member runs at the same speed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from raysys import console, lifecycle, storage, tracking
from raysys import workload as registry
from raysys.config import ConfigError, to_dict
from raysys.train.launcher import say_if_in_ray_package, storage_root
from raysys.train.pbt import EXPLOITS
from raysys.train.runtime import check_ray_address, joins_cluster
from raysys.tune import objectives as obj
from raysys.tune import space as spaces
from raysys.tune.pareto import ERROR, INCOMPLETE, OK, UNSTABLE, TrialRecord
from raysys.tune.resources import footprint, max_concurrent, trial_resources
from raysys.tune.trial import error_summary, report_times, run_seconds

STATE_FILE = "raysys_sweep.json"
_LOCKED: set[Path] = set()  # the sweep folders this process holds while run_sweep runs
_WATCHING: list = []  # their raysys.watcher, told "done" when run_sweep returns
SAVED: dict = {}
"""The folder of this process's sweep once its state file is written (a Ctrl-C before: nothing to resume)."""


DEFAULT_SAMPLES = 8


@dataclass
class SweepOptions:
    space: str
    num_samples: Optional[int] = None
    """None: 8 for a new sweep, the stored count for a resumed one."""
    max_concurrent: Optional[int] = None
    budget_minutes: Optional[float] = None
    address: Optional[str] = None
    tracking_uri: Optional[str] = None
    resume: bool = False
    name: Optional[str] = None
    storage_path: str = "raysys_runs/sweeps"
    tolerance: Optional[float] = None
    seed: int = 0
    preset: Optional[str] = None
    sets: dict[str, str] = field(default_factory=dict)
    command: str = ""
    """The command line that started the sweep (recorded on its MLflow parent run)."""
    vectorize: int = 1
    """Configurations per trial, trained as one program (raysys.tune.population); 1: one per trial."""
    max_failures: int = 2
    """Restarts of a failed trial (Tune's FailureConfig); each continues from its run's last checkpoint."""
    scheduler: str = "fifo"
    """'fifo' (every trial to its end), or 'pbt': population-based training inside each vectorized program."""
    pbt_interval: int = 4
    """PBT: chunks (member reports) between two rounds."""
    pbt_quantile: float = 0.25
    """PBT: the share of a program's members that exploits, and that is exploited."""
    reuse_processes: bool = True
    """A finished trial's process takes the next trial of the same resources (Tune's ``reuse_actors``):
    its imports, MLflow client and warm caches stay, which took 35% off a sweep of short JAX trials.
    False: every trial in a fresh process."""


@dataclass
class SweepOutcome:
    name: str
    sweep_dir: Path
    parent_run_id: str
    records: list[TrialRecord]
    recommended: Optional[TrialRecord]
    interrupted: bool
    signum: int = signal.SIGINT
    """The signal that interrupted it (SIGINT, SIGTERM or SIGHUP): the exit code is 128 + signum."""


# ---- sweep folder and MLflow parent ------------------------------------------------------------

def resolve_sweep_dir(opts: SweepOptions, workload: str) -> tuple[str, Path]:
    if opts.name:  # a name, not a path; its trials' runs are named <name>-<8-character trial id>
        lifecycle.validate_name(opts.name, "--name")
        if len(opts.name) > 119:
            raise ConfigError(f"--name {opts.name[:20]}...: a sweep name has at most 119 characters (its trials' "
                              "run names add 9)")
    if storage.is_remote(opts.storage_path):
        return _resolve_remote(opts, workload)
    root = storage_root(opts.storage_path)  # a file:// URI is a local folder
    storage.check_local_folder(root, "--storage-path")
    name = opts.name
    if opts.resume and not name:  # newest sweep of this workload
        found = sorted((p for p in root.glob(f"{workload}-sweep-*") if (p / STATE_FILE).is_file()),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(f"--resume: no earlier {workload} sweep named by default ({workload}-sweep-<date>-<time>) "
                              f"under {root}; continue a sweep of another name with --name")
        name = found[-1].name
    name = name or f"{workload}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir = root / name
    if opts.resume and not (sweep_dir / STATE_FILE).is_file():
        raise ConfigError(f"--resume: no sweep called '{name}' under {root}" + (
            f" ({sweep_dir} exists, without its {STATE_FILE}: not a sweep's folder, or its state was lost)"
            if sweep_dir.is_dir() and any(sweep_dir.iterdir()) else ""))
    if not opts.resume and sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise ConfigError(f"a sweep called '{name}' already exists at {sweep_dir}; pass --resume to continue it "
                          "or choose another --name (nothing was changed)")
    return name, sweep_dir


def _resolve_remote(opts: SweepOptions, workload: str) -> tuple[str, Path]:
    """A sweep on remote storage: a working copy here, its state file pulled when resuming."""
    remote = storage.Remote(opts.storage_path)
    remote.check()
    name = opts.name
    if opts.resume and not name:  # <workload>-sweep-<time> names sort by time
        found = [n for n in remote.listdir() if n.startswith(f"{workload}-sweep-") and remote.kind(n, STATE_FILE)]
        if not found:
            raise ConfigError(f"--resume: no earlier {workload} sweep named by default ({workload}-sweep-<date>-<time>) "
                              f"under {remote.display}; continue a sweep of another name with --name")
        name = found[-1]
    name = name or f"{workload}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_dir = storage.working_copy(remote, name)
    if opts.resume and not storage.pull(sweep_dir / STATE_FILE):
        raise ConfigError(f"--resume: no sweep called '{name}' under {remote.display}" + (
            f" ({remote.display}/{name} exists, without its {STATE_FILE}: not a sweep's folder, or its state was lost)"
            if remote.listdir(name) else ""))
    if not opts.resume and remote.listdir(name):
        raise ConfigError(f"a sweep called '{name}' already exists at {remote.display}/{name}; pass --resume to "
                          "continue it or choose another --name (nothing was changed)")
    return name, sweep_dir


def _lost_not_failed(tuner: Any) -> tuple[int, int]:
    """The trials of a restored sweep that Tune ended as failed for no error of theirs, which a --resume gives
    back: (those whose tracking server did not answer for the whole wait, ``tracking.TrackingOutageError``;
    those whose process or node Ray lost once their restarts were spent, ``trial.lost_to_ray``)."""
    try:
        grid = tuner.get_results()
    except Exception:  # nothing recorded yet
        return 0, 0
    from raysys.tune.trial import lost_to_ray, tracking_outage

    errors = [r.error for r in grid if r.error is not None]
    outage = sum(1 for e in errors if tracking_outage(e))
    return outage, sum(1 for e in errors if not tracking_outage(e) and lost_to_ray(e))


def _tune_storage(opts: SweepOptions, sweep_dir: Path) -> tuple[str, dict]:
    """Where Tune keeps its experiment state: (the sweep's path for restore, RunConfig/restore kwargs)."""
    owner = storage.remote_of(sweep_dir)
    if owner is None:  # each file whole or not at all (a full disk must not cut the last good state)
        from raysys.tune.whole_files import whole_files_fs

        return str(sweep_dir), {"storage_path": str(sweep_dir.parent), "storage_filesystem": whole_files_fs()}
    remote, name = owner
    return remote.path(name), {"storage_path": remote.base, "storage_filesystem": remote.fs}


def _stored_state(sweep_dir: Path) -> dict:
    """The sweep's own record (space, store, trials), which a --resume continues; damaged, one line."""
    path = sweep_dir / STATE_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        stored, why = None, str(e).splitlines()[0][:120]
    else:
        why = "not a sweep's record"
    if not isinstance(stored, dict) or "space" not in stored:
        raise ConfigError(f"--resume: {path} cannot be read ({why}); the sweep cannot be continued: start a new "
                          "one (another --name), its trials' run folders are kept")
    return stored


def _lock_sweep(sweep_dir: Path, name: str) -> None:
    """One process at a time drives a sweep: a second --resume of it (another terminal, a retry script) would
    train its trials twice and record one as failed."""
    lifecycle.RunLock.acquire(sweep_dir, name, what="sweep")
    _LOCKED.add(sweep_dir)


def _claim_sweep(opts: SweepOptions, workload: str, name: str, sweep_dir: Path, stored) -> tuple[str, Path]:
    """Make and lock the sweep's folder, under the next free name where its name is a default one
    (``lifecycle.claim_first``)."""
    import dataclasses

    def claim(candidate: str) -> tuple[str, Path]:
        got = (name, sweep_dir) if candidate == name else resolve_sweep_dir(dataclasses.replace(opts, name=candidate), workload)
        got[1].mkdir(parents=True, exist_ok=True)
        _lock_sweep(got[1], got[0])  # the other sweep holds it while it runs
        return got

    return lifecycle.claim_first(name, opts.name is not None or bool(stored), claim)


def _check_tune_state(sweep_dir: Path) -> None:
    """Ray Tune restores a sweep from its newest ``experiment_state-*.json``; one it cannot read (damaged by
    hand, or cut by an older raysys on a full disk) made it log an error and start the sweep afresh. One
    line instead, with how to resume from the state of the session before."""
    import shlex

    states = sorted(sweep_dir.glob("experiment_state-*.json"))
    if not states:
        return
    try:
        json.loads(states[-1].read_text())
    except (OSError, ValueError) as e:
        how = (f"to resume from the state before it ({states[-2].name}), move it aside: mv {shlex.quote(str(states[-1]))} "
               f"{shlex.quote(str(states[-1]) + '.damaged')}" if len(states) > 1 else "start a new sweep (another --name)")
        raise ConfigError(f"--resume: Ray Tune's saved state of this sweep, {states[-1]}, cannot be read "
                          f"({str(e).splitlines()[0][:120]}); {how}") from None


def _check_same_space(stored: dict, sp: spaces.SweepSpace, path: Path) -> None:
    from raysys.config import flatten

    now = flatten(json.loads(json.dumps(sp.to_dict(), default=str)))
    before = flatten(stored["space"])
    diff = [f"{k}: {before[k]!r} -> {now[k]!r}" if k in before and k in now else
            f"{k}: {'added' if k in now else 'removed'}" for k in sorted(set(now) | set(before))
            if str(now.get(k)) != str(before.get(k)) or (k in now) != (k in before)]  # a --set's '2' is the YAML's 2
    if diff:
        raise ConfigError(f"--resume: the space differs from the one this sweep started with ({path}): "
                          f"{'; '.join(diff)}. Resume with the same space file and --preset/--set, or start a new --name")


SWEEP_WIND_DOWN_S = 120.0
"""How long a sweep's signal waits for its trials to stop at a step boundary before Tune ends them."""


def _wind_down_then(stop_actor, then, signame: str) -> None:
    """Ask the trials to stop at their step boundary (``trial.SweepStop``), and call ``then`` (Tune's own
    stop) once none is training, or after SWEEP_WIND_DOWN_S; in a thread, so Tune goes on taking the
    trials' last reports meanwhile (a trial waits on its report)."""
    import ray

    def run() -> None:
        print(f"[raysys.tune] {signame}: the running trials stop at their next step with a checkpoint, then the "
              "sweep stops (send it again to stop at once)", flush=True)
        try:
            ray.get(stop_actor.ask.remote(), timeout=10)
            deadline = time.monotonic() + SWEEP_WIND_DOWN_S
            while time.monotonic() < deadline and ray.get(stop_actor.state.remote(), timeout=10)[1]:
                time.sleep(0.5)
        except Exception:  # Ray going away: Tune's stop is all there is
            pass
        then()

    threading.Thread(target=run, daemon=True, name="raysys-sweep-wind-down").start()


@contextlib.contextmanager
def _signals_stop_like_ctrl_c(stop_actor=None):
    """Tune ends a sweep cleanly on SIGINT or SIGUSR1 (trials stopped, its state saved for --resume) but
    dies at once on SIGTERM, the signal a scheduler or ``timeout`` sends, and on SIGHUP, a terminal that
    closed; and after one SIGINT it puts back the handler it found, so the echo of one signal sent to the
    process and then its group (``timeout``, Slurm) would stop it at once, mid-save. Around ``fit``,
    every ``lifecycle.STOP_SIGNALS`` (SIGUSR1 included) first lets the trials stop at a step boundary and
    then takes Tune's own SIGUSR1 path; an echo is ignored, and a signal sent again stops at once. The
    dict it yields records which signal came."""
    got: dict = {}
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    tune_stop: dict = {}  # Tune's SIGUSR1 handler, installed by fit: its clean stop

    def on_signal(signum, frame):
        if signum == signal.SIGUSR1 and got.pop("relay", False):  # the wind-down below, done: Tune stops now
            tune_stop["handler"](signal.SIGUSR1, frame)
            return
        if signum == signal.SIGHUP:  # a terminal that closed: nothing may write to it any more
            console.drop_lost_outputs()
        if "signum" in got:
            if got["signum"] == signum and time.monotonic() - got["at"] < lifecycle.ECHO_S:
                return
            raise KeyboardInterrupt
        got["signum"], got["at"] = signum, time.monotonic()
        if not callable(tune_stop.get("handler")):  # fit has not started (or Ray's internals changed)
            raise KeyboardInterrupt
        if stop_actor is None:
            tune_stop["handler"](signal.SIGUSR1, frame)
            return

        def relay() -> None:  # Tune's handler must run in the main thread: through a signal to ourselves
            got["relay"] = True
            os.kill(os.getpid(), signal.SIGUSR1)

        _wind_down_then(stop_actor, relay, signal.Signals(signum).name)  # once the trials have stopped

    # fit installs Tune's SIGUSR1 handler just before it starts the trials: take it over there, so a batch
    # system's SIGUSR1 warning stops the sweep as SIGTERM does (trials at a step boundary, exit 138)
    import ray.tune.tune as tune_run

    tune_setup = getattr(tune_run, "_setup_signal_catching", None)

    def setup_signal_catching(*a, **kw):
        interrupted = tune_setup(*a, **kw)
        if signal.getsignal(signal.SIGUSR1) is not on_signal:
            tune_stop["handler"] = signal.signal(signal.SIGUSR1, on_signal)
        return interrupted

    previous = {s: signal.signal(s, on_signal) for s in lifecycle.stop_signals()}
    if tune_setup is not None:
        tune_run._setup_signal_catching = setup_signal_catching
    else:  # a Ray without that hook: SIGUSR1 stays Tune's own stop
        signal.signal(signal.SIGUSR1, previous.pop(signal.SIGUSR1))
    tune_sigint = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # SIGINT stays with on_signal
    try:
        yield got
    finally:
        if tune_setup is not None:
            tune_run._setup_signal_catching = tune_setup
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        if tune_sigint is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = tune_sigint


def _dashboard(address: Optional[str]) -> Optional[str]:
    """The dashboard of the cluster this sweep joined, as Ray reported it (None: a Ray of this process)."""
    from raysys.train.runtime import joins_cluster

    try:
        import ray

        return ray._private.worker.get_dashboard_url() or None if joins_cluster(address) and ray.is_initialized() else None
    except Exception:  # Ray's private helper moved: the address's head and Ray's default port
        return None


def _init_ray(address: Optional[str]) -> None:
    import ray

    # Shorter Train V2 teardown (its 5 s preemption-watcher poll dominates short trials); trial
    # processes inherit these from the driver.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Trials stay in the driver's working directory: relative paths mean the same to all of them.
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    # Tune's own loggers are _result_loggers' (a restored sweep's too): no TensorBoard logger
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    if ray.is_initialized():
        return
    from raysys.train.runtime import held_stderr, join_refused, joins_cluster, one_line_cluster_errors

    # Trial output goes to per-trial logs and our progress lines; the driver stays readable.
    env = registry.runtime_env()  # a plug-in from a local file travels to every trial's node
    if joins_cluster(address):
        try:
            # Ray's INFO lines ("Connecting to existing Ray cluster...") on a quiet console: -v shows them
            with held_stderr():
                ray.init(address=address, log_to_driver=False, runtime_env=env,
                         logging_level=logging.INFO if console.verbose() else logging.WARNING)
        except Exception as e:  # it listens, but will not have us: one line, before the sweep's folder exists
            ray.shutdown()
            raise ConfigError(join_refused(address or os.environ["RAY_ADDRESS"], e)) from None
    else:
        from raysys.train.runtime import ray_services_in_own_session

        with ray_services_in_own_session():  # a SIGTERM to the whole group reaches the driver only
            # "local": never a cluster a `ray start` left on this machine (ray.init's default joins it)
            ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env=env)
    one_line_cluster_errors()


def _prepare(wl: registry.Workload, cfg: Any) -> Any:
    """Make or check the data once, on the driver, before trials start (and race to write it); a data
    problem is one line (DataError), as ``raysys train`` says it."""
    from raysys.train import launcher

    with registry.sweep_driver():  # the trials check their own devices, on their nodes
        return launcher._prepare(launcher.prepare_of(wl), cfg)


def _say_unread_knobs(wl: registry.Workload, base: Any, knobs: dict) -> None:
    """A note when the space searches an ``optim`` knob that the task's own optimizer or scheduler never reads."""
    from raysys.train import code_checks
    from raysys.train.optim import hooks_used

    if wl.task is None or not hooks_used(wl.task) or not any(k.startswith("optim.") for k in knobs):
        return
    model = code_checks.built(wl.task, wl.name, base, say=False)
    if model is not None:
        code_checks.say_unread_optim(wl.task, base, model, wl.name, knobs=set(knobs), prefix="[raysys.tune]")


def _check_local_cluster(sp: spaces.SweepSpace, opts: SweepOptions) -> None:
    """A Ray started here has this machine's CPUs and GPUs: a trial that cannot fit them is said before the
    data or the tracking store are made (a cluster's resources are known once Ray is up)."""
    import sys

    if opts.address or os.environ.get("RAY_ADDRESS") or ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        return
    from raysys.train.runtime import local_gpus

    need_cpu, need_gpu = footprint(sp, sp.base_config())
    gpus = local_gpus() if need_gpu > 0 else 0
    max_concurrent({"CPU": os.cpu_count() or 1, "GPU": gpus}, need_cpu, need_gpu, 1)


def _result_loggers() -> list:
    """Tune's CSV and JSON results per trial (the ResultGrid reads them back), without its TensorBoard
    files: MLflow keeps every curve, and tensorboardX imports torch (1.3 s) in the driver."""
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    return [CSVLoggerCallback(), JsonLoggerCallback()]


# ---- the sweep ---------------------------------------------------------------------------------

def run_sweep(opts: SweepOptions) -> SweepOutcome:
    """Run (or ``--resume``) one sweep; its folder is locked while it runs (``_lock_sweep``)."""
    SAVED.clear()
    try:
        return _run_sweep(opts)
    except KeyboardInterrupt:  # a stop before Tune's fit took the signals over (the sweep's first seconds), or
        # a signal sent again: the parent is closed KILLED with how to go on (the watcher is told done below;
        # it stayed RUNNING for good)
        opened = SAVED.get("parent")
        if opened is not None:
            uri, run_id, line = opened
            how = "stopped at once" if SAVED.get("fitting") else "stopped before its trials started"
            with contextlib.suppress(Exception):
                tracking.MLflowLogger(uri, run_id).set_tags({"raysys.error": f"{how}; continue it with: {line}"[:5000]})
                tracking.end_run(uri, run_id, "KILLED")
            with contextlib.suppress(Exception):
                from raysys.tune.report import close_running_children

                close_running_children(uri, run_id)
        raise
    finally:
        while _LOCKED:
            lifecycle.RunLock.release_dir(_LOCKED.pop())
        while _WATCHING:
            watcher = _WATCHING.pop()
            if watcher is not None:
                watcher.done()


def _run_sweep(opts: SweepOptions) -> SweepOutcome:
    from ray import tune

    from raysys.tune import report
    from raysys.tune.population import run_population_trial
    from raysys.tune.progress import (MISSING_OBJECTIVE, OBJECTIVES_DIR, SESSION_BUDGET, ObjectiveLog, Progress,
                                      StabilityStopper, objective_never_reported)
    from raysys.tune.trial import SweepStop, TrialSetup, run_trial
    from raysys.tune.trial import trainable as winds_down

    sp = spaces.load(opts.space, preset=opts.preset, overrides=opts.sets)
    wl = registry.get(sp.workload)
    registry.check_sets(wl, opts.sets)
    if opts.vectorize > 1 and wl.population is None:
        raise ConfigError(f"--vectorize {opts.vectorize}: {wl.name} has no population program (Workload.population); "
                          "run it without --vectorize")
    if opts.vectorize > 1 and (sp.base_config().launch.workers > 0 or "launch.workers" in sp.knobs):
        raise ConfigError(f"--vectorize {opts.vectorize} trains each program in its trial's own process: "
                          "fix launch.workers to 0 in the space")
    pbt = _pbt_settings(opts, sp, wl)
    check_ray_address(opts.address)
    if joins_cluster(opts.address):  # a cluster that will not have us: one line before the store or the data exist
        _init_ray(opts.address)
    name, sweep_dir = resolve_sweep_dir(opts, wl.name)
    stored = _stored_state(sweep_dir) if opts.resume else None
    if stored:
        _lock_sweep(sweep_dir, name)  # before anything of it changes
        _check_same_space(stored, sp, sweep_dir)
        if storage.remote_of(sweep_dir) is None:
            _check_tune_state(sweep_dir)
        if int(stored.get("vectorize", 1)) != opts.vectorize:
            raise ConfigError(f"--resume: this sweep ran with --vectorize {stored.get('vectorize', 1)}; resume it with the same")
        _check_same_pbt(stored.get("pbt"), pbt)
        if opts.tracking_uri and tracking.resolve_tracking_uri(opts.tracking_uri) != stored["tracking_uri"]:
            raise ConfigError(f"--resume: this sweep tracks to {stored['tracking_uri']}, not {opts.tracking_uri}")
        if opts.num_samples is not None and opts.num_samples != int(stored["num_samples"]):
            raise ConfigError(f"--resume: this sweep has {stored['num_samples']} trials (Tune keeps a restored "
                              "sweep's count); resume it without --num-samples, or start a new sweep")
    opts.num_samples = int(stored["num_samples"]) if stored else opts.num_samples or DEFAULT_SAMPLES
    if stored and opts.max_concurrent is None:  # the restored Tuner keeps the limit it started with
        opts.max_concurrent = stored.get("max_concurrent")
    uri = stored["tracking_uri"] if stored else tracking.resolve_tracking_uri(opts.tracking_uri)
    tracking.check_store(uri)
    tracking.check_experiment(uri, (stored or {}).get("experiment") or sp.base_config().launch.experiment
                              or f"raysys-{wl.name}", "launch.experiment in the space's fixed:")
    _check_local_cluster(sp, opts)
    if stored and storage.is_remote(opts.storage_path):  # a Ctrl-C kills trials without their leases' release
        storage.settle_leases(storage.Remote(storage.join(opts.storage_path, name, "runs")), "[raysys.tune] --resume")
    tolerance = opts.tolerance if opts.tolerance is not None else float(sp.objectives.get("tolerance", obj.DEFAULT_TOLERANCE))
    throughput_metric = sp.objectives.get("throughput", wl.throughput_metric)
    quality_metric = str(sp.objectives.get("quality", wl.quality_metric))

    base = _prepare(wl, sp.base_config())
    _say_unread_knobs(wl, base, sp.knobs)
    experiment = base.launch.experiment or f"raysys-{wl.name}"
    opening = tracking.open_in_background(uri)  # the store's set-up overlaps Ray's start
    try:
        _init_ray(opts.address)
    finally:
        opening.join()  # never leave a fresh store's schema half made
    import ray

    need_cpu, need_gpu = footprint(sp, base)
    concurrent = max_concurrent(ray.cluster_resources(), need_cpu, need_gpu, opts.max_concurrent)

    name, sweep_dir = _claim_sweep(opts, wl.name, name, sweep_dir, stored)
    try:
        parent, parent_log = _parent_run(uri, experiment, name, wl.name, stored,
                                         {"raysys.preset": sp.preset, "raysys.command": opts.command[:5000]})
    except ConfigError:  # a store that refused the sweep's run: its folder, only just made, holds nothing
        if not stored:
            lifecycle.RunLock.release_dir(sweep_dir)
            _LOCKED.discard(sweep_dir)
            shutil.rmtree(sweep_dir, ignore_errors=True)
        raise
    from raysys import watcher as watching

    held = lifecycle.RunLock.of(sweep_dir)  # a killed driver's parent and trials are closed KILLED (raysys.watcher)
    _WATCHING.append(watching.watch(uri, parent, None, held.path if held else None,
                                    _resume_line(opts, sp, name, sweep_dir)))
    SAVED["parent"] = (uri, parent, _resume_line(opts, sp, name, sweep_dir))
    parent_log.log_params({"sweep.workload": wl.name, "sweep.preset": sp.preset, "sweep.space_file": sp.source,
                           "sweep.num_samples": opts.num_samples, "sweep.max_concurrent": concurrent,
                           "sweep.tolerance": tolerance, "sweep.throughput_metric": throughput_metric,
                           "sweep.quality_metric": quality_metric,
                           "sweep.quality_mode": sp.quality_mode, "sweep.seed": opts.seed,
                           **({"sweep.scheduler": "pbt", "sweep.pbt_interval": pbt["interval"],
                               "sweep.pbt_quantile": pbt["quantile"], "sweep.pbt_metric": pbt["metric"]} if pbt else {}),
                           **{f"space.{k}": d.describe() for k, d in sp.knobs.items()},
                           **{f"fixed.{k}": v for k, v in sp.fixed.items()}})
    if not stored:
        storage.write_text(sweep_dir / STATE_FILE, json.dumps({
            "space": sp.to_dict(), "space_file": sp.source, "tracking_uri": uri, "experiment": experiment,
            "parent_run_id": parent, "num_samples": opts.num_samples, "tolerance": tolerance,
            "vectorize": opts.vectorize, "max_concurrent": opts.max_concurrent, "pbt": pbt}, indent=1, default=str))
    SAVED["sweep_dir"] = sweep_dir  # from here on, --resume continues it

    remote = storage.remote_of(sweep_dir)
    runs_storage = report.runs_storage(sweep_dir)
    # The recommended command keeps its run where the sweep's runs were
    flags = (("--storage-path", opts.storage_path) if remote else ()) + \
        (("--tracking-uri", uri) if uri != tracking.resolve_tracking_uri(None) else ())
    # the sweep's signal reaches its trials' training first (trial.SweepStop)
    stop_name = f"raysys-sweep-stop-{uuid.uuid4().hex[:12]}"
    stop_actor = ray.remote(num_cpus=0)(SweepStop).options(name=stop_name).remote()
    setup = TrialSetup(workload=registry.ref(wl), base_config=to_dict(base), sweep_name=name, sweep_dir=str(sweep_dir),
                       stop_actor=stop_name,
                       runs_storage=runs_storage, sweep_storage=opts.storage_path if remote else "", train_flags=flags,
                       tracking_uri=uri, experiment=experiment, parent_run_id=parent,
                       throughput_metric=throughput_metric, quality_metric=quality_metric,
                       stability=sp.stability, quality_penalty=_penalty(sp), quality_mode=sp.quality_mode,
                       preset=sp.preset, fixed=tuple(sp.fixed.items()), pbt=pbt)
    link = report.save_sweep_view(uri, parent, name, sorted(sp.knobs))
    say_if_in_ray_package(sweep_dir, uri, "sweep")
    launch = {k: getattr(base.launch, k) for k in ("workers", "cpus_per_worker", "gpus_per_worker")}
    fn = run_population_trial if opts.vectorize > 1 else run_trial
    trainable = tune.with_resources(winds_down(tune.with_parameters(fn, setup=setup)),
                                    functools.partial(trial_resources, launch))
    print(f"[raysys.tune] sweep '{name}': {wl.name} preset '{sp.preset}', {len(sp.knobs)} knobs, "
          f"{opts.num_samples} trial{'s' * (opts.num_samples != 1)}{f' (up to {opts.vectorize} per program)' if opts.vectorize > 1 else ''}, up to {concurrent} at once ({need_cpu:g} CPU each) -> {storage.where(sweep_dir)}\n"
          + tracking.ui_lines(uri, link, prefix="[raysys.tune]"), flush=True)
    apart = [k for k in sp.knobs if k not in wl.population.member_knobs] if opts.vectorize > 1 else []
    if apart:  # each value of these is a program of its own: K per program only where the others are alike
        packed = [k for k in sp.knobs if k in wl.population.member_knobs]
        print("[raysys.tune] note: " + (f"a program packs configurations that differ only in {', '.join(packed)}; "
                                        f"the space also searches {', '.join(apart)}, so configurations that differ "
                                        "there train as separate programs" if packed else
                                        f"{wl.name} trains no knob of this space inside one program "
                                        "(Population.member_knobs): every configuration is a program of its own"),
              flush=True)

    started = time.monotonic()
    SESSION_BUDGET["ends"] = started + 60 * opts.budget_minutes if opts.budget_minutes else None
    tune_path, tune_storage = _tune_storage(opts, sweep_dir)
    restore_fs = {k: v for k, v in tune_storage.items() if k == "storage_filesystem"}
    if opts.resume:  # the objectives every earlier session of the sweep recorded
        storage.pull_tree(sweep_dir / OBJECTIVES_DIR)
        if storage.remote_of(sweep_dir) is None:
            from raysys.tune.whole_files import remove_leftovers

            remove_leftovers(sweep_dir)
    if opts.resume and tune.Tuner.can_restore(tune_path, **restore_fs):
        print("[raysys.tune] resuming: finished trials are kept, unfinished ones continue from their checkpoints",
              flush=True)
        tuner = tune.Tuner.restore(tune_path, trainable=trainable, resume_unfinished=True, resume_errored=False,
                                   **restore_fs)
        outage, lost = _lost_not_failed(tuner)
        if outage or lost:  # no error of their code: they run again, from their checkpoints
            said = [f"{outage} failed while the MLflow server did not answer"] if outage else []
            said += [f"{lost} lost with {'their' if lost > 1 else 'its'} Ray process or node"] if lost else []
            print(f"[raysys.tune] of this sweep's trials, {' and '.join(said)}: they run again from their checkpoints "
                  "(other failed trials too: Tune resumes them all)", flush=True)
            tuner = tune.Tuner.restore(tune_path, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                       **restore_fs)
    else:
        log = ObjectiveLog(str(sweep_dir / OBJECTIVES_DIR))
        tuner = tune.Tuner(trainable, tune_config=_tune_config(sp, opts, concurrent, wl),
                           run_config=tune.RunConfig(
                               name=name, **tune_storage, verbose=0, stop=StabilityStopper(),
                               callbacks=[Progress(opts.num_samples, throughput_metric, quality_metric,
                                                   opts.max_failures, log=log), log, *_result_loggers()],
                               failure_config=tune.FailureConfig(max_failures=opts.max_failures)))
    SAVED["fitting"] = True  # from here a signal stops the trials at a step boundary (or, sent again, at once)
    starts_before = _starts(sweep_dir)
    with _signals_stop_like_ctrl_c(stop_actor) as signals, _watching_store(uri):
        grid = tuner.fit()
    try:  # Ray Tune's probe of the storage, left at the sweep's root; the sweep's files are raysys's
        storage.remove(sweep_dir / ".validate_storage_marker")
    except OSError:
        pass
    records = collect(grid, setup)
    if wl.population is not None:  # one speed per program, in both kinds of sweep (population.pool_throughput)
        from raysys.tune.population import pool_throughput

        pool_throughput(records, wl.population.member_knobs)
    # a stop signal late in the budget is an interruption, with its resume line, not the budget's end
    budget_hit = (opts.budget_minutes is not None and time.monotonic() - started >= 60 * opts.budget_minutes - 1
                  and not signals.get("signum"))
    unfinished = [r for r in records if r.status == INCOMPLETE]
    # a trial without an objective of the space stops the sweep (progress.StabilityStopper): not an interruption
    missing = not signals.get("signum") and any(MISSING_OBJECTIVE in r.reason for r in records)
    interrupted = (bool(unfinished) or len(records) < opts.num_samples) and not budget_hit and not missing
    if interrupted and opts.resume and not signals.get("signum") and _starts(sweep_dir) == starts_before:
        # Tune had nothing to run: what is unfinished was stopped by an earlier session's --budget, and Tune
        # does not start a stopped trial again. Its report as it stands, not an 'interruption' whose resume
        # line would do the same for ever
        print("[raysys.tune] note: nothing left to run: this sweep ended at an earlier session's --budget, and "
              "Tune neither starts its stopped trials again nor starts new ones; the report below is of the trials "
              "as they ended (for more, start a new sweep)", flush=True)
        interrupted = False

    storage.push_tree(sweep_dir / OBJECTIVES_DIR)
    # a stop signal is a deadline (a batch system's SIGKILL follows it within seconds): every record is on
    # disk and --resume sends it, so an outage is not waited out then
    unrecorded = interrupted and signals.get("signum") and not _answers(uri)
    if unrecorded:
        print(f"[raysys.tune] the MLflow server at {uri} does not answer: the sweep's runs stay RUNNING in MLflow, "
              "and --resume completes their records once it answers again", flush=True)
    else:
        try:
            tracking.wait_for_store(uri)  # an outage now would lose the sweep's verdict in MLflow: wait it out
        except tracking.TrackingOutageError as e:  # every trial's record is in its folder: a --resume sends them
            raise tracking.TrackingOutageError(f"{e}: the sweep's trials and records are kept in {storage.where(sweep_dir)}; "
                                     f"once it answers, finish the sweep with:\n  {_resume_line(opts, sp, name, sweep_dir)}") from None
        report.finalize_children(uri, experiment, setup, records, grid,
                                 None if interrupted else report.Verdict.of(records, tolerance),
                                 objectives_dir=str(sweep_dir / OBJECTIVES_DIR))
    if interrupted:
        if not unrecorded:
            tracking.end_run(uri, parent, status="KILLED")
        # counted as trials (a program of K members is K of them), ended or not: a vectorized program that had
        # not started is one Tune trial, which split the count oddly into 'unfinished' and 'unstarted'
        ended = len([r for r in records if r.status != INCOMPLETE])
        print(f"[raysys.tune] sweep interrupted with {ended} of its {opts.num_samples} trials ended; continue "
              f"it with:\n"
              f"  {_resume_line(opts, sp, name, sweep_dir)}", flush=True)
        return SweepOutcome(name, sweep_dir, parent, records, None, True, signals.get("signum", signal.SIGINT))
    rec = report.summarise(sp, wl, records, tolerance, throughput_metric, quality_metric, sweep_dir, parent_log,
                           budget_hit=budget_hit, launch=(flags, report.job_address(opts.address, _dashboard(opts.address))),
                           unstarted=opts.num_samples - len(records) if opts.vectorize == 1 else 0)
    storage.push_tree(sweep_dir / "report")
    parent_log.delete_tag("raysys.error")  # a killed session's (raysys.watcher): the sweep is whole now
    never = objective_never_reported(records)
    if never is not None:  # the command's config error (exit 2), not a finished sweep
        parent_log.set_tags({"raysys.error": f"no trial reported an objective of the space: {never}"[:5000]})
        tracking.end_run(uri, parent, status="FAILED")
    else:
        tracking.end_run(uri, parent, status="FINISHED")
    print(f"[raysys.tune] compare the trials in MLflow: {link}", flush=True)
    return SweepOutcome(name, sweep_dir, parent, records, rec, False)


@contextlib.contextmanager
def _watching_store(uri: str, every_s: float = 15.0):
    """While the trials run: one line when the tracking server stops answering and one when it is back. The
    trials wait for it and buffer their records, but they say so in their own logs; the console said nothing."""
    if not tracking.is_server(uri):
        yield
        return
    done = threading.Event()

    def watch() -> None:
        away = False
        while not done.wait(every_s):
            if _answers(uri) == away:
                away = not away
                print(f"[raysys.tune] the MLflow server at {uri} " + (
                    "does not answer: the trials buffer their records, and a trial that starts waits for it "
                    "($RAYSYS_TRACKING_WAIT_S)" if away else "answers again"), flush=True)

    thread = threading.Thread(target=watch, name="raysys-store-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _answers(uri: str) -> bool:
    """The tracking store answers now (no wait)."""
    try:
        tracking.check_store(uri)
    except ConfigError:
        return False
    return True


def _parent_run(uri: str, experiment: str, name: str, workload: str, stored: Optional[dict], tags: dict):
    """The sweep's MLflow parent run: created, or reopened on --resume (an interrupted sweep ended it KILLED)."""
    if stored:
        from mlflow.tracking import MlflowClient

        parent = stored["parent_run_id"]
        MlflowClient(tracking_uri=uri).update_run(parent, status="RUNNING")
    else:
        parent = tracking.start_run(uri, experiment, name, tags={"raysys.workload": workload, "raysys.kind": "sweep",
                                                                 "raysys.sweep": name, **tags}, own=True)
    return parent, tracking.MLflowLogger(uri, parent)


def _starts(sweep_dir: Path) -> int:
    """How many trial sessions <sweep>/trial_events.log records as started."""
    log = sweep_dir / "trial_events.log"
    try:
        storage.pull(log)
        return sum(ln.split(" ")[1:2] == ["start"] for ln in log.read_text().splitlines())
    except OSError:
        return 0


def _resume_line(opts: SweepOptions, sp: spaces.SweepSpace, name: str, sweep_dir: Path) -> str:
    where = opts.storage_path if storage.remote_of(sweep_dir) else sweep_dir.parent
    return (f"cd {shlex.quote(os.getcwd())} && python -m raysys.tune --space {shlex.quote(str(sp.source))} --name {name} "
            f"--storage-path {shlex.quote(str(where))} --resume" + (f" --vectorize {opts.vectorize}" if opts.vectorize > 1 else "")
            + _extra_flags(opts))


def _extra_flags(opts: SweepOptions) -> str:
    flags = f" --preset {shlex.quote(opts.preset)}" if opts.preset else ""
    if opts.scheduler == "pbt":
        flags += f" --scheduler pbt --pbt-interval {opts.pbt_interval} --pbt-quantile {opts.pbt_quantile:g}"
    return flags + "".join(f" --set {shlex.quote(f'{k}={v}')}" for k, v in opts.sets.items())


def _check_same_pbt(was: Optional[dict], now: Optional[dict]) -> None:
    """A resumed sweep keeps its scheduler: the same flags, and the same ranking and explored knobs."""
    if (was is None) != (now is None) or (was and (was["interval"], was["quantile"]) != (now["interval"], now["quantile"])):
        raise ConfigError("--resume: this sweep ran " + (f"with --scheduler pbt --pbt-interval {was['interval']} "
                          f"--pbt-quantile {was['quantile']:g}" if was else "without --scheduler pbt")
                          + "; resume it with the same")
    if was and (was["metric"], sorted(was["explore"])) != (now["metric"], sorted(now["explore"])):
        raise ConfigError(f"--resume: this sweep's PBT ranked by {was['metric']} and explored {', '.join(sorted(was['explore']))}; "
                          f"the workload's code now says {now['metric']} and {', '.join(sorted(now['explore']))}: "
                          "resume it with the code it ran with, or start a new sweep")


def _pbt_settings(opts: SweepOptions, sp: spaces.SweepSpace, wl: registry.Workload) -> Optional[dict]:
    """``--scheduler pbt``: what every program's rounds need (raysys.train.pbt.PBTConfig's fields but the
    seed), checked before anything is created; None for FIFO."""
    if opts.scheduler != "pbt":
        return None
    if opts.vectorize < 2:
        raise ConfigError("--scheduler pbt exploits and explores between the members of one program: it needs "
                          "--vectorize K with K >= 2 (K configurations per program)")
    if opts.num_samples is not None and opts.num_samples < 2:  # a program holds at most --num-samples members
        raise ConfigError(f"--scheduler pbt with --num-samples {opts.num_samples}: a program of one member has no "
                          "other to exploit; PBT needs --num-samples 2 or more")
    explorable = tuple(wl.population.explore_knobs) if wl.population is not None else ()
    if not explorable:
        raise ConfigError(f"--scheduler pbt: {wl.name}'s population program runs no PBT rounds "
                          "(Population.explore_knobs is empty; docs/your-workload.md)")
    explore = {k: d for k, d in sp.knobs.items() if k in explorable}
    if not explore:
        raise ConfigError(f"--scheduler pbt: the space searches none of the knobs PBT may perturb in {wl.name} "
                          f"({', '.join(explorable)})")
    for k, d in explore.items():
        if d.kind in ("choice", "grid") and not all(isinstance(v, (int, float)) for v in d.values):
            raise ConfigError(f"--scheduler pbt: knob {k} ({d.describe()}): PBT perturbs numbers; give it numeric values")
    if not 0 < opts.pbt_quantile <= 0.5:
        raise ConfigError(f"--pbt-quantile must be in (0, 0.5], got {opts.pbt_quantile:g}")
    metric = wl.population.rank_metric or str(sp.objectives.get("quality", wl.quality_metric))
    return {"explore": {k: {"kind": d.kind, "values": list(d.values), "low": d.low, "high": d.high}
                        for k, d in explore.items()},
            "metric": metric, "mode": "max" if wl.population.rank_metric else sp.quality_mode,
            "interval": opts.pbt_interval, "quantile": opts.pbt_quantile, "seed": opts.seed}


def _tune_config(sp: spaces.SweepSpace, opts: SweepOptions, concurrent: int, wl: registry.Workload):
    import optuna
    from ray import tune

    from raysys.tune.progress import trial_dirname
    from raysys.tune.searcher import OptunaSearch

    if not console.verbose():  # "A new study created in memory": the sweep's own lines say what runs
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    grid = sp.grid_points()
    if len(grid) > opts.num_samples:
        print(f"[raysys.tune] note: the grid knobs make {len(grid)} combinations but only {opts.num_samples} trials "
              "run; the first ones are tried", flush=True)
    searcher = OptunaSearch(space=spaces.OptunaSpace(sp.knobs), metric=[obj.THROUGHPUT, obj.QUALITY],
                            mode=["max", sp.quality_mode], points_to_evaluate=grid or None,
                            sampler=optuna.samplers.TPESampler(seed=opts.seed))
    if opts.vectorize > 1:
        from raysys.tune.population import PopulationSearcher

        searcher = PopulationSearcher(searcher, opts.vectorize, opts.num_samples, wl.population.member_knobs)
    return tune.TuneConfig(search_alg=searcher, num_samples=opts.num_samples, max_concurrent_trials=concurrent,
                           reuse_actors=opts.reuse_processes, trial_dirname_creator=trial_dirname)


def collect(grid, setup) -> list[TrialRecord]:
    """One record per trial from Tune's results (the last report of each carries our verdict), one per
    member for a vectorized trial."""
    from raysys.tune.population import POPULATION, ended_knobs, member_results
    from raysys.tune.progress import OBJECTIVES_DIR

    records = []
    for result in grid:
        m = result.metrics or {}
        trial_id = m.get("trial_id") or Path(result.path).name
        if POPULATION in (result.config or {}):  # a vectorized trial: one record per member
            mine = [_record(mid, ended_knobs(knobs, mm), {**mm, "time_total_s": m.get("time_total_s")}, result.error,
                            setup, start=knobs) for mid, knobs, mm in member_results(m, result.config, trial_id)]
        else:
            mine = [_record(trial_id, dict(result.config or {}), m, result.error, setup)]
        reports = report_times(Path(setup.sweep_dir) / OBJECTIVES_DIR, trial_id)
        for rec in mine:  # a trial resumed with the sweep: Tune's clock counts only its last session
            took = run_seconds(setup.sweep_dir, rec.trial_id, reports, resumed_only=True)
            rec.seconds = took if took is not None else rec.seconds
        records += mine
    return sorted(records, key=lambda r: r.trial_id)


def _record(trial_id: str, knobs: dict, m: dict, error, setup, start: Optional[dict] = None) -> TrialRecord:
    """``start``: a PBT member's knobs as proposed (``knobs``: those it ended with)."""
    rec = TrialRecord(trial_id=trial_id, knobs=knobs, run_name=setup.run_name(trial_id),
                      throughput=_float(m.get(obj.MEASURED_THROUGHPUT)), quality=_float(m.get(obj.MEASURED_QUALITY)),
                      seconds=_float(m.get(obj.RUN_SECONDS, m.get("time_total_s"))),
                      higher_is_better=setup.quality_mode == "max")
    if setup.pbt is not None and start is not None:
        rec.extra["pbt_start"], rec.extra["pbt_exploits"] = start, int(_float(m.get(EXPLOITS)) or 0)
    if error is not None:
        rec.status, rec.reason = ERROR, error_summary(error)
        # out of restarts (a kill, an OOM): its run goes on from its checkpoint, and a --resume of the sweep
        # runs it again where no error of its code failed it (_lost_not_failed)
        with contextlib.suppress(Exception):  # a storage that fails now costs the hint only
            rec.extra["resumable"] = bool(setup.latest_checkpoint(trial_id))
        from raysys.tune.trial import lost_to_ray, tracking_outage

        rec.extra["rerun_on_resume"] = tracking_outage(error) or lost_to_ray(error)
    elif m.get(obj.FAILED):  # ended at once: an error no restart can fix
        rec.status, rec.reason = ERROR, str(m[obj.FAILED])
    elif m.get(obj.UNSTABLE):
        rec.status, rec.reason = UNSTABLE, str(m.get(obj.REASON, "unstable"))
        rec.extra["ran_to_end"] = bool(m.get(obj.FINAL))  # found unstable at its final report, not stopped
    elif m.get(obj.FINAL):
        rec.status = OK
    else:
        rec.status, rec.reason = INCOMPLETE, "stopped before the end (budget or interruption)"
    return rec


def _penalty(sp: spaces.SweepSpace) -> Optional[float]:
    """The space's quality penalty; by default -1 where higher quality is better, and none (NaN, left
    out of the study) where lower is: no one value is worse than every loss."""
    if "quality_penalty" in sp.objectives:
        return float(sp.objectives["quality_penalty"])
    return obj.DEFAULT_QUALITY_PENALTY if sp.quality_mode == "max" else None


def _float(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
