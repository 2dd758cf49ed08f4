"""What a person sees while a run trains: one live progress display, messages, one summary.

Ray's own chatter (worker prefixes, Train's per-report INFO lines) stays in Ray's log files
(``/tmp/ray/session_latest/logs``); ``-v`` brings it back. Training code never prints progress
itself: rank 0 sends events to a :class:`Console`, either directly (the loop runs in this process)
or through a Ray queue that the driver drains (the loop runs on Ray Train workers, maybe on other
nodes), so the display is drawn once, by the driver, wherever the workers are.

On a terminal the display is a tqdm bar updating in place (step, ETA, loss, throughput); elsewhere
(CI logs, ``ray job logs``, a pipe) it is plain lines, at most one per tenth of the run or per
minute, so the length of the output does not grow with the length of the run; milestones (an
epoch's evaluation) are always a line of their own, in both.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional, TextIO

VERBOSE_ENV = "RAYSYS_VERBOSE"
PLAIN_EVERY_FRACTION = 0.1   # plain mode: a line per tenth of the run...
PLAIN_EVERY_S = 60.0         # ...or per minute when the total is unknown or the run is slow


def verbose() -> bool:
    """``-v``: Ray's and Train's own logs on the console too (inherited by child processes)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def exit_with(code: int):
    """End a raysys command's process with ``code``. The interpreter's last garbage collections over the
    objects Ray, Tune and MLflow leave behind took 2.3 s of a sweep's exit on a 2-core machine; the process
    is ending, so they are skipped (atexit handlers still run). Ray is shut down first, without the
    delays of its own exit hook (``runtime.shutdown_ray``)."""
    import gc

    global _frozen
    if "ray" in sys.modules:  # this command started or joined Ray: leave it without Ray's exit delays
        from raysys.train.runtime import shutdown_ray

        shutdown_ray()
    gc.freeze()
    _frozen = True
    sys.exit(code)


_frozen = False


def _quiet_teardown() -> None:
    """Registered when raysys is imported, so it runs after every atexit handler registered later (Ray's,
    MLflow's). After ``exit_with`` froze the objects, extension modules that audit their objects at
    teardown (triton's nanobind bindings, loaded by torch.compile) would list each one as 'leaked': a
    page of noise after a finished command. Only that teardown is silenced; everything before is flushed."""
    if _frozen:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)


atexit.register(_quiet_teardown)


class _OutlivesItsReader:
    """``sys.stdout``/``sys.stderr`` after a hang-up: the output that is still read now (a ``| tee`` the same
    hang-up ends a moment later) may lose its reader at any write. A write that fails then sends the
    descriptor to /dev/null and goes on, instead of raising in the middle of the run's stop."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:  # EPIPE (the reader died), EIO (the terminal closed)
            self._to_null()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._to_null()

    def _to_null(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())  # what the stream still buffers goes there at its next flush
            os.close(null)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def drop_lost_outputs() -> list[int]:
    """After a hang-up (SIGHUP): stdout and stderr that lead nowhere any more, a terminal that closed or
    a pipe whose reader died, go to /dev/null, so that no write error ends the run's stop halfway (the
    checkpoint, MLflow's KILLED). A file, or a terminal still open (``kill -HUP`` by hand), keeps its
    output; a write that finds it gone later goes to /dev/null then (``_OutlivesItsReader``). Returns the
    descriptors dropped now."""
    import select

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _OutlivesItsReader):
            setattr(sys, name, _OutlivesItsReader(stream))
    dropped: list[int] = []
    if not hasattr(select, "poll"):  # (macOS builds without it: the outputs stay as they are)
        return dropped
    for fd in (1, 2):
        try:
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            lost = any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in poll.poll(0))
            if lost:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
                dropped.append(fd)
        except (OSError, ValueError):
            pass
    return dropped


@contextlib.contextmanager
def held_stderr(drop: Callable[[str], bool] = lambda line: True) -> Iterator[None]:
    """What native code writes to file descriptor 2 meanwhile (Ray's core worker, Arrow's C++ S3 client: a
    line per retry of a call that then fails and is said in raysys's one line) goes to a file: kept back if
    the block raises, else passed on less the lines ``drop`` names. ``-v`` holds nothing back."""
    import tempfile

    if verbose():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                lines = held.read().decode(errors="replace").splitlines(keepends=True)
                sys.stderr.write("".join(line for line in lines if not drop(line)))
                sys.stderr.flush()


def name_arg(value: str) -> str:
    """argparse type of ``--name``/``--experiment``: a given name may not be empty (omit the flag for
    the default); a run or sweep name is checked as one (lifecycle.validate_name) where it is used."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty name; omit the flag for the default name")
    if value.strip().lower() in ("none", "null"):  # a config reads them as no name: the run got a default one
        raise argparse.ArgumentTypeError(f"{value!r} reads as no name in a config; choose another name, or omit the "
                                         "flag for the default")
    return value


def given_arg(value: str) -> str:
    """argparse type of a path, URI or address flag: given, it may not be empty (an unset shell variable,
    ``--storage-path "$RUNS"``, would put a run's folder straight into the working folder); omit the flag
    for its default."""
    if not value.strip():
        raise argparse.ArgumentTypeError("empty (an unset shell variable?); omit the flag for its default")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse with raysys's rule for bad input: one line naming the problem, exit 2 (argparse's
    own error prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def setup_logging() -> None:
    """Python logging for a raysys command: warnings only, unless ``-v``. MLflow's store set-up lines and
    Ray's start-up notices are INFO-level chatter for a person waiting on a run; ``-v`` shows them."""
    level = logging.INFO if verbose() else logging.WARNING
    # MLflow sets its own logger's level when first imported: tell it through its variable
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO" if verbose() else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose():
        # raysys's own warnings (a storage outage waited out) in the console's voice, as a worker's reach it
        # (``forwarding``), not as logging records with a date, a level and a logger's name
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:
                handler.setFormatter(_OwnVoice(handler.formatter))
        # Tune's own output engine draws an experiment table, TensorBoard hints and, on Ctrl+C, a
        # Tuner.restore line: raysys draws its progress and prints its own resume command
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        logging.getLogger("ray.tune.tune").setLevel(logging.ERROR)
        # "Trials did not complete: [...]": raysys's summary names each failed trial and its reason
        logging.getLogger("ray.tune.tune").addFilter(
            lambda record: not str(record.msg).startswith("Trials did not complete"))
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        from raysys.tracking import calm_http_client

        calm_http_client()
        # "Token authentication is enabled for this Ray cluster": the safe default, said at every start
        logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
        # "Running in local mode..." for every in-process (--workers 0) run
        logging.getLogger("ray.train.v2.api.config").setLevel(logging.WARNING)
        # a failed trial's whole traceback: raysys.tune says it failed in one line, the traceback is in
        # the trial's error.txt it names
        logging.getLogger("ray.tune.execution.tune_controller").addFilter(
            lambda record: not str(record.msg).startswith("Trial task failed"))
        # a trial stopped before its first report has no result files, which Tune's analysis warns of on every
        # stop and resume: raysys's own records (its objective log) say what each trial did
        logging.getLogger("ray.tune.analysis.experiment_analysis").addFilter(
            lambda record: not (str(record.msg).startswith("Failed to fetch metrics") and all(
                "FileNotFoundError" in line for line in str(record.msg).splitlines()[1:])))
        # Tune's syncer and Train's storage set-up print a whole traceback for each sync a storage outage
        # fails, several a minute; raysys waits the outage out, so one line naming the cause says it all
        for name in ("ray.train._internal.syncer", "ray.train._internal.storage",
                     "ray.train.v2._internal.execution.storage"):
            logging.getLogger(name).addFilter(_one_line_storage_error)


class _OwnVoice(logging.Formatter):
    """raysys's records as ``[raysys] <message>``; other libraries' as ``base`` formats them."""

    def __init__(self, base: Optional[logging.Formatter]):
        super().__init__()
        self.base = base or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "raysys" or record.name.startswith("raysys."):
            return f"[raysys] {record.getMessage()}"
        return self.base.format(record)


_said_at: dict[str, float] = {}


def _one_line_storage_error(record: logging.LogRecord) -> bool:
    """A storage error of Ray's as one line (its first, and the traceback's last: the cause), at most once
    a minute for the same first line."""
    lines = [ln.strip() for ln in record.getMessage().splitlines() if ln.strip()]
    error = record.exc_info[1] if record.exc_info else None
    if error is not None:
        lines.append(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}")
    if len(lines) < 2:
        return True
    from raysys.storage import unreachable

    head, cause, now = lines[0].rstrip(":"), lines[-1][:300], time.monotonic()
    outage = unreachable(Exception(cause))
    # an outage fails a sync and a directory's creation alike: one line a minute for all of them, which says
    # what happens next (Ray tries again at its next sync; the trials go on and checkpoint when it answers)
    key = "outage" if outage else head
    if now - _said_at.get(key, -1e9) < 60:
        return False
    _said_at[key] = now
    msg = (f"[raysys] the storage does not answer ({cause}); Ray tries again at its next sync, and the run goes "
           "on (said at most once a minute)" if outage else f"{head}: {cause}")
    record.msg, record.args, record.exc_info, record.exc_text = msg, (), None, None
    return True


class Console:
    """Draws progress and messages for one process's console (thread-safe)."""

    def __init__(self, stream: Optional[TextIO] = None, tty: Optional[bool] = None):
        self._stream, self._tty = stream, tty
        self._bar = None
        self._bar_key: Optional[tuple] = None
        self._last_plain: dict[str, tuple[float, float]] = {}  # name -> (fraction, time) of the last line
        self._first: dict[str, tuple[float, float]] = {}  # name -> (done, time) when first seen: for the ETA
        self._lock = threading.Lock()

    @property
    def stream(self) -> TextIO:
        # looked up at each write: sys.stdout may be replaced (pytest's capture, a redirect) after start
        return self._stream or sys.stdout

    @property
    def tty(self) -> bool:
        if self._tty is not None:
            return self._tty
        try:
            return self.stream.isatty()
        except (ValueError, AttributeError):
            return False

    # ---- events ------------------------------------------------------------------------------
    def progress(self, name: str, done: float, total: Optional[float], text: str = "", unit: str = "step",
                 keep: bool = False) -> None:
        """``keep``: a milestone (an epoch's evaluation) that stays readable: a line above the bar on a
        terminal, where the bar's next step would overwrite it, and never left out of a plain log."""
        with self._lock:
            if self.tty:
                self._draw_bar(name, done, total, text, unit)
                if keep:
                    self._bar.write(f"[{name}] {text}", file=self.stream)
            else:
                self._plain(name, done, total, text, force=keep)

    def message(self, text: str) -> None:
        with self._lock:
            if self._bar is not None and self._bar.total and self._bar.n >= self._bar.total:
                # the run's end (its breakdown, its summary): the finished bar stays where it is, above
                # them, rather than being drawn again below each of them
                self._bar.close()
                self._bar = None
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)

    def handle(self, event: dict) -> None:
        if event.get("kind") == "progress":
            self.progress(event["name"], event["done"], event.get("total"), event.get("text", ""),
                          event.get("unit", "step"), event.get("keep", False))
        else:
            self.message(event.get("text", ""))

    def close(self) -> None:
        """End of a run: the bar stays on screen; the next run starts its own display."""
        with self._lock:
            self._last_plain.clear()
            self._first.clear()
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    # ---- drawing -----------------------------------------------------------------------------
    def _draw_bar(self, name: str, done: float, total: Optional[float], text: str, unit: str) -> None:
        from tqdm import tqdm

        key = (name, total, unit)
        if self._bar is None or self._bar_key != key:
            if self._bar is not None:
                self._bar.close()
            # a pty nobody sized reports 0x0, and tqdm then hides the bar (as if off screen): assume 100x40
            sized = _terminal_width(self.stream) > 0
            self._bar = tqdm(total=total, desc=name, unit=unit, file=self.stream, dynamic_ncols=sized,
                             ncols=None if sized else 100, nrows=None if sized else 40, leave=True, initial=done,
                             smoothing=0.1)
            self._bar_key = key
        self._bar.n = done
        self._bar.set_postfix_str(text, refresh=False)
        self._bar.refresh()

    def _plain(self, name: str, done: float, total: Optional[float], text: str, force: bool = False) -> None:
        now = time.monotonic()
        frac = done / total if total else 0.0
        first = self._first.setdefault(name, (done, now))
        last = self._last_plain.get(name)
        due = (force or last is None or (total and (frac - last[0] >= PLAIN_EVERY_FRACTION or done >= total))
               or now - last[1] >= PLAIN_EVERY_S)
        if not due:
            return
        self._last_plain[name] = (frac, now)
        where = f"{done:g}/{total:g} ({100 * frac:.0f}%)" if total else f"{done:g}"
        elapsed = now - first[1]
        timing = f" | {elapsed:.0f}s"
        if total and done > first[0] and done < total:
            timing += f", eta {elapsed / (done - first[0]) * (total - done):.0f}s"
        print(f"[{name}] {where} {text}{timing}".rstrip(), file=self.stream, flush=True)


def _terminal_width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


_CONSOLE: Optional[Console] = None


def current() -> Console:
    """This process's console (created on first use)."""
    global _CONSOLE
    if _CONSOLE is None:
        _CONSOLE = Console()
    return _CONSOLE


class Sink:
    """Where training code sends its progress: this process's console or, from a Ray worker, the
    driver's (through a Ray queue). What the payload carries is ``handle`` (None or the queue)."""

    def __init__(self, queue: Any = None):
        self.handle = queue

    def progress(self, name: str, done: float, total: Optional[float], text: str = "", unit: str = "step",
                 keep: bool = False) -> None:
        self._send({"kind": "progress", "name": name, "done": done, "total": total, "text": text, "unit": unit,
                    "keep": keep})

    def message(self, text: str) -> None:
        self._send({"kind": "message", "text": text})

    def _send(self, event: dict) -> None:
        if self.handle is None:
            current().handle(event)
            return
        try:
            self.handle.put_nowait(event)
        except Exception:  # the driver went away: training goes on, its metrics are tracked anyway
            pass


class _ToSink(logging.Handler):
    def __init__(self, sink: Sink):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.message(f"[raysys] {record.getMessage()}")
        except Exception:  # never let a warning about the console break training
            pass


@contextlib.contextmanager
def forwarding(sink: Sink) -> Iterator[None]:
    """raysys's own warnings in a Ray worker (a storage outage waited out, a pruning put off) on the
    driver's console: a worker's logging goes to Ray's log files only, so a 40 s storage outage was a
    silent 40 s stall in the progress."""
    if sink.handle is None:  # this process's console: its logging already reaches it
        yield
        return
    handler, logger = _ToSink(sink), logging.getLogger("raysys")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def live(remote: bool) -> Iterator[Sink]:
    """The driver side of a run's display. ``remote``: training runs on Ray workers, so events come
    through a Ray queue (an actor using no CPU) drained here by a thread; else they are drawn directly."""
    con = current()
    if not remote:
        try:
            yield Sink()
        finally:
            con.close()
        return
    from ray.util.queue import Empty, Queue

    queue = Queue(actor_options={"num_cpus": 0})
    stop = threading.Event()

    def drain(block: bool) -> None:
        while True:
            try:
                con.handle(queue.get(block=block, timeout=0.25) if block else queue.get_nowait())
            except Empty:
                return

    def pump() -> None:
        while not stop.is_set():
            try:
                drain(block=True)
            except Exception:  # the queue actor is gone (Ray shutting down)
                return

    thread = threading.Thread(target=pump, daemon=True, name="raysys-console")
    thread.start()
    try:
        yield Sink(queue)
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            drain(block=False)
            queue.shutdown()
        con.close()
