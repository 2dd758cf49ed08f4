"""A run's life: its name, its lock, and stopping it cleanly.

- **Names.** A run name is a name, never a path: it becomes one folder under the storage path and
  the MLflow run name.
- **One process per run.** Creating a run makes its folder atomically (``mkdir`` fails if another
  process got there first); creating or resuming takes an exclusive ``flock`` on
  ``<run>/.raysys.lock`` held for the life of the process, so a second process is refused with the
  holder's pid instead of training into the same folder. The OS drops the lock when the process
  dies, so a crashed run never needs manual unlocking.
- **Signals.** The first SIGINT/SIGTERM/SIGHUP (or SIGUSR1/SIGUSR2, a batch system's warning) asks the training loop to stop at the next step
  boundary: it saves a checkpoint, the MLflow run is marked KILLED, the resume command is printed and
  the process exits 128 + the signal (130/143/129/138/140). A second signal stops at once (the last checkpoint is still there).
  SIGHUP is a terminal that closed (an ssh session that dropped): output that leads nowhere any more
  goes to /dev/null first. Under ``nohup`` it stays ignored.
  Ray workers learn about the request from a tiny actor (:class:`StopFlag`) the driver sets. A
  SIGTERM sent to a Ray Train worker (preemption, a node draining) sets the same flag, so the whole
  run stops at the boundary and the driver reports it as if it had been signalled itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from raysys.config import ConfigError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,127}")
LOCK_FILE = ".raysys.lock"


def validate_name(name: str, what: str = "--name") -> str:
    """A run name: letters, digits and ``. _ + = @ -``, at most 128 characters, no ``..``."""
    if not NAME.fullmatch(name) or ".." in name:
        raise ConfigError(f"{what} {name!r} is not a valid run name: use letters, digits and . _ + = @ - "
                          "(no '/', no '..', at most 128 characters); a run name is a name, not a path")
    return name


WATCHER_HOLDER = "the watcher of a session that ended"
"""How ``raysys.watcher`` names itself in a lock it holds while it closes a killed session's MLflow run."""
WATCHER_HOLD_S = 30.0
"""How long a resume waits for such a watcher (its MLflow calls, a second or two) rather than being refused."""


class RunLock:
    """An exclusive, process-lifetime lock on a run folder."""

    _held: dict[str, "RunLock"] = {}  # one per run folder per process (a re-entrant acquire is a no-op)

    def __init__(self, run_dir: Path, lock_dir: Optional[Path] = None, name: str = ""):
        self.key = str(Path(run_dir).resolve())
        if lock_dir is not None:
            lock_dir.mkdir(parents=True, exist_ok=True)
        self.path = (lock_dir / f"{name}.lock") if lock_dir is not None else Path(run_dir) / LOCK_FILE
        self.fd: Optional[int] = None
        self.lease = None
        """The run's ``storage.Lease`` when it lives on remote storage: the lock other machines see."""

    @classmethod
    def acquire(cls, run_dir: Path, name: str, lock_dir: Optional[Path] = None, what: str = "run") -> "RunLock":
        """``lock_dir``: where the lock file lives when not in the run folder (runs on remote storage); ``what``
        the folder holds (a run, a sweep), as the refusal names it."""
        key = str(Path(run_dir).resolve())
        if key in cls._held:
            return cls._held[key]
        lock = cls(run_dir, lock_dir, name)
        fd = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + WATCHER_HOLD_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                if holder.startswith(WATCHER_HOLDER) and time.monotonic() < deadline:
                    time.sleep(0.1)  # the watcher of a killed session closes its MLflow run: a moment
                    continue
                os.close(fd)
                raise ConfigError(f"{what} '{name}' is in use by {holder}; wait for it to finish, or choose another "
                                  "--name (nothing was changed)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        lock.fd = fd
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.fd is not None:
            self._held.pop(self.key, None)
            os.close(self.fd)  # closing drops the flock
            self.fd = None


    @staticmethod
    def in_use(run_dir: Path) -> bool:
        """Whether another process holds the run folder's lock now (a run being trained)."""
        try:
            fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)  # closing drops a lock it got

    @classmethod
    def of(cls, run_dir: Path) -> Optional["RunLock"]:
        """The lock this process holds on ``run_dir``, if any."""
        return cls._held.get(str(Path(run_dir).resolve()))

    @classmethod
    def release_dir(cls, run_dir: Path) -> None:
        lock = cls._held.get(str(Path(run_dir).resolve()))
        if lock is not None:
            lock.release()


def holder_of(run_dir: Path) -> Optional[str]:
    """What the run folder's lock says of the session holding it ('process N on host'), or None where the
    lock lives elsewhere (a run on remote storage). Its workers carry it: a worker of a session that was
    killed may train on for seconds, and must not write into a run another session has taken over."""
    try:
        return (Path(run_dir) / LOCK_FILE).read_text().strip() or None
    except OSError:
        return None


def claim_first(name: str, given: bool, claim: Callable[[str], Any]) -> Any:
    """``claim(name)``, which makes and locks what the name stands for (a ConfigError: taken). A default
    name (<workload>-<time>, ``given`` False) that a command started in the same second holds goes on to
    <name>-2, -3, ...: a user who named nothing named no collision. A name the user gave is refused."""
    tries = [name] if given else [name, *(f"{name}-{k}" for k in range(2, 100))]
    for candidate in tries[:-1]:
        try:
            return claim(candidate)
        except ConfigError:
            continue
    return claim(tries[-1])


def create_run_dir(run_dir: Path, name: str, lock_dir: Optional[Path] = None) -> RunLock:
    """Make a new run's folder and lock it. Of two processes creating the same run at once, one gets
    the lock first and the other is refused (by the lock, or by the folder it then finds in use)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run_dir, name, lock_dir)
    if any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        lock.release()
        raise ConfigError(f"a run called '{name}' already exists at {run_dir}; pass --resume to continue it "
                          "or choose another --name (nothing was changed)")
    return lock


# ---- stopping at a step boundary -------------------------------------------------------------------

_stop: dict[str, Any] = {"signum": None, "at": 0.0, "installed": False, "actor": None, "job": None, "worker_watch": False,
                        "event": threading.Event(), "armed": None, "complete": False, "late": None,
                        "uncut": None, "waiting": False}


def arm(resume: str = "", saved: Optional[Callable[[], bool]] = None) -> None:
    """A run now exists (its folder, locked): a stop request from here on ends it at a step boundary with
    a checkpoint. Before that there is nothing to save, and the first signal stops at once (a long data
    download, say, is not waited for). ``resume``: the command that continues it. A signal that came
    after the previous run of this process had trained to its end (:func:`late_stop`) stops this one."""
    _stop["armed"] = resume
    _stop["saved"] = saved
    _stop["complete"] = False
    if _stop["late"] is not None:
        request_stop(_stop["late"][0])
        _stop["late"] = None


def late_stop() -> Optional[int]:
    """A signal that came after the run had trained to its end (it finished all the same): a command
    that runs several runs (cross-validation's folds) starts no other."""
    return _stop["late"][0] if _stop["late"] is not None else None


def armed() -> bool:
    return _stop["armed"] is not None


def saved() -> bool:
    """Whether the run this process holds has a checkpoint (True where it cannot be told: storage away)."""
    check = _stop.get("saved")
    try:
        return check is None or bool(check())
    except Exception:
        return True


def resume_hint() -> str:
    """The command that continues the run this process holds ('' if it said none)."""
    return _stop["armed"] or ""


def stop_requested() -> Optional[int]:
    """The signal that asked this process to stop (one of ``STOP_SIGNALS``), or None."""
    return _stop["signum"]


def request_stop(signum: int = signal.SIGINT) -> None:
    """Ask the run to stop at its next step boundary; the Ray workers learn it through the StopFlag. Safe
    in a signal handler: no Ray call is made here (submitting a task from a handler that interrupted
    the driver's ``ray.get`` can fail, and the workers would never hear of the stop); the relay thread
    of :func:`stop_flag_actor` passes it on."""
    if _stop["signum"] is None:
        _stop["signum"], _stop["at"] = signum, time.monotonic()
    _stop["event"].set()


def withdraw_stop() -> None:
    """The run ended on its own before it acted on the stop request (it trained to its end): no stop."""
    _stop["signum"] = None


def _relay(actor: Any, event: threading.Event) -> None:
    """Driver thread: pass the stop request on to the workers' StopFlag once one comes."""
    event.wait()
    if _stop["actor"] is actor and _stop["signum"] is not None:
        try:
            actor.set.remote(_stop["signum"])
        except Exception:  # Ray already gone: the workers are too
            pass


# `timeout`, Slurm and `kill -- -PGID` signal the process and then its whole group: this process can get
# one request twice, microseconds apart. A repeat of the same signal this soon is that echo, not a
# person asking again.
ECHO_S = 1.0


def _echoes(first: Optional[tuple[int, float]], signum: int) -> bool:
    """Whether ``signum`` repeats, within ``ECHO_S``, the signal ``first`` (its number and time)."""
    return first is not None and first[0] == signum and time.monotonic() - first[1] < ECHO_S


def is_echo(signum: int) -> bool:
    """Whether ``signum`` repeats, within ``ECHO_S``, the stop request this process already has."""
    return _echoes((_stop["signum"], _stop["at"]), signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""What stops a run at its next step boundary: Ctrl-C; a scheduler, ``timeout`` or ``kill``; a terminal
that closed; a batch system's warning that the job's time is nearly up (Slurm's ``--signal=USR1@90``,
Grid Engine's ``-notify``: SIGUSR1/SIGUSR2), whose default action would kill the run mid-step."""


def stop_signals(signals: tuple = STOP_SIGNALS) -> list[int]:
    """Those of ``signals`` this process is to handle: a SIGHUP that ``nohup`` ignores stays ignored."""
    return [s for s in signals if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN]


def _handler(signum, frame) -> None:
    if signum == signal.SIGHUP:  # before any message: a write to a closed terminal fails
        from raysys import console

        console.drop_lost_outputs()
    if _stop["complete"]:  # trained to its end: what is left (its final evaluation, its records) is not cut
        late = _stop["late"]
        if late is not None and not _echoes(late, signum):
            raise KeyboardInterrupt  # asked again: stop now
        if late is None:
            _stop["late"] = (signum, time.monotonic())
            from raysys import console

            console.Sink().message(f"[raysys] {signal.Signals(signum).name}: the run has trained to its end; it "
                                   "finishes its final records (send it again to stop at once)")
        return
    if _stop["signum"] is not None:
        if is_echo(signum):
            return
        if _stop["uncut"] is not None:  # asked again during a compiled program: said, not raised (see uncut)
            from raysys import console

            left = _stop["uncut"] - time.monotonic()
            eta = f", in about {max(1, round(left))} s" if _stop["uncut"] and left > 0 else ""
            console.Sink().message(f"[raysys] {signal.Signals(signum).name}: the step running now is one compiled "
                                   f"program, which cannot be cut short: the run stops when it ends{eta}, with a "
                                   "checkpoint")
            return
        raise KeyboardInterrupt  # asked again: stop now (the CLI exits 128 + the first signal)
    request_stop(signum)
    if _stop["armed"] is None:
        raise KeyboardInterrupt  # no run yet: nothing to save, nothing to wait for
    if _stop["waiting"]:  # no worker runs (the cluster cannot place them): no step boundary will come
        raise KeyboardInterrupt
    from raysys import console

    console.Sink().message(f"[raysys] {signal.Signals(signum).name}: stopping at the next step boundary with a "
                           "checkpoint (send it again to stop at once)")


def set_waiting(waiting: bool) -> None:
    """Whether the run waits for workers the cluster cannot place now (``runtime.WaitingForWorkers``): a stop
    signal then stops at once, keeping the last checkpoint, since no step boundary comes while none runs."""
    _stop["waiting"] = bool(waiting)


@contextlib.contextmanager
def uncut(seconds: Optional[float] = None):
    """A stretch no signal can cut short: one compiled program (a JAX chunk) that runs to its end whatever
    Python does; even the process's exit waits for it. A second stop signal meanwhile is answered with when
    the run stops (``seconds``: how long the stretch is expected to take), not with a stop "at once" that
    would drop the chunk and still wait it out. Its wait must let handlers run: ``jax_host.wait``."""
    _stop["uncut"] = time.monotonic() + seconds if seconds else 0.0
    try:
        yield
    finally:
        _stop["uncut"] = None


def install_signal_handlers() -> None:
    """Graceful stop on ``STOP_SIGNALS`` for this (driver) process; a SIGHUP that ``nohup`` ignores stays
    ignored. Call again after ``ray.init``, which installs its own SIGTERM handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in stop_signals():
        signal.signal(signum, _handler)
    _stop["installed"] = True


def restore_signal_handlers(handlers: dict) -> None:
    """Put back the handlers a caller had (``main`` called from Python, e.g. a notebook or a test)."""
    if threading.current_thread() is threading.main_thread() and _stop["installed"]:
        if _stop["signum"] is not None:  # an echo still on its way must meet this handler, not the default
            time.sleep(max(0.0, _stop["at"] + ECHO_S - time.monotonic()))
        for signum, h in handlers.items():
            signal.signal(signum, h if h is not None else signal.SIG_DFL)
        _stop["installed"] = False


def handles_signals() -> bool:
    """Whether this process stops runs gracefully on a signal (``install_signal_handlers`` ran)."""
    return bool(_stop["installed"])


def reinstall_if_active() -> None:
    if _stop["installed"]:
        install_signal_handlers()


def reset() -> None:
    """Forget a stop request (tests, and a process that runs several runs)."""
    _stop["signum"], _stop["actor"], _stop["armed"] = None, None, None
    _stop["complete"], _stop["late"], _stop["uncut"], _stop["waiting"] = False, None, None, False
    _stop["event"].set()  # a waiting relay sees no actor of its own and ends
    _stop["event"] = threading.Event()


def settle_stop(actor: Any = None) -> Optional[int]:
    """The driver, once the workers of a run are done (``actor``: that run's :class:`StopFlag`, None for a
    run in this process): adopt a stop that a worker's SIGTERM asked for, or withdraw one that came too
    late to act on (rank 0 said :func:`reached_end`)."""
    if actor is not None:
        import ray

        try:
            signum, ended = ray.get(actor.state.remote(), timeout=10)
        except Exception:  # Ray gone: nobody can have asked
            signum, ended = None, False
        if ended:
            _stop["complete"] = True  # a signal from here on cannot make the run KILLED
            if _stop["signum"] is not None:
                _said_complete()
        elif _stop["signum"] is None and signum is not None:
            _stop["signum"] = signum
    return _stop["signum"]


def reached_end(actor: Any = None) -> None:
    """A loop (rank 0) trained to its end without acting on a stop request: the run is complete, and the
    driver is not to mark it KILLED. ``actor``: the run's :class:`StopFlag` when the loop runs in a Ray
    worker; None in the driver's own process."""
    if actor is None:
        _stop["complete"] = True  # a signal from here on (its final evaluation) cannot make the run KILLED
        if _stop["signum"] is not None:
            _said_complete()
        return
    import ray

    try:
        ray.get(actor.end.remote(), timeout=10)
    except Exception:  # Ray gone: the driver then keeps the stop (a resume finds nothing left to train)
        pass


def _said_complete() -> None:
    withdraw_stop()
    from raysys import console

    console.Sink().message("[raysys] the run reached its end before it could act on the stop request: it is complete")


def _worker_handler(signum, frame) -> None:
    loop = _stop["worker_watch"]
    if is_echo(signum):
        return
    if _stop["signum"] is not None or not (isinstance(loop, threading.Thread) and loop.is_alive()):
        # a second SIGTERM, or no loop left to stop (Ray shutting the worker down): exit now, as
        # Ray's own handler would
        raise SystemExit(1)
    # no Ray call here: submitting a task from a signal handler trips Ray's checks; the training
    # thread's StopPoller passes the request on to the StopFlag at its next step boundary
    _stop["signum"], _stop["at"] = signum, time.monotonic()


def watch_worker_sigterm(actor: Any) -> None:
    """In a Ray actor that runs a training loop: SIGTERM (or SIGHUP, SIGUSR1/2) sets the run's
    :class:`StopFlag` instead of killing the worker, so every rank stops at the next step boundary with a checkpoint. Only the main
    thread may install a handler, and Train runs the loop in a thread of its own; the main thread runs
    the actor's tasks, so the handler is installed by a task sent to this very actor (not awaited)."""
    import ray

    if _stop["worker_watch"] or not ray.is_initialized():
        return
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE or ctx.get_actor_id() is None:
        return  # the driver has its own handlers; a plain task has no thread to ask
    _stop["worker_watch"], _stop["actor"] = threading.current_thread(), actor  # the loop's thread
    if threading.current_thread() is threading.main_thread():
        _install_worker_handler(None)
    else:
        ctx.current_actor.__ray_call__.remote(_install_worker_handler)


def _install_worker_handler(_instance: Any) -> None:
    for signum in STOP_SIGNALS[1:]:  # SIGINT is Ray's: a worker never sees a terminal's Ctrl-C
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _worker_handler)


def exit_code(signum: int) -> int:
    return 128 + int(signum)  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP, 138 for SIGUSR1


class StopFlag:
    """Holds the driver's stop request for Ray workers on any node (a 0-CPU actor)."""

    def __init__(self):
        self.signum, self.ended = None, False

    def set(self, signum: int) -> None:
        self.signum = signum

    def get(self) -> Optional[int]:
        return self.signum

    def begin(self) -> None:
        """A new run of this driver starts: the last one's end is not its end."""
        self.ended = False

    def end(self) -> None:
        """Rank 0 trained the run to its end (a stop request, if any, came too late to act on)."""
        self.ended = True

    def state(self) -> tuple[Optional[int], bool]:
        return self.signum, self.ended


def stop_flag_actor():
    """The driver's StopFlag actor for the run it starts now (created on first use; already set if a signal
    came first)."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    if _stop["actor"] is None or _stop["job"] != job:  # one per Ray session (tests start several)
        _stop["actor"], _stop["job"] = ray.remote(num_cpus=0)(StopFlag).remote(), job
        # a stop already asked is passed on at once by the relay: its event is set
        threading.Thread(target=_relay, args=(_stop["actor"], _stop["event"]), daemon=True,
                         name="raysys-stop-relay").start()
    else:
        _stop["actor"].begin.remote()  # ordered before this driver's later calls: settle_stop sees this run only
    return _stop["actor"]


class StopPoller:
    """What a training loop asks at each step boundary. In the driver's process it reads the local flag;
    in a Ray worker it asks the driver's :class:`StopFlag`, at most every ``interval`` seconds."""

    def __init__(self, actor: Any = None, interval: float = 1.0):
        self.actor, self.interval, self._next, self._seen, self._told = actor, interval, 0.0, None, False
        if actor is not None:
            watch_worker_sigterm(actor)

    def __call__(self) -> Optional[int]:
        if self._seen is not None:
            return self._seen
        local = stop_requested()
        if local is not None:
            self._seen = local
            if self.actor is not None and not self._told:  # a worker's own SIGTERM: tell every rank
                self._told = True
                try:
                    self.actor.set.remote(local)
                except Exception:
                    pass
        elif self.actor is not None:
            import time

            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.interval
                import ray

                try:
                    self._seen = ray.get(self.actor.get.remote(), timeout=10)
                except Exception:
                    pass
        return self._seen
