"""A run that loses nothing: every case of issue #15's table, tried as a user would, in fresh
processes (``python -m raysys``) against real files, a real MLflow store and a real server."""

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import MlflowServer, TcpGate
from raysys.checkpoint import STEP_DIR

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"
QUICK = ["deep_gpcm", "--preset", "quick", "--workers", "0", "--set", "train.epochs=1"]

# The digits example, asking its own run to stop (exactly what SIGINT does) when micro-batch STOP_AT
# begins: a deterministic interruption, for the step-for-step resume comparison.
STOPPER = '''
import dataclasses, os
from digits_mlp import WORKLOAD as BASE, DigitsTask
from raysys import lifecycle

class StoppingTask(DigitsTask):
    calls = 0
    def loss(self, model, batch):
        StoppingTask.calls += 1
        if StoppingTask.calls == int(os.environ.get("STOP_AT", "0")):
            lifecycle.request_stop()
        return super().loss(model, batch)

WORKLOAD = dataclasses.replace(BASE, name="digits_stop", task=StoppingTask())
'''

# The same, its evaluation drawing random numbers (a sampled metric, a bootstrap), which rank 0 alone runs.
DDP_STOPPER = STOPPER.replace("""        return super().loss(model, batch)
""", """        return super().loss(model, batch)
    def evaluate(self, model, batches):
        import random, numpy, torch
        torch.rand(3), numpy.random.rand(3), random.random()
        return super().evaluate(model, batches)
""")

# The summarizer, stopped the same way (its TorchTask through the shared loop).
PG_STOPPER = STOPPER.replace("from digits_mlp import WORKLOAD as BASE, DigitsTask",
                             "from raysys.workloads.pointer_generator.workload import WORKLOAD as BASE, "
                             "SummarizationTask as DigitsTask").replace('"digits_stop"', '"pg_stop"')
PG_SMALL = ["--preset", "quick", "--set", "data.n_train=200", "--set", "data.max_src_len=128", "--set",
            "data.max_tgt_len=32", "--set", "train.batch_size=8", "--set", "train.epochs=2", "--set", "model.max_len=16"]

# hackmatrix_ppo, whose session says "stop" (what SIGINT makes it say) after STOP_AT chunk boundaries.
PPO_STOPPER = '''
import dataclasses, os
from raysys import lifecycle
from raysys.workloads.hackmatrix_ppo.workload import WORKLOAD as BASE

def train(cfg, session):
    asked = {"n": 0}
    real = session.should_stop
    def should_stop():
        asked["n"] += 1
        if asked["n"] == int(os.environ.get("STOP_AT", "0")):
            lifecycle.request_stop()
        return real()
    session.should_stop = should_stop
    return BASE.train_fn(cfg, session)

WORKLOAD = dataclasses.replace(BASE, name="ppo_stop", train_fn=train)
'''


# mpn_dqn, stopped the same way after STOP_AT collection rounds.
MPN_STOPPER = PPO_STOPPER.replace("hackmatrix_ppo.workload", "mpn_dqn.workload").replace('"ppo_stop"', '"mpn_stop"')


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAYSYS_VERBOSE", "RAY_ADDRESS")}
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLE), env.get("PYTHONPATH")])), **extra}


def _train(cwd: Path, *args: str, env: dict | None = None, timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "raysys", "train", *args], cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout, **kw)
    print(args, "->", proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return proc


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """A test that fails while its run still trains (e.g. a stop that never came) kills the run and its
    Ray processes, so one failure does not slow or break every test after it."""
    yield
    import contextlib

    import psutil

    while _STARTED:
        proc = _STARTED.pop()
        with contextlib.suppress(psutil.NoSuchProcess):  # gone already: nothing to kill
            root = psutil.Process(proc.pid)
            for p in [*root.children(recursive=True), root]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        proc.communicate()


def _start(cwd: Path, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "raysys", "train", *args], cwd=cwd, env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    _STARTED.append(proc)
    return proc


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _mlflow_runs(uri: str, experiment: str) -> list:
    c = _client(uri)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id])


def _losses(uri: str, run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in _client(uri).get_metric_history(run_id, "train/loss")}


def _one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert proc.returncode == code
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("raysys:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _wait_for(ckpts: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> int:
    """Wait for the first complete checkpoint at or past ``step``; return its step. Not the exact
    ``step_N``: only the newest two are kept, so a fast run may prune it between two polls."""
    deadline = time.time() + timeout
    while True:
        done = [int(p.parent.name[5:]) for p in ckpts.glob("step_*/meta.json") if STEP_DIR.fullmatch(p.parent.name)]
        if any(s >= step for s in done):
            return min(s for s in done if s >= step)
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"no checkpoint at or past step {step} in {ckpts}"
        time.sleep(0.2)


# ---- validation before anything exists --------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--name", "../../x"], "not a valid run name"),
    (["--name", "/abs/path", "--resume"], "not a valid run name"),
    (["--max-failures", "-2"], "launch.max_failures must be >= 0, got -2"),
    (["--set", "train.seed=-1"], "train.seed must be in [0, 2**32), got -1"),
    (["--set", "train.max_steps=0"], "train.max_steps must be >= 1"),
    (["--set", "model.memory_size=0"], "model.memory_size must be >= 1"),
    (["--set", "model.chunk=0"], "model.chunk must be >= 1"),
    (["--set", "optim.lr=nan"], "optim.lr"),
    (["--set", "optim.betas=[0.9]"], "optim.betas must be two values"),
    (["--storage-path", "nosuchfs://bucket/runs"], "storage path"),  # s3:// itself: tests/test_storage.py
    (["--storage-path", "file://rel/runs"], "a file URI names no host ('rel' here)"),  # it wrote to /runs
    (["--tracking-uri", "http://127.0.0.1:9"], "does not answer"),
    (["--tracking-uri", "sqlite:///notes.txt"], "notes.txt is not an SQLite database"),
    (["--tracking-uri", "sqlite:///a_folder"], "a_folder is a folder, not a database file"),
    (["--tracking-uri", "sqlite://mlflow.db"], "an SQLite URL has three slashes"),  # was a SQLAlchemy traceback
    (["--tracking-uri", "127.0.0.1:5000"], "did you mean http://127.0.0.1:5000?"),
    (["--workers", "1", "--address", "127.0.0.1:9"], "no Ray cluster answers at 127.0.0.1:9"),
    (["--workers", "1", "--address", "http://127.0.0.1:8265"], "an http address is a Ray dashboard's"),
    # a cross-validation made its parent run (and took minutes of MLflow's retries) before its folds said these
    (["--cv", "--tracking-uri", "http://127.0.0.1:9"], "does not answer"),
    (["--cv", "--set", "data.path=/nonexistent/seqs.txt"], "no sequences file at /nonexistent/seqs.txt"),
    # an unset shell variable ($DATA): it read as none, and the run trained on the workload's own data
    (["--set", "data.path="], "--set data.path= is empty (an unset shell variable?)"),
    (["--set", "data.data_dir=notes.txt"], "--set data.data_dir=notes.txt: that is a file"),  # was "[Errno 17]"
    (["--set", "optim.lr=inf"], "optim.lr: inf is not a valid value"),  # it trained on NaN and ended "done" (AY F1)
    # audit AR: a traceback of numpy's MemoryError; a run made, then failed twice; no key named; a compile per length
    (["--set", "data.max_len=100000000"], "responses to generate, ~626 GiB, more than this machine's"),
    (["--set", "data.seed=-1"], "data.seed must be >= 0, got -1"),
    (["--cv", "--set", "data.n_folds=0"], "data.n_folds must be >= 2, got 0"),  # was "data.fold must be in 0..-1"
    (["--set", "train.compile=true", "--set", "model.path=naive"], "train.compile=true applies to model.path=optimized"),
])
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, args, needle):
    (tmp_path / "notes.txt").write_text("my notes\n")  # what a mistyped --tracking-uri may name
    (tmp_path / "a_folder").mkdir()
    proc = _train(tmp_path, *QUICK, *args, timeout=120)  # a hang guard: MLflow's retries would take minutes
    _one_line_error(proc, 2, needle)
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()
    assert not list(tmp_path.glob("s3*")) and not (tmp_path.parent.parent / "x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_folder", "notes.txt"]


def test_a_deleted_experiment_is_one_line_and_creates_nothing(tmp_path):
    """Audit BE F2: an experiment deleted in the UI (in the store's trash) made every new run fail after its
    folder existed, with MLflow's words and a --resume that could not work; a sweep left a folder."""
    from raysys import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.get_or_create_experiment(uri, "raysys-deep_gpcm")
    _client(uri).delete_experiment(exp)
    (tmp_path / "space.yaml").write_text("workload: deep_gpcm\npreset: quick\nspace: {optim.lr: {choice: [0.001, 0.002]}}\n")
    expected = (f"the MLflow experiment 'raysys-deep_gpcm' (id {exp}) is deleted (in the trash of {uri}): restore it "
                f"with `MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id {exp}`, or track to "
                "another experiment")
    for cmd in (["train", *QUICK], ["train", *QUICK, "--cv", "--set", "data.n_folds=2"]):
        proc = subprocess.run([sys.executable, "-m", "raysys", *cmd], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=300)
        _one_line_error(proc, 2, expected, "(--experiment NAME) (nothing was created)")
    proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "2"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock", "space.yaml"]  # the store's


def test_a_server_that_refuses_writes_is_one_line_in_seconds(tmp_path):
    """Audit BE F4: a server whose database is read-only answers reads (the start-up check) and 503 to writes:
    `train` was silent for ~4 minutes of MLflow's retries, then one urllib3 chain, exit 1, and a --resume
    advice for a run that never existed; a sweep left its folder."""
    server = MlflowServer(tmp_path / "server", read_only=True).start()
    try:
        (tmp_path / "space.yaml").write_text("workload: deep_gpcm\npreset: quick\nspace: {optim.lr: {choice: [0.001, 0.002]}}\n")
        expected = (f"the MLflow tracking server at {server.url} answers, but did not take the run (MlflowException: "
                    f"API request to {server.url}/api/2.0/mlflow/experiments/create failed: too many 503 error "
                    "responses): its database may be read-only or full")
        proc = _train(tmp_path, *QUICK, "--tracking-uri", server.url, timeout=120)  # a hang guard, not a timing
        _one_line_error(proc, 2, expected, "(no run was created)")
        proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "2",
                               "--tracking-uri", server.url], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not list((tmp_path / "raysys_runs").rglob("*-sweep-*"))  # its folder, only just made, is gone
    finally:
        server.stop()


def test_an_address_of_another_grpc_service_is_one_line_and_creates_nothing(tmp_path):
    """A gRPC server that is not a Ray GCS (another service's port) passed the HTTP/2 check, and ray.init then
    retried it for minutes, silent but for a warning every few seconds."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = _train(tmp_path, "deep_gpcm", "--preset", "quick", "--workers", "1", "--address", f"127.0.0.1:{port}",
                      timeout=120)
    finally:
        server.stop(0)
    _one_line_error(proc, 2, f"127.0.0.1:{port} answers gRPC, but has no Ray GCS service")
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_model_too_large_for_this_machine_is_one_line_and_creates_no_run(tmp_path):
    """Audit AR F2: model sizes no memory holds made the run and its MLflow run, failed on the allocation,
    restarted, failed again, and offered a --resume of a run that can never start. (The synthetic data the
    model's sizes come from is made first, and kept: it is a complete dataset, reused by the next run.)"""
    proc = _train(tmp_path, *QUICK, "--set", "model.memory_size=1000000", "--set", "model.value_dim=1000000")
    _one_line_error(proc, 2, "deep_gpcm: its model has 3,000,303,005,405 parameters (11177.0 GiB), 22354.0 GiB "
                             "with the gradients, more than this machine's")
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("task, needle", [
    ("ContextDecisionMaking-v9", "not a gymnasium or NeuroGym id; did you mean ContextDecisionMaking-v0"),
    ("Pendulum-v1", "(Discrete); this task's actions are Box"),
    ("FrozenLake-v1", "flat Box observation (a vector); this task's is Discrete(16)"),
    # declares a vector, returns a bare number: failed after the run existed (audit N)
    ("Null-v0", "its observation space says shape (1,), but reset() returned shape ()"),
])
def test_an_env_task_mpn_dqn_cannot_learn_is_one_line_and_creates_nothing(tmp_path, task, needle):
    """mpn_dqn takes any gymnasium id with a vector observation and discrete actions; others were a
    traceback after the run folder existed."""
    proc = _train(tmp_path, "mpn_dqn", "--preset", "quick", "--set", f"task={task}", timeout=120)
    _one_line_error(proc, 2, "config error", needle)
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("sets, needle", [
    (["device=tpu"], "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["device=cpu", "precision=fp16"], "precision=fp16 needs a CUDA device"),
    (["device=cpu", "cuda_graph=true"], "cuda_graph needs a CUDA learner"),
])
def test_an_mpn_dqn_device_this_machine_lacks_is_one_line_and_creates_nothing(tmp_path, sets, needle):
    """Before: found by the training function, after the run folder and its MLflow run existed (the
    name then taken), or a torch traceback (device=tpu), exit 1."""
    proc = _train(tmp_path, "mpn_dqn", "--preset", "quick", *[a for kv in sets for a in ("--set", kv)], timeout=120)
    _one_line_error(proc, 2, "config error", needle)
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("sets, needle", [
    (["train.num_envs=30"], "train.num_envs=30 must be a multiple of the 4 devices"),
    (["train.num_envs=4", "train.num_steps=3", "train.num_minibatches=2"], "splits its 3 rows"),
    (["launch.jax_platforms=tpu"], "launch.jax_platforms=tpu: Unable to initialize backend 'tpu'"),  # was ignored
    # jax asserts where no backend of it initialises: a traceback, exit 1 (audit AP F4)
    (["launch.jax_platforms=cuda"], "launch.jax_platforms=cuda: no JAX backend for it initialises"),
    # with Ray Train workers, found by the first of them, after the run and its MLflow run existed (audit AP F5)
    (["launch.workers=2", "train.num_envs=33"], "train.num_envs=33 must be a multiple of the 2 Ray Train workers"),
    # sizes no memory of this machine holds: XLA's allocation error after the run, a compile, a traceback (AP F11)
    (["model.hidden=[100000000]"], "need at least 2,347 GiB (0.0 GiB of rollout, 157,500,000,029 parameters"),
    (["train.num_envs=100000000", "train.num_steps=4", "train.num_minibatches=1"], "GiB of rollout"),
])
def test_a_hackmatrix_split_over_devices_that_cannot_be_is_one_line_and_creates_nothing(tmp_path, sets, needle):
    """4 devices (XLA's host platform): the envs per device, and each device's rows per minibatch, are
    checked before the run exists. Before: a ValueError traceback or a reshape TypeError, exit 1, the run left."""
    env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = _train(tmp_path, "hackmatrix_ppo", "--preset", "quick", *[a for kv in sets for a in ("--set", kv)],
                  env=env, timeout=300)
    _one_line_error(proc, 2, "config error", needle)
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


def _parquet(path: Path, questions: list, responses: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"questions": questions, "responses": responses}), path)
    return path


@pytest.mark.parametrize("case, needle", [
    ("huge_id", "sparse"),
    ("missing_column", "missing required column"),
    ("not_parquet", "not readable as parquet"),
    ("too_few_rows", "cannot split"),
])
def test_bad_user_data_is_one_line_and_creates_nothing(tmp_path, case, needle):
    rows = [[1, 2, 3, 4]] * 20
    if case == "huge_id":
        data = _parquet(tmp_path / "d.parquet", rows[:-1] + [[1, 2, 3, 10**9]], [[0, 1, 0, 1]] * 20)
    elif case == "missing_column":
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = tmp_path / "d.parquet"
        pq.write_table(pa.table({"questions": rows}), data)
    elif case == "not_parquet":
        data = tmp_path / "d.parquet"
        data.write_bytes(b"this is not parquet")
    else:
        data = _parquet(tmp_path / "d.parquet", rows[:3], [[0, 1, 0, 1]] * 3)
    proc = _train(tmp_path, *QUICK, "--set", f"data.path={data}", timeout=120)
    _one_line_error(proc, 2, "data error", needle)
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


# ---- one process per run --------------------------------------------------------------------------

def test_the_same_name_twice_at_once_runs_once(tmp_path):
    procs = [_start(tmp_path, *QUICK, "--name", "twin") for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    refused = outs[[p.returncode for p in procs].index(2)][1]
    # the holder is named once its lock text is written; a moment before, "in use by another process"
    assert "in use by process" in refused or "in use by another process" in refused or "already exists" in refused
    runs = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-deep_gpcm")
    assert [r.info.run_name for r in runs] == ["twin"] and runs[0].info.status == "FINISHED"
    assert not list((tmp_path / "raysys_runs" / "twin").glob("config.resume-*"))


def test_commands_started_in_the_same_second_get_names_of_their_own(tmp_path):
    """Default names are <workload>-<time>: of two trains (or sweeps) started in one second without --name,
    the second was refused as "in use", a name its user never chose. It now takes <name>-2. A name the
    user gave is still refused, and a bare --resume takes the newest unfinished run no command trains now."""
    import time as clock

    from raysys.config import ConfigError
    from raysys.train.config import LaunchConfig
    from raysys.train.launcher import _claim, resolve_run_dir
    from raysys.tune.runner import SweepOptions, _claim_sweep

    root = tmp_path / "raysys_runs"
    older, taken = root / "deep_gpcm-20260101-000000", root / "deep_gpcm-20260101-000100"
    older.mkdir(parents=True)
    (older / "events.log").write_text("crashed\n")
    sweep = root / "sweeps" / "deep_gpcm-sweep-20260101-000100"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from raysys import lifecycle; lifecycle.create_run_dir(Path(sys.argv[1]), 'a'); "
                               "(Path(sys.argv[1]) / 'events.log').write_text('training'); "
                               "Path(sys.argv[2]).mkdir(parents=True); lifecycle.RunLock.acquire(Path(sys.argv[2]), 'b'); "
                               "print('held', flush=True); time.sleep(60)", str(taken), str(sweep)],
                              stdout=subprocess.PIPE, text=True)
    _STARTED.append(holder)
    assert holder.stdout.readline().strip() == "held"
    os.utime(older, (clock.time() - 60, clock.time() - 60))  # the crashed run is the older one
    default = LaunchConfig(storage_path=str(root))
    assert _claim("deep_gpcm", default, taken.name, taken) == (f"{taken.name}-2", root / f"{taken.name}-2")
    with pytest.raises(ConfigError, match="is in use by process"):
        _claim("deep_gpcm", LaunchConfig(storage_path=str(root), name=taken.name), taken.name, taken)
    again = LaunchConfig(storage_path=str(root), resume=True)
    assert resolve_run_dir("deep_gpcm", again)[0] == older.name  # not the run the other command trains
    opts = SweepOptions(space="s.yaml", storage_path=str(root / "sweeps"))
    assert _claim_sweep(opts, "deep_gpcm", sweep.name, sweep, None)[0] == f"{sweep.name}-2"
    from raysys import lifecycle
    from raysys.tune import runner

    for held in (root / f"{taken.name}-2", root / "sweeps" / f"{sweep.name}-2"):
        lifecycle.RunLock.release_dir(held)
        runner._LOCKED.discard(held)
    holder.kill()
    holder.wait()


def test_three_runs_at_once_on_a_fresh_store(tmp_path):
    procs = [_start(tmp_path, *QUICK, "--name", f"r{i}") for i in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    runs = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-deep_gpcm")
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [(f"r{i}", "FINISHED") for i in range(3)]


def test_a_folder_named_like_a_url_keeps_its_store_and_its_lines_paste(tmp_path):
    """The default store's URI held the working folder as it is: SQLAlchemy read a '?' as the start of a
    query (the database went to a file named after the folder's first half, outside it) and decoded a
    '%41' (a crash after the run existed). The `mlflow ui` hint and a sweep's resume line were not quoted
    for the shell, so a space or a quote in a path or a --set value broke them when pasted."""
    import shlex
    from types import SimpleNamespace

    from raysys.tracking import sqlite_path
    from raysys.tune.runner import SweepOptions, _resume_line

    folder = tmp_path / "really? 100%41 it's"
    folder.mkdir()
    proc = _train(folder, *QUICK, "--name", "q")
    assert proc.returncode == 0
    hint = next(l for l in proc.stdout.splitlines() if "mlflow ui --backend-store-uri" in l)
    uri = shlex.split(hint.split("serve this store first: ")[1].rstrip(")"))[-1]
    assert sqlite_path(uri) == folder / "mlflow.db" and (folder / "mlflow.db").is_file()
    # beside it, nothing but the empty folder MLflow 3.x makes of the URI's text (mlflow.store.db.utils.
    # _make_parent_dirs_if_sqlite does not decode it): the store itself is inside
    assert all(p == folder or not any(p.iterdir()) for p in tmp_path.iterdir())
    (run,) = _mlflow_runs(uri, "raysys-deep_gpcm")
    assert run.info.status == "FINISHED"

    opts = SweepOptions(space="s.yaml", preset="quick", sets={"data.data_dir": "raysys_data/syn data ü"})
    line = _resume_line(opts, SimpleNamespace(source=folder / "s.yaml"), "s", folder / "raysys_runs" / "sweeps" / "s")
    words = shlex.split(line)
    assert words[:2] == ["cd", os.getcwd()] and str(folder / "s.yaml") in words
    assert words[words.index("--storage-path") + 1] == str(folder / "raysys_runs" / "sweeps")
    assert words[words.index("--set") + 1] == "data.data_dir=raysys_data/syn data ü"


# ---- checkpoint folders are never guessed at --------------------------------------------------------

def test_foreign_and_moved_aside_folders_are_kept_and_stale_ones_cleaned(tmp_path):
    first = _train(tmp_path, *QUICK, "--name", "ck", "--set", "train.epochs=2", "--set", "train.checkpoint_every_steps=2")
    assert first.returncode == 0
    ckpts = tmp_path / "raysys_runs" / "ck" / "checkpoints"
    latest = sorted(ckpts.iterdir())[-1]
    latest.rename(ckpts / f"{latest.name}.bad")  # what the corrupt-checkpoint message advises
    (ckpts / "step_000000001").mkdir()  # no meta.json: not a complete raysys checkpoint
    (ckpts / "step_000000001" / "notes.txt").write_text("mine")
    (ckpts / "step_000000999").mkdir()  # a later-looking folder without meta.json must not win
    (ckpts / ".tmp-step_000000007-0123abcd").mkdir()  # a crash mid-save
    (ckpts / ".tmp-step_000000007-0123abcd" / "state.pt").write_bytes(b"half")

    proc = _train(tmp_path, "deep_gpcm", "--name", "ck", "--resume", "--set", "train.epochs=4")
    assert proc.returncode == 0
    names = {p.name for p in ckpts.iterdir()}
    assert f"{latest.name}.bad" in names and (ckpts / "step_000000001" / "notes.txt").read_text() == "mine"
    assert "step_000000999" in names and not any(n.startswith(".tmp-") for n in names)
    events = (tmp_path / "raysys_runs" / "ck" / "events.log").read_text()
    assert "removed .tmp-step_000000007-0123abcd" in events and "resumed" in events


def test_a_killed_sessions_workers_write_nothing_into_the_run_a_resume_holds(tmp_path):
    """A SIGKILLed driver's Ray workers train on for a second or more (audit G saw step_5 and step_6 written
    after the kill). They carry the session the run folder's lock named when they started; once a resume
    holds the folder, their saves are refused and write nothing."""
    from raysys import lifecycle
    from raysys.checkpoint import CheckpointStore, Superseded

    run = tmp_path / "r"
    first = lifecycle.create_run_dir(run, "r")
    holder = lifecycle.holder_of(run)
    assert holder == f"process {os.getpid()} on {os.uname().nodename}"
    worker = CheckpointStore(run, "wl", {}, holder=holder)
    worker.save({"x": 1}, 1)
    first.release()  # the driver is killed: its lock goes with it
    (run / lifecycle.LOCK_FILE).write_text("process 99999999 on elsewhere\n")  # a --resume now holds the run
    with pytest.raises(Superseded, match="now held by process 99999999 on elsewhere"):
        worker.save({"x": 2}, 2)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000000001"]
    # in-process and remote-storage stores carry no holder: they save as before
    CheckpointStore(run, "wl", {}).save({"x": 3}, 3)
    assert lifecycle.holder_of(tmp_path / "nowhere") is None


def test_a_killed_commands_mlflow_run_is_closed_by_its_watcher(tmp_path):
    """SIGKILL (or the OOM killer, or Ray's core worker after its raylet died) ends a run that can close
    nothing: its MLflow run showed RUNNING until a --resume. The command's watcher closes it KILLED, says
    why and how to resume (in the run's tag, and on the command's stderr); the resume then ends it FINISHED, the error tag gone."""
    args = [*QUICK, "--name", "wk", "--set", "train.epochs=50", "--set", "train.checkpoint_every_steps=3"]
    run = _start(tmp_path, *args)
    _wait_for(tmp_path / "raysys_runs" / "wk" / "checkpoints", run, 3)
    run.kill()
    _, err = run.communicate(timeout=120)  # the watcher holds the command's stderr until it has said its line
    assert err.rstrip().endswith("its MLflow run is closed KILLED; resume it with:\n"
                                 f"  cd {tmp_path} && python -m raysys train deep_gpcm --name wk --resume"), err[-2000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    deadline = time.time() + 120
    while (r := _mlflow_runs(uri, "raysys-deep_gpcm")[0]).info.status == "RUNNING":
        assert time.time() < deadline, "the killed run's MLflow run stayed RUNNING"
        time.sleep(0.5)
    assert r.info.status == "KILLED"
    assert r.data.tags["raysys.error"].endswith(f"resume it with: cd {tmp_path} && python -m raysys train deep_gpcm "
                                                "--name wk --resume")
    assert "the run's watcher closed its MLflow run KILLED" in (tmp_path / "raysys_runs" / "wk" / "events.log").read_text()
    assert _train(tmp_path, "deep_gpcm", "--workers", "0", "--name", "wk", "--resume", "--set", "train.epochs=2").returncode == 0
    (r,) = _mlflow_runs(uri, "raysys-deep_gpcm")
    assert r.info.status == "FINISHED" and "raysys.error" not in r.data.tags


@pytest.mark.slow  # ~25 s, most of it the watcher's back-off; the default suite checks its other cases
def test_a_watcher_waits_out_a_tracking_outage(tmp_path):
    """A command killed while its tracking server was away left its runs RUNNING (until a --resume): its
    watcher tried once and gave up. It now waits for the server, as a sweep does, and closes them."""
    from raysys import tracking, watcher

    server = MlflowServer(tmp_path / "server").start()
    try:
        parent = tracking.start_run(server.url, "w", "p")
        child = tracking.start_run(server.url, "w", "c", parent_run_id=parent)
        server.stop()
        said = tmp_path / "stderr.txt"
        saved, out = os.dup(2), os.open(said, os.O_WRONLY | os.O_CREAT)
        os.dup2(out, 2)  # the command's stderr, as the watcher takes a copy of it
        try:
            w = watcher.watch(server.url, parent, tmp_path, tmp_path / "lock", "resume me")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(out)
        os.close(w.fd)  # the command died in the outage
        with pytest.raises(subprocess.TimeoutExpired):
            w.proc.wait(timeout=5)  # still waiting for the server (it would wait 600 s)
        # said at its first try, and the command's stderr let go of (a `| tee` of the command ends)
        assert "its MLflow run could not be closed now (the tracking server does not answer)" in said.read_text()
        assert not any(os.path.realpath(f"/proc/{w.proc.pid}/fd/{fd}") == str(said)
                       for fd in os.listdir(f"/proc/{w.proc.pid}/fd"))
        server.start()
        assert w.proc.wait(timeout=120) == 0
        c = _client(server.url)
        assert (c.get_run(parent).info.status, c.get_run(child).info.status) == ("KILLED", "KILLED")
        assert c.get_run(parent).data.tags["raysys.error"].endswith("resume it with: resume me")
    finally:
        server.stop()


def test_a_watcher_leaves_alone_what_is_not_its_to_close(tmp_path):
    """The watcher acts only on a death: not after "done", not while a --resume holds the run (its lock);
    after one, the run's RUNNING children close too, and records that wait in the run's tracking buffer
    (the command died in an outage) are sent first (audit BE F1: the run had stayed RUNNING, unsaid)."""
    import fcntl

    from raysys import tracking, watcher

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def case(done=False, locked=False, buffered=False, remote=False) -> tuple[str, str]:
        parent = tracking.start_run(uri, "w", f"p{time.monotonic_ns()}")
        child = tracking.start_run(uri, "w", f"c{time.monotonic_ns()}", parent_run_id=parent)
        (run_dir / tracking.BUFFER_FILE).write_text('{"kind": "metrics", "data": {"train/loss": 0.5}, "step": 7}\n'
                                                    if buffered else "")
        held = os.open(run_dir / "lock", os.O_RDWR | os.O_CREAT)
        if locked:
            fcntl.flock(held, fcntl.LOCK_EX)
        w = watcher.watch(uri, parent, run_dir, run_dir / "lock", "resume me", remote=remote)
        if done:
            w.done()
        else:
            os.close(w.fd)  # the command died
        assert w.proc.wait(timeout=120) == 0
        os.close(held)
        c = _client(uri)
        case.child_tags = c.get_run(child).data.tags
        case.history = [(m.step, m.value) for m in c.get_metric_history(parent, "train/loss")]
        return c.get_run(parent).info.status, c.get_run(child).info.status

    # a resume that comes while a watcher holds the run's lock (its MLflow calls) waits for it, not refused
    from raysys import lifecycle

    (run_dir / lifecycle.LOCK_FILE).touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); os.pwrite(fd, sys.argv[2].encode(), 0); print('held', "
                               "flush=True); sys.stdin.readline()", str(run_dir / lifecycle.LOCK_FILE),
                               f"{lifecycle.WATCHER_HOLDER} (process 1, for a moment)"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _STARTED.append(holder)
    assert holder.stdout.readline().strip() == "held"
    got = []
    waiter = threading.Thread(target=lambda: got.append(lifecycle.RunLock.acquire(run_dir, "run")))
    waiter.start()
    time.sleep(0.5)  # (the acquire meets the held lock; had it been refused, got stays empty)
    holder.stdin.write("\n")  # the watcher is done
    holder.stdin.flush()
    waiter.join(timeout=60)
    assert got and got[0].fd is not None
    got[0].release()

    assert case(done=True) == ("RUNNING", "RUNNING")
    assert case(locked=True) == ("RUNNING", "RUNNING")
    assert case() == ("KILLED", "KILLED") and case.history == []
    # a run on remote storage: its buffer is also on the storage, which a --resume sends (audit BI F4)
    assert case(buffered=True, remote=True) == ("RUNNING", "RUNNING") and case.history == []
    assert case(buffered=True) == ("KILLED", "KILLED") and case.history == [(7, 0.5)]
    assert not (run_dir / tracking.BUFFER_FILE).exists()
    assert "after sending the 1 record(s) of its tracking buffer" in (run_dir / "events.log").read_text()
    # the child (a fold, a trial) says why and how to go on too, as its parent does (audit AW F3)
    assert "the process ended without closing its run" in case.child_tags["raysys.error"]
    assert case.child_tags["raysys.error"].endswith("resume it with: resume me")


def test_unit_checkpoint_store_finishes_an_interrupted_swap(tmp_path):
    import torch

    from raysys.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path, "w", {"model": {}}, keep=1)
    store.save({"x": torch.ones(1)}, 3)
    # a crash between moving step 3 aside and moving its replacement in: only the .old copy is complete
    os.replace(store.root / "step_000000003", store.root / ".old-step_000000003-89abcdef")
    assert store.latest() is None
    assert store.clean_stale() == [".old-step_000000003-89abcdef -> step_000000003"]
    assert store.load()[0]["x"].item() == 1.0
    # a prune cut by a kill: the older checkpoint, moved out of sight first, is removed; the newest stays
    store.save({"x": torch.full((1,), 4.0)}, 4)
    assert [p.name for p in store.root.iterdir()] == ["step_000000004"]  # keep=1: step 3 pruned, nothing left over
    half = store.root / ".pruned-step_000000002-0123abcd"
    half.mkdir()
    (half / "meta.json").write_text("{}")  # its state file already removed
    assert store.clean_stale() == ["removed .pruned-step_000000002-0123abcd"]
    assert [p.name for p in store.root.iterdir()] == ["step_000000004"] and store.load()[0]["x"].item() == 4.0


def test_a_snapshot_cut_by_a_kill_is_never_what_a_resume_reads(tmp_path):
    """Config snapshots are written whole or not at all; an empty one an older raysys left (killed
    between open and write) is passed over for the newest whole one, where it broke every --resume."""
    from raysys import storage
    from raysys.train.launcher import saved_config

    storage.write_text(tmp_path / "config.yaml", "train: {epochs: 2}\n")
    storage.write_text(tmp_path / "config.resume-1.yaml", "train: {epochs: 3}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.resume-1.yaml", "config.yaml"]  # no temp left
    (tmp_path / "config.resume-2.yaml").write_text("")  # cut by a kill
    assert saved_config(tmp_path) == tmp_path / "config.resume-1.yaml"
    (tmp_path / "config.resume-1.yaml").write_text("[unclosed")
    assert saved_config(tmp_path) == tmp_path / "config.yaml"


def test_a_damaged_final_metrics_file_is_kept_aside_and_the_end_recorded_again(tmp_path, caplog):
    from raysys.train.launcher import recorded_final

    (tmp_path / "final_metrics.json").write_text('{"eval/qwk": 0.5, broken')
    with caplog.at_level("WARNING"):
        assert recorded_final(tmp_path) is None
    assert (tmp_path / "final_metrics.json.damaged").read_text() == '{"eval/qwk": 0.5, broken'
    assert "kept as final_metrics.json.damaged" in caplog.text
    (tmp_path / "final_metrics.json").write_text('{"eval/qwk": 0.5}')
    assert recorded_final(tmp_path) == {"eval/qwk": 0.5}
    assert recorded_final(tmp_path / "nowhere") is None


def test_a_resume_whose_saved_config_cannot_be_read_goes_on_with_its_checkpoints(tmp_path, capsys, monkeypatch):
    """Every snapshot of the run damaged: the resume takes the config its newest checkpoint recorded, and says
    so (it was silent, and went on with the command line's lr and batch size: another experiment); without
    such a checkpoint it says it uses the command line's."""
    import argparse

    from raysys import workload as registry
    from raysys.checkpoint import CheckpointStore
    from raysys.cli import _resumed_base
    from raysys.config import apply_overrides, to_dict

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "raysys_runs" / "dmg"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model: {hidden: 3")  # cut in half
    wl = registry.get("deep_gpcm")
    args = argparse.Namespace(name="dmg", storage_path=None, tracking_uri=None)
    assert _resumed_base(wl, wl.config("quick"), args) is None
    assert "this session uses the config of this command line" in capsys.readouterr().out
    own = apply_overrides(wl.config("quick"), {"optim.lr": 0.02, "train.batch_size": 8})
    CheckpointStore(run_dir, "deep_gpcm", {}, config=to_dict(own)).save({"x": 1}, 5)
    cfg = _resumed_base(wl, wl.config("quick"), args)
    assert (cfg.optim.lr, cfg.train.batch_size) == (0.02, 8)
    assert ("config.yaml in " in (out := capsys.readouterr().out)
            and "this session continues with the config its checkpoint step_000000005 recorded" in out)
    (run_dir / "config.yaml").unlink()  # no snapshot ever written (killed before it), no checkpoint: nothing to say
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "events.log").write_text("")
    assert _resumed_base(wl, wl.config("quick"), args) is None and capsys.readouterr().out == ""


# ---- faults of the machine and the services --------------------------------------------------------

def test_a_full_disk_fails_in_one_line_and_the_run_resumes(tmp_path):
    def small_files():  # every file of the run limited to 3 MB: the checkpoint (about 5 MB) cannot be written
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))

    args = ["deep_gpcm", "--workers", "0", "--name", "full", "--set", "train.max_steps=3",
            "--set", "train.checkpoint_every_steps=2"]
    proc = _train(tmp_path, *args, preexec_fn=small_files)
    _one_line_error(proc, 1, "I/O error", "EFBIG")
    assert "python -m raysys train deep_gpcm --name full --resume" in proc.stderr  # the whole command, to paste
    ckpts = tmp_path / "raysys_runs" / "full" / "checkpoints"
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]  # the half copy was removed
    runs = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-deep_gpcm")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "EFBIG" in runs[0].data.tags["raysys.error"]
    run_dir = tmp_path / "raysys_runs" / "full"
    traceback = (run_dir / "error.txt").read_text()
    assert "Traceback" in traceback
    again = _train(tmp_path, "deep_gpcm", "--name", "full", "--resume")
    assert again.returncode == 0 and "done: run 'full'" in again.stdout
    (r,) = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-deep_gpcm")
    assert r.info.status == "FINISHED" and "raysys.error" not in r.data.tags  # the failure is history (events.log)
    assert "config.resume-1.yaml" in [a.path for a in _client(f"sqlite:///{tmp_path / 'mlflow.db'}").list_artifacts(r.info.run_id)]
    assert "failed: " in (run_dir / "events.log").read_text()
    # a finished run's folder reads as finished: the failed session's traceback is kept under another name
    assert not (run_dir / "error.txt").exists() and (run_dir / "error.earlier.txt").read_text() == traceback
    # each checkpoint records the whole config of the session that wrote it (a resume whose snapshots are damaged)
    import yaml

    (newest,) = sorted((run_dir / "checkpoints").glob("step_*"))[-1:]
    snapshot = yaml.safe_load((run_dir / "config.resume-1.yaml").read_text())
    assert json.loads((newest / "meta.json").read_text())["config"] == json.loads(json.dumps(snapshot))


def test_tunes_state_is_written_whole_or_not_at_all(tmp_path):
    """Ray Tune copies a sweep's state into its folder with pyarrow, in place: a disk that filled mid-copy
    cut the last good experiment_state-*.json, and --resume started the sweep afresh. Through raysys's file
    system a write that fails (here past a file-size limit) keeps the earlier file and leaves no temporary
    one; a whole write replaces it, with the mode an open() would give."""
    import textwrap

    import pyarrow.fs as pafs

    from raysys.tune.whole_files import TMP_SUFFIX, remove_leftovers, whole_files_fs

    staging, sweep = tmp_path / "staging", tmp_path / "sweep"
    staging.mkdir(), sweep.mkdir()
    (staging / "experiment_state.json").write_text('{"trials": ["a", "b"]}')
    fs = whole_files_fs()
    pafs.copy_files(str(staging), str(sweep), destination_filesystem=fs)
    state = sweep / "experiment_state.json"
    assert state.read_text() == '{"trials": ["a", "b"]}' and oct(state.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    (staging / "experiment_state.json").write_text('{"trials": [' + '"c", ' * 40 + '"d"]}')  # more than 64 bytes
    child = textwrap.dedent(f"""
        import resource, signal
        import pyarrow.fs as pafs
        from raysys.tune.whole_files import whole_files_fs
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        # one thread: pyarrow's threaded copy, its write failing, now and then aborts the process in C++
        # ("terminate called without an active exception"), which is pyarrow's, not what is tested here
        pafs.copy_files({str(staging)!r}, {str(sweep)!r}, destination_filesystem=whole_files_fs(), use_threads=False)
        print("copied", flush=True)
        os._exit(0)  # what is tested is done: no interpreter teardown (pyarrow's C++ one aborted once in CI)
    """).replace("import resource, signal", "import os, resource, signal")
    # pyarrow's copy takes the failed close for done (Tune then tries again at its next save); should the
    # child abort anyway, faulthandler says where
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "copied\n", (out.returncode, out.stdout, out.stderr)
    assert state.read_text() == '{"trials": ["a", "b"]}'  # the last good state, whole
    assert not list(sweep.glob(f".*{TMP_SUFFIX}"))
    pafs.copy_files(str(staging), str(sweep), destination_filesystem=fs)  # room again: the new state, whole
    assert state.read_text().endswith('"d"]}')
    (sweep / f".experiment_state.json.x1{TMP_SUFFIX}").write_text("{")  # a killed process's unfinished write
    remove_leftovers(sweep)
    assert sorted(p.name for p in sweep.iterdir()) == ["experiment_state.json"]


def test_a_sweeps_damaged_tune_state_is_one_line_on_resume(tmp_path):
    """Tune restores from the newest experiment_state-*.json; one it cannot read made it log an error and
    start the sweep afresh. Now --resume stops in one line, naming the file and how to go on from the one
    before; after that move, the check passes."""
    from raysys.config import ConfigError
    from raysys.tune.runner import _check_tune_state

    old, new = tmp_path / "experiment_state-2026-01-01_10-00-00.json", tmp_path / "experiment_state-2026-01-01_11-00-00.json"
    old.write_text('{"trial_data": []}')
    new.write_text('{"trial_data": [{"tri')
    with pytest.raises(ConfigError, match="cannot be read") as err:
        _check_tune_state(tmp_path)
    assert f"to resume from the state before it ({old.name}), move it aside: mv {new} {new}.damaged" in str(err.value)
    subprocess.run(str(err.value).split("move it aside: ")[1].split(), check=True)
    _check_tune_state(tmp_path)
    old.write_text("")
    with pytest.raises(ConfigError, match="start a new sweep"):
        _check_tune_state(tmp_path)


def test_a_sweep_is_driven_by_one_process_and_its_damaged_record_is_one_line(tmp_path):
    """Two --resume of one sweep at once trained trials twice and recorded one as failed: the second is
    refused. A damaged raysys_sweep.json was a traceback: now one line."""
    from raysys.config import ConfigError
    from raysys.tune.runner import STATE_FILE, _lock_sweep, _stored_state

    sweep = tmp_path / "sw"
    sweep.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from raysys.tune.runner import _lock_sweep; "
                               f"_lock_sweep(__import__('pathlib').Path({str(sweep)!r}), 'sw'); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    _STARTED.append(holder)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=f"sweep 'sw' is in use by process {holder.pid} on "):
        _lock_sweep(sweep, "sw")
    holder.kill()
    holder.wait()
    _lock_sweep(sweep, "sw")  # its holder gone, the lock is free
    for damaged in ('{"space": {"workload": "deep', "", "[1, 2]"):
        (sweep / STATE_FILE).write_text(damaged)
        with pytest.raises(ConfigError, match=f"--resume: {sweep / STATE_FILE} cannot be read"):
            _stored_state(sweep)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.fixture
def small_disk(tmp_path):
    """A 200 MB file system of its own (tmpfs), for a disk that really fills: ENOSPC for every writer at
    once (the checkpoint, the MLflow store, the tracking buffer), not one file's size limit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(disk: Path, undo: bool = False) -> None:
    """Take every byte left on ``disk`` (a file of zeros), or give them back."""
    if undo:
        (disk / "filler").unlink()
        return
    with open(disk / "filler", "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()


@pytest.mark.slow  # ~1 min; needs a tmpfs mount (root)
def test_a_disk_that_fills_mid_run_fails_in_one_line_and_the_run_resumes(small_disk):
    """The run's folder and its sqlite MLflow store share a disk that fills after the first checkpoint: the
    run ends in one line naming the full disk (not SQLAlchemy's advice about autoflush), with the command
    that resumes it; nothing half written is left behind; once space is freed the resume goes on from that
    checkpoint and the MLflow run ends FINISHED."""
    args = ["deep_gpcm", "--workers", "0", "--name", "full", "--set", "train.epochs=6",
            "--set", "train.checkpoint_every_steps=20"]
    proc = _start(small_disk, *args)
    ckpts = small_disk / "raysys_runs" / "full" / "checkpoints"
    _wait_for(ckpts, proc, 20)
    _fill(small_disk)
    out, err = proc.communicate(timeout=300)
    print(out[-3000:], err[-3000:], sep="\n")
    _one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 1,
                    "I/O error: ENOSPC No space left on device", "resume it with:")
    assert "python -m raysys train deep_gpcm --name full --resume" in err
    run_dir = small_disk / "raysys_runs" / "full"
    assert not [p for p in run_dir.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    _fill(small_disk, undo=True)
    again = _train(small_disk, "deep_gpcm", "--name", "full", "--resume")
    assert again.returncode == 0 and "resumed from" in again.stdout
    (run,) = _mlflow_runs(f"sqlite:///{small_disk / 'mlflow.db'}", "raysys-deep_gpcm")
    assert run.info.status == "FINISHED" and run.data.metrics["train/epoch"] == 6


@pytest.mark.slow  # ~2 min; needs a tmpfs mount (root)
def test_a_sweep_whose_disk_fills_keeps_its_state_and_resumes_every_trial(small_disk):
    """A sweep's folder, its trials' runs and its MLflow store fill one disk while trials train: the sweep
    ends in one line; Tune's state in its folder stays the last whole one (before, it was cut, and --resume
    started the sweep afresh); once space is freed --resume finishes every trial, the finished kept."""
    args = [sys.executable, "-m", "raysys.tune", "--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"),
            "--num-samples", "4", "--preset", "quick", "--set", "train.epochs=3",
            "--set", "train.checkpoint_every_steps=5", "--name", "sw"]
    proc = subprocess.Popen(args, cwd=small_disk, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    sweep = small_disk / "raysys_runs" / "sweeps" / "sw"
    deadline = time.time() + 300
    while not list(sweep.glob("runs/*/checkpoints/step_*/meta.json")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    _fill(small_disk)
    out, err = proc.communicate(timeout=600)
    print(out[-3000:], err[-3000:], sep="\n")
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith("raysys.tune: I/O error: ENOSPC No space left on device; the sweep "
                                                   "keeps its saved state")
    for state in sweep.glob("experiment_state-*.json"):
        json.loads(state.read_text())  # whole
    _fill(small_disk, undo=True)
    again = subprocess.run([*args, "--resume"], cwd=small_disk, env=_env(), capture_output=True, text=True, timeout=900)
    print(again.stdout[-5000:], again.stderr[-3000:], sep="\n")
    assert again.returncode == 0 and "resuming: finished trials are kept" in again.stdout
    assert "Failed to restore" not in again.stdout + again.stderr
    assert "4 trials — 4 ok" in again.stdout
    assert not list(sweep.rglob("*.tmp"))


def test_a_tracking_url_that_is_no_mlflow_server_is_one_line_and_creates_nothing(tmp_path):
    """A web server that is not MLflow (a wrong port): before, it passed the check, and the first MLflow call
    failed after ~10 s with exit 1 and a resume hint for a run that never existed (a server answering 500:
    four silent minutes of retries first)."""
    from conftest import free_port

    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import requests

        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except requests.RequestException:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        proc = _train(tmp_path, *QUICK, "--tracking-uri", f"http://127.0.0.1:{port}", timeout=120)
    finally:
        web.kill()
        web.wait()
    _one_line_error(proc, 2, "answers, but not as an MLflow tracking server (HTTP 404")
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


class _Refusing(threading.Thread):
    """A web server answering /health 200 and MLflow's REST API with ``status`` (an MLflow behind a proxy that
    wants credentials, or one whose database is broken)."""

    def __init__(self, status: int):
        import http.server

        answer = status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                code = 200 if self.path == "/health" else answer
                body = b"OK" if code == 200 else b'{"error_code": "INTERNAL_ERROR", "message": "database is locked"}'
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

            def log_message(self, *a):
                pass

        super().__init__(daemon=True)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def run(self):
        self.httpd.serve_forever()


@pytest.mark.parametrize("status,said", [(403, "refuses this client (HTTP 403): set MLFLOW_TRACKING_USERNAME"),
                                         (500, "answers but its API fails (HTTP 500: ")])
def test_a_tracking_server_that_refuses_or_fails_is_one_line_and_creates_nothing(tmp_path, status, said):
    """/health said the process was up, and train went on: a 403 failed the run's first MLflow call with exit 1 and a
    resume hint for a run never made, a 500 after four silent minutes of retries, the data generated first."""
    server = _Refusing(status)
    server.start()
    try:
        proc = _train(tmp_path, *QUICK, "--tracking-uri", server.url, timeout=120)
    finally:
        server.httpd.shutdown()
    _one_line_error(proc, 2, said, "(nothing was created)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_artifact_store_that_fails_holds_back_no_metric_nor_the_runs_end(tmp_path):
    """A server whose artifact store cannot be written (here a path under /dev/null) answers the rest: the
    artifacts are parked beside the run, its metrics and FINISHED reach the server, and a resume once the
    store works sends them (before, the first artifact held every later call in the buffer for good)."""
    from mlflow.tracking import MlflowClient

    server = MlflowServer(tmp_path / "server", artifacts="/dev/null/art").start()
    try:
        proc = _train(tmp_path, *QUICK, "--name", "art", "--tracking-uri", server.url, timeout=600)
        assert proc.returncode == 0
        assert "the tracking server did not store some artifacts of this run" in proc.stdout
        run_dir = tmp_path / "raysys_runs" / "art"
        assert (run_dir / "tracking-artifacts.jsonl").is_file() and not (run_dir / "tracking-buffer.jsonl").exists()
        client = MlflowClient(tracking_uri=server.url)
        (run,) = client.search_runs([client.get_experiment_by_name("raysys-deep_gpcm").experiment_id])
        assert run.info.status == "FINISHED" and "eval/qwk" in run.data.metrics
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) >= 2
        server.stop()
        server.artifacts = str(tmp_path / "server" / "art")
        server.start()
        again = _train(tmp_path, *QUICK, "--name", "art", "--resume", "--tracking-uri", server.url, timeout=600)
        assert again.returncode == 0
        assert not (run_dir / "tracking-artifacts.jsonl").exists()
        assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    finally:
        server.stop()


def test_tracking_outage_mid_run_loses_nothing(tmp_path):
    server = MlflowServer(tmp_path / "server").start()
    try:
        run = _start(tmp_path, *QUICK, "--name", "outage", "--tracking-uri", server.url, "--set", "train.epochs=6",
                     "--set", "train.log_every_steps=1", "--set", "train.checkpoint_every_steps=2")
        _wait_for(tmp_path / "raysys_runs" / "outage" / "checkpoints", run, 2)
        server.stop()  # the server dies mid-run
        out, err = run.communicate(timeout=600)
        print(out[-3000:], err[-3000:])
        assert run.returncode == 0, err  # training never stopped for tracking
        buffer = tmp_path / "raysys_runs" / "outage" / "tracking-buffer.jsonl"
        assert buffer.is_file() and "records wait in" in out
        assert "a watcher process sends them once the store answers again" in out
        # said once by raysys, not by urllib3 per failed request or by MLflow per run
        assert "Retrying (Retry(" not in out + err and "View run" not in out + err
        final = json.loads((tmp_path / "raysys_runs" / "outage" / "final_metrics.json").read_text())

        server.start()  # back: the command's watcher sends what waited, the run's end with it (audit BE F6: the
        deadline = time.time() + 300  # run stayed RUNNING, its metrics cut, until someone ran --resume)
        while buffer.exists():
            assert time.time() < deadline, "the watcher never sent the buffered records"
            time.sleep(0.5)
        (r,) = _mlflow_runs(server.url, "raysys-deep_gpcm")
        assert r.info.status == "FINISHED"
        assert sorted(_losses(server.url, r.info.run_id)) == list(range(1, final["step"] + 1))  # every step arrived
        assert "the run's watcher sent the" in (tmp_path / "raysys_runs" / "outage" / "events.log").read_text()
        again = _train(tmp_path, "deep_gpcm", "--name", "outage", "--resume", "--tracking-uri", server.url)
        assert again.returncode == 0 and "nothing left to train" in again.stdout
        assert _mlflow_runs(server.url, "raysys-deep_gpcm")[0].info.status == "FINISHED"
    finally:
        server.stop()


def test_an_outage_is_said_in_one_short_line_and_the_servers_return_too(tmp_path, caplog):
    """The buffer's warning names the failed call, not urllib3's retry chain cut mid-word; when the server
    answers again the run says so and sends what waited, in order."""
    from raysys import tracking

    server = MlflowServer(tmp_path / "server").start()
    gate = TcpGate(server.port)  # the server's port as a client sees it: closed and opened at once
    gate.open()
    url = f"http://127.0.0.1:{gate.port}"
    try:
        run_id = tracking.start_run(url, "outage", "r")
        logger = tracking.MLflowLogger(url, run_id, buffer=tmp_path / tracking.BUFFER_FILE)
        logger.log_metrics({"loss": 1.0}, step=1)
        gate.close()
        with caplog.at_level("WARNING", logger="raysys.tracking"):
            logger.log_metrics({"loss": 0.5}, step=2)
            (failed,) = [r.getMessage() for r in caplog.records if "tracking call failed" in r.getMessage()]
            assert "log-batch failed: no answer" in failed and "HTTPConnectionPool" not in failed
            gate.open()
            logger._retry_at = 0.0  # its back-off has passed
            logger.log_metrics({"loss": 0.25}, step=3)
        assert any("answers again: the 1 records" in r.getMessage() for r in caplog.records)
        assert logger.pending == 0
        from mlflow.tracking import MlflowClient

        hist = MlflowClient(url).get_metric_history(run_id, "loss")
        assert [(m.step, m.value) for m in hist] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    finally:
        server.stop()


@pytest.mark.slow  # ~2 min: a sweep through an outage of its tracking server
def test_a_sweep_waits_out_a_tracking_outage(tmp_path):
    """The server goes away once the sweep's first trial has started and comes back 30 s later. Before,
    every trial that started in the outage failed as a config error (and was never retried), and the
    driver's last MLflow writes failed after minutes of retries. Now trials and driver wait for it."""
    server = MlflowServer(tmp_path / "server").start()
    events = tmp_path / "raysys_runs" / "sweeps" / "out" / "trial_events.log"
    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", "--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"),
                             "--num-samples", "2", "--max-concurrent", "1", "--preset", "quick", "--set", "train.epochs=1",
                             "--tracking-uri", server.url, "--name", "out"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(proc)
    try:
        deadline = time.time() + 300
        while not (events.is_file() and " start " in events.read_text()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        server.stop()
        time.sleep(30)  # the first trial trains on (buffered); the next one starts and waits for the server
        server.start()
        out, _ = proc.communicate(timeout=900)
        print(out[-5000:])
        assert proc.returncode == 0 and "Recommended: trial" in out
        assert "FAILED" not in out  # no trial failed for the outage
        # the sweep's own console says it (the trials said it in their logs only); checked every 15 s
        assert f"[raysys.tune] the MLflow server at {server.url} does not answer: the trials buffer" in out
        exp = _client(server.url).get_experiment_by_name("raysys-deep_gpcm")
        children = [r for r in _client(server.url).search_runs([exp.experiment_id]) if "raysys.trial_id" in r.data.tags]
        assert sorted(c.data.tags["raysys.trial_status"] for c in children) == ["ok", "ok"]
    finally:
        server.stop()


@pytest.mark.slow  # ~2 min: an outage longer than the sweep waits
def test_a_sweep_whose_server_stays_away_says_so_and_how_to_finish(tmp_path):
    """The server goes away once the first trial's run exists and stays away past $RAYSYS_TRACKING_WAIT_S:
    the second trial, started in the outage, fails waiting for it, and the sweep ends with exit 1 naming the
    outage and its resume line (it said "config error ... nothing was created", exit 2, with neither). Once
    the server is back that resume finishes it, the trial the outage failed trained (it stayed failed, and
    its second failure was called an error of the training code)."""
    server = MlflowServer(tmp_path / "server").start()
    runs = tmp_path / "raysys_runs" / "sweeps" / "away" / "runs"
    args = [sys.executable, "-m", "raysys.tune", "--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"),
            "--num-samples", "2", "--max-concurrent", "1", "--preset", "quick", "--set", "train.epochs=1",
            "--tracking-uri", server.url, "--name", "away"]
    proc = subprocess.Popen(args, cwd=tmp_path, env={**_env(), "RAYSYS_TRACKING_WAIT_S": "5"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _STARTED.append(proc)
    try:
        deadline = time.time() + 300
        while not list(runs.glob("*/checkpoints")):  # the trial's MLflow run exists: it trains on, buffering
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        server.stop()
        out, err = proc.communicate(timeout=900)
        print(out[-5000:], err[-3000:], sep="\n")
        assert proc.returncode == 1 and "config error" not in err and "ConfigError" not in out
        said = err.strip().splitlines()
        assert said[-2].startswith(f"raysys.tune: the MLflow tracking server at {server.url} has not answered for 5 s")
        assert said[-1].startswith("  cd ") and " --resume" in said[-1]
        server.start()
        again = subprocess.run(said[-1].strip(), shell=True, cwd=tmp_path, env=_env(), capture_output=True,
                               text=True, timeout=900)
        print(again.stdout[-3000:], again.stderr[-3000:], sep="\n")
        assert again.returncode == 0
        assert ("[raysys.tune] of this sweep's trials, 1 failed while the MLflow server did not answer: they run again "
                "from their checkpoints") in again.stdout
        assert "training code" not in out + again.stdout
        exp = _client(server.url).get_experiment_by_name("raysys-deep_gpcm")
        found = _client(server.url).search_runs([exp.experiment_id])
        (parent,) = [r for r in found if "raysys.trial_id" not in r.data.tags]
        assert parent.info.status == "FINISHED"
        trials = [r for r in found if "raysys.trial_id" in r.data.tags]
        assert len(trials) == 2 and all(r.info.status == "FINISHED" and "eval/quality" in r.data.metrics for r in trials)
    finally:
        server.stop()


@pytest.mark.slow  # ~2 min: a trial that ends inside an outage of its sweep's tracking server
def test_a_sweep_sends_what_a_trial_buffered_in_an_outage(tmp_path):
    """The server goes away while the trial trains and comes back only after the trial has ended, so
    its run could not send its buffered records. Before, they waited for a --resume of that run
    (which a sweep's user never types) and the child run in MLflow stayed cut short. Now the sweep's
    driver sends them once the server is back: every step's loss, the run's end, no buffer left."""
    server = MlflowServer(tmp_path / "server").start()
    sweep = tmp_path / "raysys_runs" / "sweeps" / "buf"
    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", "--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"),
                             "--num-samples", "1", "--preset", "quick", "--set", "model.path=optimized", "--set", "train.epochs=8",
                             "--set", "train.log_every_steps=1", "--set", "train.checkpoint_every_steps=2",
                             "--tracking-uri", server.url, "--name", "buf"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(proc)
    try:
        deadline = time.time() + 300
        while not list(sweep.glob("runs/*/checkpoints/step_*/meta.json")):  # its run is open and training
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        server.stop()
        events = sweep / "trial_events.log"
        while not (events.is_file() and " end " in events.read_text()):  # the trial is over, server still down
            assert proc.poll() is None and time.time() < deadline + 300, proc.communicate()
            time.sleep(0.2)
        assert list(sweep.glob("runs/*/tracking-buffer.jsonl"))  # the premise: records wait
        server.start()
        out, _ = proc.communicate(timeout=600)
        print(out[-5000:])
        assert proc.returncode == 0 and "Recommended: trial" in out
        assert not list(sweep.glob("runs/*/tracking-buffer.jsonl"))
        (final_file,) = sweep.glob("runs/*/final_metrics.json")
        final = json.loads(final_file.read_text())
        (child,) = [r for r in _mlflow_runs(server.url, "raysys-deep_gpcm") if "raysys.trial_id" in r.data.tags]
        assert child.info.status == "FINISHED" and child.data.tags["raysys.trial_status"] == "ok"
        assert sorted(_losses(server.url, child.info.run_id)) == list(range(1, final["step"] + 1))
    finally:
        server.stop()


@pytest.mark.slow  # ~1.5 min: a sweep's trial killed with no restart left, then continued alone
def test_a_trial_out_of_restarts_says_how_its_run_goes_on(tmp_path):
    """A trial killed (the OOM killer) once its restarts are used up is failed, and --resume of the sweep
    keeps it so, without a word on how to continue it. Its run kept its checkpoints: the summary now
    prints the command that continues it alone, and that command finishes it from its checkpoint."""
    sweep = tmp_path / "raysys_runs" / "sweeps" / "oom"
    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", "--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"),
                             "--num-samples", "1", "--preset", "quick", "--set", "train.epochs=4", "--set",
                             "train.checkpoint_every_steps=2", "--max-failures", "0", "--name", "oom"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(proc)
    deadline = time.time() + 300
    while not list(sweep.glob("runs/*/checkpoints/step_*/meta.json")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    (lock,) = sweep.glob("runs/*/.raysys.lock")
    os.kill(int(lock.read_text().split()[1]), signal.SIGKILL)  # "process <pid> on <host>"
    out, _ = proc.communicate(timeout=600)
    print(out[-5000:])
    assert proc.returncode == 1  # its only trial failed
    assert "1 failed trial(s) kept checkpoints: their restarts (--max-failures) were used up" in out
    assert "every trial failed; the first: RuntimeError: training failed: its process was killed (SIGKILL" in out
    (line,) = [l.strip() for l in out.splitlines() if l.strip().endswith("--resume") and "raysys train" in l]
    again = subprocess.run(["bash", "-c", line], env=_env(), capture_output=True, text=True, timeout=600)
    print(again.stdout[-3000:], again.stderr[-3000:])
    assert again.returncode == 0 and "done: run 'oom-" in again.stdout
    assert "resumed step=" in (lock.parent / "events.log").read_text()  # from its checkpoint, not from step 0


@pytest.mark.slow  # ~2 min: a sweep stopped by SIGTERM in an outage, resumed once the server is back
def test_a_sweep_stopped_in_its_first_seconds_is_closed_and_says_how_to_go_on(tmp_path):
    """One Ctrl-C just after the sweep's banner, before Tune's fit takes the signals over: its MLflow parent
    stayed RUNNING for good (its watcher was told done) and it printed the message of a signal sent twice,
    without a resume line. Whether the signal lands before fit or just after it, the parent ends KILLED and
    the console says how to continue."""
    import signal

    space = tmp_path / "space.yaml"
    space.write_text("workload: deep_gpcm\npreset: quick\nspace:\n  optim.lr: {loguniform: [0.001, 0.01]}\n")
    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", "--space", str(space), "--num-samples", "2",
                             "--name", "early"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = ""
    for line in proc.stdout:  # the banner's MLflow line: the parent exists, fit has not started
        seen += line
        if "MLflow" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, seen + out[-2000:] + err[-2000:]
    assert "continue it with" in out + err and "--name early" in out + err and "--resume" in out + err, out + err
    (parent,) = [r for r in _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-deep_gpcm")
                 if r.data.tags.get("raysys.kind") == "sweep"]
    assert parent.info.status == "KILLED"


@pytest.mark.slow  # ~2 min (its resume trains the trial's 20 epochs); by default a sweep's outage is tested by
# test_a_sweep_waits_out_a_tracking_outage and test_a_sweep_whose_server_stays_away_says_so_and_how_to_finish
def test_a_sweep_stopped_in_an_outage_does_not_wait_for_the_server(tmp_path):
    """A stop signal is a deadline (a batch system's SIGKILL follows within seconds), but a sweep whose
    tracking server was down waited for it, up to $RAYSYS_TRACKING_WAIT_S, before its exit and its resume
    line. Now it exits 143 with the line at once, and the --resume after the server's return completes
    every MLflow record."""
    server = MlflowServer(tmp_path / "server").start()
    sweep = tmp_path / "raysys_runs" / "sweeps" / "late"
    args = ["--space", str(REPO / "tune_spaces" / "deep_gpcm.yaml"), "--num-samples", "1", "--preset", "quick",
            "--set", "train.epochs=20", "--set", "train.checkpoint_every_steps=2", "--tracking-uri", server.url]
    env = {**_env(), "RAYSYS_TRACKING_WAIT_S": "3600"}  # were it waited out, the communicate below times out
    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", *args, "--name", "late"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(proc)
    try:
        deadline = time.time() + 300
        while not list(sweep.glob("runs/*/checkpoints/step_*/meta.json")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        server.stop()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
        print(out[-5000:])
        assert proc.returncode == 143 and "does not answer: the sweep's runs stay RUNNING" in out
        resume = out.split("continue it with:\n")[1].strip().splitlines()[0]
        assert "--resume" in resume and "waiting up to" not in out
        server.start()
        again = subprocess.run(["bash", "-c", resume], env=env, capture_output=True, text=True, timeout=900)
        print(again.stdout[-5000:], again.stderr[-3000:])
        assert again.returncode == 0 and "Recommended: trial" in again.stdout
        runs = _mlflow_runs(server.url, "raysys-deep_gpcm")
        assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]  # the sweep and its trial
        (child,) = [r for r in runs if "raysys.trial_id" in r.data.tags]
        assert child.data.tags["raysys.trial_status"] == "ok"
    finally:
        server.stop()


# ---- signals and resume -----------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_saves_marks_killed_and_says_how_to_resume(tmp_path, sig):
    """SIGUSR1 is a batch system's warning that the job's time is nearly up (Slurm's --signal=USR1@90):
    its default action killed the run mid-step, its MLflow run RUNNING for ever."""
    args = ["deep_gpcm", "--workers", "0", "--name", "sig", "--set", "train.checkpoint_every_steps=3"]
    run = _start(tmp_path, *args)
    ckpts = tmp_path / "raysys_runs" / "sig" / "checkpoints"
    _wait_for(ckpts, run, 3)
    run.send_signal(sig)
    out, err = run.communicate(timeout=300)
    print(out[-3000:], err[-3000:])
    assert run.returncode == 128 + sig
    assert "stopped with a checkpoint" in out and "python -m raysys train deep_gpcm --name sig --resume" in out
    stopped_at = int(out.split("stopped at step ")[1].split("/")[0])
    assert (ckpts / f"step_{stopped_at:09d}" / "meta.json").is_file()
    (r,) = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-deep_gpcm")
    assert r.info.status == "KILLED"


def test_a_terminal_that_closes_stops_the_run_at_a_step_boundary(tmp_path):
    """An ssh session that drops or a terminal window closed: the kernel hangs up the terminal and sends
    SIGHUP. Before, that killed the run: no checkpoint since the last periodic one, and its MLflow run
    RUNNING for ever. Now it stops as on SIGTERM, its output (which has nowhere to go) sent to /dev/null
    first so that no write error cuts the stop short, and exits 129; a --resume continues it."""
    import pty

    master, slave = pty.openpty()
    # The run starts as a login shell's would: a session leader whose controlling terminal is the pty (it
    # opens the terminal by name, then becomes raysys). No preexec_fn: pytest's process may run threads.
    args = [*QUICK, "--name", "hup", "--set", "train.epochs=50", "--set", "train.checkpoint_every_steps=4"]
    login = ("import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); [os.dup2(fd, i) for i in (0, 1, 2)]; "
             "os.execv(sys.executable, [sys.executable, '-m', 'raysys', 'train', *sys.argv[2:]])")
    run = subprocess.Popen([sys.executable, "-c", login, os.ttyname(slave), *args], cwd=tmp_path, env=_env(),
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    _STARTED.append(run)
    os.close(slave)
    os.set_blocking(master, False)
    out = bytearray()

    def drain() -> None:  # the terminal's buffer must not fill, or the run blocks on its writes
        with contextlib.suppress(BlockingIOError, OSError):
            while data := os.read(master, 65536):
                out.extend(data)

    ckpts = tmp_path / "raysys_runs" / "hup" / "checkpoints"
    deadline = time.time() + 300
    while not (done := [int(p.parent.name[5:]) for p in ckpts.glob("step_*/meta.json") if STEP_DIR.fullmatch(p.parent.name)]):
        drain()
        assert run.poll() is None and time.time() < deadline, out.decode(errors="replace")[-3000:]
        time.sleep(0.2)
    before = max(done)
    drain()
    os.close(master)  # the terminal hangs up
    assert run.wait(timeout=300) == 128 + signal.SIGHUP, out.decode(errors="replace")[-3000:]
    saved = max(int(p.parent.name[5:]) for p in ckpts.glob("step_*/meta.json"))
    assert saved > before  # the stop's own checkpoint, not only the periodic one before it
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (r,) = _mlflow_runs(uri, "raysys-deep_gpcm")
    assert r.info.status == "KILLED"
    again = _train(tmp_path, *args, "--resume")
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"resumed step={saved} " in (tmp_path / "raysys_runs" / "hup" / "events.log").read_text()
    (r,) = _mlflow_runs(uri, "raysys-deep_gpcm")
    assert r.info.status == "FINISHED"


def test_a_sigterm_while_ray_starts_is_a_stop_request_not_an_exit():
    """ray.init first installs its own SIGTERM handler (sys.exit(15)): a `timeout` or scheduler SIGTERM in
    the seconds Ray takes to start ended an opened run with exit 15, no resume line and its MLflow run
    RUNNING. raysys's handler now stays through ray.init: the signal is a stop request like any other.
    (The signal is sent from inside ray.init, deterministically, by wrapping a step of it.)"""
    import textwrap

    script = textwrap.dedent("""
        import os, signal
        import ray._private.worker as worker
        from raysys import lifecycle
        from raysys.train import runtime
        lifecycle.install_signal_handlers()
        lifecycle.arm("resume me")  # a run is open
        connect = worker.connect
        def connect_after_a_sigterm(*a, **k):  # inside ray.init, after it set its own handler
            os.kill(os.getpid(), signal.SIGTERM)
            return connect(*a, **k)
        worker.connect = connect_after_a_sigterm
        try:
            runtime.init_ray(None)
        except SystemExit as e:
            print("exit", e.code)
        print("stop", lifecycle.stop_requested(), signal.getsignal(signal.SIGTERM) is lifecycle._handler)
        runtime.shutdown_ray()
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exit" not in proc.stdout and f"stop {int(signal.SIGTERM)} True" in proc.stdout, proc.stdout


# The digits example, sent a real SIGTERM by its own final evaluation (a run that max_steps ends
# mid-epoch evaluates once more after its last step).
LATE_SIGNAL = '''
import dataclasses, os, signal
from digits_mlp import WORKLOAD as BASE, DigitsTask

class LateTask(DigitsTask):
    def evaluate(self, model, batches):
        if os.environ.get("SIGNAL_AT_EVAL") == "1":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().evaluate(model, batches)

WORKLOAD = dataclasses.replace(BASE, name="digits_late", task=LateTask())
'''


# The digits example whose step, at micro-batch STOP_AT, is sent SIGTERM and then fails as a step whose own
# subprocess the signal killed does (torch.compile's C++ compiler, a data loader's worker).
KILLED_STEP = STOPPER.replace("""            lifecycle.request_stop()
""", """            os.kill(os.getpid(), __import__("signal").SIGTERM)
            raise RuntimeError("C++ compile error: the compiler was killed")
""").replace('"digits_stop"', '"digits_killed_step"')


def test_an_error_of_a_step_the_stop_signal_killed_stops_the_run_and_does_not_restart_it(tmp_path):
    """Audit AR F4: a SIGTERM to the process group during a torch.compile step killed the C++ compiler; its
    error was taken for a failure of the training, and the run restarted from step 0 after the stop request.
    Now it stops, as the signal asked: KILLED, exit 143, a --resume line, no restart."""
    (tmp_path / "killed_step.py").write_text(KILLED_STEP)
    args = ["killed_step:WORKLOAD", "--workers", "0", "--name", "ks", "--set", "train.checkpoint_every_steps=2"]
    proc = _train(tmp_path, *args, env=_env(STOP_AT="5"))
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "restarting" not in proc.stdout and "after the stop request the step raised" in proc.stdout
    assert "--name ks --resume" in proc.stdout
    events = (tmp_path / "raysys_runs" / "ks" / "events.log").read_text()
    assert "restart" not in events and "stopped; after the stop request the step raised" in events
    (r,) = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-digits_killed_step")
    assert r.info.status == "KILLED"
    done = _train(tmp_path, *args, "--resume", "--set", "train.epochs=1")
    assert done.returncode == 0 and "step_000000002 (step 2" in done.stdout, done.stderr[-3000:]


def test_a_signal_after_the_last_step_leaves_a_finished_run(tmp_path):
    """Audit M: a SIGTERM during the final evaluation, after the run had trained to its end, marked the
    complete run KILLED, printed a resume line and exited 143. The run now finishes its records and is
    FINISHED, exit 0; a second signal would still stop it at once."""
    (tmp_path / "late.py").write_text(LATE_SIGNAL)
    # 5 steps of 23 an epoch: no evaluation inside the loop, only the final one
    args = ["late:WORKLOAD", "--workers", "0", "--set", "train.max_steps=5", "--set", "train.epochs=1"]
    proc = _train(tmp_path, *args, "--name", "late", env=_env(SIGNAL_AT_EVAL="1"))
    assert proc.returncode == 0 and "SIGTERM: the run has trained to its end" in proc.stdout, proc.stderr[-3000:]
    assert "Resume with" not in proc.stdout
    run_dir = tmp_path / "raysys_runs" / "late"
    assert "eval/quality" in json.loads((run_dir / "final_metrics.json").read_text())
    (r,) = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-digits_late")
    assert r.info.status == "FINISHED"


def test_a_hang_up_drops_only_outputs_that_lead_nowhere(tmp_path):
    """SIGHUP sends stdout and stderr to /dev/null only where they are lost: a closed terminal, a pipe
    whose reader died. A file, a live pipe (``kill -HUP`` by hand) and ``nohup``'s ignored SIGHUP stay. A
    pipe whose reader dies after the hang-up (a ``| tee`` it ends too) goes to /dev/null at the first write
    that fails, instead of raising BrokenPipeError in the middle of the stop."""
    import textwrap

    script = textwrap.dedent("""
        import os, pty, signal, sys
        from raysys import console, lifecycle
        kind = sys.argv[1]
        if kind == "terminal":
            master, slave = pty.openpty()
            os.dup2(slave, 1); os.close(master)  # the terminal hung up
        elif kind == "dead pipe":
            r, w = os.pipe(); os.dup2(w, 1); os.close(r)
        elif kind in ("live pipe", "pipe that dies"):
            r, w = os.pipe(); os.dup2(w, 1)
        else:
            os.dup2(os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT), 1)
        dropped = console.drop_lost_outputs()
        os.write(1, b"after\\n")  # a lost output would raise EIO or EPIPE here
        if kind == "pipe that dies":  # a `| tee` the same hang-up ends a moment later
            os.close(r)
            print("the stop goes on", flush=True)  # BrokenPipeError, before
            print("and on")
            sys.stdout.flush()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
        lifecycle.install_signal_handlers()
        print(dropped, signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, file=sys.stderr)
    """)
    for kind, dropped in (("terminal", "[1]"), ("dead pipe", "[1]"), ("live pipe", "[]"), ("pipe that dies", "[]"),
                          ("file", "[]")):
        proc = subprocess.run([sys.executable, "-c", script, kind, str(tmp_path / "out.txt")], env=_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stderr.split() == [dropped, "True"], (kind, proc.stderr)
    assert (tmp_path / "out.txt").read_text() == "after\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGUSR2, marks=pytest.mark.slow)])
def test_a_signal_to_the_whole_process_group_stops_ray_workers_at_a_step_boundary(tmp_path, sig):
    """The signal reaches every process of the command's group, as Ctrl-C in a terminal (SIGINT) or
    `timeout`, Slurm's scancel and a systemd stop (SIGTERM) send it. Ray's own processes (GCS, raylet)
    run in a session of their own, so the SIGTERM cannot kill them under the stopping run; before,
    it did: no last checkpoint, the MLflow run left RUNNING and a 60 s wait for the dead GCS."""
    args = ["digits_mlp:WORKLOAD", "--workers", "2", "--name", "ddp", "--set", "train.epochs=5000",
            "--set", "train.checkpoint_every_steps=5"]
    run = _start(tmp_path, *args, start_new_session=True)
    ckpts = tmp_path / "raysys_runs" / "ddp" / "checkpoints"
    _wait_for(ckpts, run, 5, timeout=400)
    os.killpg(run.pid, sig)
    out, err = run.communicate(timeout=300)
    print(out[-3000:], err[-3000:])
    assert run.returncode == 128 + sig and "--name ddp --resume" in out
    stopped_at = int(out.split("stopped at step ")[1].split("/")[0])
    assert (ckpts / f"step_{stopped_at:09d}" / "meta.json").is_file()
    (r,) = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-digits_mlp")
    assert r.info.status == "KILLED"


@pytest.mark.slow  # ~45 s; by default test_train_deep_gpcm kills a worker and the SIGINT test above stops two
def test_sigterm_to_one_ray_worker_stops_the_run_at_a_step_boundary(tmp_path):
    """Preemption: SIGTERM reaches one Train worker, not the driver. The worker sets the run's stop
    flag instead of dying; every rank stops at the next boundary with a checkpoint; the driver reports
    it as its own SIGTERM."""
    import psutil

    args = ["digits_mlp:WORKLOAD", "--workers", "2", "--name", "pre", "--set", "train.epochs=5000",
            "--set", "train.checkpoint_every_steps=5"]
    run = _start(tmp_path, *args)
    ckpts = tmp_path / "raysys_runs" / "pre" / "checkpoints"
    _wait_for(ckpts, run, 5, timeout=400)
    workers = [p for p in psutil.Process(run.pid).children(recursive=True) if "RayTrainWorker" in p.name()
               or any("RayTrainWorker" in part for part in p.cmdline())]
    assert len(workers) == 2, [p.cmdline() for p in psutil.Process(run.pid).children(recursive=True)]
    workers[-1].send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=300)
    print(out[-3000:], err[-3000:])
    assert run.returncode == 143 and "SIGTERM" in out and "--name pre --resume" in out
    assert "restart" not in out  # stopped, not lost and restarted
    stopped_at = int(out.split("stopped at step ")[1].split("/")[0])
    assert stopped_at > 5 and (ckpts / f"step_{stopped_at:09d}" / "meta.json").is_file()
    (r,) = _mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "raysys-digits_mlp")
    assert r.info.status == "KILLED"


@pytest.mark.parametrize("workload, experiment, stop_at, sets", [
    ("stopper:WORKLOAD", "digits_stop", 13, ["--preset", "quick"]),  # a small model with dropout, stopped mid-epoch
    # two data-parallel workers, stopped in the second epoch: rank 0 alone evaluated, so the ranks' RNG streams
    # differ by then, and each must come back as its own (all took rank 0's, and losses drifted by 1e-4)
    pytest.param("ddp_stopper:WORKLOAD", "digits_stop", 16, ["--preset", "quick", "--workers", "2"],
                 marks=pytest.mark.slow),  # ~80 s: three runs of two Ray Train workers
    # stopped by a real SIGINT wherever it lands (~65 s; test_a_signal_saves_marks_killed_and_says_how_to_resume
    # checks a real signal's checkpoint and resume by default)
    pytest.param("deep_gpcm", "deep_gpcm", 0, ["--set", "train.epochs=2"], marks=pytest.mark.slow),
    # bucketed text batches, dropout, stopped mid-epoch (~1 min; the shared loop's resume is checked above)
    pytest.param("pg_stopper:WORKLOAD", "pg_stop", 17, PG_SMALL, marks=pytest.mark.slow),
])
def test_resume_is_bit_exact_and_reuses_the_saved_config(tmp_path, workload, experiment, stop_at, sets):
    (tmp_path / "stopper.py").write_text(STOPPER)
    (tmp_path / "pg_stopper.py").write_text(PG_STOPPER)
    (tmp_path / "ddp_stopper.py").write_text(DDP_STOPPER)
    common = [workload, "--workers", "0", *sets, "--set", "train.log_every_steps=1"]
    whole_run = _train(tmp_path, *common, "--name", "whole")
    assert whole_run.returncode == 0
    if stop_at:
        first = _train(tmp_path, *common, "--name", "cut", env=_env(STOP_AT=str(stop_at)))
        assert first.returncode == 130
    else:  # stopped by a real signal, wherever it lands
        run = _start(tmp_path, *common, "--name", "cut", "--set", "train.checkpoint_every_steps=2")
        _wait_for(tmp_path / "raysys_runs" / "cut" / "checkpoints", run, 4)
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=300)
        assert run.returncode == 130
    # no --preset and no --set: the run's own config.yaml is reused
    again = _train(tmp_path, workload, "--name", "cut", "--resume")
    assert again.returncode == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = {r.info.run_name: r.info.run_id for r in _mlflow_runs(uri, f"raysys-{experiment}")}
    whole, cut = _losses(uri, ids["whole"]), _losses(uri, ids["cut"])
    assert len(whole) > 20 and whole == cut  # step for step, to the last bit
    if stop_at:  # an epoch's mean loss on the console is the whole epoch's, not the steps since the resume
        means = lambda out: re.findall(r"epoch \d+/\d+ done, mean loss \S+", out)  # noqa: E731
        assert means(whole_run.stdout) and means(whole_run.stdout) == means(first.stdout + again.stdout)


@pytest.mark.slow  # ~15 s
def test_a_run_trained_further_and_stopped_goes_on_with_its_new_length(tmp_path):
    """A finished run resumed with a longer train.epochs and stopped before its new end keeps that session's
    config: the next --resume trains on to the new length. (It used to count as a session that trained
    nothing, its final metrics being unchanged: its config.resume-1.yaml was removed, and the next
    --resume said 'nothing left to train' with the first end's metrics.)"""
    (tmp_path / "stopper.py").write_text(STOPPER)
    common = ["stopper:WORKLOAD", "--workers", "0", "--name", "r"]
    assert _train(tmp_path, *common, "--preset", "quick", "--set", "train.epochs=1").returncode == 0
    run_dir = tmp_path / "raysys_runs" / "r"
    first_end = json.loads((run_dir / "final_metrics.json").read_text())["step"]
    further = _train(tmp_path, *common, "--resume", "--set", "train.epochs=3", env=_env(STOP_AT="5"))
    assert further.returncode == 130 and (run_dir / "config.resume-1.yaml").is_file()
    again = _train(tmp_path, *common, "--resume")
    assert again.returncode == 0 and "nothing left to train" not in again.stdout
    assert json.loads((run_dir / "final_metrics.json").read_text())["step"] == 3 * first_end
    assert (run_dir / f"final_metrics.step_{first_end}.json").is_file()  # the first end, kept beside it


@pytest.mark.slow  # ~2 min: three JAX runs; test_ad_source's bit-exact resume covers the JAX checkpoint by default
def test_hackmatrix_ppo_resume_is_bit_exact(tmp_path):
    """The JAX workload checkpoints its whole state (envs, observations, PRNG streams) and continues
    exactly; compile cache off so both runs compile alike."""
    (tmp_path / "ppo_stopper.py").write_text(PPO_STOPPER)
    common = ["ppo_stopper:WORKLOAD", "--preset", "quick", "--set", "train.updates_per_chunk=2",
              "--set", "train.compilation_cache_dir="]
    assert _train(tmp_path, *common, "--name", "whole").returncode == 0
    assert _train(tmp_path, *common, "--name", "cut", env=_env(STOP_AT="4")).returncode == 130
    again = _train(tmp_path, "ppo_stopper:WORKLOAD", "--name", "cut", "--resume")
    assert again.returncode == 0 and "resumed at" in again.stdout
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = {r.info.run_name: r.info.run_id for r in _mlflow_runs(uri, "raysys-ppo_stop")}
    c = _client(uri)
    for metric in ("losses/loss", "charts/entropy"):
        whole = {m.step: m.value for m in c.get_metric_history(ids["whole"], metric)}
        cut = {m.step: m.value for m in c.get_metric_history(ids["cut"], metric)}
        assert len(whole) == 10 and whole == cut, metric


@pytest.mark.slow  # ~35 s each; by default test_mpn_dqn_train's resume test checks the episodes and replay come back
@pytest.mark.parametrize("sets, stop_at", [
    ([], 23),  # envs stepped in the learner's process
    (["--set", "num_actors=2", "--set", "envs_per_actor=4", "--set", "num_episodes=32",
      "--set", "checkpoint_freq=8"], 15),  # on 2 Ray rollout actors
])
def test_mpn_dqn_resume_is_bit_exact(tmp_path, sets, stop_at):
    """The recurrent DQN checkpoints its rollout side too (NeuroGym envs mid-trial as plain data,
    recurrent states, exploration generators, the weights of the sample in flight) and continues
    exactly, in the learner's process and on Ray actors."""
    (tmp_path / "mpn_stopper.py").write_text(MPN_STOPPER)
    common = ["mpn_stopper:WORKLOAD", "--preset", "quick", "--set", "print_freq=1", "--set", "eval_trials=0", *sets]
    assert _train(tmp_path, *common, "--name", "whole").returncode == 0
    first = _train(tmp_path, *common, "--name", "cut", env=_env(STOP_AT=str(stop_at)))
    assert first.returncode == 130 and "stopped at" in first.stdout
    again = _train(tmp_path, "mpn_stopper:WORKLOAD", "--name", "cut", "--resume")
    assert again.returncode == 0 and "resumed at episode" in again.stdout
    assert "envs start fresh" not in again.stdout
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ids = {r.info.run_name: r.info.run_id for r in _mlflow_runs(uri, "raysys-mpn_stop")}
    c = _client(uri)
    for metric in ("losses/td_loss", "losses/grad_norm", "charts/avg_reward", "charts/episodes"):
        whole = {m.step: m.value for m in c.get_metric_history(ids["whole"], metric)}
        cut = {m.step: m.value for m in c.get_metric_history(ids["cut"], metric)}
        assert len(whole) >= 4 and whole == cut, metric


@pytest.mark.parametrize("args, experiment, speed", [
    (QUICK, "raysys-deep_gpcm", "perf/tokens_per_s"),  # the shared torch loop
    pytest.param(["hackmatrix_ppo", "--preset", "quick", "--set", "train.total_timesteps=5120",
                  "--set", "train.compilation_cache_dir="], "raysys-hackmatrix_ppo", "perf/env_steps_per_s",
                 marks=pytest.mark.slow),  # a train_fn (~1 min: two JAX compiles)
])
def test_resuming_a_finished_run_keeps_what_it_recorded(tmp_path, args, experiment, speed):
    """--resume of a run that already reached its end trains nothing, says so, and leaves its final
    metrics (file and MLflow) as they were: the zero speed of an empty session replaces nothing."""
    assert _train(tmp_path, *args, "--name", "done").returncode == 0
    final = tmp_path / "raysys_runs" / "done" / "final_metrics.json"
    before = final.read_bytes()
    assert json.loads(before)[speed] > 0
    again = _train(tmp_path, *args, "--name", "done", "--resume")
    assert again.returncode == 0
    assert "nothing left to train" in again.stdout and "its recorded final metrics and config are kept" in again.stdout
    assert final.read_bytes() == before
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = _mlflow_runs(uri, experiment)
    assert run.info.status == "FINISHED"
    assert all(m.value > 0 for m in _client(uri).get_metric_history(run.info.run_id, speed))
    # a change given to a resume that trains nothing is not kept as the run's config (they piled up there)
    assert _train(tmp_path, *args, "--name", "done", "--resume", "--set", "optim.lr=0.00123").returncode == 0
    assert sorted(p.name for p in final.parent.glob("config*.yaml")) == ["config.yaml"]
    logged = [a.path for a in _client(uri).list_artifacts(run.info.run_id)]  # nor logged to MLflow
    assert "config.yaml" in logged and not [a for a in logged if a.startswith("config.resume")], logged


def test_one_signal_sent_to_the_process_and_then_its_group_is_one_request():
    """`timeout`, Slurm and `kill -- -PGID` deliver one stop request to the driver twice, microseconds
    apart; taken as "sent again", it stopped the run at once without its checkpoint (and a SIGTERM
    exited 130). The echo is ignored; a signal really sent again still stops at once."""
    from raysys import lifecycle

    lifecycle.reset()
    lifecycle.arm()  # a run exists (before one does, the first signal stops at once)
    try:
        lifecycle._handler(signal.SIGTERM, None)
        lifecycle._handler(signal.SIGTERM, None)  # the echo: still one request, to stop at a step boundary
        assert lifecycle.stop_requested() == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            lifecycle._handler(signal.SIGINT, None)  # another signal: now
        lifecycle._stop["at"] -= lifecycle.ECHO_S  # the same signal, a second later: a person asking again
        with pytest.raises(KeyboardInterrupt):
            lifecycle._handler(signal.SIGTERM, None)
    finally:
        lifecycle.reset()


def test_signals_during_a_compiled_jax_chunk_are_answered_at_once_and_its_stop_waits_for_it():
    """A JAX chunk is one compiled program: while the driver waited inside XLA for it, Python ran no signal
    handler, so a Ctrl-C said nothing for the whole chunk (a minute on a CPU), and a second one, meant to stop
    at once, could not. Now the wait lets handlers run: the first signal is answered at once, and a second
    says the run stops when the chunk ends, with a checkpoint, and does not raise. The "chunk" here never
    ends: the script ends itself (os._exit) once both signals were answered, or after 60 s without."""
    import textwrap

    script = textwrap.dedent("""
        import os, signal, threading, time
        import jax, jax.numpy as jnp
        from raysys import console, lifecycle
        from raysys.train.jax_host import to_host

        said, answered = [], threading.Event()
        def message(self, text):
            said.append(text)
            answered.set()
        console.Sink.message = message
        # a program that never ends (tanh stays below 2): only a handler that runs during it can answer. (A matrix
        # product in it: XLA's CPU client runs a program without one inline, in the call, not in its threads)
        chunk = jax.jit(lambda x: jax.lax.while_loop(lambda a: a[0, 0] < 2.0, lambda a: jnp.tanh(a @ a), x))
        lifecycle.install_signal_handlers()
        lifecycle.arm("resume me")

        def signals():
            for _ in range(2):
                answered.clear()
                time.sleep(lifecycle.ECHO_S + 0.2)  # the second is not an echo of the first: a person asking again
                os.kill(os.getpid(), signal.SIGINT)
                if not answered.wait(60):
                    break
            print("stop", lifecycle.stop_requested(), flush=True)
            for text in said:
                print(text, flush=True)
            os._exit(0)

        out = chunk(jnp.ones((8, 8)) / 8)
        threading.Thread(target=signals, daemon=True).start()
        with lifecycle.uncut(30.0):
            to_host(out)
        print("the chunk ended first", flush=True)
        os._exit(1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    stop, first, second = proc.stdout.splitlines()
    assert stop == f"stop {int(signal.SIGINT)}"
    assert first == "[raysys] SIGINT: stopping at the next step boundary with a checkpoint (send it again to stop at once)"
    assert re.fullmatch(r"\[raysys\] SIGINT: the step running now is one compiled program, which cannot be cut short: "
                        r"the run stops when it ends, in about \d+ s, with a checkpoint", second), second


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_timeouts_double_delivery_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, sig):
    """As `timeout` sends it: the signal to the driver, then at once to its whole group."""
    args = [*QUICK, "--name", "twice", "--set", "train.epochs=50", "--set", "train.checkpoint_every_steps=5"]
    run = _start(tmp_path, *args, start_new_session=True)
    ckpts = tmp_path / "raysys_runs" / "twice" / "checkpoints"
    _wait_for(ckpts, run, 5, timeout=300)
    os.kill(run.pid, sig)
    time.sleep(0.05)  # the driver's handler has run by now, mid-step: the echo cannot merge into the first signal
    os.killpg(run.pid, sig)
    out, err = run.communicate(timeout=300)
    print(out[-3000:], err[-3000:])
    assert run.returncode == 128 + sig and "--name twice --resume" in out, err
    stopped_at = int(out.split("stopped at step ")[1].split("/")[0])
    assert (ckpts / f"step_{stopped_at:09d}" / "meta.json").is_file()


@pytest.mark.parametrize("name, needle", [(None, "no earlier cross-validation of deep_gpcm"),
                                          ("nope", "no cross-validation called 'nope'")])
def test_a_cross_validation_resume_with_nothing_to_resume_is_one_line(tmp_path, name, needle):
    """Before: a new cross-validation started, silently, with whatever config was given."""
    proc = _train(tmp_path, *QUICK, "--cv", "--resume", *(["--name", name] if name else []), timeout=120)
    _one_line_error(proc, 2, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_bare_cross_validation_resume_takes_the_newest_that_has_not_ended(tmp_path):
    """As a bare --resume of one run does: it took the newest by name, a finished one, trained nothing and said
    'done', while an older interrupted one stayed half trained. A cv has ended when it has all its k folds (its
    first fold's config says k) and each recorded its end."""
    import yaml

    from raysys import workload as registry
    from raysys.train.config import LaunchConfig
    from raysys.train.cv import _resumed

    runs = tmp_path / "runs"

    def fold(base: str, i: int, ended: bool) -> None:
        (runs / f"{base}-fold{i}").mkdir(parents=True)
        (runs / f"{base}-fold{i}" / "config.yaml").write_text(yaml.safe_dump({"data": {"n_folds": 3, "fold": i}}))
        if ended:
            (runs / f"{base}-fold{i}" / "final_metrics.json").write_text("{}")

    for i, ended in enumerate((True, False)):  # cut in its fold 1
        fold("deep_gpcm-cv-20261128-100000", i, ended)
    for i in range(3):  # newer, and ended
        fold("deep_gpcm-cv-20261128-110000", i, True)
    for i in range(2):  # older: every fold it has ended, but the third never started
        fold("deep_gpcm-cv-20261128-090000", i, True)
    launch = LaunchConfig(resume=True, storage_path=str(runs))
    assert _resumed(registry.get("deep_gpcm"), launch) == "deep_gpcm-cv-20261128-100000"
    (runs / "deep_gpcm-cv-20261128-100000-fold1" / "final_metrics.json").write_text("{}")
    assert _resumed(registry.get("deep_gpcm"), launch) == "deep_gpcm-cv-20261128-100000"  # its third fold is left
    fold("deep_gpcm-cv-20261128-100000", 2, True)
    assert _resumed(registry.get("deep_gpcm"), launch) == "deep_gpcm-cv-20261128-090000"  # its third fold is left
    fold("deep_gpcm-cv-20261128-090000", 2, True)
    assert _resumed(registry.get("deep_gpcm"), launch) == "deep_gpcm-cv-20261128-110000"  # all ended: the newest
    # audit AW F8: a cv stopped as it began left its claimed first fold's folder (only its lock), which a bare
    # resume then took as the newest and refused ("no run called ...-fold0") until it was removed by hand
    from raysys.train.cv import _unclaim

    claimed = runs / "deep_gpcm-cv-20261128-120000-fold0"
    claimed.mkdir()
    (claimed / ".raysys.lock").write_text("")
    assert _resumed(registry.get("deep_gpcm"), launch) == "deep_gpcm-cv-20261128-110000"
    _unclaim(registry.get("deep_gpcm"), launch, "deep_gpcm-cv-20261128-120000")  # what the stopped cv does now
    assert not claimed.exists()
    _unclaim(registry.get("deep_gpcm"), launch, "deep_gpcm-cv-20261128-110000")  # a run's folder is never removed
    assert (runs / "deep_gpcm-cv-20261128-110000-fold0" / "config.yaml").is_file()


@pytest.mark.slow  # ~2 min: 3 folds, one of them twice
def test_cross_validation_stopped_in_a_fold_ends_killed_and_resumes_the_rest(tmp_path):
    """Ctrl-C in fold 1 of 3: no later fold starts, no mean of the finished ones is published, the parent is
    KILLED, exit 130, and the printed command resumes the cross-validation: fold 0 trains nothing, fold 1
    continues, fold 2 starts, and the mean is over all 3. (Before: folds 2.. started and stopped at once,
    the mean of the finished folds was the result, FINISHED, exit 0; and --cv --resume was refused.)"""
    import shlex
    import signal
    import time

    cmd = [sys.executable, "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", "--workers", "0", "--cv",
           "--name", "cv", "--set", "data.n_folds=3", "--set", "train.epochs=40"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not list((tmp_path / "raysys_runs" / "cv-fold1" / "checkpoints").glob("step_*/meta.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert not (tmp_path / "raysys_runs" / "cv-fold2").exists() and "cross-validation of" not in out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (parent,) = [r for r in _mlflow_runs(uri, "raysys-deep_gpcm") if r.data.tags.get("raysys.kind") == "cross_validation"]
    assert parent.info.status == "KILLED" and not parent.data.metrics
    resume = out.strip().splitlines()[-1].strip()
    assert resume.startswith("cd ") and resume.endswith(" --resume") and "--cv" in resume and "--name cv" in resume, out[-2000:]
    # a fold another process trains now (its lock held here): a resume is refused before it touches the parent
    # (it marked the live parent FAILED, and reopened the finished folds, before the refusal at the busy fold)
    from raysys import lifecycle

    held = lifecycle.RunLock.acquire(tmp_path / "raysys_runs" / "cv-fold1", "cv-fold1")
    try:
        busy = subprocess.run(shlex.split(resume.split(" && ", 1)[1]), cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=600)
    finally:
        held.release()
    assert busy.returncode == 2 and "cross-validation 'cv' is being trained by another process now" in busy.stderr
    assert _client(uri).get_run(parent.info.run_id).info.status == "KILLED"
    # the name again without --resume: refused before a second parent of that name exists (it was left FAILED)
    twice = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert twice.returncode == 2 and "a cross-validation called 'cv' already exists" in twice.stderr, twice.stderr
    assert len([r for r in _mlflow_runs(uri, "raysys-deep_gpcm") if r.data.tags.get("raysys.kind") == "cross_validation"]) == 1
    again = subprocess.run(shlex.split(resume.split(" && ", 1)[1]) + ["--set", "train.keep_checkpoints=3"], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing left to train" in again.stdout and "3-fold cross-validation" in again.stdout
    # the change is said of the folds it resumed, not of the one it started (audit AW F10)
    tagged = {r.data.tags["raysys.cv_fold"]: r.data.tags.get("raysys.resume_changes")
              for r in _mlflow_runs(uri, "raysys-deep_gpcm") if r.data.tags.get("raysys.kind") == "cv_fold"}
    assert tagged["1"] == "resume-1: train.keep_checkpoints: 2 -> 3" and tagged["2"] is None, tagged
    assert _client(uri).get_run(parent.info.run_id).info.status == "FINISHED"
    folds = [json.loads((tmp_path / "raysys_runs" / f"cv-fold{i}" / "final_metrics.json").read_text()) for i in range(3)]
    mean = _client(uri).get_run(parent.info.run_id).data.metrics["cv_mean/qwk"]
    assert abs(mean - sum(f["eval/qwk"] for f in folds) / 3) < 1e-9
    # trained further without its --preset/--set: every fold goes on from the cross-validation's own config (the
    # folds trained with the config given now, here the default preset's: a mean of folds no config had, or a
    # checkpoint refused), and the parent's mean is the new one (a second value at step 0 was dropped)
    before = [f["step"] for f in folds]
    further = subprocess.run([sys.executable, "-m", "raysys", "train", "deep_gpcm", "--cv", "--name", "cv", "--resume",
                              "--set", "train.epochs=41"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=900)
    assert further.returncode == 0, further.stdout[-3000:] + further.stderr[-3000:]
    assert "3-fold cross-validation" in further.stdout and "resuming with changed config: train.epochs: 40 -> 41" in further.stdout
    folds = [json.loads((tmp_path / "raysys_runs" / f"cv-fold{i}" / "final_metrics.json").read_text()) for i in range(3)]
    assert all(f["step"] > b for f, b in zip(folds, before)), (before, [f["step"] for f in folds])
    mean = _client(uri).get_run(parent.info.run_id).data.metrics["cv_mean/qwk"]
    assert abs(mean - sum(f["eval/qwk"] for f in folds) / 3) < 1e-9


def test_a_restart_says_a_lost_peer_plainly_and_names_a_node_found_dead(monkeypatch):
    """A lost node's workers fail as their peers' lost connection: the restart line quoted gloo's source
    location and advice ("... GLHF! 🏖️"); it now says the connection, and a node Ray found dead since the
    attempt began by its address (audit AV F4)."""
    from raysys.train import failures

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:33977. This is typically caused by a remote worker crashing. Check the logs "
                        "of the remote worker before reporting an error. GLHF! \U0001F3D6\uFE0F")
    assert failures.error_line(gloo) == "RuntimeError: Connection closed by peer [127.0.0.1]:33977."
    assert failures.error_line(ValueError("[not a source] kept")) == "ValueError: [not a source] kept"

    nodes = [{"NodeID": "a" * 40, "Alive": True, "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "b" * 40, "Alive": True, "NodeManagerAddress": "10.0.0.2"}]
    said, attempts = [], []
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    monkeypatch.setattr("ray.nodes", lambda: [dict(n) for n in nodes])

    class Trainer:
        def fit(self):
            attempts.append(1)
            if len(attempts) == 1:
                nodes[1]["Alive"] = False  # lost during the first attempt
                raise gloo
            return "done"

    class Sink:
        def message(self, text):
            said.append(text)

    monkeypatch.setattr(failures, "record_event", lambda run_dir, text: said.append(f"event: {text}"))
    monkeypatch.setattr(failures, "newest_checkpoint", lambda run_dir: "step_000000066")
    assert failures.fit_with_restarts(Trainer, 2, Path("unused"), Sink()) == "done"
    assert said[0] == ("event: restart 1/2 after: node 10.0.0.2 (bbbbbbbb) was lost (RuntimeError: Connection closed "
                       "by peer [127.0.0.1]:33977.)"), said
