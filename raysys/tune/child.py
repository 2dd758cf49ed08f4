"""``python -m raysys.tune.child PAYLOAD.json FD``: one sweep trial trained in-process (``launch.workers=0``).

Why a child process: Ray Train's local mode (``num_workers=0``) refuses ``ray.train.report`` inside
a Tune trial (it raises in a Tune session), and ignores Train callbacks, so the shared loop cannot
run in the trial's own process. Here, outside any Tune session, it runs unchanged; each report it
makes is also written as one JSON line to ``FD`` (a pipe), which the trial reads and forwards to
Tune. If the trial stops it (unstable, ended by Tune) or goes away, the child stops like Ctrl-C: at
the next step boundary with a checkpoint, its MLflow run KILLED. (Ray SIGKILLs a worker's children
when it ends the worker: if that comes first, the last periodic checkpoint is what a resume
continues from.)
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO

from raysys import lifecycle


def _relay_reports(out: IO[str]) -> None:
    """Also send every ``ray.train.report`` of local mode down the pipe."""
    # Private Ray API, patched only in this throwaway process: local mode keeps just the last
    # report, and offers no hook (see the foundation change proposed in docs/tune.md).
    from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils

    original = LocalTrainFnUtils.report

    def report(self, metrics, *args, **kwargs):
        original(self, metrics, *args, **kwargs)
        if out.closed:
            return
        try:
            out.write(json.dumps(metrics, default=float) + "\n")
            out.flush()
        except BrokenPipeError:  # nobody listens any more: stop at the next step, with a checkpoint
            lifecycle.request_stop(signal.SIGTERM)
            try:
                out.close()
            except OSError:
                pass

    LocalTrainFnUtils.report = report


def _watch_parent(parent: int) -> None:
    """Stop training when the trial process that started us dies (it may be killed, not asked): at
    the next step boundary, with a checkpoint, as Ctrl-C stops a run; at once if that takes longer
    than PARENT_GONE_GRACE_S (a step that never ends)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        lifecycle.request_stop(signal.SIGTERM)
        time.sleep(PARENT_GONE_GRACE_S)
        _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True, name="raysys-parent-watch").start()


PARENT_GONE_GRACE_S = 60.0


def main(argv: list[str]) -> int:
    payload = json.loads(Path(argv[0]).read_text())
    out = os.fdopen(int(argv[1]), "w", buffering=1)
    # SIGINT (the trial stopping an unstable run) and SIGTERM stop at the next step boundary with a
    # checkpoint, as they stop `raysys train`; a second one stops at once. Either way the run is KILLED.
    # The trial's thread that started us had them blocked (Ray's worker threads do), and a child
    # inherits its parent's signal mask: unblocked, or no signal would ever arrive.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    lifecycle.install_signal_handlers()
    _watch_parent(int(payload["parent_pid"]))
    _relay_reports(out)

    from raysys import workload as registry
    from raysys.config import from_dict
    from raysys.train.launcher import run_training

    wl = registry.get(payload["workload"])
    cfg = from_dict(wl.config_cls, payload["config"])
    try:
        result = run_training(payload["workload"], cfg, parent_run_id=payload["parent_run_id"], tags=payload["tags"])
        if result.stopped_by is not None:
            print("[raysys.tune] trial training stopped at a step boundary; checkpoint saved", flush=True)
            return 130
    except KeyboardInterrupt:
        print("[raysys.tune] trial training interrupted", flush=True)
        return 130
    except Exception as e:
        from raysys.tune.objectives import FAILED
        from raysys.tune.trial import permanent_reason

        reason = permanent_reason(e)
        if reason is not None:  # tell the trial that a restart cannot fix this; the traceback goes to the log
            out.write(json.dumps({FAILED: reason}) + "\n")
            out.flush()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
