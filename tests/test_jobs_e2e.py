"""`ray job submit` against a real local head with token auth, end to end."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A real head on 127.0.0.1 with token auth; stopped (only it) at the end."""
    tmp = tmp_path_factory.mktemp("head")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp / "auth_token")}
    env.pop("RAY_ADDRESS", None)
    # The secret the head and every client share (users: `ray get-auth-token --generate` writes one
    # to ~/.ray/auth_token; a test keeps its own so it never touches the user's).
    (tmp / "auth_token").write_text(secrets.token_hex(32))
    gcs, dash = _free_port(), _free_port()
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", "--disable-usage-stats",
         f"--temp-dir={tmp / 'ray'}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while time.time() < deadline:
        r = subprocess.run(["ray", "job", "list", "--address", url], env=env, capture_output=True, text=True)
        if r.returncode == 0:
            break
        time.sleep(2)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        pytest.fail("the Ray head did not come up")
    (tmp / "gcs_address").write_text(f"127.0.0.1:{gcs}")  # what `--address` of a command takes
    yield url, env, tmp
    os.killpg(proc.pid, signal.SIGTERM)  # `ray stop` would stop every Ray on the machine
    try:
        proc.wait(timeout=10)  # its own temp dir: nothing to keep after a hard stop
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _submit(url: str, env: dict, *entrypoint: str, working_dir: Path = REPO, options: tuple = ()) -> str:
    """``ray job submit`` (with ``options``, e.g. --no-wait); its output, once it succeeded."""
    for _ in range(30):  # the head's job agent can come up a little after its HTTP server
        r = subprocess.run(["ray", "job", "submit", "--address", url, "--working-dir", str(working_dir), *options,
                            "--", *entrypoint],
                           env=env, capture_output=True, text=True, timeout=900)
        if "No available agent to submit job" not in r.stdout + r.stderr:
            break
        time.sleep(3)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "--no-wait" in options or "succeeded" in r.stdout, r.stdout[-3000:]
    return r.stdout


def test_job_without_token_is_refused(head):
    url, env, _ = head
    (tmp_wrong := Path(env["RAY_AUTH_TOKEN_PATH"]).with_name("wrong_token")).write_text(secrets.token_hex(32))
    no_token = {**env, "RAY_AUTH_TOKEN_PATH": str(tmp_wrong)}
    r = subprocess.run(["ray", "job", "list", "--address", url], env=no_token, capture_output=True, text=True)
    assert r.returncode != 0


def test_submit_deep_gpcm_training_job(head):
    from mlflow.tracking import MlflowClient

    url, env, tmp = head
    db = tmp / "mlflow.db"
    out = _submit(url, env, "python", "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", "--workers", "2",
                  "--name", "job-run", "--tracking-uri", f"sqlite:///{db}", "--storage-path", str(tmp / "runs"))
    assert "[raysys] done: run 'job-run'" in out
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("raysys-deep_gpcm")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and "eval/qwk" in run.data.metrics
    assert (tmp / "runs" / "job-run" / "final_metrics.json").is_file()


@pytest.mark.slow  # a sweep as a job; the training job covers submission by default
def test_submit_tiny_sweep_job(head):
    from mlflow.tracking import MlflowClient

    url, env, tmp = head
    db = tmp / "sweep.db"
    out = _submit(url, env, "python", "-m", "raysys.tune", "--space", "tune_spaces/deep_gpcm.yaml", "--num-samples", "2",
                  "--preset", "quick", "--set", "train.epochs=1", "--set", "train.compile=false", "--name", "job-sweep",
                  "--tracking-uri", f"sqlite:///{db}", "--storage-path", str(tmp / "sweeps"))
    assert "python -m raysys train deep_gpcm" in out  # the recommendation's command
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("raysys-deep_gpcm")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2


@pytest.mark.slow  # ~50 s: the user's folder as the job's working dir (docs/your-workload.md)
def test_submit_a_plugin_workload_from_its_own_folder(head, tmp_path):
    """A user's module:attr workload, shipped as the job's working_dir, found by the job's driver and by
    both Ray Train workers."""
    url, env, tmp = head
    project = tmp_path / "project"
    shutil.copytree(REPO / "examples" / "digits", project,
                    ignore=shutil.ignore_patterns("raysys_runs", "mlflow.db", "*.egg-info", "build"))
    db = tmp / "plugin.db"
    out = _submit(url, env, "python", "-m", "raysys", "train", "digits_mlp:WORKLOAD", "--preset", "quick",
                  "--workers", "2", "--name", "plugin-job", "--tracking-uri", f"sqlite:///{db}",
                  "--storage-path", str(tmp / "runs"), working_dir=project)
    assert "[raysys] done: run 'plugin-job'" in out and "TrainingReport(" not in out
    import json

    final = json.loads((tmp / "runs" / "plugin-job" / "final_metrics.json").read_text())
    assert final["world_size"] == 2 and final["eval/accuracy"] > 0.5


@pytest.mark.slow  # ~25 s: Ray retries the refused handshake
def test_workers_a_cluster_cannot_place_are_said_and_a_signal_stops_the_wait(head, tmp_path):
    """Three workers on a 2-CPU cluster: Ray Train waits, silently and for ever, for a node to join (an
    autoscaler's, or a lost node's return), and a SIGTERM (`timeout`, a scheduler) waited for a step boundary
    that could not come. Now the wait is said once, with what the cluster has, and the signal stops at once."""
    from mlflow.tracking import MlflowClient

    _, env, tmp = head
    proc = subprocess.Popen([sys.executable, "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", "--workers",
                             "3", "--address", (tmp / "gcs_address").read_text(), "--name", "three"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    import threading

    never = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))  # a silent wait ends the output
    never.start()
    try:
        for line in proc.stdout:  # until the wait is said
            lines.append(line)
            if "Ray Train waits for the cluster" in line:
                break
        never.cancel()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = [x for x in lines if "Ray Train waits for the cluster" in x]
    assert len(said) == 1 and "to place 3 worker(s) of {CPU 1" in said[0] and "CPU 2 (" in said[0], "".join(lines)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "raysys: interrupted; the run had no checkpoint yet" in err and "Traceback" not in err, err[-3000:]
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(["1"])
    assert run.info.status == "KILLED"


@pytest.mark.slow  # ~25 s: two joins of the test head
def test_a_sweep_joins_a_cluster_quietly(head, tmp_path):
    """`raysys.tune --address` printed Ray's INFO lines ("Connecting to existing Ray cluster at address: ...")
    on a quiet console; `train` did not (audit AV F6). -v shows them. The dashboard its job line names is the
    one Ray joined, not the GCS host with port 8265."""
    url, env, tmp = head
    script = ("import sys, ray; from raysys.tune.runner import _dashboard, _init_ray; _init_ray(sys.argv[1]); "
              "print('joined', ray.is_initialized(), _dashboard(sys.argv[1])); ray.shutdown()")
    quiet = {k: v for k, v in env.items() if k != "RAYSYS_VERBOSE"}
    for verbose in (False, True):
        r = subprocess.run([sys.executable, "-c", script, (tmp / "gcs_address").read_text()], cwd=tmp_path,
                           env={**quiet, "RAYSYS_VERBOSE": "1"} if verbose else quiet, capture_output=True, text=True,
                           timeout=300)
        # and the dashboard its recommendation's `ray job submit` line names is the one Ray joined (audit AV F5)
        assert r.returncode == 0 and f"joined True {url.split('://')[1]}" in r.stdout, r.stdout + r.stderr[-3000:]
        assert ("Connecting to existing Ray cluster" in r.stderr) == verbose, r.stderr[-3000:]


def test_joining_a_token_cluster_without_its_token_is_one_line_and_creates_nothing(head, tmp_path):
    """Before: a traceback after Ray's retries, exit 1, and a half-made run (its folder blocking the name,
    its MLflow run RUNNING for ever)."""
    _, env, tmp = head
    no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    r = subprocess.run([sys.executable, "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", "--workers", "1",
                        "--address", (tmp / "gcs_address").read_text(), "--name", "x"], cwd=tmp_path, env=no_token,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("raysys: config error: the Ray cluster at ")
    assert "asks for its auth token: set RAY_AUTH_MODE=token" in r.stderr
    assert "gcs_client" not in r.stderr, r.stderr[-3000:]  # Ray's warning per try, 20 of them (audit AV F1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # ~90 s: a job stopped mid-run, then resumed by a second job
def test_ray_job_stop_ends_the_run_killed_and_a_new_job_resumes_it(head):
    """`ray job stop` SIGTERMs the job and SIGKILLs it 3 s later unless RAY_JOB_STOP_WAIT_TIME_S says
    otherwise; cluster/runtime_env.yaml does, so the run checkpoints, ends KILLED and resumes."""
    import json

    from mlflow.tracking import MlflowClient

    url, env, tmp = head
    db, runs = tmp / "stop.db", tmp / "stop-runs"
    common = ["--name", "stopped", "--tracking-uri", f"sqlite:///{db}", "--storage-path", str(runs)]
    _submit(url, env, "python", "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", "--workers", "1",
            "--set", "train.epochs=1000", *common,
            options=("--no-wait", "--runtime-env", str(REPO / "cluster" / "runtime_env.yaml"), "--submission-id", "stop-1"))
    deadline = time.time() + 600
    while not list((runs / "stopped" / "checkpoints").glob("step_*/meta.json")):
        assert time.time() < deadline, "no checkpoint"
        time.sleep(1)
    subprocess.run(["ray", "job", "stop", "stop-1", "--address", url], env=env, capture_output=True, timeout=300)
    logs = subprocess.run(["ray", "job", "logs", "stop-1", "--address", url], env=env, capture_output=True,
                          text=True, timeout=120).stdout
    assert "run 'stopped' stopped with a checkpoint (MLflow: KILLED)" in logs, logs[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-deep_gpcm").experiment_id])
    assert run.info.status == "KILLED"
    out = _submit(url, env, "python", "-m", "raysys", "train", "deep_gpcm", "--resume", "--set", "train.epochs=1",
                  *common)
    assert "resumed from" in out or "nothing left to train" in out, out[-3000:]
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert json.loads((runs / "stopped" / "final_metrics.json").read_text())


def test_a_job_keeping_its_run_in_rays_unpacked_working_dir_is_told(tmp_path, monkeypatch, capsys):
    """A job's working dir is Ray's unpacked copy, named after the source's hash: runs kept there are not
    found by the next job after an edit. Said in one line; not said where the run and store are elsewhere."""
    from raysys.train.launcher import say_if_in_ray_package

    pkg = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    pkg.mkdir(parents=True)
    monkeypatch.chdir(pkg)
    say_if_in_ray_package(pkg / "raysys_runs" / "r", f"sqlite:///{pkg / 'mlflow.db'}")
    out = capsys.readouterr().out
    assert "the run's folder and the MLflow store are in Ray's unpacked copy" in out and "--storage-path" in out
    say_if_in_ray_package(tmp_path / "runs" / "r", "http://127.0.0.1:5000")
    assert capsys.readouterr().out == ""


def test_a_jobs_resume_line_is_a_job_of_the_same_source(tmp_path, monkeypatch):
    """`ray job stop` printed `cd <Ray's unpacked copy on the head> && python -m raysys train ... --resume`: a
    folder the user's machine lacks, and a driver that would start a Ray of its own (audit AV F2). A job's
    resume is a new job of the same source, on the cluster, as cluster/README.md says."""
    from raysys import workload as registry
    from raysys.train.config import LaunchConfig
    from raysys.train.launcher import _resume_command

    wl = registry.get("deep_gpcm")
    launch = LaunchConfig(storage_path="/shared/runs", tracking_uri="http://mlflow.internal:5000")
    monkeypatch.chdir(tmp_path)
    assert _resume_command(wl, launch, "r") == (f"cd {tmp_path} && python -m raysys train deep_gpcm --name r --resume "
                                                "--storage-path /shared/runs")
    pkg = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    pkg.mkdir(parents=True)
    monkeypatch.chdir(pkg)
    assert _resume_command(wl, launch, "r") == (
        "ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env cluster/runtime_env.yaml -- "
        "python -m raysys train deep_gpcm --name r --resume --storage-path /shared/runs --tracking-uri "
        "http://mlflow.internal:5000")


def test_a_refused_join_says_the_whole_reason_on_one_line():
    """Ray's first line alone ended at "Initialization failure from server:" (audit AV F8)."""
    from raysys.train.runtime import join_refused

    e = ConnectionError("Initialization failure from server:\nTraceback ...\nSpecificServer startup failed")
    assert join_refused("ray://127.0.0.1:9911", e) == (
        "could not join the Ray cluster at ray://127.0.0.1:9911: Initialization failure from server: Traceback ... "
        "SpecificServer startup failed (nothing was created)")
