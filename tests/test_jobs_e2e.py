"""`ray job submit` against a real local head with token auth, end to end."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
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
    yield url, env, tmp
    os.killpg(proc.pid, signal.SIGTERM)  # `ray stop` would stop every Ray on the machine
    try:
        proc.wait(timeout=10)  # its own temp dir: nothing to keep after a hard stop
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _submit(url: str, env: dict, *entrypoint: str, working_dir: Path = REPO) -> str:
    for _ in range(30):  # the head's job agent can come up a little after its HTTP server
        r = subprocess.run(["ray", "job", "submit", "--address", url, "--working-dir", str(working_dir), "--",
                            *entrypoint],
                           env=env, capture_output=True, text=True, timeout=900)
        if "No available agent to submit job" not in r.stdout + r.stderr:
            break
        time.sleep(3)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout, r.stdout[-3000:]
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
