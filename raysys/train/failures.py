"""When a run fails: which errors a restart cannot fix, the one line a user reads, the restarts
from the last checkpoint, and the run's ``events.log`` (resumes, restarts, failures)."""

from __future__ import annotations

import contextlib
import errno
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

from raysys import console, lifecycle, storage
from raysys.checkpoint import CheckpointError, CheckpointStore, CheckpointWriteError
from raysys.config import ConfigError
from raysys.train import runtime


PERMANENT = (ConfigError, CheckpointError, CheckpointWriteError, ImportError, storage.LeaseLost)
"""Errors a restart cannot fix (a config, an unknown workload, bad data, a foreign checkpoint, a full disk, a
run another process took over)."""


def find_cause(e: BaseException, types: tuple, where: Optional[Callable[[BaseException], bool]] = None
               ) -> Optional[BaseException]:
    """The first error of ``types`` (for which ``where`` holds) in ``e`` and Ray's wrappers around it
    (worker failures, causes)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, types) and (where is None or where(err)):
            return err
        failures = getattr(err, "worker_failures", None)
        if isinstance(failures, dict):
            stack.extend(failures.values())
        # not a context its raise set aside (``raise X from None``): a TrackingOutageError raised while a
        # ConfigError of one failed look was being handled is an outage, not that ConfigError
        stack.extend([err.__cause__, None if err.__suppress_context__ else err.__context__])
    return None


def _alive_nodes(dead: bool = False) -> dict[str, str]:
    """The cluster's nodes alive now (``dead``: those dead now), id -> address; {} without a Ray here."""
    try:
        import ray

        if not ray.is_initialized():
            return {}
        return {n["NodeID"]: f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]})" for n in ray.nodes()
                if bool(n.get("Alive")) != dead}
    except Exception:  # the state API away (the cluster going down): nothing to name
        return {}


def full_traceback(e: BaseException) -> str:
    """The error's traceback, and each failed Ray Train worker's whole one after it: Ray Train cuts a worker's
    traceback to its first and last 500 characters in the error the driver gets ("Output truncated"), which
    were the frames of the workload's own code between the loop's and torch's."""
    import traceback

    text = "".join(traceback.format_exception(e))
    seen, todo = set(), [e]
    while todo:  # the error, its causes and contexts
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        for rank, failure in sorted((getattr(x, "worker_failures", None) or {}).items()):
            whole = str(getattr(failure, "raysys_traceback", None) or failure).rstrip()
            if whole and whole not in text:
                text += f"\nRank {rank}'s whole traceback (shortened above by Ray Train):\n{whole}\n"
        todo += [x.__cause__, x.__context__]
    return text


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
    if not text:
        return type(e).__name__
    # a collective's peer gone (a worker or its node lost): gloo's source location and advice are noise here
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[0]).split(" This is typically caused")[0]
    return f"{type(e).__name__}: {first[:300]}"


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
"""A full disk, a quota, a read-only file system, a file-size limit: a restart meets them again."""


def disk_error(e: BaseException) -> Optional[BaseException]:
    """A full or read-only disk in ``e``'s chain (a checkpoint, the tracking buffer, a sqlite store's file)."""
    return find_cause(e, (OSError,), lambda err: err.errno in DISK_ERRNOS and type(err).__module__ != "requests.exceptions")


def permanent_cause(e: BaseException) -> Optional[BaseException]:
    """The first error in Ray's wrappers (worker failures, causes) that retrying cannot fix, or None. A
    checkpoint that could not be uploaded because the storage did not answer (an outage longer than
    ``$RAYSYS_STORAGE_RETRY_S``) is not one: a restart from the last checkpoint may well find it back."""
    return find_cause(e, PERMANENT, lambda err: not (isinstance(err, CheckpointWriteError) and storage.unreachable(err))
                      ) or disk_error(e)


def fit_with_restarts(make_trainer: Callable[[], Any], max_failures: int, run_dir: Path, sink: Any = None) -> Any:
    """``make_trainer().fit()``, restarted from the run's last checkpoint after a worker failure, up to
    ``max_failures`` times. Ray's own FailureConfig would retry every error alike; here a config error,
    an unknown workload or bad data fails at once with its own message (the trainers are built with
    ``max_failures=0``; node preemptions keep Ray's separate budget)."""
    attempt, last = 0, None
    while True:
        alive = _alive_nodes()
        try:
            trainer = make_trainer()
            if lifecycle.handles_signals() and hasattr(trainer, "_register_sigint_handler"):
                # Train V2's fit() replaces the SIGINT handler with one that aborts the controller (the
                # workers die mid-step); ours lets them checkpoint at the next step boundary instead.
                trainer._register_sigint_handler = lambda controller: None
            # the driver a person stops: a worker group the cluster cannot place is said, and a signal stops it
            watch = runtime.WaitingForWorkers((sink or console.Sink()).message) if lifecycle.handles_signals() else None
            with watch or contextlib.nullcontext():
                return trainer.fit()
        except Exception as e:
            cause = permanent_cause(e)
            if cause is not None:
                raise cause from None
            line = error_line(e)
            lost = [n for n in _alive_nodes(dead=True) if n in alive]
            if lost:  # a worker's error is then its peers' lost connection (gloo's "Connection closed by peer")
                line = f"node {', '.join(alive[n] for n in lost)} was lost ({line})"
            at = newest_checkpoint(run_dir)
            if lifecycle.stop_requested() is not None:
                # a stop was asked for, and the signal reached the step's own processes too (a compiler's, a
                # data loader's): their error ends the run as the stop does, not as a failure to start again
                record_event(run_dir, f"stopped; after the stop request the step raised: {line}")
                (sink or console.Sink()).message(
                    f"[raysys] stopped; after the stop request the step raised {line} "
                    + (f"(the last checkpoint is {at})" if at is not None else "(no checkpoint yet)"))
                return None
            if attempt >= max_failures:
                raise
            if last == (line, at):  # the same error again from the same checkpoint: the code's, not a node's
                (sink or console.Sink()).message("[raysys] the same error again from the same checkpoint: not "
                                                 "restarted further (an error of the training code, not of a worker)")
                raise
            last = (line, at)
            attempt += 1
            record_event(run_dir, f"restart {attempt}/{max_failures} after: {line}")
            # where it goes on from, as found now: a storage that lost the run's checkpoints is not hidden
            (sink or console.Sink()).message(
                f"[raysys] training failed ({line}); restarting from the last checkpoint ({at}, "
                f"{attempt}/{max_failures}, launch.max_failures)" if at is not None else
                f"[raysys] training failed ({line}); no checkpoint found in {storage.where(run_dir)}: restarting "
                f"from step 0 ({attempt}/{max_failures}, launch.max_failures)")


def newest_checkpoint(run_dir: Path) -> Optional[str]:
    """The name of the run's newest complete checkpoint, or None."""
    try:
        latest = CheckpointStore(run_dir, "", {}).latest()
    except Exception:
        return None
    return latest.name if latest is not None else None


def record_event(run_dir: Path, line: str) -> None:
    """Append to <run>/events.log: resumes and restarts, for users and tests to audit a run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    storage.pull(run_dir / "events.log")  # a remote run: append to what other processes wrote
    with open(run_dir / "events.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    storage.push(run_dir / "events.log")


def environment_line(e: BaseException) -> Optional[str]:
    """One line for an error of the machine or a service, not of the training code: a checkpoint that
    could not be written, a full or read-only disk, the tracking server; None for anything else."""
    return _environment_error(find_cause(e, (CheckpointWriteError,)) or disk_error(e) or _service_error(e)
                              or find_cause(e, (OSError,)))


def _service_error(e: BaseException) -> Optional[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.split(".")[0] in ("mlflow", "requests", "urllib3"):
            return e
        e = e.__cause__ or e.__context__
    return None


def _environment_error(e: Optional[BaseException]) -> Optional[str]:
    """A one-line account of errors that come from the machine or a service, not from raysys: disk
    (full, read-only, permissions) and the tracking server. Anything else keeps its traceback."""
    if e is None:
        return None
    if isinstance(e, OSError) and e.errno is not None and type(e).__module__ != "requests.exceptions":
        if isinstance(e.strerror, str) and e.strerror.startswith("could not write"):
            return f"I/O error: {e.strerror}"
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return f"I/O error: {errno.errorcode.get(e.errno, e.errno)} {e.strerror}{where}"
    if type(e).__module__.split(".")[0] in ("mlflow", "requests", "urllib3"):
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        return f"tracking error: {msg}"
    return None
