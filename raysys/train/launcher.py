"""Driver side of a training run: name it, track it, and hand it to Ray Train.

``run_training`` is what ``python -m raysys train`` and each Tune trial call. It resolves the
run's folder (refusing to clobber an existing run unless resuming), validates an existing
checkpoint *before* any worker starts, prepares data once, opens the MLflow run, and fits a Train
V2 ``TorchTrainer`` (``--workers 0`` runs the same loop in this process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from raysys import console, lifecycle, storage, tracking
from raysys import workload as registry
from raysys.checkpoint import CheckpointError, CheckpointStore, CheckpointWriteError
from raysys.config import ConfigError, flatten, to_dict
from raysys.metrics import divergence

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    name: str
    run_dir: Path
    run_id: Optional[str]
    tracking_uri: str
    metrics: dict[str, Any]
    stopped_by: Optional[int] = None
    """The signal that stopped the run at a step boundary (its checkpoint saved), or None."""
    resume_command: str = ""
    failure: str = ""
    """Why a run that ended without an error did not train (it diverged): its MLflow run is FAILED."""


def identity_of(wl: registry.Workload, cfg: Any) -> dict:
    """Config sections a checkpoint must match (model shape and data by default)."""
    d = to_dict(cfg)
    return {k: d[k] for k in wl.extra.get("identity_sections", ("model", "data")) if k in d}


def storage_root(path: str) -> Path:
    """The local folder of ``launch.storage_path`` (``file://`` URIs included)."""
    if path.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(path).path)).resolve()
    return Path(path).resolve()


def resolve_run_dir(wl_name: str, launch: Any) -> tuple[str, Path]:
    """The run's name and folder, validated; nothing is created here. On remote storage the folder is this
    process's working copy (raysys.storage), with the run's files pulled when resuming."""
    remote = storage.Remote(launch.storage_path) if storage.is_remote(launch.storage_path) else None
    root = remote.display if remote else storage_root(launch.storage_path)
    if remote:
        remote.check()
    else:
        storage.check_local_folder(root, "--storage-path")
    name = launch.name
    if name is not None:
        lifecycle.validate_name(name)
    if launch.resume and not name:  # newest run of this workload
        if remote:
            runs = [n for n in remote.listdir() if n.startswith(f"{wl_name}-")]  # <workload>-<time>: sorts by time
        else:
            runs = [p.name for p in sorted((p for p in root.glob(f"{wl_name}-*") if p.is_dir()),
                                           key=lambda p: p.stat().st_mtime)]
        if not runs:
            raise ConfigError(f"--resume: no earlier {wl_name} run under {root}")
        name = runs[-1]
    name = name or f"{wl_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if remote:
        exists = remote.kind(name) == "dir" and bool(remote.listdir(name))
        run_dir = storage.working_copy(remote, name)
        if exists and launch.resume:
            storage.pull_run_files(remote, name, run_dir)
    else:
        run_dir = root / name
        exists = run_dir.is_dir() and any(p.name != lifecycle.LOCK_FILE for p in run_dir.iterdir())
    if launch.resume and not exists:
        raise ConfigError(f"--resume: no run called '{name}' under {root}")
    if not launch.resume and exists:
        raise ConfigError(f"a run called '{name}' already exists at {root}/{name}; pass --resume to continue it "
                          "or choose another --name (nothing was changed)")
    return name, run_dir


def ray_storage(run_dir: Path) -> dict:
    """``RunConfig`` storage arguments: Ray Train keeps its own run state in the run's storage too."""
    owner = storage.remote_of(run_dir)
    return owner[0].ray_storage() if owner else {"storage_path": str(run_dir.parent)}


def saved_config(run_dir: Path) -> Optional[Path]:
    """The config snapshot a resume continues from: the newest whole one of config.yaml,
    config.resume-N.yaml (a process killed mid-write by an older raysys left an empty file)."""
    snaps = sorted((p for p in run_dir.glob("config.resume-*.yaml") if p.stem.split("-")[-1].isdigit()),
                   key=lambda p: int(p.stem.split("-")[-1]), reverse=True)
    for snap in [*snaps, run_dir / "config.yaml"]:
        try:
            if isinstance(yaml.safe_load(snap.read_text()), dict):
                return snap
        except (OSError, yaml.YAMLError):
            pass
    return None


def _next_snapshot(run_dir: Path, resume: bool) -> Path:
    if not resume or not (run_dir / "config.yaml").exists():
        return run_dir / "config.yaml"
    n = 1
    while (run_dir / f"config.resume-{n}.yaml").exists():  # every resume keeps its own snapshot
        n += 1
    return run_dir / f"config.resume-{n}.yaml"


def check_ray_address(address: Optional[str], timeout: float = 5.0) -> None:
    """One line in seconds, where ``ray.init`` would retry for minutes, when nothing listens at ``address``
    (or $RAY_ADDRESS): a Ray cluster's GCS (``host:port``, port 6379 unless given) or Ray Client server
    (``ray://host:port``, port 10001 unless given). ``auto``, ``local`` and no address start or find Ray
    by themselves."""
    import socket
    from urllib.parse import urlsplit

    addr = (address or os.environ.get("RAY_ADDRESS", "")).strip()
    if addr in ("", "auto", "local"):
        return
    scheme, _, rest = addr.rpartition("://")
    if scheme in ("http", "https"):
        where = "--address" if address else "$RAY_ADDRESS"
        raise ConfigError(f"{where} {addr}: an http address is a Ray dashboard's, where `ray job submit` sends jobs; "
                          "a command joins a cluster at its GCS address, host:port (port 6379 unless given), at "
                          "ray://host:10001, or with auto (nothing was created)")
    if scheme not in ("", "ray"):
        return
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port or (10001 if scheme == "ray" else 6379)
    except ValueError as e:
        raise ConfigError(f"Ray address {addr!r}: {e}") from None
    if not host:
        raise ConfigError(f"Ray address {addr!r} names no host; give host:port, ray://host:port or auto")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"no Ray cluster answers at {addr} ({host}:{port}: {reason}); start one with "
                          "`ray start --head`, or leave out --address and $RAY_ADDRESS to run Ray in this process "
                          "(nothing was created)") from None


def joins_cluster(address: Optional[str]) -> bool:
    """Whether ``init_ray`` joins a running cluster (``--address`` or $RAY_ADDRESS) rather than starting Ray here."""
    return (address or os.environ.get("RAY_ADDRESS", "")).strip() not in ("", "local")


def join_refused(addr: str, e: BaseException) -> str:
    """One line for a ``ray.init`` that reached the cluster at ``addr`` and was refused (its exception chain)."""
    chain = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(c) for c in chain)
    if "InvalidAuthToken" in text or "authentication token" in text.lower():
        return (f"the Ray cluster at {addr} asks for its auth token: set RAY_AUTH_MODE=token and give the token "
                "(~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN), as for `ray job submit` "
                "(nothing was created)")
    first = next((line.strip() for line in str(chain[0]).splitlines() if line.strip()), type(chain[0]).__name__)
    return f"could not join the Ray cluster at {addr}: {first[:300]} (nothing was created)"


def local_gpus() -> int:
    """GPUs a Ray started in this process would see: $CUDA_VISIBLE_DEVICES when set, else the NVIDIA
    device files (what NVML counts), without importing torch, JAX or Ray."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def check_local_resources(launch: Any) -> None:
    """Ray Train waits, silently and for ever, for resources a cluster does not have. A Ray started in
    this process has this machine's, so a run that asks for more fails here, in one line, before
    anything is created. A cluster (--address, $RAY_ADDRESS) may grow, and is not checked."""
    addr = (getattr(launch, "address", None) or os.environ.get("RAY_ADDRESS", "")).strip()
    if launch.workers <= 0 or addr not in ("", "local") or "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    need_gpu, need_cpu = launch.workers * launch.gpus_per_worker, launch.workers * launch.cpus_per_worker
    if need_gpu > 0 and need_gpu > (have_gpu := local_gpus()):
        raise ConfigError(f"--workers {launch.workers} x --gpus-per-worker {launch.gpus_per_worker:g} needs {need_gpu:g} "
                          f"GPU(s); this machine has {have_gpu}, and the Ray started here has no more. Use fewer, "
                          "--gpus-per-worker 0 for the CPU, or --address of a cluster with GPUs (nothing was created)")
    if need_cpu > cpus:
        raise ConfigError(f"--workers {launch.workers} x launch.cpus_per_worker {launch.cpus_per_worker:g} needs "
                          f"{need_cpu:g} CPUs; this machine has {cpus}, and the Ray started here has no more. Use "
                          "fewer, or --address of a bigger cluster (nothing was created)")


@contextlib.contextmanager
def ray_services_in_own_session():
    """Around the ``ray.init`` that starts Ray here: its processes (the GCS, the raylet and through it
    every worker, the dashboard) get a session of their own. A SIGTERM to this command's whole process
    group (``timeout``, Slurm's scancel, a systemd stop) then reaches this driver only, which stops the
    run at a step boundary with a checkpoint. Before, the same signal killed the GCS at once: no
    checkpoint, the MLflow run left RUNNING, and the driver waited 60 s for a GCS that was gone. Ray
    already keeps SIGINT from them (it blocks it), and they still die with this process (Ray's
    fate sharing). Ray has no option for this, so its process class is wrapped for the call."""
    try:
        from ray._private import services
    except ImportError:
        services = None
    base = getattr(services, "ConsolePopen", None)
    if base is None or sys.platform == "win32":
        yield
        return

    class _OwnSession(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = base


def process_group_backend(workers: int, gpus_per_worker: float) -> str:
    """torch.distributed backend of the Train workers: gloo on CPUs, NCCL on GPUs, except where
    workers hold a fraction of a GPU each: Ray may then place two ranks on one device, and NCCL
    refuses that ("Duplicate GPU detected", ray-project/ray#48012). gloo all-reduces CUDA tensors
    through the host, so such a run trains, slower, and says why once."""
    if gpus_per_worker <= 0:
        return "gloo"
    if workers > 1 and gpus_per_worker < 1:
        print(f"[raysys] {workers} workers x {gpus_per_worker:g} GPU can share a GPU, which NCCL refuses: "
              "gradients are all-reduced with gloo", flush=True)
        return "gloo"
    return "nccl"


def init_ray(address: Optional[str]) -> None:
    """Connect to ``address`` / $RAY_ADDRESS, or start Ray in this process with quiet defaults."""
    import ray

    if ray.is_initialized():
        return
    check_ray_address(address)
    # Train V2's preemption watcher polls every 5 s and dominates teardown of short local runs.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Train V2 reroutes a worker's print() into its logger *and* tees it to the wrapped stdout, so
    # every progress line reached the console twice; workers inherit this from the local raylet.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Workers' and actors' own output stays in Ray's log files: progress reaches the console through
    # raysys.console. `-v` forwards it all, as Ray does by default.
    quiet = not console.verbose()
    # a plug-in imported from a local file travels to every node's workers (registry.runtime_env)
    env = registry.runtime_env()
    if joins_cluster(address):
        try:
            ray.init(address=address, log_to_driver=not quiet, runtime_env=env,
                     logging_level=logging.WARNING if quiet else logging.INFO)
        except Exception as e:  # it listens, but will not have us: say why in one line
            ray.shutdown()
            raise ConfigError(join_refused(address or os.environ["RAY_ADDRESS"], e)) from None
    else:
        # The dashboard process also serves the State API that Train V2's controller polls; it binds
        # to 127.0.0.1 only, so nothing listens beyond this machine. address="local": with no address,
        # ray.init joins any cluster a `ray start` left on this machine (another user's, say).
        with ray_services_in_own_session():
            ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=not quiet,
                     configure_logging=False, runtime_env=env)
    lifecycle.reinstall_if_active()  # ray.init replaced our SIGTERM handler with its own


def shutdown_ray() -> None:
    """End this process's Ray as a command's last step, about 1.5 s sooner than Ray's exit hook. That
    hook first sleeps 0.5 s so that workers' output reaches the console (raysys forwards it only with
    ``-v``, and then leaves the exit to Ray). Then the autoscaler's monitor of an in-process cluster
    used its whole 1 s SIGTERM grace before Ray killed it: it keeps nothing here, so it is killed at
    once, and the other processes stop as Ray stops them."""
    import ray

    if not ray.is_initialized() or console.verbose():
        return
    from ray._private import ray_constants, worker

    node = getattr(worker, "_global_node", None)
    if node is not None and node.is_head():
        for info in getattr(node, "all_processes", {}).get(ray_constants.PROCESS_TYPE_MONITOR, []):
            info.process.kill()
    ray.shutdown()


def train_logging():
    """Ray Train's own INFO lines ('Reporting training result N: TrainingReport(...)') only with -v."""
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if console.verbose() else "WARNING")


def work_where_the_driver_works(payload: dict) -> None:
    """In a Ray Train worker: work in the driver's folder (``payload["cwd"]``), as a run with
    ``--workers 0`` does, so that a relative data path names the same file and data made once there is
    found, not made again. Ray Train starts its workers in a folder of its own; a worker on a machine
    without the driver's folder stays there."""
    cwd = payload.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)


def set_threads(launch: Any) -> None:
    """torch intra-op threads of this process: ``launch.threads``, or for an in-process run one per
    physical core (half the logical CPUs this process may use; on a busy 2-core machine 1 thread ran
    5x faster than 2). Ray workers keep Ray's default (their ``cpus_per_worker``) unless it is set.
    A process that has not imported torch (a JAX workload's) does not import it for this (1-2 s):
    torch, if it comes later, starts with ``OMP_NUM_THREADS`` threads, set here."""
    n = getattr(launch, "threads", None)
    if n is None and launch.workers == 0:
        n = max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else None
    if not n:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(n))
    else:
        os.environ["OMP_NUM_THREADS"] = str(int(n))


def recorded_final(run_dir: Path) -> Optional[dict]:
    """The final metrics a run recorded when it last finished (``final_metrics.json``), or None. A resumed
    run that has nothing left to train keeps them: rewriting them would replace its measured speed with
    the zero of a session that trained nothing."""
    path = Path(run_dir) / "final_metrics.json"
    try:
        return json.loads(path.read_text()) if storage.pull(path) else None
    except (OSError, ValueError):
        return None


PERMANENT = (ConfigError, CheckpointError, CheckpointWriteError, ImportError)
"""Errors a restart cannot fix (a config, an unknown workload, bad data, a foreign checkpoint, a full disk)."""


def find_cause(e: BaseException, types: tuple) -> Optional[BaseException]:
    """The first error of ``types`` in ``e`` and Ray's wrappers around it (worker failures, causes)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, types):
            return err
        failures = getattr(err, "worker_failures", None)
        if isinstance(failures, dict):
            stack.extend(failures.values())
        stack.extend([err.__cause__, err.__context__])
    return None


def error_line(e: BaseException) -> str:
    """``Type: message`` of the error a user should read: the first failed worker's own error, not
    Ray's wrapper around it (whose first line names no error)."""
    for _ in range(8):
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict) and failures:
            e = failures[min(failures)]
            continue
        cause = getattr(e, "cause", None)  # a RayTaskError around the task's own exception
        if isinstance(cause, BaseException) and cause is not e:
            e = cause
            continue
        break
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def permanent_cause(e: BaseException) -> Optional[BaseException]:
    """The first error in Ray's wrappers (worker failures, causes) that retrying cannot fix, or None."""
    return find_cause(e, PERMANENT)


def fit_with_restarts(make_trainer: Callable[[], Any], max_failures: int, run_dir: Path, sink: Any = None) -> Any:
    """``make_trainer().fit()``, restarted from the run's last checkpoint after a worker failure, up to
    ``max_failures`` times. Ray's own FailureConfig would retry every error alike; here a config error,
    an unknown workload or bad data fails at once with its own message (the trainers are built with
    ``max_failures=0``; node preemptions keep Ray's separate budget)."""
    attempt, last = 0, None
    while True:
        try:
            trainer = make_trainer()
            if lifecycle.handles_signals() and hasattr(trainer, "_register_sigint_handler"):
                # Train V2's fit() replaces the SIGINT handler with one that aborts the controller (the
                # workers die mid-step); ours lets them checkpoint at the next step boundary instead.
                trainer._register_sigint_handler = lambda controller: None
            return trainer.fit()
        except Exception as e:
            cause = permanent_cause(e)
            if cause is not None:
                raise cause from None
            line = error_line(e)
            at = _latest_step(run_dir)
            if attempt >= max_failures:
                raise
            if last == (line, at):  # the same error again from the same checkpoint: the code's, not a node's
                (sink or console.Sink()).message(f"[raysys] the same error again from the same checkpoint: not "
                                                 "restarted further (an error of the training code, not of a worker)")
                raise
            last = (line, at)
            attempt += 1
            _event(run_dir, f"restart {attempt}/{max_failures} after: {line}")
            (sink or console.Sink()).message(f"[raysys] training failed ({line}); restarting from the last "
                                             f"checkpoint ({attempt}/{max_failures}, launch.max_failures)")


def _latest_step(run_dir: Path) -> Optional[str]:
    """The name of the run's newest complete checkpoint, or None."""
    try:
        latest = CheckpointStore(run_dir, "", {}).latest()
    except Exception:
        return None
    return latest.name if latest is not None else None


def _event(run_dir: Path, line: str) -> None:
    """Append to <run>/events.log: resumes and restarts, for users and tests to audit a run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    storage.pull(run_dir / "events.log")  # a remote run: append to what other processes wrote
    with open(run_dir / "events.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    storage.push(run_dir / "events.log")


class DataError(ConfigError):
    """The user's data cannot be used (missing or wrong columns, bad values, unreadable files)."""


@dataclass
class OpenRun:
    """A run whose folder, config snapshot and MLflow run exist; what both kinds of loop start from."""

    wl: registry.Workload
    cfg: Any
    cfg_dict: dict
    name: str
    run_dir: Path
    identity: dict
    tracking_uri: str
    run_id: str
    logger: tracking.MLflowLogger
    snapshot: Optional[Path] = None
    """This session's config snapshot (``config.yaml`` or ``config.resume-N.yaml``)."""
    holder: Optional[str] = None
    """On a Ray worker: the session that started it, as the run folder's lock named it (``lifecycle.holder_of``)."""

    def store(self, keep: int = 2) -> CheckpointStore:
        return CheckpointStore(self.run_dir, self.wl.name, self.identity, keep=keep,
                               local_keys=self.wl.extra.get("local_keys", ()), holder=self.holder)

    def finish(self, status: str) -> None:
        lifecycle.RunLock.release_dir(self.run_dir)
        if status == "FINISHED":  # an earlier session's failure is history now: events.log keeps it
            self.logger.delete_tag("raysys.error")
            self._retire_error_file()
        if not self.logger.end(status):
            console.Sink().message(f"[raysys] the tracking store did not answer (a server away, a full disk): "
                                   f"{self.logger.pending} records wait in {storage.where(self.run_dir)}/"
                                   f"{self.logger.buffer.name}; they are sent on --resume of this run")

    def _retire_error_file(self) -> None:
        """A finished run has no error.txt: the traceback of the session that failed before this resume
        is added to error.earlier.txt (moved, not deleted), so the run folder no longer reads as failed."""
        path, earlier = self.run_dir / ERROR_FILE, self.run_dir / EARLIER_ERROR_FILE
        try:
            if storage.pull(path):
                before = earlier.read_text() + "\n" if storage.pull(earlier) else ""
                storage.write_text(earlier, before + path.read_text())
                storage.remove(path)
        except Exception as e:  # storage away: the stale file is only misleading, never worth failing the run
            log.warning("could not move %s of run %s aside: %s", ERROR_FILE, self.name, e)

    def resume_command(self) -> str:
        return _resume_command(self.wl, self.cfg.launch, self.name)

    def record_failure(self, why: str | BaseException) -> str:
        """Keep why the run failed where it outlives the console: ``events.log``, the MLflow tag
        ``raysys.error``, and for an error its traceback in ``<run>/error.txt`` (also an artifact).
        An error gets ``raysys_failure`` (the line), which the CLI prints after the traceback."""
        line = why if isinstance(why, str) else error_line(why)

        def keep(what: str, write) -> None:  # each record on its own: a lost storage must not cost the tag
            try:
                write()
            except Exception as e:  # a full disk or a lost store must not hide the error itself
                log.warning("could not record the failure of run %s in %s: %s", self.name, what, e)

        keep("MLflow", lambda: self.logger.set_tags({"raysys.error": line[:5000]}))
        keep("events.log", lambda: _event(self.run_dir, f"failed: {line}"))
        if isinstance(why, BaseException):
            import traceback

            def error_file():
                storage.write_text(self.run_dir / ERROR_FILE, "".join(traceback.format_exception(why)))
                self.logger.log_artifact(self.run_dir / ERROR_FILE)

            keep(ERROR_FILE, error_file)
            try:
                try:
                    saved = self.store().latest() is not None
                except Exception:  # storage away: say what usually holds
                    saved = True
                how = "resume from its last checkpoint" if saved else "no checkpoint yet; start it again from step 0"
                why.raysys_resume = self.resume_command()
                why.raysys_failure = (f"[raysys] run '{self.name}' failed: {line}\n  traceback: "
                                      f"{storage.where(self.run_dir)}/{ERROR_FILE}\n  {how}: {why.raysys_resume}")
            except AttributeError:  # an exception type without a __dict__: the plain traceback then
                pass
        return line

    @contextlib.contextmanager
    def tracked(self):
        """Close the MLflow run as FINISHED, KILLED (a signal, Ctrl-C) or FAILED, however the block ends.
        The block may set ``.failure`` (a run that diverged): FAILED, recorded."""
        status, outcome = "FAILED", _Outcome()
        try:
            yield outcome
            status = "KILLED" if lifecycle.stop_requested() is not None else "FINISHED"
            if status == "FINISHED" and outcome.failure:
                status = "FAILED"
                self.record_failure(outcome.failure)
            if outcome.trained_nothing and self.cfg.launch.resume and self.snapshot is not None:
                # resumed after its end: the config given now trained nothing, and must not become the one
                # the next --resume starts from (changes that never trained would pile up there)
                storage.remove(self.snapshot)
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except Exception as e:
            if isinstance(e, CheckpointError) and self.cfg.launch.resume and self.snapshot is not None:
                # a resume its checkpoint refused trained nothing: its snapshot must not become the config
                # the next --resume starts from (it would be refused again, for ever)
                storage.remove(self.snapshot)
            self.record_failure(e)
            raise
        finally:
            self.finish(status)


@dataclass
class _Outcome:
    failure: str = ""
    trained_nothing: bool = False
    """A resume after the run's end that trained nothing (its recorded final metrics kept)."""

    def check(self, final: dict, quality: Optional[str] = None, required: bool = True) -> None:
        """The block's run ended with these final metrics: a diverged loss makes it FAILED, and so does
        ending with a non-finite ``quality`` (a metric its workload declares), or without it where
        ``required``, unless it was asked to stop: a run that cannot be judged did not do what it was for."""
        self.failure = divergence(final) or ""
        if quality and not self.failure and lifecycle.stop_requested() is None:
            if quality not in final and required:
                self.failure = (f"no quality: the run ended without {quality} (Workload.quality_metric), neither "
                                "logged through its session nor in what train_fn returned")
            elif isinstance(final.get(quality), float) and not math.isfinite(final[quality]):
                # a model whose quality is NaN learned nothing that can be judged (its loss may have gone
                # non-finite too few times in a row for the loop to stop itself)
                self.failure = f"diverged: its final {quality} is {final[quality]}"


ERROR_FILE = "error.txt"
EARLIER_ERROR_FILE = "error.earlier.txt"


def _resume_command(wl: registry.Workload, launch: Any, name: str) -> str:
    """The line that continues this run, from any folder: the run folder, the default MLflow store and a
    ``module:attr`` workload are all found relative to the folder the run started in."""
    import shlex

    cmd = f"cd {shlex.quote(os.getcwd())} && python -m raysys train {shlex.quote(registry.ref(wl))} --name {name} --resume"
    if Path(launch.storage_path).resolve() != Path("raysys_runs").resolve():
        cmd += f" --storage-path {shlex.quote(launch.storage_path)}"  # an S3 URI's options hold '&'
    return cmd


def _lock_dir(launch: Any) -> Optional[Path]:
    """Where a remote run's lock file lives: runs of one machine share a lock folder (other machines are
    kept out by the run's lease on the storage, ``_hold``)."""
    if not storage.is_remote(launch.storage_path):
        return None
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / "raysys-locks" / hashlib.sha256(_same_place(launch.storage_path).encode()).hexdigest()[:16]


def _hold(run_dir: Path, name: str, launch: Any, create: bool) -> lifecycle.RunLock:
    """Lock the run folder (making it when ``create``); a run on remote storage is also leased there, so a
    process on another machine is refused too (``storage.Lease``)."""
    get = lifecycle.create_run_dir if create else lifecycle.RunLock.acquire
    lock = get(run_dir, name, lock_dir=_lock_dir(launch))
    owner = storage.remote_of(run_dir)
    if owner is not None and lock.lease is None:
        try:
            lock.lease = storage.Lease(*owner).acquire()
        except BaseException:
            lock.release()
            raise
    return lock


def _same_place(uri: str) -> str:
    """One spelling of a storage URI: its options in any order, a trailing slash or not, name one place."""
    from urllib.parse import parse_qsl, urlsplit

    u = urlsplit(uri)
    return f"{u.scheme.lower()}://{u.netloc}/{u.path.strip('/')}?{sorted(parse_qsl(u.query))}"


def _refuse_before_prepare(wl: registry.Workload, cfg: Any, run_dir: Path, changes: str) -> None:
    """A resume that changed a key of the checkpoint's identity is refused now, not after ``prepare``, which may
    make data for minutes (the ad_transformer's PPO histories) for a run that cannot go on. Only a key given
    anew on this resume counts (``changes``: 'key: old -> new; ...'): ``prepare`` fills in others (an absolute
    path), and the checkpoint's own check after it sees those."""
    store = CheckpointStore(run_dir, wl.name, identity_of(wl, cfg), local_keys=wl.extra.get("local_keys", ()))
    latest = store.latest()
    if latest is None:
        return
    given = {part.split(":", 1)[0] for part in changes.split("; ")}
    diff = {k: v for k, v in store.differences(store.meta(latest)).items() if k in given and not _same_path(*v)}
    if diff:
        from raysys.checkpoint import refuse_different

        refuse_different(latest, diff)


def _same_path(a: Any, b: Any) -> bool:
    """Two spellings of one file (relative now, absolute in the checkpoint)."""
    return isinstance(a, str) and isinstance(b, str) and bool(a) and bool(b) and Path(a).resolve() == Path(b).resolve()


def _prepare(prepare, cfg: Any) -> Any:
    """Make or validate the data once, before any run folder or MLflow run exists; a data problem is one
    line (DataError), not a traceback."""
    if prepare is None:
        return cfg
    try:
        return prepare(cfg) or cfg
    except ConfigError:
        raise
    except (ValueError, LookupError, OSError) as e:  # pyarrow's ArrowInvalid/ArrowIOError are among these
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(msg) from None  # said as "data error: ..."


def open_run(wl: registry.Workload, cfg: Any, prepare=None, parent_run_id: Optional[str] = None,
             tags: Optional[dict] = None, fits: Optional[Callable[[Any, dict], None]] = None,
             check: Optional[Callable[[Any], None]] = None) -> OpenRun:
    """Validate everything, then create: the run folder (locked), the config snapshot and the MLflow run
    (reopened when resuming). Any problem found before the folder exists leaves nothing behind.
    ``fits(cfg, state)``: raises a CheckpointError when a resume's changed config cannot take the
    checkpoint's state (a shape outside the checkpoint's identity). ``check(cfg)``: the workload's own
    check of the prepared config, which raises a ConfigError (before anything exists)."""
    launch = cfg.launch
    name, run_dir = resolve_run_dir(wl.name, launch)
    uri = tracking.resolve_tracking_uri(launch.tracking_uri)
    if parent_run_id is None:
        tracking.check_store(uri)  # a command's own store: bad input, one line before anything
    else:
        tracking.wait_for_store(uri)  # a sweep's trial: its server answered when the sweep began
    if getattr(launch, "workers", 0) > 0 or wl.extra.get("needs_ray", False):
        check_ray_address(getattr(launch, "address", None))
        if joins_cluster(getattr(launch, "address", None)):  # a cluster that will not have us: before anything exists
            init_ray(launch.address)
        check_local_resources(launch)
    if getattr(launch, "jax_platforms", "") and launch.workers == 0:
        use_jax_platforms(launch.jax_platforms)
    if launch.resume:
        _hold(run_dir, name, launch, create=False)
        lifecycle.arm(_resume_command(wl, launch, name))  # from here a signal stops the run with a checkpoint
    if launch.resume and (tags or {}).get("raysys.resume_changes"):
        _refuse_before_prepare(wl, cfg, run_dir, tags["raysys.resume_changes"])
    cfg = _prepare(prepare, cfg)  # data made/validated once here; paths made absolute for workers
    if check is not None:
        check(cfg)
    identity = identity_of(wl, cfg)
    store = CheckpointStore(run_dir, wl.name, identity, local_keys=wl.extra.get("local_keys", ()))
    if launch.resume:
        for line in store.clean_stale():  # a crash mid-save: finish the swap or drop the half copy
            _event(run_dir, f"checkpoint cleanup: {line}")
        if store.latest() is not None:
            state, _ = store.load()  # a corrupt or foreign checkpoint fails here, before anything starts or is written
            if fits is not None and (tags or {}).get("raysys.resume_changes"):  # the same config fits by itself
                fits(cfg, state)
    created = not launch.resume
    if created:
        _hold(run_dir, name, launch, create=True)
        lifecycle.arm(_resume_command(wl, launch, name))
    try:
        cfg_dict = to_dict(cfg)
        if hasattr(launch, "tracking_uri") and cfg_dict.get("launch", {}).get("tracking_uri") is None:
            cfg_dict["launch"]["tracking_uri"] = uri  # the store it tracks to: a --resume from elsewhere finds it
        cfg_file = _next_snapshot(run_dir, launch.resume)
        storage.write_text(cfg_file, yaml.safe_dump(cfg_dict, sort_keys=False))
        experiment = launch.experiment or f"raysys-{wl.name}"
        new_mlflow_run = created or (parent_run_id is None and tracking.find_run(uri, experiment, name) is None)
        if launch.resume and new_mlflow_run:
            if getattr(launch, "tracking_uri", None) and tracking.resolve_tracking_uri(launch.tracking_uri) == uri:
                print(f"[raysys] note: '{name}' has no MLflow run yet (its first session ended before it made one): "
                      "this session's holds it from here", flush=True)
            else:
                print(f"[raysys] note: {uri} has no MLflow run of '{name}' (it tracked to another store): a new MLflow "
                      "run holds this session; the earlier steps stay where they were recorded", flush=True)
        run_id = tracking.start_run(uri, experiment, name, tags={"raysys.workload": wl.name, "raysys.kind": "run",
                                                                 **(tags or {})},
                                    parent_run_id=parent_run_id, resume=launch.resume)
    except BaseException:
        if created:  # nothing of this run exists elsewhere yet: do not let a half-made folder block the name
            lifecycle.RunLock.release_dir(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    logger = tracking.MLflowLogger(uri, run_id, buffer=run_dir / tracking.BUFFER_FILE)
    if launch.resume and (tags or {}).get("raysys.resume_changes"):  # the run's params keep their first values
        logger.set_tags({"raysys.resume_changes": tags["raysys.resume_changes"]})
    if launch.resume and logger.pending:
        sent = logger.pending
        if logger.flush():
            _event(run_dir, f"tracking buffer sent ({sent} records)")
    logger.log_params({k: v for k, v in flatten(cfg_dict).items() if not k.startswith("launch.")}
                      | {"launch.workers": launch.workers, "launch.gpus_per_worker": launch.gpus_per_worker})
    logger.log_artifact(cfg_file)
    _log_dataset(wl, cfg, uri, run_id)
    if new_mlflow_run and "raysys.command" in (tags or {}) and tracking.NOTE_TAG not in (tags or {}):
        logger.set_note(f"{wl.name}, preset `{tags.get('raysys.preset', 'default')}`.\n\n"
                        f"Run again: `{tags['raysys.command']}`\n\nResume if interrupted: `{_resume_command(wl, launch, name)}`\n")
    link = tracking.ui_link(uri, tracking.experiment_of(uri, run_id), run_id)
    say_if_in_ray_package(run_dir, uri)
    if launch.resume and (tags or {}).get("raysys.resume_changes"):  # said once the checkpoint has taken it
        print(f"[raysys] resuming with changed config: {tags['raysys.resume_changes']}", flush=True)
    if os.environ.get(BENCH_ENV):  # a bench's quality run, in a store it removes: no links to follow
        print(f"[raysys] run '{name}' (the bench's own quality run)", flush=True)
    else:
        print(f"[raysys] run '{name}' -> {storage.where(run_dir)}\n{tracking.ui_lines(uri, link)}", flush=True)
    return OpenRun(wl, cfg, cfg_dict, name, run_dir, identity, uri, run_id, logger, snapshot=cfg_file)


BENCH_ENV = "RAYSYS_IN_BENCH"
"""Set by ``python -m raysys.bench``: its quality runs live in temporary stores it removes."""


def use_jax_platforms(platforms: str) -> None:
    """--workers 0: this process is the run's JAX process, so ``launch.jax_platforms`` applies here (it went
    to the workers only, and was silently ignored); a platform this machine lacks is one line, now."""
    import jax

    try:
        jax.config.update("jax_platforms", platforms)
        have = jax.devices()[0].platform
    except RuntimeError as e:
        raise ConfigError(f"launch.jax_platforms={platforms}: {str(e).splitlines()[0][:300]}") from None
    if have not in platforms.replace("cuda", "gpu").split(",") and have not in platforms.split(","):
        raise ConfigError(f"launch.jax_platforms={platforms}: JAX in this process already runs on {have}")


RAY_PACKAGE = "/runtime_resources/working_dir_files/"  # where Ray unpacks a job's --working-dir


def say_if_in_ray_package(run_dir: Path, uri: str, what: str = "run") -> None:
    """A `ray job submit` job works in Ray's unpacked copy of its working_dir, named after the source's
    hash: after any edit the next job gets a new, empty copy, and Ray may delete old ones. A run or an
    MLflow store kept there is said to be at risk (one line), not refused: a one-off job may not care."""
    cwd = str(Path.cwd().resolve())
    if RAY_PACKAGE not in cwd + "/":
        return
    inside = [name for name, path in ((f"the {what}'s folder", None if storage.remote_of(run_dir) else str(run_dir)),
                                      ("the MLflow store", uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None))
              if path and str(Path(path).resolve()).startswith(cwd)]
    if inside:
        print(f"[raysys] note: {' and '.join(inside)} {'are' if len(inside) > 1 else 'is'} in Ray's unpacked copy "
              "of this job's working_dir, which a job with edited source does not see again (--resume finds nothing) "
              "and Ray may delete: pass --storage-path (a shared folder or s3://...) and --tracking-uri (an MLflow "
              "server)", flush=True)


def _model_fits(task: Any, tags: Optional[dict]) -> Callable[[Any, dict], None]:
    """A resume's check that the model its config builds takes the checkpoint's weights: a setting that
    changes a shape may lie outside the sections a checkpoint compares (``identity_sections``). The model
    is built as a worker builds it (data first), on torch's meta device: shapes, no memory."""

    def fits(cfg: Any, state: dict) -> None:
        saved = state.get("model") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            return
        model = _meta_model(task, cfg)
        if model is None:  # not buildable here: the workers build it, and a mismatch fails there in one line
            return
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = {k: tuple(v.shape) for k, v in saved.items() if hasattr(v, "shape")}
        odd = next((k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)), None)
        if odd is None:
            return
        seen = (f"{odd}: checkpoint {list(have[odd]) if odd in have else 'none'}, "
                f"now {list(want[odd]) if odd in want else 'none'}")
        changed = (tags or {}).get("raysys.resume_changes", "")
        raise CheckpointError(f"the checkpoint does not fit the model this config builds ({seen}); changed on this "
                              f"resume: {changed}. Resume with the run's settings, or start a new run (another --name)")

    return fits


def _hooks_work(wl: registry.Workload) -> Optional[Callable[[Any], None]]:
    """For a task with its own optimizer hooks: the mistakes ``optim.task_optimizer`` and ``task_scheduler``
    refuse (a parameter left out, a plateau's mode) are found here, on a model built on torch's meta device,
    before the run exists, not in its workers after. The hooks' own errors are left to the workers, which
    meet them again with their tracebacks."""
    from raysys.train.optim import hooks_used

    task = wl.task
    if not hooks_used(task):
        return None

    def check(cfg: Any) -> None:
        from raysys.train.optim import task_optimizer, task_scheduler

        model = _meta_model(task, cfg)
        if model is None:
            return
        try:
            opt = task_optimizer(task, cfg, model, wl.name)
            task_scheduler(task, cfg, opt, 1000, wl.name, wl.quality_metric, wl.quality_mode)
        except ConfigError:
            raise
        except Exception:  # a hook of its own failing on meta tensors: the workers find out, with its traceback
            return

    return check


def _meta_model(task: Any, cfg: Any) -> Any:
    """The model a worker would build from ``cfg`` (data first: a model may take a size from it, a
    vocabulary), on torch's meta device: shapes, no memory. None where it cannot be built here."""
    import torch

    try:
        task.datasets(cfg)
        with torch.device("meta"):
            return task.build_model(cfg)
    except Exception:
        return None


def _log_dataset(wl: registry.Workload, cfg: Any, uri: str, run_id: str) -> None:
    """The workload's data as the run's MLflow input, where it names one (``Workload.dataset``)."""
    info = wl.dataset(cfg) if wl.dataset is not None else None
    if info:
        tracking.log_dataset(uri, run_id, **info)


def run_training(wl_name: str, cfg: Any, *, callbacks: Optional[list] = None, parent_run_id: Optional[str] = None,
                 tags: Optional[dict] = None) -> RunResult:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raysys.train.loop import train_loop_per_worker

    wl = registry.get(wl_name)
    if wl.task is None:
        raise ConfigError(f"{wl_name} is not a PyTorch supervised workload")
    run = open_run(wl, cfg, wl.task.prepare, parent_run_id, tags, fits=_model_fits(wl.task, tags),
                   check=_hooks_work(wl))
    launch, name, run_dir, uri, run_id = run.cfg.launch, run.name, run.run_dir, run.tracking_uri, run.run_id
    cfg_dict, identity, logger = run.cfg_dict, run.identity, run.logger

    use_gpu = launch.gpus_per_worker > 0
    if launch.workers > 0:
        init_ray(launch.address)
    resources = {"CPU": launch.cpus_per_worker, **({"GPU": launch.gpus_per_worker} if use_gpu else {})}
    backend = process_group_backend(launch.workers, launch.gpus_per_worker)

    stop = lifecycle.stop_flag_actor() if launch.workers > 0 else None

    def make_trainer():
        payload = {"workload": registry.ref(wl), "config": cfg_dict, "run_dir": str(run_dir),
                   **storage.payload(run_dir), "identity": identity,
                   "tracking_uri": uri, "run_id": run_id, "console": sink.handle, "stop": stop, "cwd": os.getcwd(),
                   # --cv: the first fold's breakdown table is on the console; the others' are alike
                   "brief_breakdown": (tags or {}).get("raysys.cv_fold", "0") != "0",
                   "holder": lifecycle.holder_of(run_dir) if launch.workers > 0 else None}
        return TorchTrainer(
            train_loop_per_worker,
            train_loop_config=payload,
            scaling_config=ScalingConfig(num_workers=launch.workers, use_gpu=use_gpu,
                                         resources_per_worker=resources if launch.workers > 0 else None),
            torch_config=TorchConfig(backend=backend),
            run_config=RunConfig(name=name, **ray_storage(run_dir), callbacks=callbacks,
                                 failure_config=FailureConfig(max_failures=0), logging_config=train_logging(),
                                 checkpoint_config=CheckpointConfig(num_to_keep=1)),
        )

    final_path = run_dir / "final_metrics.json"
    recorded = recorded_final(run_dir) if launch.resume else None
    with run.tracked() as outcome:
        trained = False
        try:
            with console.live(remote=launch.workers > 0) as sink:
                if launch.workers > 0 and not callbacks:  # a sweep's trial says nothing on the sweep's console
                    # placing the workers and building their data takes seconds to a minute: not a hang
                    sink.message(f"[raysys] starting {launch.workers} Ray Train worker(s); progress from their first step")
                fit_with_restarts(make_trainer, launch.max_failures, run_dir, sink)
            lifecycle.settle_stop(stop)  # a worker's SIGTERM stops the run as the driver's would
            trained = True
        finally:
            try:
                if storage.pull(final_path) and storage.pull(run_dir / "breakdown.md"):
                    logger.log_artifact(run_dir / "breakdown.md")
            except OSError:
                if trained:  # else the storage's outage is what failed the run: its own error is the one to record
                    raise
            try:  # Ray Train's probe of the storage, left in the run folder; the run's files are raysys's
                storage.remove(run_dir / ".validate_storage_marker")
            except OSError:
                pass
        metrics = json.loads(final_path.read_text()) if final_path.is_file() else {}
        outcome.check(metrics, quality=wl.quality_metric, required=False)  # the loop evaluates at its end
        outcome.trained_nothing = recorded is not None and metrics == recorded
    return RunResult(name, run_dir, run_id, uri, metrics, stopped_by=lifecycle.stop_requested(),
                     resume_command=run.resume_command(), failure=outcome.failure)
