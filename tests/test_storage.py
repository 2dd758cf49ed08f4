"""Runs on storage every node can reach: a real S3-compatible server (moto's, on 127.0.0.1), runs
that write to it and resume from it, and a multi-node local cluster losing the node of rank 0."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TcpGate, free_port, interrupt_sweep

REPO = Path(__file__).resolve().parents[1]
BUCKET = "raysys-test"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _moto(port: int, log_file: Path):
    """moto's S3 server on 127.0.0.1:``port`` with the test bucket made; (its process, a boto3 client)."""
    import boto3

    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log_file, "a"), stderr=subprocess.STDOUT, start_new_session=True)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **{
        "aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"})
    deadline = time.time() + 60
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            return proc, client
        except Exception:
            assert proc.poll() is None and time.time() < deadline, log_file.read_text()
            time.sleep(0.3)


@pytest.fixture
def s3(tmp_path):
    """An S3-compatible server; yields (storage URI for raysys, boto3 client)."""
    port = free_port()
    proc, client = _moto(port, tmp_path / "moto.log")
    # moto answers pyarrow's multipart uploads wrongly; objects written in one PUT (all of these tests') are fine
    uri = f"s3://{BUCKET}/runs?endpoint_override=127.0.0.1:{port}&scheme=http&allow_delayed_open=true"
    yield uri, client
    proc.kill()
    proc.wait()


def test_an_upload_waits_out_a_storage_endpoint_that_restarts(s3, tmp_path, monkeypatch, caplog):
    """The endpoint goes away (connection refused) and comes back: an upload meanwhile is tried again
    and lands, where it used to fail the run at once. What the service answers (no such bucket) is
    raised at once, with no retry."""
    import threading
    from urllib.parse import parse_qs, urlsplit

    from raysys.storage import Remote

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    uri, client = s3
    port = int(parse_qs(urlsplit(uri).query)["endpoint_override"][0].rsplit(":", 1)[1])
    gate = TcpGate(port)
    gate.open()
    remote = Remote(uri.replace(f"127.0.0.1:{port}", f"127.0.0.1:{gate.port}"))
    remote.check()
    (tmp_path / "state.pt").write_bytes(b"x" * 1000)
    gate.close()
    reopen = threading.Timer(12.0, gate.open)  # longer than pyarrow's own retries (~7 s)
    reopen.start()
    try:
        remote.put(tmp_path / "state.pt", "r", "checkpoints", "step_1", "state.pt")
    finally:
        reopen.join()
    assert _keys(client, "runs/r/") == ["runs/r/checkpoints/step_1/state.pt"]
    assert "unreachable" in caplog.text and "trying the upload r/checkpoints/step_1/state.pt again" in caplog.text
    assert "answers again: the upload r/checkpoints/step_1/state.pt went through after" in caplog.text  # its end too
    caplog.clear()
    with pytest.raises(OSError, match="NO_SUCH_BUCKET"):
        Remote(uri.replace(f"s3://{BUCKET}/", "s3://no-such-bucket/")).put(tmp_path / "state.pt", "x")
    assert "unreachable" not in caplog.text
    gate.close()


def test_one_file_pulled_by_two_threads_at_once(s3, tmp_path, monkeypatch):
    """A sweep's trials pull the same remote files at once (its trial_events.log): two pulls of one file
    into one working copy never share a temporary name (one used to find the other's moved away)."""
    from raysys import storage

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    uri, client = s3
    remote = storage.Remote(uri)
    (tmp_path / "src.txt").write_text("x" * 100_000)
    remote.put(tmp_path / "src.txt", "sw", "trial_events.log")
    local = tmp_path / "copy"
    errors = []

    def pull() -> None:
        try:
            remote.get(local / "trial_events.log", "sw", "trial_events.log")
        except Exception as e:  # noqa: BLE001 - any error is the finding
            errors.append(e)

    _together([pull] * 6)
    assert not errors and (local / "trial_events.log").read_text() == "x" * 100_000
    assert sorted(p.name for p in local.iterdir()) == ["trial_events.log"]  # no temporary file left


def test_a_storage_uri_with_a_raw_space_or_letter_says_how_to_write_it():
    """pyarrow refuses a raw space or a non-ASCII letter in an S3 URI (with the letter's bytes garbled): the
    one line says the percent-encoding that works."""
    from raysys.config import ConfigError
    from raysys.storage import Remote

    with pytest.raises(ConfigError, match=r"a URI holds ' ' and 'ü' percent-encoded \(%20, %C3%BC\)"):
        Remote("s3://bkt/my rüns?endpoint_override=127.0.0.1:1&scheme=http")


def _together(fns) -> None:
    import threading

    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.slow
def test_an_endpoint_that_never_answers_is_one_line_not_a_hang(tmp_path):
    """A hung S3 server or proxy (it takes connections, never answers): the storage check gives up after
    pyarrow's few short attempts, one line and exit 2, nothing created, where the AWS SDK's own retries
    of the URI's filesystem held the command for minutes before anything was said."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))  # listens; the kernel takes connections nobody answers
    try:
        port = silent.getsockname()[1]
        uri = f"s3://{BUCKET}/runs?endpoint_override=127.0.0.1:{port}&scheme=http&allow_delayed_open=true"
        proc = subprocess.run([sys.executable, "-m", "raysys", "train", *QUICK, "--storage-path", uri], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=240)
    finally:
        silent.close()
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "cannot write there" in proc.stderr and "Timeout was reached" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def _keys(client, prefix: str) -> list[str]:
    out = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def _text(client, key: str) -> str:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAYSYS_VERBOSE", "RAY_ADDRESS")}
    return {**env, **CREDS, **extra}


def _train(cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "raysys", "train", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    print(args, "->", proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return proc


QUICK = ["deep_gpcm", "--preset", "quick", "--workers", "0"]


def test_leases_left_by_killed_holders_are_settled_at_once_and_a_live_one_refused(s3, monkeypatch):
    """What a resumed sweep does with its trials' leases: those no longer renewed are removed after one
    shared watch (said), a renewed one refuses the resume."""
    from raysys.config import ConfigError
    from raysys.storage import LEASES, Lease, Remote, settle_leases

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAYSYS_LEASE_BEAT_S", "0.2")
    uri, _ = s3
    remote = Remote(uri)
    for name in ("sw-aaaa", "sw-bbbb"):
        Lease(remote, name)._write()  # written, never renewed: a killed holder's
    said = []
    settle_leases(remote, "resume", said.append)
    assert remote.listdir(LEASES) == [] and "2 run(s) still carry" in said[0]
    live = Lease(remote, "sw-cccc").acquire(say=said.append)
    try:
        with pytest.raises(ConfigError, match="run 'sw-cccc' is in use by process"):
            settle_leases(remote, "resume", said.append)
    finally:
        live.release()
    settle_leases(remote, "resume", lambda line: pytest.fail(line))  # released cleanly: nothing to watch


def test_a_run_lives_on_s3_and_resumes_from_it(tmp_path, s3):
    uri, client = s3
    first = _train(tmp_path, *QUICK, "--storage-path", uri, "--name", "on-s3", "--set", "train.epochs=2")
    assert first.returncode == 0 and f"s3://{BUCKET}/runs/on-s3" in first.stdout
    assert "leaked" not in first.stderr  # no teardown audit of the objects left at exit (console.exit_with)
    keys = _keys(client, "runs/on-s3/")
    for f in ("config.yaml", "final_metrics.json", "breakdown.md", "checkpoints/step_000000012/meta.json",
              "checkpoints/step_000000012/state.pt"):
        assert f"runs/on-s3/{f}" in keys, keys
    assert not list(tmp_path.glob("s3*")) and not (tmp_path / "raysys_runs").exists()  # nothing local

    # a new process (its own empty working copy) resumes from the bucket, with the run's saved config
    again = _train(tmp_path, "deep_gpcm", "--storage-path", uri, "--name", "on-s3", "--resume", "--set", "train.epochs=4")
    assert again.returncode == 0
    assert "resumed step=12 epoch=2 from=step_000000012" in _text(client, "runs/on-s3/events.log")
    # its working copy holds only the checkpoint it resumed from: pruning an older one (step 6) removes it
    # from the bucket alone (it used to fail the resumed run once, spending a restart on every resume)
    assert "restart" not in _text(client, "runs/on-s3/events.log") and "restart" not in again.stdout
    assert "runs/on-s3/checkpoints/step_000000006/meta.json" not in _keys(client, "runs/on-s3/")
    assert "runs/on-s3/checkpoints/step_000000024/meta.json" in _keys(client, "runs/on-s3/")
    assert "runs/on-s3/config.resume-1.yaml" in _keys(client, "runs/on-s3/")
    # trained further after its end: what it ended with is kept in the bucket beside the new result
    keys = _keys(client, "runs/on-s3/")
    assert {"runs/on-s3/checkpoints/step_000000012/meta.json", "runs/on-s3/final_metrics.step_12.json",
            "runs/on-s3/breakdown.step_12.md"} <= set(keys), keys
    assert json.loads(_text(client, "runs/on-s3/final_metrics.json"))["step"] == 24
    # the same name again, without --resume: refused, nothing changed
    twice = _train(tmp_path, *QUICK, "--storage-path", uri, "--name", "on-s3")
    assert twice.returncode == 2 and "already exists" in twice.stderr
    # a bare --resume finds the newest default-named run in the bucket (it looked for one named after this
    # process's working copy, raysys-deep_gpcm-...-<random>, and always failed)
    assert _train(tmp_path, *QUICK, "--storage-path", uri, "--set", "train.epochs=1").returncode == 0
    bare = _train(tmp_path, "deep_gpcm", "--storage-path", uri, "--resume", "--set", "train.epochs=2")
    assert bare.returncode == 0 and "resumed from s3://" in bare.stdout, bare.stderr[-2000:]


def test_two_machines_never_train_one_remote_run_and_a_killed_holder_is_taken_over(tmp_path, s3):
    """Lock files are per machine: a process with another temp folder stands for another machine. While a
    run on S3 trains, a resume from there is refused (the run's lease is being renewed); once its holder
    is SIGKILLed (a lost node), the lease stops moving and the resume takes the run over."""
    import signal

    uri, client = s3
    args = [*QUICK, "--storage-path", uri, "--name", "shared"]
    env = {**_env(), "RAYSYS_LEASE_BEAT_S": "1"}
    (tmp_path / "A").mkdir(), (tmp_path / "B").mkdir()
    first = subprocess.Popen([sys.executable, "-m", "raysys", "train", *args, "--set", "train.epochs=1000"], cwd=tmp_path,
                             env={**env, "TMPDIR": str(tmp_path / "A")}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not [k for k in _keys(client, "runs/shared/checkpoints/") if k.endswith("/meta.json")]:
            assert first.poll() is None and time.time() < deadline, first.stdout.read() if first.poll() is not None else ""
            time.sleep(0.5)
        assert "runs/.raysys-leases/shared" in _keys(client, "runs/.raysys-leases/")

        def resume(epochs: int):
            proc = subprocess.run([sys.executable, "-m", "raysys", "train", *args, "--resume", "--set",
                                   f"train.epochs={epochs}"], cwd=tmp_path, env={**env, "TMPDIR": str(tmp_path / "B")},
                                  capture_output=True, text=True, timeout=600)
            print(proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return proc

        busy = resume(2000)
        assert busy.returncode == 2 and f"is in use by process {first.pid} on" in busy.stderr
        assert first.poll() is None  # the holder trains on, untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    took = resume(1)  # at or past its end already: nothing left to train, a clean finish
    assert took.returncode == 0 and f"was last held by process {first.pid}" in took.stdout
    assert "resumed step=" in _text(client, "runs/shared/events.log")
    assert not [k for k in _keys(client, "runs/.raysys-leases/") if not k.endswith("/")]  # released at the end


def test_a_holder_paused_past_its_lease_writes_nothing_more_to_the_run_taken_over(tmp_path, s3, mlflow_server):
    """A holder stopped (SIGSTOP, a suspended machine) past its lease's watch loses the run to a resume from
    another machine. It used to renew the lease blindly when it came back: both trained the run, each
    deleting the other's checkpoints, and the one MLflow run got every step twice. Now it finds the lease
    taken, says so in one line, exits 1 and writes nothing more: no metric, no checkpoint, no end. (Two
    machines share a tracking server, not a sqlite file: a process stopped in a write would lock that.)"""
    import signal

    import mlflow

    uri, client = s3
    args = [*QUICK, "--storage-path", uri, "--name", "paused", "--set", "train.epochs=1000",
            "--tracking-uri", mlflow_server]
    env = {**_env(), "RAYSYS_LEASE_BEAT_S": "1"}
    (tmp_path / "A").mkdir(), (tmp_path / "B").mkdir()

    def start(machine: str, *more: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "raysys", "train", *args, *more], cwd=tmp_path,
                                env={**env, "TMPDIR": str(tmp_path / machine)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def text(key: str) -> str:
        return _text(client, key) if key in _keys(client, key) else ""

    def wait_for(what, proc: subprocess.Popen) -> None:
        deadline = time.time() + 300
        while not what():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.5)

    a = start("A")
    b = None
    try:
        wait_for(lambda: [k for k in _keys(client, "runs/paused/checkpoints/") if k.endswith("/meta.json")], a)
        os.killpg(a.pid, signal.SIGSTOP)
        b = start("B", "--resume")
        wait_for(lambda: f"process {b.pid} on" in text("runs/.raysys-leases/paused"), b)
        wait_for(lambda: "resumed step=" in text("runs/paused/events.log"), b)
        os.killpg(a.pid, signal.SIGCONT)
        out, err = a.communicate(timeout=300)
        print(out[-3000:], err[-3000:], sep="\n")
        assert a.returncode == 1 and "Traceback" not in err, err[-3000:]
        (line,) = [x for x in err.splitlines() if x.startswith("raysys:")]
        assert line.startswith(f"raysys: run 'paused' on s3://{BUCKET}/runs was taken over by process {b.pid} on ")
        assert f"process {b.pid} on" in _text(client, "runs/.raysys-leases/paused")  # the lease left to B
        assert b.poll() is None  # B trains on, its checkpoints untouched (A deleted them as its own older ones)
        events = _text(client, "runs/paused/events.log")
        assert "failed" not in events and events.count("resumed step=") == 1, events
        mlflow.set_tracking_uri(mlflow_server)
        (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
        assert run.info.status == "RUNNING"  # B's: A did not close it FAILED, nor did its watcher KILLED
        b.send_signal(signal.SIGINT)
        b.communicate(timeout=300)
        assert b.returncode == 130
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/loss")]
    assert steps and len(steps) == len(set(steps)), steps  # one writer: every step once


@pytest.mark.slow  # ~1 min: two JAX compiles; test_a_run_lives_on_s3_and_resumes_from_it covers S3 resume by default
def test_a_jax_run_on_s3_resumes_from_its_numpy_checkpoint(tmp_path, s3):
    """A JAX workload's checkpoint is state.npz (written without torch): it is uploaded, a new process pulls
    it back, and the run continues from it."""
    uri, client = s3
    args = ["hackmatrix_ppo", "--preset", "quick", "--storage-path", uri, "--name", "jax-on-s3",
            "--set", "train.compilation_cache_dir="]
    first = _train(tmp_path, *args, "--set", "train.total_timesteps=10240")
    assert first.returncode == 0
    keys = _keys(client, "runs/jax-on-s3/checkpoints/")
    assert keys == ["runs/jax-on-s3/checkpoints/step_000010240/ENDED",  # the model the run ended with
                    "runs/jax-on-s3/checkpoints/step_000010240/meta.json",
                    "runs/jax-on-s3/checkpoints/step_000010240/state.npz"], keys
    again = _train(tmp_path, *args, "--resume", "--set", "train.total_timesteps=20480")
    assert again.returncode == 0 and "resumed at 10240 env steps" in again.stdout
    assert "runs/jax-on-s3/checkpoints/step_000020480/state.npz" in _keys(client, "runs/jax-on-s3/")


@pytest.mark.slow  # a 3-node cluster: ~2-3 min on 2 cores (over the ~3 min budget under load)
def test_losing_the_node_of_rank_0_resumes_from_s3(tmp_path, s3):
    """Three 1-CPU worker nodes (their own raylets and temp dirs), two Ray Train workers: the node
    hosting rank 0 is removed mid-run; the run finishes on the others from the S3 checkpoint."""
    import json

    uri, client = s3
    endpoint = client.meta.endpoint_url
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("node_loss_scenario.py")), uri, BUCKET,
                           endpoint, str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in result, result
    assert result["returncode"] == 0, result["stderr"]
    events = result["events"]
    assert "restart 1/2" in events
    resumed = int(events.split("resumed step=")[-1].split()[0])
    assert resumed >= result["done_before"]  # at most one checkpoint interval repeated
    assert events.split("rank 0 on node ")[-1].split()[0] != result["rank0_before"]  # it moved to another node
    assert "runs/lost/final_metrics.json" in result["keys"]


def _sweep_events(client, prefix: str) -> list[list[str]]:
    try:
        return [line.split()[1:] for line in _text(client, f"{prefix}/trial_events.log").splitlines() if line.strip()]
    except client.exceptions.NoSuchKey:
        return []


@pytest.mark.slow  # ~2 min: a sweep cut and resumed; test_a_run_lives_on_s3_and_resumes_from_it covers S3 resume by default
def test_a_sweep_on_s3_is_interrupted_and_resumed_from_it(tmp_path, s3):
    uri, client = s3
    sweeps = uri.replace("/runs?", "/sweeps?")
    args = ["--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"), "--num-samples", "3", "--max-concurrent", "1",
            "--preset", "quick", "--set", "train.epochs=3", "--set", "train.compile=false",
            "--set", "train.checkpoint_every_steps=2", "--storage-path", sweeps, "--name", "sw"]
    def ready():  # one trial done, the next with a checkpoint in S3 past its first report (step 5)
        ev = _sweep_events(client, "sweeps/sw")
        ended = {e[1] for e in ev if e[0] == "end"}
        running = [e[1] for e in ev if e[0] == "start" and e[1] not in ended]
        return bool(ended and running and any(k.endswith("/meta.json") and int(k.split("/step_")[1][:9]) >= 10
                                              for k in _keys(client, f"sweeps/sw/runs/sw-{running[0]}/")))

    returncode, out = interrupt_sweep(args, tmp_path, ready, env=_env(), poll_s=0.3)
    assert returncode == 130 and "--resume" in out
    finished = {e[1] for e in _sweep_events(client, "sweeps/sw") if e[0] == "end"}
    cut_rows = {k: _text(client, k) for k in _keys(client, "sweeps/sw/objectives/")}
    # the cut trial stopped at a step boundary and ended its run: no lease left for the resume to wait out
    assert not [k for k in _keys(client, "sweeps/sw/runs/.raysys-leases/") if not k.endswith("/")]

    line = out.split("continue it with:\n")[1].splitlines()[0].strip()  # pasted as printed, '&'s and all
    resumed = subprocess.run(["bash", "-c", line.replace("python -m", f"{sys.executable} -m")], env=_env(),
                             capture_output=True, text=True, timeout=600)
    print(resumed.stdout[-4000:], resumed.stderr[-3000:])
    assert resumed.returncode == 0 and "Recommended: trial" in resumed.stdout
    rec = resumed.stdout.split("Train it (from any folder):")[1].split("\n\n")[1]
    assert "--storage-path " + shlex.quote(sweeps) in rec  # the recommended run goes where the sweep's runs went
    assert "up to 1 at once" in resumed.stdout  # its --max-concurrent, kept by the sweep
    starts: dict = {}
    for e in _sweep_events(client, "sweeps/sw"):
        if e[0] == "start":
            starts.setdefault(e[1], []).append(e)
    assert len(starts) == 3 and all(len(starts[t]) == 1 for t in finished)
    (again,) = [t for t, s in starts.items() if len(s) > 1]
    resumed_at = int(_text(client, f"sweeps/sw/runs/sw-{again}/events.log").split("resumed step=")[1].split()[0])
    assert "sweeps/sw/report/pareto.md" in _keys(client, "sweeps/sw/report/")
    # the trial cut and resumed keeps its whole objectives history: its child run has both past the
    # resume, and its rows on S3 are those of before the cut, once, then the resumed session's (not
    # left in the first session's temporary working copy)
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (child,) = [r for r in mlflow.search_runs([mlflow.get_experiment_by_name("raysys-deep_gpcm").experiment_id])
                if r.data.tags.get("raysys.trial_id") == again]
    for key in ("objective/throughput", "objective/quality"):
        steps = [m.step for m in mlflow.get_metric_history(child.info.run_id, key)]
        assert steps and max(steps) > resumed_at, (key, steps, resumed_at)
    rows = _text(client, f"sweeps/sw/objectives/{again}.jsonl").splitlines()
    cut = cut_rows.get(f"sweeps/sw/objectives/{again}.jsonl", "").splitlines()
    assert cut and rows[:len(cut)] == cut and all(rows.count(row) == 1 for row in cut), (cut, rows)
    assert any(json.loads(row).get("step", 0) > resumed_at for row in rows[len(cut):]), rows
    assert not (tmp_path / "raysys_runs").exists()  # everything went to the bucket


def test_a_storage_path_that_cannot_be_written_is_one_line_before_anything(tmp_path):
    """A file in the way, or a folder no one can write (/proc, even for root): exit 2, nothing made."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "space.yaml").write_text("workload: deep_gpcm\npreset: quick\nspace:\n  train.batch_size: {choice: [16, 32]}\n")
    for cmd, path, words in [
            (["raysys", *QUICK], "afile/runs", "afile is a file, not a folder"),
            (["raysys", *QUICK], "/proc/raysys-runs", "cannot write in /proc"),
            (["raysys.tune", "--space", "space.yaml"], "/proc/raysys-sweeps", "cannot write in /proc"),
            (["raysys.tune", "--space", "space.yaml"], "file:///proc/raysys-sweeps", "cannot write in /proc")]:
        if cmd[0] == "raysys":
            cmd = ["raysys", "train", *cmd[1:]]
        proc = subprocess.run([sys.executable, "-m", *cmd, "--storage-path", path], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, (cmd, path, proc.stderr[-2000:])
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "space.yaml"]


def test_remote_storage_that_cannot_be_written_is_one_line_before_anything(tmp_path, s3):
    """A missing bucket, an endpoint nothing answers at, no bucket at all (moto takes any credentials):
    exit 2 and one line naming the storage, before a data folder, a store or an MLflow run exists.
    (Before: tracebacks and exit 1 once training wrote its first file, a sweep's MLflow run left RUNNING.)"""
    uri, client = s3
    port = uri.split("127.0.0.1:")[1].split("&")[0]
    dead = free_port()
    work = tmp_path / "work"
    work.mkdir()
    (work / "space.yaml").write_text("workload: deep_gpcm\npreset: quick\nspace:\n  train.batch_size: {choice: [16, 32]}\n")
    bad = [(uri.replace(BUCKET, "no-such-bucket"), {}, "cannot write there"),
           # moto answers multipart uploads wrongly: the line says what a server like it takes (audit AW F9)
           (uri.replace("&allow_delayed_open=true", ""), {}, "takes one PUT per file with ?allow_delayed_open=true"),
           (uri.replace(f"127.0.0.1:{port}", f"127.0.0.1:{dead}"), {}, "cannot write there"),
           ("s3://", {}, "names no bucket")]
    # the sweep goes through the same check (Remote.check): one bad storage of it is enough
    for cmd, cases in ((["raysys", "train", *QUICK], bad), (["raysys.tune", "--space", "space.yaml"], bad[:1])):
        for path, env, words in cases:
            proc = subprocess.run([sys.executable, "-m", *cmd, "--storage-path", path], cwd=work,
                                  env=_env(**env), capture_output=True, text=True, timeout=300)
            assert proc.returncode == 2, (cmd, path, proc.stderr[-2000:])
            assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in work.iterdir()) == ["space.yaml"]
    assert not [k for k in _keys(client, "") if ".raysys-probe-" in k]  # the probe objects were removed


def test_a_remote_runs_resume_line_pastes_and_its_lock_ignores_how_the_uri_is_spelt():
    """An S3 URI's options hold '&': unquoted, a pasted resume line ran in the background without them.
    Its options in another order named another lock, and two processes trained one run at once."""
    import shlex
    from types import SimpleNamespace

    from raysys import workload as registry
    from raysys.train.launcher import _lock_dir, _resume_command

    uri = "s3://b/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    cmd = _resume_command(registry.get("deep_gpcm"), SimpleNamespace(storage_path=uri), "r1")
    words = shlex.split(cmd.split(" && ", 1)[1])
    assert words[words.index("--storage-path") + 1] == uri
    same = ["s3://b/runs/?scheme=http&endpoint_override=127.0.0.1:9000", "S3://b/runs?scheme=http&endpoint_override=127.0.0.1:9000"]
    assert {_lock_dir(SimpleNamespace(storage_path=u)) for u in [uri, *same]} == {_lock_dir(SimpleNamespace(storage_path=uri))}
    assert _lock_dir(SimpleNamespace(storage_path=uri.replace("/runs", "/other"))) != _lock_dir(SimpleNamespace(storage_path=uri))


def test_working_copies_of_killed_processes_are_removed_by_the_next_one(tmp_path):
    """A remote run's working copy lives in the temp folder; a SIGKILLed process cannot remove its own.
    The next process that makes one removes those whose process is gone, never a live process's."""
    make = ("import os, signal, sys, time\nfrom raysys import storage\n"
            "root = storage.working_copy(storage.Remote(sys.argv[1]), sys.argv[2])\n"
            "(root / 'state.pt').write_bytes(b'x' * 1000)\nprint(root, flush=True)\n"
            "if sys.argv[3] == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
            "if sys.argv[3] == 'live': time.sleep(600)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    uri = f"file://{tmp_path / 'store'}"

    def run(name, how):
        return subprocess.run([sys.executable, "-c", make, uri, name, how], env=env, capture_output=True, text=True,
                              timeout=120)

    killed = Path(run("killed", "kill").stdout.strip())
    assert killed.is_dir()
    live = subprocess.Popen([sys.executable, "-c", make, uri, "live", "live"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        live_copy = Path(live.stdout.readline().strip())
        done = run("next", "exit")
        assert done.returncode == 0, done.stderr
        assert not killed.exists() and not Path(f"{killed}.alive").exists()
        assert not Path(done.stdout.strip()).exists()  # its own, at its exit
        assert (live_copy / "state.pt").is_file()  # a live process's copy is kept
    finally:
        live.kill()
        live.wait()


def test_a_ray_workers_working_copy_is_removed_when_its_function_ends(tmp_path):
    """Ray ends its worker processes without atexit: a Ray Train worker's copy of a remote run (every
    checkpoint it saved) used to stay in the node's temp folder. The copy a worker made is removed when its
    function ends, also by an error; a worker in the driver's own process (--workers 0) keeps the driver's."""
    from raysys import storage

    payload = {"storage_uri": f"file://{tmp_path / 'store'}", "run_name": f"w-{tmp_path.name}"}
    with storage.worker_run_dir(payload) as made:
        (made / "state.pt").write_bytes(b"x")
    assert not made.exists() and not Path(f"{made}{storage.ALIVE}").exists()
    with pytest.raises(RuntimeError), storage.worker_run_dir(payload) as made:
        raise RuntimeError("a worker's training failed")
    assert not made.exists()
    drivers = storage.working_copy(storage.Remote(payload["storage_uri"]), payload["run_name"])
    try:
        with storage.worker_run_dir(payload) as same:
            assert same == drivers
        assert drivers.is_dir()
    finally:
        storage.drop_copy(drivers)
    assert not drivers.exists()
    from raysys import lifecycle

    lock = lifecycle.create_run_dir(tmp_path / "local", "local")  # a shared folder: the driver made the run there
    try:
        with storage.worker_run_dir({"run_dir": str(tmp_path / "local")}) as shared:
            assert shared == tmp_path / "local"
    finally:
        lock.release()


def test_a_storage_call_that_stalls_is_said_while_it_waits(tmp_path, monkeypatch):
    """An endpoint that stalls without failing (a paused server) held an upload for as long as its retries
    allowed, in silence: a 35 s gap in the progress. A first attempt taking SLOW_S is said, once."""
    import logging
    import threading

    from raysys import storage

    monkeypatch.setattr(storage, "SLOW_S", 0.01)
    said = threading.Event()

    class Heard(logging.Handler):
        def emit(self, record):
            if "has not answered the upload x/state.pt" in record.getMessage():
                said.set()

    heard = Heard()
    lines = []
    heard.emit = lambda record, emit=heard.emit: (lines.append(record.getMessage()), emit(record))
    logging.getLogger("raysys.storage").addHandler(heard)
    try:
        remote = storage.Remote(f"file://{tmp_path}")
        assert remote._retrying(lambda: said.wait(60), "upload x/state.pt")  # answers once it was said
        assert remote._retrying(lambda: "fast", "upload y") == "fast"
    finally:
        logging.getLogger("raysys.storage").removeHandler(heard)
    # the wait said, its end is said too (once); a call that answered at once says nothing
    assert len(lines) == 2 and lines[1].startswith(f"storage file://{tmp_path} answers again: the upload x/state.pt went "
                                                   "through after"), lines


def test_a_worker_that_does_not_see_the_run_folder_says_the_storage_is_not_shared(tmp_path, monkeypatch):
    """A local --storage-path on a cluster whose nodes do not share it: the run ran to its end with its
    checkpoints and results on a worker node's disk, 'done' with every result n/a, a --resume finding nothing
    (audit AV F9). A worker now finds the run folder the driver made (its lock file), or refuses in one line."""
    from raysys import lifecycle, storage
    from raysys.config import ConfigError

    monkeypatch.setenv("RAYSYS_SHARED_WAIT_S", "0")
    seen = tmp_path / "runs" / "r"
    lock = lifecycle.create_run_dir(seen, "r")  # what the driver makes before any worker starts
    try:
        with storage.worker_run_dir({"run_dir": str(seen)}) as got:
            assert got == seen
    finally:
        lock.release()
    elsewhere = tmp_path / "other-node" / "runs" / "r"
    with pytest.raises(ConfigError, match=f"the run folder {elsewhere} is not on node .*: a cluster's nodes must share "
                                          r"--storage-path \(a shared file system, or s3://...\)"):
        with storage.worker_run_dir({"run_dir": str(elsewhere)}):
            pass


def test_a_lease_fences_its_holder_once_taken_and_not_once_let_go(s3, monkeypatch, tmp_path):
    """What the lease's fence says of a run: nothing while this process holds it; LeaseLost once another holds
    it (its records and checkpoints stop); nothing after this process let go of it itself (its MLflow run's
    end comes after the lock's release: a JAX run on S3 ended 'taken over' at its last record)."""
    from raysys import storage

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAYSYS_LEASE_BEAT_S", "0.2")
    for registry in ("_runs", "_tokens", "_lost", "_checked"):
        monkeypatch.setattr(storage, registry, {})
    uri, _ = s3
    copy = tmp_path / "copy"
    storage.register(copy, uri, "r")
    remote = storage.Remote(uri)
    lease = storage.Lease(remote, "r").acquire(say=lambda line: None)
    storage.check_lease(copy)  # held
    lease.release()
    storage.check_lease(copy)  # let go of on purpose
    lease = storage.Lease(remote, "r").acquire(say=lambda line: None)
    try:
        storage.Lease(remote, "r")._write()  # another process's token now (as after a takeover)
        with pytest.raises(storage.LeaseLost, match="run 'r' on .* was taken over by process"):
            storage.check_lease(copy)
        with pytest.raises(storage.LeaseLost):  # said again without a read: this session's run is lost for good
            storage.check_lease(copy, every_s=3600)
    finally:
        lease.release()
    # a later session of this process takes the run over (the other's lease no longer renewed): its own again
    lease = storage.Lease(remote, "r").acquire(say=lambda line: None)
    try:
        storage.check_lease(copy)
    finally:
        lease.release()
