"""A command's MLflow run does not stay RUNNING after its process is gone.

A process killed by a signal it cannot catch (SIGKILL, the kernel's out-of-memory killer), or ended by
Ray's core worker when its raylet or GCS died, never closes its MLflow run: the UI showed it RUNNING,
for ever or until a ``--resume``. So a command that opens runs (``train``, ``--cv``, a sweep) starts a
small watcher process, in a session of its own, that waits on a pipe only the command holds. The
command says "done" once it has closed its runs itself, whatever their end; a pipe that ends without
it means the command died. The watcher then closes the run, and its children still RUNNING (a
sweep's trials, a cross-validation's folds), as KILLED, with why in the tag ``raysys.error`` and in
``events.log`` -- unless a ``--resume`` already holds the run (its lock). Records that wait in the
run's tracking buffer (the command died in an outage) are sent first, in order. A store that does not
answer then is tried again for up to ``$RAYSYS_TRACKING_WAIT_S`` (600 s); past it, the run stays
RUNNING until a ``--resume`` sends them and ends it. A command that ended its run while the store was away
(its close waits in the buffer) says so ("hand off"): the watcher sends the records, the close among
them, once the store answers, and says nothing of a death.

The watcher costs a Python start and then sleeps in ``read``; it imports MLflow only after a death.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

DONE = b"d"
HAND_OFF = b"h"
"""The command ended, but its run's last records (its close among them) wait in its tracking buffer: the
watcher sends them once the store answers, and closes nothing itself."""


class Watcher:
    """The command's end of the pipe."""

    def __init__(self, fd: int, proc: subprocess.Popen):
        self.fd, self.proc = fd, proc

    def done(self) -> None:
        """The command closed its runs itself: the watcher leaves them as they are."""
        self._tell(DONE)

    def hand_off(self) -> None:
        """The command ended with records (the run's close among them) waiting in its tracking buffer, the
        store away: the watcher sends them once it answers (a --resume meanwhile takes them over)."""
        self._tell(HAND_OFF)

    def _tell(self, what: bytes) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, what)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def watch(uri: str, run_id: str, run_dir: Optional[Path] = None, lock: Optional[Path] = None,
          resume: str = "", remote: bool = False) -> Optional[Watcher]:
    """Start the watcher of MLflow run ``run_id`` (and its children) in store ``uri``. ``run_dir``: where
    its ``events.log`` and tracking buffer are; ``lock``: the lock file a resume of it holds; ``resume``:
    the command that continues it; ``remote``: the run lives on remote storage, ``run_dir`` being the
    command's copy (its buffer is the storage's to keep: a --resume sends it). None where no process can be started (the run is then as before)."""
    from raysys.tracking import BUFFER_FILE

    spec = {"uri": uri, "run_id": run_id, "resume": resume,
            "events": str(Path(run_dir) / "events.log") if run_dir else None,
            "buffer": str(Path(run_dir) / BUFFER_FILE) if run_dir else None, "lock": str(lock) if lock else None,
            "remote": remote}
    here = str(Path(__file__).resolve().parents[1])  # this raysys, wherever the command found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    r, w = os.pipe()  # not inheritable: no process this command starts holds the pipe open after it
    # the command's stderr, for the one line that says what happened when the command could not: the
    # watcher's own output (an import's warning) goes nowhere
    say = os.dup(2) if _is_open(2) else None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "raysys.watcher", json.dumps(spec), str(r), str(say or -1)],
                                pass_fds=tuple(fd for fd in (r, say) if fd is not None),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # a signal to the command's group leaves it be
    except OSError:
        os.close(w)
        return None
    finally:
        os.close(r)
        if say is not None:
            os.close(say)
    return Watcher(w, proc)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


WHY = ("the process ended without closing its run: killed (SIGKILL, out of memory) or ended by Ray when its "
       "raylet or GCS died")


def _close(spec: dict, hand_off: bool = False) -> bool:
    """Close the dead command's run and its RUNNING children KILLED, after sending in order what waits in
    its tracking buffer (the command died in an outage); whether it closed them."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a store that is away: leave it to --resume
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=spec["uri"])
    run = client.get_run(spec["run_id"])
    if run.info.status != "RUNNING":
        return False
    fd = None
    if spec.get("lock"):
        import fcntl

        fd = os.open(spec["lock"], os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False  # a --resume holds the run: it is RUNNING again, rightly
        os.ftruncate(fd, 0)
        from raysys.lifecycle import WATCHER_HOLDER

        os.pwrite(fd, f"{WATCHER_HOLDER} (process {os.getpid()}, for a moment)\n".encode(), 0)
    try:
        if client.get_run(spec["run_id"]).info.status != "RUNNING":
            return False
        buffer, sent = spec.get("buffer"), 0
        if buffer and os.path.isfile(buffer) and os.path.getsize(buffer):
            if spec.get("remote"):  # a remote run's buffer is also on its storage: sent here, a --resume
                return False        # would send it again
            # records the command could not send: they go first, in order (held by the lock, as a --resume
            # would send them); a store that refuses them raises, and the wait goes on
            from raysys.tracking import MLflowLogger

            with open(buffer) as f:
                sent = sum(1 for line in f if line.strip())
            if not MLflowLogger.send_buffer(spec["uri"], spec["run_id"], buffer):
                raise RuntimeError(f"the records in {buffer} could not be sent")
            if client.get_run(spec["run_id"]).info.status != "RUNNING":
                if hand_off:
                    _event(spec, f"the run's watcher sent the {sent} record(s) its command left in the tracking "
                                 "buffer (the store answered again)")
                return False  # they held its end
        if hand_off:  # the command ended the run itself: nothing of it is a death
            return False
        why = WHY + (f"; resume it with: {spec['resume']}" if spec.get("resume") else "")
        children = client.search_runs([run.info.experiment_id], filter_string=(
            f"tags.`mlflow.parentRunId` = '{spec['run_id']}' and attributes.status = 'RUNNING'"))
        for child in children:  # a fold or a trial says why too: the one a user opens in the UI may be it
            client.set_tag(child.info.run_id, "raysys.error", why[:5000])
            client.set_terminated(child.info.run_id, "KILLED")
        client.set_tag(spec["run_id"], "raysys.error", why[:5000])
        client.set_terminated(spec["run_id"], "KILLED")
        _event(spec, f"the run's watcher closed its MLflow run KILLED"
                     f"{f' (and {len(children)} children)' if children else ''}"
                     f"{f', after sending the {sent} record(s) of its tracking buffer' if sent else ''}: {WHY}")
        return True
    finally:
        if fd is not None:
            os.close(fd)


def _event(spec: dict, text: str) -> None:
    """One line in the run's events.log, where it has one."""
    if spec.get("events") and os.path.isdir(os.path.dirname(spec["events"])):
        import time

        with open(spec["events"], "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n")


def _say(fd: int, spec: dict, closed: bool = True) -> None:
    """One line on the dead command's stderr (a terminal, a job's log): nothing else could say it. Then the
    watcher lets go of that stderr: a pipe from the command (``| tee``) ends, whatever the store does."""
    if fd < 0:
        return
    line = (f"raysys: {WHY}; " + ("its MLflow run is closed KILLED" if closed else
                                  "its MLflow run could not be closed now (the tracking server does not answer); "
                                  "this watcher goes on trying, and a --resume closes it")
            + (f"; resume it with:\n  {spec['resume']}" if spec.get("resume") else "") + "\n")
    try:
        os.write(fd, line.encode())
    except OSError:  # the terminal is gone
        pass
    os.close(fd)


def main(argv: list[str]) -> int:
    spec, fd = json.loads(argv[0]), int(argv[1])
    say = int(argv[2]) if len(argv) > 2 else -1
    said = b""
    try:
        while chunk := os.read(fd, 16):  # blocks until the command says done or its end of the pipe closes
            said += chunk
    except OSError:
        pass
    if DONE in said:
        return 0
    hand_off = HAND_OFF in said
    if hand_off and say >= 0:  # the command said it all: its stderr (a `| tee`) is let go of at once
        os.close(say)
        say = -1
    import time

    # a tracking server that is away (an outage the command died in) is waited for, as a sweep waits
    # for it (tracking.wait_for_store); a --resume meanwhile takes the run over (the lock, above)
    wait_s = float(os.environ.get("RAYSYS_TRACKING_WAIT_S", "600")) if spec["uri"].startswith("http") else 30.0
    deadline, delay = time.monotonic() + wait_s, 2.0
    while True:
        try:
            if _close(spec, hand_off) and say >= 0:
                _say(say, spec)
            return 0
        except Exception:  # past the wait: the run stays RUNNING until a --resume
            if say >= 0:  # said once, at the first try: the command's stderr is not held for the whole wait
                _say(say, spec, closed=False)
                say = -1
            if time.monotonic() + delay > deadline:
                return 1
        time.sleep(delay)
        delay = min(2 * delay, 30.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
