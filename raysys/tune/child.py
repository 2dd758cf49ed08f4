"""``python -m raysys.tune.child PAYLOAD.json FD``: one sweep trial trained in-process (``launch.workers=0``).

Why a child process: Ray Train's local mode (``num_workers=0``) refuses ``ray.train.report`` inside
a Tune trial (it raises in a Tune session), and ignores Train callbacks, so the shared loop cannot
run in the trial's own process. Here, outside any Tune session, it runs unchanged; each report it
makes is also written as one JSON line to ``FD`` (a pipe), which the trial reads and forwards to
Tune. If the trial goes away (stopped as unstable, sweep interrupted), the child stops like Ctrl-C,
so its MLflow run ends as KILLED and its last checkpoint stays usable for a resume.
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


def _relay_reports(out: IO[str]) -> None:
    """Also send every ``ray.train.report`` of local mode down the pipe."""
    # Private Ray API, patched only in this throwaway process: local mode keeps just the last
    # report, and offers no hook (see the foundation change proposed in docs/tune.md).
    from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils

    original = LocalTrainFnUtils.report

    def report(self, metrics, *args, **kwargs):
        original(self, metrics, *args, **kwargs)
        try:
            out.write(json.dumps(metrics, default=float) + "\n")
            out.flush()
        except BrokenPipeError:  # nobody listens any more: stop as if interrupted
            raise KeyboardInterrupt from None

    LocalTrainFnUtils.report = report


def _watch_parent(parent: int) -> None:
    """Interrupt training when the trial process that started us dies (it may be killed, not asked)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True, name="raysys-parent-watch").start()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    payload = json.loads(Path(argv[0]).read_text())
    out = os.fdopen(int(argv[1]), "w", buffering=1)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM ends the run cleanly too (status KILLED)
    _watch_parent(int(payload["parent_pid"]))
    _relay_reports(out)

    from raysys import workload as registry
    from raysys.config import from_dict
    from raysys.train.launcher import run_training

    wl = registry.get(payload["workload"])
    cfg = from_dict(wl.config_cls, payload["config"])
    try:
        run_training(payload["workload"], cfg, parent_run_id=payload["parent_run_id"], tags=payload["tags"])
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
