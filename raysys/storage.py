"""Where runs live: a local folder, or any filesystem ``pyarrow.fs`` resolves (``s3://``, ``gs://``,
``hdfs://``, ``file://``), as Ray Train's own storage layer does.

A run on remote storage has a **working copy** on each process that touches it: a private temporary
folder (never shared between processes, so a worker restarted on another node really reads the
storage, not a neighbour's leftovers). Everything the run folder holds is written there first and
then pushed: checkpoints (``state.pt`` or ``state.npz`` first, ``meta.json`` last, so a half upload is never taken
for a checkpoint), the config snapshots, ``events.log``, the breakdown and final metrics. Resuming
pulls the run's files and the newest complete checkpoint back.

URI query parameters go to the filesystem, e.g.
``s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http`` for an S3-compatible server.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import quote, urlsplit

URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
RETRY_ENV, RETRY_S = "RAYSYS_STORAGE_RETRY_S", 60
SLOW_S = 10  # a storage call taking this long is said on the console
log = logging.getLogger(__name__)

# What pyarrow's object stores say when the endpoint cannot be reached at all (its OSErrors carry no
# errno): curl's "could not connect" and the AWS SDK's network and throttling errors.
_UNREACHABLE = ("NETWORK_CONNECTION", "Could not connect", "Couldn't connect", "Connection refused",
                "Connection reset", "Connection timed out", "Timeout was reached", "SERVICE_UNAVAILABLE", "SLOW_DOWN")


def unreachable(e: BaseException) -> bool:
    """Whether a storage error says the service could not be reached (worth trying again), not what it answered."""
    return isinstance(e, (ConnectionError, TimeoutError)) or any(k in str(e) for k in _UNREACHABLE)


def is_file_uri(path: str) -> bool:
    """``file://...``, its scheme in any case (URI schemes are case-insensitive, RFC 3986)."""
    return path[:7].lower() == "file://"


def is_remote(path: str) -> bool:
    return bool(URI.match(path)) and not is_file_uri(path)


def check_local_folder(folder: Path, what: str = "storage path") -> None:
    """A ConfigError naming ``folder`` unless it is (or can be made as) a writable folder. Its nearest
    existing ancestor is tried with a throwaway subfolder, removed at once: permission bits do not say
    what root, a read-only mount or a pseudo filesystem such as /proc allow."""
    from raysys.config import ConfigError

    folder = Path(folder)
    base = folder
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{what} {folder}: {base} is a file, not a folder")
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".raysys-probe-", dir=base))
    except OSError as e:
        raise ConfigError(f"{what} {folder}: cannot write in {base} ({e.strerror or type(e).__name__})") from None


def bounded(fs: Any) -> Any:
    """An S3 filesystem whose every call gives up within seconds on an endpoint that accepts connections but
    never answers (a hung server or proxy): ``from_uri`` leaves the AWS SDK's own retries, minutes per call,
    where ``Remote._retrying`` should decide (and say) how long an outage is waited out. The options are the
    URI's own (the filesystem's pickled form, which keeps them all); other filesystems are left as they are."""
    import pyarrow.fs as pafs

    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    make, (options,) = fs.__reduce__()
    try:
        return make(options)  # pyarrow's own retry strategy: a few attempts of a few seconds each
    except Exception:  # a pyarrow whose pickled form differs: the URI's filesystem as it was
        return fs


class Remote:
    """The storage root of remote runs: a pyarrow filesystem and the base path in it."""

    def __init__(self, uri: str):
        import pyarrow.fs as pafs

        from raysys.config import ConfigError

        self.uri = uri
        try:
            self.fs, self.base = pafs.FileSystem.from_uri(uri)
        except Exception as e:  # unknown scheme, missing credentials library, malformed URI
            raw = sorted({c for c in urlsplit(uri).path if c == " " or not c.isascii()})
            hint = (f"; a URI holds {' and '.join(repr(c) for c in raw)} percent-encoded ({', '.join(quote(c) for c in raw)})"
                    if raw else "")
            raise ConfigError(f"storage path {uri!r}: {str(e).splitlines()[0]}{hint}") from None
        self.fs = bounded(self.fs)
        self.base = self.base.rstrip("/")
        self.display = urlsplit(uri)._replace(query="").geturl().rstrip("/")
        if not self.base:
            raise ConfigError(f"storage path {uri!r} names no bucket or folder (e.g. s3://bucket/runs)")

    def check(self, what: str = "--storage-path") -> None:
        """A ConfigError naming the storage unless a throwaway object can be written there and removed: a
        missing bucket, refused credentials or an endpoint nothing answers at, said before anything exists."""
        from raysys.config import ConfigError

        from raysys.console import held_stderr

        probe = self.path(f".raysys-probe-{uuid.uuid4().hex[:12]}")
        try:
            with held_stderr(drop=lambda line: "/arrow/" in line):  # Arrow's line per retry of a refused write
                with self.fs.open_output_stream(probe) as f:
                    f.write(b"raysys")
                self.fs.delete_file(probe)
        except Exception as e:  # pyarrow's OSError has no errno: its first line says what the service said
            try:  # a write that failed late (its completion refused) may have left the object
                self.fs.delete_file(probe)
            except Exception:
                pass
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            # S3-compatible servers that answer pyarrow's multipart uploads wrongly (moto's): one PUT a file
            hint = ("; a server that mishandles multipart uploads takes one PUT per file with ?allow_delayed_open=true "
                    "on the URI" if "MultipartUpload" in str(e) and "allow_delayed_open" not in self.uri else "")
            raise ConfigError(f"{what} {self.display}: cannot write there ({reason}){hint}") from None

    def path(self, *parts: str) -> str:
        return "/".join([self.base, *[p.strip("/") for p in parts if p]])

    def kind(self, *parts: str):
        import pyarrow.fs as pafs

        t = self._retrying(lambda: self.fs.get_file_info(self.path(*parts)), f"look-up of {'/'.join(parts)}").type
        return {pafs.FileType.File: "file", pafs.FileType.Directory: "dir"}.get(t)

    def listdir(self, *parts: str) -> list[str]:
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self.path(*parts), allow_not_found=True)
        return sorted(info.base_name for info in self._retrying(lambda: self.fs.get_file_info(sel),
                                                                f"listing of {'/'.join(parts)}"))

    def put(self, local: Path, *parts: str) -> None:
        def once() -> None:
            with open(local, "rb") as src, self.fs.open_output_stream(self.path(*parts)) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)

        self._retrying(once, f"upload {'/'.join(parts)}")

    def get(self, local: Path, *parts: str) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.part")  # two pulls of one file never share it

        def once() -> None:
            with self.fs.open_input_stream(self.path(*parts)) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)

        try:
            self._retrying(once, f"download {'/'.join(parts)}")
            tmp.replace(local)
        finally:
            tmp.unlink(missing_ok=True)

    def _retrying(self, once, what: str):
        """``once()``, tried again while the storage cannot be reached (an endpoint restarting, a network
        blip), for up to ``$RAYSYS_STORAGE_RETRY_S`` (60 s): an outage that short costs a checkpoint no run.
        Anything else the service answers (denied, no such bucket) is raised at once."""
        start = time.monotonic()
        deadline, delay, said = start + float(os.environ.get(RETRY_ENV, RETRY_S)), 0.5, False
        waited = threading.Event()  # a wait was said: its end is said too (the progress alone goes on silently)

        def stalled():
            waited.set()
            log.warning("storage %s has not answered the %s for %d s; waiting for it", self.display, what, SLOW_S)

        # an endpoint that stalls without failing (a paused server, a congested link) holds a call until the
        # filesystem's own retries give up or it answers: a first attempt taking SLOW_S is said
        slow = threading.Timer(SLOW_S, stalled)
        slow.daemon = True
        slow.start()
        while True:
            try:
                done = once()
                if said or waited.is_set():
                    log.warning("storage %s answers again: the %s went through after %.0f s", self.display, what,
                                time.monotonic() - start)
                return done
            except OSError as e:
                if not unreachable(e) or time.monotonic() + delay > deadline:
                    raise
                if not said:
                    said = True
                    log.warning("storage %s unreachable (%s); trying the %s again for up to %s s", self.display,
                                " ".join(str(e).split())[:160], what, os.environ.get(RETRY_ENV, RETRY_S))
                time.sleep(delay)
                delay = min(2 * delay, 8.0)
            finally:
                slow.cancel()  # after the first attempt: an unreachable storage is said above

    def delete_dir(self, *parts: str) -> None:
        self._retrying(lambda: self.fs.delete_dir(self.path(*parts)), f"removal of {'/'.join(parts)}")

    def ray_storage(self) -> dict:
        """``RunConfig`` arguments that put Ray Train's own run state on the same storage."""
        return {"storage_path": self.base, "storage_filesystem": self.fs}


# ---- run folders ----------------------------------------------------------------------------------

_runs: dict[str, tuple[Remote, str]] = {}  # working copy -> (storage, run name)


def working_copy(storage: Remote, name: str) -> Path:
    """A fresh private folder standing for run ``name`` in this process, removed when the process ends.
    A process killed outright cannot remove its own: each copy has a ``<copy>.alive`` file its process
    keeps locked, and the copies whose lock nobody holds are removed by the next process that makes one."""
    held = _copy_of(storage, name)
    if held is not None:
        return held
    _remove_orphans()
    # the lock first, then the folder: a sweeper that finds the lock free before it is taken removes
    # nothing of ours (the folder does not exist yet, and the unlinked lock file is never looked at again)
    fd, alive = tempfile.mkstemp(prefix=f"raysys-{name}-", suffix=ALIVE)
    fcntl.flock(fd, fcntl.LOCK_EX)
    root = Path(alive[: -len(ALIVE)])
    root.mkdir()
    _locks[str(root)] = fd
    atexit.register(drop_copy, root)
    _runs[str(root)] = (storage, name)
    return root


def _copy_of(storage: Remote, name: str) -> Optional[Path]:
    """This process's working copy of run ``name`` on ``storage``, if it has one."""
    return next((Path(local) for local, (s, n) in _runs.items() if s.uri == storage.uri and n == name), None)


ALIVE = ".alive"
_swept = False
_locks: dict[str, int] = {}  # working copy -> its locked .alive file


def drop_copy(root: Path) -> None:
    """Remove a working copy this process made (once; a second call, or another folder, does nothing)."""
    fd = _locks.pop(str(root), None)
    if fd is None:
        return
    _runs.pop(str(root), None)
    shutil.rmtree(root, ignore_errors=True)
    Path(f"{root}{ALIVE}").unlink(missing_ok=True)
    os.close(fd)


def _remove_orphans() -> None:
    """Remove the working copies of processes that ended without removing them (SIGKILL, a crash), once
    per process: a copy's ``.alive`` lock is free exactly when its process is gone."""
    global _swept
    if _swept:
        return
    _swept = True
    for alive in Path(tempfile.gettempdir()).glob(f"raysys-*{ALIVE}"):
        try:
            fd = os.open(alive, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its process is alive
            os.close(fd)
            continue
        shutil.rmtree(str(alive)[: -len(ALIVE)], ignore_errors=True)
        alive.unlink(missing_ok=True)
        os.close(fd)


def register(local: Path, uri: str, name: str) -> None:
    """Declare ``local`` the working copy of ``<uri>/<name>`` in this process (a sweep's trial processes)."""
    _runs.setdefault(str(local), (Remote(uri), name))


def remote_of(run_dir: Path) -> Optional[tuple[Remote, str]]:
    return _runs.get(str(run_dir))


def push(path: Path) -> None:
    """Upload a file of a run's working copy to its storage (nothing to do for local runs)."""
    path = Path(path)
    owner = remote_of(path.parent) or remote_of(path.parent.parent)
    if owner is None or not path.is_file():
        return
    storage, name = owner
    rel = path.relative_to(_local_of(storage, name)).as_posix()
    storage.put(path, name, rel)


def pull_run_files(storage: Remote, name: str, local: Path) -> None:
    """The run folder's own files (not checkpoints) from storage into the working copy."""
    for entry in storage.listdir(name):
        if storage.kind(name, entry) == "file":
            storage.get(local / entry, name, entry)


def _local_of(storage: Remote, name: str) -> Path:
    for local, (s, n) in _runs.items():
        if s is storage or (s.uri == storage.uri and n == name):
            return Path(local)
    raise KeyError(name)


def payload(run_dir: Path) -> dict[str, Any]:
    """What a Ray worker needs to find the run: its storage URI and name when remote."""
    owner = remote_of(run_dir)
    if owner is None:
        return {}
    return {"storage_uri": owner[0].uri, "run_name": owner[1], "lease_token": _tokens.get((owner[0].uri, owner[1]))}


SHARED_WAIT_S = 30.0  # how long a worker looks for the run folder (a network file system's cache)


def _shared(run_dir: Path) -> Path:
    """The run folder as a worker on another node sees it, or a ConfigError: a --storage-path the nodes do not
    share (a local folder on a cluster) ran to its end with its checkpoints and results on some other node's
    disk, the driver finding none. The driver made the folder and its lock file before any worker started; a
    network file system may show them a moment late."""
    from raysys.config import ConfigError
    from raysys.lifecycle import LOCK_FILE

    deadline = time.monotonic() + float(os.environ.get("RAYSYS_SHARED_WAIT_S", SHARED_WAIT_S))
    while not (run_dir / LOCK_FILE).exists():
        if time.monotonic() >= deadline:
            import socket

            raise ConfigError(f"the run folder {run_dir} is not on node {socket.gethostname()} (a Ray Train worker "
                              "runs there): a cluster's nodes must share --storage-path (a shared file system, or "
                              "s3://...)")
        time.sleep(1.0)
    return run_dir


@contextlib.contextmanager
def worker_run_dir(p: dict) -> Iterator[Path]:
    """The run folder of a Ray worker: the shared one, or a working copy of the remote run. A copy made here
    is removed when the worker's function ends, however it ends: Ray ends its worker processes without
    running ``atexit``, which would leave a copy of every checkpoint in each node's temp folder. (A worker
    in the driver's own process, ``--workers 0``, works in the driver's copy, which stays.)"""
    if not p.get("storage_uri"):
        yield _shared(Path(p["run_dir"]))
        return
    remote = Remote(p["storage_uri"])
    made = _copy_of(remote, p["run_name"]) is None
    root = working_copy(remote, p["run_name"])
    if p.get("lease_token"):  # the session's lease: a worker's writes are fenced by it too (check_lease)
        _tokens[(remote.uri, p["run_name"])] = p["lease_token"]  # this session's, not a process's earlier one
    try:
        yield root
    finally:
        if made:
            drop_copy(root)


def write_text(path: Path, text: str) -> None:
    """Write a run file in the working copy and push it to the run's storage. The file appears whole or
    not at all: a process killed mid-write must not leave an empty config snapshot a resume reads."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half copy left in the run folder
        tmp.unlink(missing_ok=True)
        raise
    push(path)


def pull(path: Path) -> bool:
    """Fetch one run file from storage into the working copy; False when it is not there."""
    path = Path(path)
    owner = remote_of(path.parent)
    if owner is None:
        return path.is_file()
    storage, name = owner
    if storage.kind(name, path.name) != "file":
        return False
    storage.get(path, name, path.name)
    return True


def where(run_dir: Path) -> str:
    """The run folder as users know it: the storage URI of a remote run, else the local path."""
    owner = remote_of(Path(run_dir))
    return f"{owner[0].display}/{owner[1]}" if owner else str(run_dir)


def join(uri: str, *parts: str) -> str:
    """``uri`` with path ``parts`` appended, its query (the filesystem's options) kept."""
    s = urlsplit(uri)
    return s._replace(path="/".join([s.path.rstrip("/"), *[p.strip("/") for p in parts]])).geturl()


def append_line(path: Path, line: str) -> None:
    """Append to a run's or sweep's log file; on remote storage after pulling what others wrote. An object
    store has no append: a process that pushed between this one's pull and push replaced the object, so the
    line is looked for once pushed and appended again where it was lost then (a sweep's trials share one
    log; a writer slower still can drop a line, which costs a trial's reported seconds or one more restart)."""
    for _ in range(5):
        pull(path)
        with open(path, "a") as f:
            f.write(line)
        push(path)
        if remote_of(path.parent) is None:  # a local file: appended in place
            return
        pull(path)
        if line in path.read_text(errors="replace"):
            return
        time.sleep(0.05 + 0.1 * (uuid.uuid4().int % 10) / 10)  # apart from the other writer


def push_tree(folder: Path) -> None:
    """Upload every file under ``folder`` of a working copy."""
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            push_nested(p)


def pull_tree(folder: Path) -> None:
    """Fetch every file of one folder (not its subfolders) of a working copy from its storage."""
    for parent in Path(folder).parents:
        owner = remote_of(parent)
        if owner is not None:
            remote, name = owner
            rel = Path(folder).relative_to(parent).as_posix()
            for entry in remote.listdir(name, rel):
                if remote.kind(name, rel, entry) == "file":
                    remote.get(Path(folder) / entry, name, rel, entry)
            return


def push_nested(path: Path) -> None:
    """``push`` for a file at any depth below its working copy."""
    for parent in Path(path).parents:
        owner = remote_of(parent)
        if owner is not None:
            owner[0].put(path, owner[1], path.relative_to(parent).as_posix())
            return


def remove(path: Path) -> None:
    """Delete a run file from the working copy and from the run's storage."""
    path = Path(path)
    path.unlink(missing_ok=True)
    owner = remote_of(path.parent)
    if owner is not None and owner[0].kind(owner[1], path.name) == "file":
        owner[0].fs.delete_file(owner[0].path(owner[1], path.name))


# ---- one holder of a remote run, across machines -----------------------------------------------------

LEASES = ".raysys-leases"
"""Folder of the storage root holding a lease object per remote run in use (run names start with a letter
or digit, so no run is called this)."""


class LeaseLost(RuntimeError):
    """Another process holds this session's remote run now: this one was paused or cut off from the storage
    past its lease's watch (a stopped process, a suspended machine), and a newcomer took the run over. It
    writes nothing more to the run (no checkpoint, no metric, no end in MLflow): the run goes on there."""


_tokens: dict[tuple[str, str], str] = {}  # (storage, run) -> the token of the lease this session trains under
_lost: dict[tuple[str, str], str] = {}  # (storage, run) -> why, once this process's lease was found taken
_checked: dict[tuple[str, str], float] = {}  # (storage, run) -> when check_lease last read the lease


def check_lease(run_dir: Path, every_s: float = 0.0) -> None:
    """Raise :class:`LeaseLost` where ``run_dir``'s remote run is leased to another process than the session
    this process trains for (its lease's token differs, or the lease is gone). ``every_s``: read the lease at
    most that often (a metric's record), else only what this process's own lease found. A storage that does not
    answer says nothing here: its writes wait for it and say so."""
    owner = remote_of(Path(run_dir))
    if owner is None:
        return
    key = (owner[0].uri, owner[1])
    if key in _lost:
        raise LeaseLost(_lost[key])
    token = _tokens.get(key)
    if token is None or time.monotonic() - _checked.get(key, -1e9) < every_s:
        return
    _checked[key] = time.monotonic()
    lease = Lease(*owner)
    try:
        now = lease._read()
    except Exception:
        return
    if now is None or now.get("token") != token:
        _lost[key] = lease.taken_line(now)
        raise LeaseLost(_lost[key])


def lease_fence(run_dir: Path):
    """For a remote run's MLflow logger: a call that raises :class:`LeaseLost` once another process holds the run
    (reading the lease at most once a beat); None for a local run (its lock is the machine's)."""
    import functools

    if remote_of(Path(run_dir)) is None:
        return None
    return functools.partial(check_lease, Path(run_dir), every_s=beat_s())


def beat_s() -> float:
    """Seconds between a lease's renewals (``RAYSYS_LEASE_BEAT_S``, default 5). A holder is taken for
    gone once its lease went unrenewed for 4 beats."""
    return float(os.environ.get("RAYSYS_LEASE_BEAT_S", "5"))


class Lease:
    """The run lock of a run on remote storage, where two machines cannot see each other's lock files and
    object stores have no locks: ``<root>/.raysys-leases/<run>`` names its holder and a beat count that a
    thread of the holder raises every :func:`beat_s` seconds. A newcomer that finds a lease watches it for
    4 beats and, if the count moved, is refused; if it did not, the holder is gone (a killed process, a lost
    node) and the newcomer takes over. No clock is compared: only whether the object changes.

    Two newcomers at the same instant are told apart by writing, waiting one second and reading back
    (object stores are read-after-write consistent): the one that reads another's lease steps back. A
    newcomer that read no lease and wrote its own more than a second later may still share the run."""

    def __init__(self, storage: Remote, name: str):
        import socket

        self.storage, self.name = storage, name
        self.holder = f"process {os.getpid()} on {socket.gethostname()}"
        self.token = uuid.uuid4().hex
        self.beats = 0
        self._stop = None
        self._writing = None  # a beat's write and the release never overlap (a late beat would revive it)

    def _read(self) -> Optional[dict]:
        import json

        try:
            with self.storage.fs.open_input_stream(self.storage.path(LEASES, self.name)) as f:
                return json.loads(f.read().decode())
        except (FileNotFoundError, ValueError):
            return None
        except OSError as e:  # pyarrow's "not found" of some stores carries no errno
            if "not found" in str(e).lower() or "nosuchkey" in str(e).lower() or "does not exist" in str(e).lower():
                return None
            raise

    def _write(self) -> None:
        import json

        body = json.dumps({"holder": self.holder, "token": self.token, "beats": self.beats}).encode()
        with self.storage.fs.open_output_stream(self.storage.path(LEASES, self.name)) as f:
            f.write(body)

    def acquire(self, say=lambda line: print(line, flush=True)) -> "Lease":
        """Hold the run, or raise a ConfigError naming its live holder; ``say`` tells of a wait."""
        import time

        from raysys.config import ConfigError

        seen = self._read()
        if seen is not None and seen.get("token") != self.token:
            wait = 4 * beat_s()
            say(f"[raysys] run '{self.name}' on {self.storage.display} was last held by {seen.get('holder')}; "
                f"watching its lease for {wait:.0f} s to see whether it is still running")
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                time.sleep(min(1.0, beat_s() / 2))
                now = self._read()
                if now is None:  # released meanwhile: a clean finish
                    break
                if now != seen:
                    raise ConfigError(f"run '{self.name}' is in use by {now.get('holder')} (its lease on "
                                      f"{self.storage.display} is being renewed); wait for it to finish, or choose "
                                      "another --name (nothing was changed)")
        self._write()
        time.sleep(1.0)
        now = self._read()
        if now is None or now.get("token") != self.token:
            raise ConfigError(f"run '{self.name}' was taken at this moment by "
                              f"{(now or {}).get('holder', 'another process')}; choose another --name (nothing was changed)")
        self._renew()
        return self

    def taken_line(self, now: Optional[dict]) -> str:
        who = (now or {}).get("holder") or "another process (its lease is gone)"
        return (f"run '{self.name}' on {self.storage.display} was taken over by {who}: this process did not renew "
                f"its lease for {4 * beat_s():.0f} s (stopped, suspended or cut off from the storage), so it stops and "
                "writes nothing more to the run, which goes on there")

    def _renew(self) -> None:
        import atexit
        import threading

        self._stop, self._writing = threading.Event(), threading.Lock()
        key = (self.storage.uri, self.name)
        _tokens[key] = self.token
        _lost.pop(key, None)  # held again (a later session of this process): what it lost before is history
        _checked.pop(key, None)

        def beat():
            while not self._stop.wait(beat_s()):
                with self._writing:
                    if self._stop.is_set():
                        return
                    # read before renewing: after a pause (SIGSTOP, a suspended machine) a newcomer may hold the
                    # run, and a blind renewal would make two processes train it, each deleting the other's files
                    try:
                        now, known = self._read(), True
                    except Exception:  # storage away for a while: the run's own pushes say so; keep beating
                        now, known = None, False
                    if known and (now is None or now.get("token") != self.token):
                        _lost[key] = self.taken_line(now)
                        self._stop.set()
                        return
                    self.beats += 1
                    try:
                        self._write()
                    except Exception:
                        pass

        threading.Thread(target=beat, name=f"raysys-lease-{self.name}", daemon=True).start()
        atexit.register(self.release)

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this process's."""
        if self._stop is None or self._stop.is_set():
            return
        with self._writing:
            self._stop.set()
        key = (self.storage.uri, self.name)
        if _tokens.get(key) == self.token:  # let go of on purpose: what this process still records (the MLflow
            del _tokens[key]                # run's end, after the lock) is not a run taken from it
        try:
            if (self._read() or {}).get("token") == self.token:
                self.storage.fs.delete_file(self.storage.path(LEASES, self.name))
        except Exception:  # storage away: the lease expires by itself (its beats stop)
            pass


def settle_leases(remote: Remote, what: str, say=lambda line: print(line, flush=True)) -> None:
    """Remove the leases under ``remote`` whose holders are gone, watched all at once for 4 beats; a lease
    still renewed is a ConfigError. A sweep resumed after a Ctrl-C finds its trials' leases left behind (a
    trial process is killed, not ended): each trial would otherwise watch its own in turn, unsaid."""
    from raysys.config import ConfigError

    leases = {n: Lease(remote, n) for n in remote.listdir(LEASES)}
    seen = {n: v for n, v in ((n, lease._read()) for n, lease in leases.items()) if v is not None}
    if not seen:
        return
    wait = 4 * beat_s()
    say(f"{what}: {len(seen)} run(s) still carry the leases of the process that was interrupted; watching them "
        f"for {wait:.0f} s to be sure nothing runs them any more")
    deadline = time.monotonic() + wait
    while seen and time.monotonic() < deadline:
        time.sleep(min(1.0, beat_s() / 2))
        for n in list(seen):
            now = leases[n]._read()
            if now is None:
                del seen[n]
            elif now != seen[n]:
                raise ConfigError(f"run '{n}' is in use by {now.get('holder')} (its lease on {remote.display} is "
                                  "being renewed): is it still running elsewhere? (nothing was changed)")
    for n in seen:
        remote.fs.delete_file(remote.path(LEASES, n))
