"""What a person sees: the README's main job under a pseudo-terminal draws one progress bar and a
summary, with none of Ray Train's per-report lines; piped, it prints a bounded number of plain lines."""

import os
import pty
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The main job takes ~7 min here at its 30 epochs; the same job shortened to 1 epoch shows the same console.
SHORTEN = ["--set", "train.epochs=1"]


def _main_job() -> list[str]:
    """The README's 'install and run the main job' command, without the install."""
    readme = (REPO / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("bash scripts/install.sh && "))
    cmd = shlex.split(line.split("&&", 1)[1])
    assert cmd[:3] == ["python", "-m", "raysys"]
    return [sys.executable, *cmd[1:]]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAYSYS_VERBOSE", "RAY_ADDRESS")}


def test_main_job_on_a_terminal_shows_a_bar_and_a_summary(tmp_path):
    master, slave = pty.openpty()
    proc = subprocess.Popen(_main_job() + SHORTEN, cwd=tmp_path, env={**_env(), "COLUMNS": "120"},
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:  # drain the terminal, or the job blocks once its buffer fills
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the job closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rc = proc.wait(timeout=900)
    reader.join(timeout=10)
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    print(out[-5000:])
    assert rc == 0
    assert "TrainingReport(" not in out and "Reporting training result" not in out
    assert "(RayTrainWorker" not in out and "(TrainController" not in out  # Ray's chatter stays in its logs
    assert re.search(r"\d+%\|", out), "no tqdm bar drawn"  # the live bar, redrawn in place with \r
    assert "\r" in out
    lines = out.replace("\r\n", "\n").split("\n")
    assert len(lines) <= 40, f"{len(lines)} lines"
    assert re.search(r"\[raysys\] done: run '.*' \| eval/qwk [\d.-]+ \| perf/tokens_per_s", out)
    # the epoch's evaluation is a line of its own above the bar; the finished bar is not drawn again
    # below the breakdown and the summary that follow it
    assert re.search(r"\[deep_gpcm\] epoch 1/1 done, mean loss [\d.]+ \| qwk [\d.-]+", out)
    assert out.rfind("%|") < out.find("step-time breakdown")


def test_piped_progress_is_plain_and_bounded_whatever_the_run_length():
    import io

    from raysys.console import Console

    for steps in (40, 4000):
        out = io.StringIO()
        con = Console(out, tty=False)
        for step in range(1, steps + 1):
            con.progress("wl", step, steps, f"loss {1 / step:.3f}")
        con.message("summary")
        con.close()
        lines = out.getvalue().splitlines()
        assert "\r" not in out.getvalue()
        assert lines[0].startswith("[wl] 1/") and lines[-2].startswith(f"[wl] {steps}/{steps} (100%)")
        assert lines[-1] == "summary"
        assert 10 <= len(lines) <= 13, lines  # a line per tenth, the first and the last: not one per step
        # a second run in the same process starts its own count
        con.progress("wl", 1, 10)
        assert out.getvalue().splitlines()[-1].startswith("[wl] 1/10")


def test_an_epochs_evaluation_is_never_throttled_out_of_a_plain_log():
    """A piped run prints a line per tenth of the run: the epochs' evaluations between them were lost."""
    import io

    from raysys.console import Console

    out = io.StringIO()
    con = Console(out, tty=False)
    for step in range(1, 101):
        end = step % 4 == 0  # 25 epochs of 4 steps
        con.progress("wl", step, 100, f"epoch {step // 4}/25 done | acc {step / 100}" if end else "loss 1", keep=end)
    evals = [l for l in out.getvalue().splitlines() if " done | acc " in l]
    assert len(evals) == 25 and evals[-1].startswith("[wl] 100/100 (100%) epoch 25/25 done | acc 1.0")


def test_an_empty_name_is_refused_not_replaced_by_the_default():
    import argparse

    import pytest

    from raysys import console

    assert console.name_arg("exp1") == "exp1"
    for empty in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match="an empty name"):
            console.name_arg(empty)


def test_a_workers_warnings_reach_the_drivers_console_and_rays_storage_tracebacks_are_one_line(caplog, monkeypatch):
    """A Ray worker's logging goes to Ray's log files only: a storage outage it waited out was a silent stall
    in the progress. Its raysys warnings now travel the queue its progress does. Ray Tune's syncer printed a
    whole traceback per failed sync during an outage; it is one line naming the cause, once a minute."""
    import logging
    import queue
    import traceback

    from raysys import console

    events: queue.Queue = queue.Queue()  # what a worker's Sink puts on (a Ray queue, drained by the driver)
    with console.forwarding(console.Sink(events)):
        logging.getLogger("raysys.storage").warning("storage %s unreachable (Could not connect); trying again",
                                                    "s3://b/runs")
        logging.getLogger("raysys.storage").info("not a warning")
    logging.getLogger("raysys.storage").warning("after the worker's function ended")
    said = [events.get_nowait() for _ in range(events.qsize())]
    assert said == [{"kind": "message", "text": "[raysys] storage s3://b/runs unreachable (Could not connect); "
                                                 "trying again"}]

    syncer = logging.getLogger("ray.train._internal.syncer")
    monkeypatch.setattr(console, "_said_at", {})  # what an earlier test in this process said this minute
    try:
        raise OSError("When uploading 'x': AWS Error NETWORK_CONNECTION during PutObject: Could not connect")
    except OSError:
        failed = f"Last sync command failed with the following error:\n{traceback.format_exc()}"
    records = [logging.LogRecord(syncer.name, logging.WARNING, __file__, 1, failed, (), None) for _ in range(2)]
    # an outage fails the directory's creation too: within the minute, the same outage
    records.append(logging.LogRecord("ray.train._internal.storage", logging.ERROR, __file__, 1,
                                     failed.replace("Last sync command failed", "Caught exception when creating "
                                                    "directory at (s3fs, bkt/runs/k2)"), (), None))
    assert [console._one_line_storage_error(r) for r in records] == [True, False, False]  # said once
    assert records[0].getMessage() == (
        "[raysys] the storage does not answer (OSError: When uploading 'x': AWS Error NETWORK_CONNECTION during "
        "PutObject: Could not connect); Ray tries again at its next sync, and the run goes on (said at most once a "
        "minute)")
    # what the storage answered (not an outage): Ray's first line and the cause, once a minute for each first line
    try:
        raise OSError("When uploading 'x': AWS Error ACCESS_DENIED during PutObject: Access Denied")
    except OSError:
        denied = f"Last sync command failed with the following error:\n{traceback.format_exc()}"
    one, two = (logging.LogRecord(syncer.name, logging.WARNING, __file__, 1, denied.replace("Last", word), (), None)
                for word in ("Last", "Previous"))
    assert console._one_line_storage_error(one) and console._one_line_storage_error(two)
    assert "\n" not in two.getMessage()
    assert two.getMessage() == ("Previous sync command failed with the following error: OSError: When uploading 'x': "
                                "AWS Error ACCESS_DENIED during PutObject: Access Denied")


DIED = ("A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the "
        "problem, check the logs for the dead worker. Lease ID: 0600 Worker ID: db5a Node ID: 0dd4 Worker IP "
        "address: 192.0.2.2 Worker port: 35485 Worker PID: 6085 Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
        "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called")


def test_a_worker_that_died_is_one_short_line_on_a_quiet_console(monkeypatch, capsys):
    """Ray's driver prints what its cluster publishes (a killed worker: the paragraph above, ~1,000 characters
    with ids and advice) whatever log_to_driver says; a quiet console gets its first sentence, the pid and
    the exit detail. Ray's own printing function is the one that runs, wrapped."""
    import ray._private.worker as ray_worker

    from raysys.train.runtime import one_line_cluster_errors

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # put back after the test
    monkeypatch.setenv("RAY_COLOR_PREFIX", "")  # recorded: whatever the wrapper sets goes after the test
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    one_line_cluster_errors()
    one_line_cluster_errors()  # once wrapped is enough: a second run's init does not wrap it again
    ray_worker.print_to_stdstream({"lines": [DIED], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    ray_worker.print_to_stdstream({"lines": ["One sentence alone."], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(
        "A worker died or was killed while executing a task by an unexpected system error (pid 6085, Worker "
        "unexpectedly exits with a connection error code 2. End of file.); Ray's session logs hold the rest")
    assert out.splitlines()[1].endswith("One sentence alone.") and len(out.splitlines()) == 2
    assert out.startswith("(raylet) A worker died") and "\x1b[" not in out  # not a terminal: no colour codes


def test_raysys_warnings_speak_in_the_consoles_voice():
    """A storage outage waited out in the driver's own process printed `2026-11-29 14:43:14,212 WARNING
    raysys.storage: ...` between the progress lines, where a worker's came as `[raysys] ...`; now both alike.
    Other libraries' records keep their form; -v keeps logging's for all."""
    script = ("import logging; from raysys import console; console.setup_logging(); "
              "logging.getLogger('raysys.storage').warning('storage %s answers again', 's3://b'); "
              "logging.getLogger('other.lib').warning('its own')")
    env = {k: v for k, v in os.environ.items() if k != "RAYSYS_VERBOSE"}
    quiet = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    lines = quiet.stderr.strip().splitlines()
    assert lines[0] == "[raysys] storage s3://b answers again" and lines[1].endswith("WARNING other.lib: its own"), lines
    loud = subprocess.run([sys.executable, "-c", script], env={**env, "RAYSYS_VERBOSE": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert "WARNING raysys.storage: storage s3://b answers again" in loud.stderr, loud.stderr
