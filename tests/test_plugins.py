"""Bring your own workload: the plug-in path end to end, in fresh processes, from a folder outside
the repository. Nothing is installed into raysys; the entry-point test installs the example into a
temporary folder of its own."""

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raysys.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "your-workload.md"
EXAMPLE = REPO / "examples" / "digits"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAYSYS_VERBOSE", "RAY_ADDRESS")}
    return {**env, **extra}


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    if cmd[0] == "python":
        cmd = [sys.executable, *cmd[1:]]
    proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    print(" ".join(cmd), "->", proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return proc


def test_the_doc_shows_the_shipped_example():
    (code,) = _blocks("python")
    (space,) = _blocks("yaml")
    assert code == (EXAMPLE / "digits_mlp.py").read_text()
    assert space == (EXAMPLE / "digits_space.yaml").read_text()


@pytest.fixture
def project(tmp_path) -> Path:
    """The reader's empty folder, with the two files the doc tells them to save."""
    d = tmp_path / "my_project"
    d.mkdir()
    (code,) = _blocks("python")
    (space,) = _blocks("yaml")
    (d / "digits_mlp.py").write_text(code)
    (d / "digits_space.yaml").write_text(space)
    return d


@pytest.mark.slow  # ~4-6 min: every command of docs/your-workload.md, DDP, bench and sweep included
def test_the_doc_runs_as_written(project):
    """Its three commands: 2 Ray Train workers, the generic bench, a 2-trial sweep, all through module:attr."""
    (bash,) = _blocks("bash")
    commands = [shlex.split(line) for line in bash.strip().splitlines()]
    assert [c[:3] for c in commands] == [["python", "-m", "raysys"], ["python", "-m", "raysys.bench"],
                                         ["python", "-m", "raysys.tune"]]
    outs = []
    for cmd in commands:
        proc = _run(cmd, project)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout)

    # train: two DDP workers, learned, tracked
    (final_file,) = (project / "raysys_runs").glob("digits_mlp-*/final_metrics.json")
    final = json.loads(final_file.read_text())
    assert final["world_size"] == 2
    assert final["eval/accuracy"] > 0.6, final["eval/accuracy"]  # 10 classes: chance is 0.1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-digits_mlp")
    runs = client.search_runs([exp.experiment_id])
    train_run = [r for r in runs if r.data.tags.get("raysys.run_name") == final_file.parent.name][0]
    assert train_run.info.status == "FINISHED" and train_run.data.params["optim.name"] == "sgd"
    assert "eval/accuracy" in train_run.data.metrics and "eval/quality" in train_run.data.metrics

    # bench: both paths, same loss on the same weights, the fast one faster
    bench = outs[1]
    assert re.search(r"^naive\s+[\d.]+", bench, re.M) and re.search(r"^optimized\s+[\d.]+", bench, re.M)
    diff = float(re.search(r"same weights and batch: ([\d.e+-]+)", bench).group(1))
    assert diff < 1e-5
    assert float(re.search(r"speedup\s+([\d.]+)x", bench).group(1)) > 1.0

    # sweep: a parent and its 2 trials, with the knobs as params and both objectives
    parents = [r for r in runs if r.data.tags.get("raysys.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == 2
    for child in children:
        assert {"train.batch_size", "model.path", "optim.lr"} <= set(child.data.params)
        assert "eval/accuracy" in child.data.metrics
    assert "Recommended" in outs[2] or "recommended" in outs[2].lower()


def test_an_installed_entry_point_plugin_is_listed_and_trains(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("raysys_runs", "mlflow.db", "*.egg-info", "build"))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert list(site.glob("*.dist-info/entry_points.txt"))
    elsewhere = tmp_path / "elsewhere"  # no digits_mlp.py here: only the installed package has it
    elsewhere.mkdir()
    env = _env(PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    listed = _run(["python", "-m", "raysys", "list"], elsewhere, env)
    assert listed.returncode == 0
    line = next(l for l in listed.stdout.splitlines() if l.startswith("digits_mlp"))
    assert "[plug-in]" in line
    trained = _run(["python", "-m", "raysys", "train", "digits_mlp", "--preset", "quick", "--workers", "0",
                    "--name", "ep"], elsewhere, env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((elsewhere / "raysys_runs" / "ep" / "final_metrics.json").read_text())["eval/accuracy"] > 0.5
    # the run records which package (and version) trained it: raysys's own commit is all MLflow says otherwise
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{elsewhere / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`raysys.run_name` = 'ep'")[0]
    assert run.data.tags["raysys.plugin"] == "raysys-digits-example 0.1.0 (entry point digits_mlp = digits_mlp:WORKLOAD)"


def _dist(site: Path, name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """An installed distribution as pip lays one out: its modules, and a dist-info folder with its metadata
    and its raysys.workloads entry points."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[raysys.workloads]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for module, text in modules.items():
        (site / f"{module}.py").write_text(text)


def test_installed_plugins_that_clash_exit_or_misname_are_said_in_list_and_refused(tmp_path):
    """Two packages claiming one name (which one won depended on the order the file system lists them), a name
    a built-in has (silently unreachable), a module that runs argparse when imported (it ended `list` for every
    plug-in after it, with its own usage text), an entry point named unlike its workload (runs named after one
    that `train --resume` cannot find): each is one line naming the problem, and `list` goes on."""
    site = tmp_path / "site"
    digits = (EXAMPLE / "digits_mlp.py").read_text()
    _dist(site, "pkg-a", "0.3.1", {"mine": "mod_a:WORKLOAD", "deep_gpcm": "mod_a:WORKLOAD"},
          {"mod_a": digits.replace('name="digits_mlp"', 'name="mine"')})
    _dist(site, "pkg-b", "9.9.0", {"mine": "mod_b:WORKLOAD", "exits": "mod_exit:WORKLOAD", "alias": "mod_b:WORKLOAD"},
          {"mod_b": digits.replace('name="digits_mlp"', 'name="mine"'),
           "mod_exit": "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr')\nargs = p.parse_args()\n"})
    assert 'name="mine"' in (site / "mod_a.py").read_text()
    env = _env(PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    listed = _run(["python", "-m", "raysys", "list"], tmp_path, env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.strip()}
    assert ("installed by 2 packages (pkg-a 0.3.1: mod_a:WORKLOAD; pkg-b 9.9.0: mod_b:WORKLOAD); uninstall all but "
            "one, or name the one you mean as module:attr") in lines["mine"]
    assert ("importing mod_exit exited (SystemExit 2): a plug-in module must not parse sys.argv or exit when imported "
            f"({site / 'mod_exit.py'}, line 4)") in lines["exits"]
    assert "is a workload named 'mine'; an entry point's name is its workload's name" in lines["alias"]
    assert "reached only as module:attr: deep_gpcm (pkg-a 0.3.1: mod_a:WORKLOAD)" in listed.stdout
    assert "usage:" not in listed.stderr and "raysys.workloads" in listed.stdout
    for name in ("mine", "exits", "alias"):
        refused = _run(["python", "-m", "raysys", "train", name, "--preset", "quick"], tmp_path, env)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


BROKEN = '''
import dataclasses
import os

from raysys.config import ConfigError

import digits_mlp


class BrokenTask(digits_mlp.DigitsTask):
    def build_model(self, cfg):  # runs inside each Ray Train worker
        with open(os.environ["ATTEMPTS_FILE"], "a") as f:
            f.write("attempt\\n")
        raise ConfigError("model.hidden=128 needs a GPU on this worker")


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="broken", task=BrokenTask())
'''


@pytest.mark.slow  # ~25 s; a workload's config errors are said by default (in process) in test_a_users_mistakes_are_said_plainly
def test_a_config_error_inside_a_ray_train_run_fails_once_with_its_message(project):
    (project / "broken.py").write_text(BROKEN)
    attempts = project / "attempts.txt"
    proc = _run(["python", "-m", "raysys", "train", "broken:WORKLOAD", "--preset", "quick", "--workers", "1",
                 "--max-failures", "2"], project, _env(ATTEMPTS_FILE=str(attempts)))
    assert proc.returncode == 2
    assert "raysys: config error: model.hidden=128 needs a GPU on this worker" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the driver's look at the model (which leaves a ConfigError, maybe of its own devices, to the worker) and
    # the worker's one try: not retried by max_failures
    assert attempts.read_text().count("attempt") == 2


FAILING = '''
import dataclasses

import digits_mlp


class FailingTask(digits_mlp.DigitsTask):
    steps = 0

    def loss(self, model, batch):  # a bug in the user's code, met from the 5th step on
        FailingTask.steps += 1
        if FailingTask.steps >= 5:
            raise RuntimeError("loss exploded at the 5th step")
        return super().loss(model, batch)


class MisnamedTask(digits_mlp.DigitsTask):
    quality_metric = "acc"  # evaluate() returns "accuracy"


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="failing", task=FailingTask())
MISNAMED = dataclasses.replace(digits_mlp.WORKLOAD, name="misnamed", task=MisnamedTask())
'''


def test_an_error_in_the_users_training_code_is_kept_with_the_run(project):
    """Retried as a crash is (launch.max_failures), each restart naming the error itself; then the
    traceback, and a last line saying where the run keeps it: error.txt (also an MLflow artifact),
    events.log, the MLflow tag raysys.error. Exit 1."""
    from mlflow.tracking import MlflowClient

    (project / "failing.py").write_text(FAILING)
    proc = _run(["python", "-m", "raysys", "train", "failing:WORKLOAD", "--preset", "quick", "--workers", "0",
                 "--name", "f", "--max-failures", "1"], project)
    assert proc.returncode == 1
    both = proc.stdout + proc.stderr
    # it failed at its 5th step, before its first checkpoint: the restart says it starts again from step 0
    assert (f"training failed (RuntimeError: loss exploded at the 5th step); no checkpoint found in "
            f"{project / 'raysys_runs' / 'f'}: restarting from step 0 (1/1") in both
    assert "Traceback" in proc.stderr
    run_dir = project / "raysys_runs" / "f"
    assert proc.stderr.rstrip().splitlines()[-3:] == [
        "[raysys] run 'f' failed: RuntimeError: loss exploded at the 5th step", f"  traceback: {run_dir / 'error.txt'}",
        f"  no checkpoint yet; start it again from step 0: cd {project} && python -m raysys train failing:WORKLOAD "
        "--name f --resume"]  # it failed at its 5th step, before its first checkpoint
    assert "RuntimeError: loss exploded at the 5th step" in (run_dir / "error.txt").read_text()
    events = (run_dir / "events.log").read_text()
    assert "restart 1/1 after: RuntimeError: loss exploded" in events and "failed: RuntimeError: loss exploded" in events
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-failing").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["raysys.error"] == "RuntimeError: loss exploded at the 5th step"
    assert "error.txt" in [a.path for a in client.list_artifacts(run.info.run_id)]

    # a quality metric that evaluate() never returns: a config error at the first evaluation, not a NaN quality
    proc = _run(["python", "-m", "raysys", "train", "failing:MISNAMED", "--preset", "quick", "--workers", "0"], project)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("raysys: config error: misnamed: its Task.quality_metric 'acc' is "
                                                    "not among the metrics its evaluate() returned: accuracy")


@pytest.mark.slow  # ~1.5 min: a sweep whose one trial fails twice
def test_a_sweep_trial_failing_again_from_the_same_checkpoint_is_not_restarted_further(project):
    """An error of the training code (not a worker's) meets every restart at the same step: after it
    failed twice from the same checkpoint the trial is failed, as `raysys train` stops restarting, and
    Tune's last restart of it is not spent (it was: 3 attempts, each from step 0)."""
    (project / "failing.py").write_text(FAILING)
    (project / "space.yaml").write_text("workload: failing:WORKLOAD\npreset: quick\nfixed:\n  train.epochs: 1\n"
                                        "  launch.max_failures: 0\nspace:\n  optim.lr: {grid: [0.05]}\n")
    proc = _run(["python", "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "1", "--name", "s",
                 "--max-failures", "2"], project)
    assert proc.returncode == 1, proc.stdout  # its only trial failed
    assert "restart 1 of 2" in proc.stdout and "restart 2 of 2" not in proc.stdout
    (line,) = [l for l in proc.stdout.splitlines() if "FAILED" in l]
    assert "loss exploded at the 5th step (again from the same checkpoint: an error of the training code) (not restarted" in line
    events = (project / "raysys_runs" / "sweeps" / "s" / "trial_events.log").read_text()
    assert events.count(" start ") == 2


@pytest.mark.slow  # ~1 min: one trial of a sweep, the sweep stopped after it
def test_a_sweep_whose_trial_never_reports_an_objective_stops_after_it(project):
    """A quality the workload never reports (an evaluate() key misspelt in the space; one outside eval/ is refused
    before the sweep starts): the first
    trial to end says so, and the sweep stops there with exit 2, not after training every trial."""
    (project / "space.yaml").write_text("workload: digits_mlp:WORKLOAD\npreset: quick\nfixed:\n  train.epochs: 1\n"
                                        "space:\n  optim.lr: {grid: [0.01, 0.02, 0.05]}\n"
                                        "objectives: {quality: eval/nosuch}\n")
    proc = _run(["python", "-m", "raysys.tune", "--space", "space.yaml", "--name", "s", "--max-concurrent", "1"],
                project)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "raysys.tune: config error: no trial reported an objective of the space: eval/nosuch never reported")
    events = (project / "raysys_runs" / "sweeps" / "s" / "trial_events.log").read_text()
    assert events.count(" start ") == 1 and "--resume" not in proc.stdout
    from mlflow.tracking import MlflowClient  # audit AS D15: its parent run was FINISHED, like a sweep that worked

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("raysys-digits_mlp").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("raysys.kind") == "sweep"]
    assert parent.info.status == "FAILED" and "eval/nosuch never reported" in parent.data.tags["raysys.error"]


SOMETIMES_BROKEN = BROKEN.replace("    def build_model(self, cfg):  # runs inside each Ray Train worker\n",
                                   "    def build_model(self, cfg):  # runs inside each trial's training\n"
                                   "        if cfg.model.hidden != 128:\n            return super().build_model(cfg)\n")


@pytest.mark.slow  # ~70 s; test_plugin_population checks a config error in a vectorized trial by default
def test_a_config_error_inside_a_sweep_trial_fails_that_trial_once(project):
    """A knob value that only the trial's training can refuse (a ConfigError at build_model): that trial
    fails at once with its message, without spending --max-failures restarts on it; the searcher, the
    table and MLflow see one failed trial, and the other trial trains."""
    (project / "broken.py").write_text(SOMETIMES_BROKEN)
    (project / "space.yaml").write_text("workload: broken:WORKLOAD\npreset: quick\nfixed:\n  train.epochs: 1\n"
                                        "space:\n  model.hidden: {grid: [64, 128]}\n")
    attempts = project / "attempts.txt"
    proc = _run(["python", "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "2", "--name", "s",
                 "--max-failures", "2"], project, _env(ATTEMPTS_FILE=str(attempts)))
    assert proc.returncode == 0
    assert attempts.read_text().count("attempt") == 1  # one try: a restart cannot fix a config error
    (line,) = [l for l in proc.stdout.splitlines() if "FAILED" in l]
    assert "FAILED: ConfigError: model.hidden=128 needs a GPU on this worker (not restarted" in line
    assert "starting again" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert "not acceptable" not in proc.stderr  # Optuna is told the failure, not its NaN objectives
    assert "2 trials — 1 ok, 1 error" in proc.stdout
    import csv

    with open(project / "raysys_runs" / "sweeps" / "s" / "report" / "trials.csv") as f:
        rows = {r["model.hidden"]: r for r in csv.DictReader(f)}
    assert rows["128"]["status"] == "error" and "needs a GPU" in rows["128"]["reason"]
    assert rows["64"]["status"] == "ok" and rows["64"]["on_front"] == "True"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=50)
    trials = {r.data.params.get("model.hidden"): r for r in runs if r.data.tags.get("raysys.kind") == "sweep_trial"}
    assert trials["128"].data.tags["raysys.trial_status"] == "error"
    assert "needs a GPU" in trials["128"].data.tags["raysys.trial_reason"]
    assert trials["64"].data.tags["raysys.trial_status"] == "ok"


def test_unknown_workloads_and_specs_fail_before_anything(tmp_path):
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "json.py").write_text("WORKLOAD = None\n")
    for spec, words in [("nope", "unknown workload 'nope'"), ("no_such_module:WORKLOAD", "no module named"),
                        ("json:WORKLOAD", "has no attribute"), ("json:dumps", "not a raysys.workload.Workload"),
                        ("./no_such_file.py:WORKLOAD", "no Python file"), ("./notes.txt:WORKLOAD", "Python module"),
                        ("sub/json.py:WORKLOAD", "no Python file"), ("shadow/json.py:WORKLOAD", "already taken"),
                        ("shadow/json.py", "name the Workload in the file too, e.g. shadow/json.py:WORKLOAD")]:
        proc = _run(["python", "-m", "raysys", "train", spec, "--workers", "0"], tmp_path)
        assert proc.returncode == 2, spec
        assert words in proc.stderr, (spec, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_workload_named_by_its_file_from_another_folder(project, tmp_path):
    """``path/to/file.py:attr`` works from any working directory; ``module:attr`` only from the module's."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run(["python", "-m", "raysys", "show", "../my_project/digits_mlp.py:WORKLOAD", "--preset", "quick"],
                elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "batch_size" in proc.stdout
    assert _run(["python", "-m", "raysys", "show", "digits_mlp:WORKLOAD"], elsewhere).returncode == 2


@pytest.mark.slow  # ~2 min: Ray Train workers and Tune trials import the file in their own processes
def test_a_file_named_workload_trains_and_sweeps_in_other_processes(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = "../my_project/digits_mlp.py:WORKLOAD"
    proc = _run(["python", "-m", "raysys", "train", spec, "--preset", "quick", "--workers", "2", "--name", "by-file"],
                elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((elsewhere / "raysys_runs" / "by-file" / "final_metrics.json").read_text())["world_size"] == 2
    space = (project / "digits_space.yaml").read_text().replace("workload: digits_mlp:WORKLOAD", f"workload: {spec}")
    (elsewhere / "space.yaml").write_text(space.replace("  model.path: {grid: [naive, optimized]}\n", ""))
    proc = _run(["python", "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "2", "--name", "s"], elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{elsewhere / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    trials = [r for r in runs if r.data.tags.get("raysys.kind") == "sweep_trial"]
    assert len(trials) == 2 and all(r.info.status == "FINISHED" for r in trials)
    # the resume command a user copies names the file absolutely: it works from any folder
    (lone,) = [r for r in runs if r.data.tags.get("raysys.run_name") == "by-file"]
    assert f"train {project / 'digits_mlp.py'}:WORKLOAD --name by-file --resume" in lone.data.tags["mlflow.note.content"]


def test_permanent_errors_are_found_inside_rays_wrappers():
    from raysys.config import ConfigError
    from raysys.train.failures import permanent_cause

    class Wrapped(RuntimeError):
        def __init__(self, failures):
            super().__init__("Training failed")
            self.worker_failures = failures

    inner = ConfigError("bad")
    outer = Wrapped({0: RuntimeError("collective aborted"), 1: inner})
    assert permanent_cause(outer) is inner
    try:
        try:
            raise ModuleNotFoundError("no module named x")
        except ModuleNotFoundError as e:
            raise RuntimeError("worker died") from e
    except RuntimeError as e:
        assert isinstance(permanent_cause(e), ImportError)
    assert permanent_cause(Wrapped({0: RuntimeError("actor died")})) is None
    # a full disk under whatever wrote to it (the tracking buffer, a store): a restart would meet it again
    import errno

    full = OSError(errno.ENOSPC, "No space left on device", "run/tracking-buffer.jsonl")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full") from e
    except RuntimeError as e:
        assert permanent_cause(Wrapped({0: e})) is full
    assert permanent_cause(Wrapped({0: OSError(errno.ECONNRESET, "reset")})) is None  # a lost peer: restartable
    # a checkpoint the storage did not take: a full disk is for good, an endpoint that did not answer is not
    from raysys.checkpoint import CheckpointWriteError

    disk = CheckpointWriteError(errno.ENOSPC, "could not write checkpoint step_000000010 (ENOSPC No space left)")
    away = CheckpointWriteError(errno.EIO, "could not upload checkpoint step_000000010 to s3://b/runs/r (When uploading"
                                " object: AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 28, "
                                "Timeout was reached); the earlier checkpoints are intact")
    assert permanent_cause(Wrapped({0: disk})) is disk and permanent_cause(Wrapped({0: away})) is None
    # a tracking server away for the whole wait, raised while one failed look's ConfigError was handled: an
    # outage (Tune retries it, a --resume runs it again), not that ConfigError
    from raysys.tracking import TrackingOutageError

    try:
        try:
            raise ConfigError("the MLflow tracking server does not answer")
        except ConfigError:
            raise TrackingOutageError("has not answered for 10 min") from None
    except TrackingOutageError as e:
        assert permanent_cause(Wrapped({0: e})) is None


def test_sgd_with_nesterov_and_the_quality_metric_named_once():
    import torch

    from raysys.config import ConfigError, apply_overrides
    from raysys.train.config import OptimConfig
    from raysys.train.optim import build_optimizer
    from raysys.workload import get

    opt = build_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True), torch.nn.Linear(2, 2))
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.9
    cfg = get("deep_gpcm").config("quick")
    with pytest.raises(ConfigError, match="nesterov"):
        apply_overrides(cfg, {"optim.nesterov": True})  # adam has no Nesterov momentum
    assert get("deep_gpcm").quality_metric == "eval/qwk"  # from the task's quality_metric
    assert get("mpn_dqn").quality_metric == "eval/quality"


def test_threads_knob_and_the_in_process_default():
    import torch

    from raysys.train.config import LaunchConfig
    from raysys.train.runtime import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(LaunchConfig(workers=0, threads=3))
        assert torch.get_num_threads() == 3
        set_threads(LaunchConfig(workers=0))  # one per physical core: half the usable logical CPUs
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        torch.set_num_threads(2)
        set_threads(LaunchConfig(workers=2))  # Ray workers keep Ray's own setting unless asked
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_bench_measures_the_configuration_given_with_set(tmp_path, monkeypatch, capsys):
    """``python -m raysys.bench --set/--config``: the generic bench times the configuration asked for
    (a narrower model here) and records the overrides; a bench that measures fixed shapes of its own
    refuses them in one line, and an unknown key is one line, before anything is measured."""
    from raysys.bench import main as bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    (tmp_path / "narrow.yaml").write_text("model:\n  hidden: 8\n")
    import torch

    threads = torch.get_num_threads()
    assert bench(["digits_mlp:WORKLOAD", "--quick", "--config", "narrow.yaml", "--set", "model.dropout=0.0",
                  "--json", "b.json"]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["overrides"] == {"model.hidden": "8", "model.dropout": "0.0"}
    learning = res["learning"]  # both paths learn on the same batches: their loss falls from the first pass
    assert all(v["last_pass_loss"] < v["first_pass_loss"] for v in learning.values()) and "problems" not in res
    assert res["params"] == (64 * 8 + 8) + (8 * 8 + 8) + (8 * 10 + 10)  # the 8-wide MLP, not the default 128
    assert bench(["digits_mlp:WORKLOAD", "--quick", "--set", "train.batch_size=100000", "--json", "big.json"]) == 0
    assert json.loads((tmp_path / "big.json").read_text())["batch"]["size"] < 100000  # the size used (audit AX F3)
    assert "measured with: model.hidden=8 model.dropout=0.0" in capsys.readouterr().out
    # the device as the speed was timed (the bench's quality runs change torch's threads after), and the code
    assert res["device"].endswith(f"{threads} threads)")
    assert set(res["environment"]) >= {"date", "raysys_commit", "torch", "jax", "ray", "python"}
    (tmp_path / "results").mkdir()
    for args, needle in ((["hackmatrix_ppo", "--set", "train.num_envs=64"], "takes no --set/--config"),
                         (["digits_mlp:WORKLOAD", "--set", "model.nope=1"], "unknown config key 'model.nope'"),
                         # a path asked of a built-in whose bench measures both: it was accepted and ignored (AX F2)
                         (["deep_gpcm", "--set", "model.path=naive"], "the bench measures both paths"),
                         (["mpn_dqn", "--set", "path=naive"], "the bench measures both paths"),
                         # a preset of a built-in whose bench measures its own configuration: ignored (AY F10)
                         (["deep_gpcm", "--quick", "--preset", "nosuch"], "--preset nosuch: deep_gpcm's bench measures"),
                         (["digits_mlp:WORKLOAD", "--quick", "--preset", "nosuch"], "unknown preset 'nosuch'"),
                         # a folder for --json: the whole bench ran, then a traceback lost its results (AX F6)
                         (["digits_mlp:WORKLOAD", "--quick", "--json", "results"], "--json results is a folder")):
        assert bench(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_accumulation_is_a_larger_batch_also_in_an_epochs_last_short_group(tmp_path, monkeypatch):
    """Audit BB F3: an epoch's last group of fewer micro-batches backpropagated loss / grad_accum, so that
    step took a fraction of its gradient. 1347 digits at 128 a micro-batch are 11 micro-batches: 5 groups of
    two and one of one, the same samples as batches of 256 (5 and one of 67): SGD must go the same way."""
    from mlflow.tracking import MlflowClient

    from raysys.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    common = ["train", "digits_mlp:WORKLOAD", "--preset", "quick", "--workers", "0", "--set", "train.epochs=2",
              "--set", "model.dropout=0", "--set", "optim.name=sgd", "--set", "optim.lr=0.1", "--set",
              "optim.clip_grad_norm=null", "--set", "train.log_every_steps=1"]
    assert main([*common, "--name", "accum", "--set", "train.batch_size=128", "--set", "train.grad_accum=2"]) == 0
    assert main([*common, "--name", "big", "--set", "train.batch_size=256"]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "raysys-digits_mlp"]
    curves = {}
    for run in client.search_runs([exp.experiment_id]):
        curves[run.info.run_name] = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert sorted(curves["accum"]) == sorted(curves["big"]) == list(range(1, 13))
    assert all(abs(curves["accum"][s] - curves["big"][s]) < 1e-4 for s in range(1, 13)), curves


def test_a_workloads_functions_are_checked_when_it_loads(monkeypatch):
    """A task without a required method, a train_fn that takes the wrong arguments or is no function, a
    bench that cannot take quick=: one line when the workload loads (every command loads it before it
    creates anything), not a traceback in a worker after the run was made and restarted."""
    import dataclasses

    import torch

    from raysys import workload as registry
    from raysys.bench import check_result
    from raysys.config import ConfigError
    from raysys.train.loop import checked_loss

    monkeypatch.syspath_prepend(str(EXAMPLE))
    import digits_mlp

    class NoEvaluate:  # a task written from scratch, evaluate forgotten
        quality_metric = "accuracy"

        def datasets(self, cfg): ...
        def collate(self, batch): ...
        def build_model(self, cfg): ...
        def loss(self, model, batch): ...

    class BadLoss(digits_mlp.DigitsTask):
        def loss(self, model):  # the batch argument forgotten
            return model

    class NoPrepare(digits_mlp.DigitsTask):
        prepare = None  # optional: a task whose data needs no preparing

    base = digits_mlp.WORKLOAD
    cases = {
        "its task (NoEvaluate) has no evaluate; a task needs datasets, build_model, loss, evaluate":
            dataclasses.replace(base, name="a", task=NoEvaluate()),
        "its BadLoss.loss cannot be called as loss(model, batch) (its signature: (model))":
            dataclasses.replace(base, name="b", task=BadLoss()),
        "its train_fn cannot be called as train_fn(cfg, session) (its signature: (cfg))":
            dataclasses.replace(base, name="c", task=None, train_fn=lambda cfg: {}),
        "its train_fn is a str, not a function train_fn(cfg, session)":
            dataclasses.replace(base, name="d", task=None, train_fn="train"),
        "its task is the class NoPrepare, not one of its objects: task=NoPrepare()":
            dataclasses.replace(base, name="g", task=NoPrepare),
        "its bench cannot be called as bench(quick=...) (its signature: (fast))":
            dataclasses.replace(base, name="e", bench=lambda fast: {}),
    }
    for needle, wl in cases.items():
        with pytest.raises(ConfigError) as e:
            registry.register(wl, f"check-{wl.name}")
        assert f"workload {wl.name}: {needle}" in str(e.value)
    registry.register(dataclasses.replace(base, name="f", task=NoPrepare()), "check-f")  # prepare is optional
    # a path key the bench cannot set: said when a config is built (before any banner), naming the workload's key
    with pytest.raises(ConfigError, match=r"workload h: its path_key 'model.pathx' is not a key of its config "
                                          r"\(did you mean 'model.path'\?\)"):
        dataclasses.replace(base, name="h", path_key="model.pathx").config("quick")
    with pytest.raises(ConfigError, match="workload i: its path_key 'model.hidden' must take 'naive' and 'optimized'"):
        dataclasses.replace(base, name="i", path_key="model.hidden").config("quick")
    # a bench's result: a row without a number throughput is the bench's error, named (not a KeyError)
    with pytest.raises(ConfigError, match="mine's bench returned a 'naive' row without a number 'throughput' "
                                          r"\(its keys: env_steps_per_s\)"):
        check_result({"naive": {"env_steps_per_s": 1.0}, "optimized": {"throughput": 2.0}}, "mine")
    with pytest.raises(ConfigError, match="mine's bench returned no 'optimized' row"):
        check_result({"naive": {"throughput": 1.0}}, "mine")
    # without a speedup of its own, the two rows' ratio (the JSON always has one); its own is kept
    assert check_result({"naive": {"throughput": 100.0}, "optimized": {"throughput": 300.0}}, "mine")["speedup"] == 3.0
    assert check_result({"naive": {"throughput": 1.0}, "optimized": {"throughput": 3.0}, "speedup": 2.5}, "m")["speedup"] == 2.5
    # a loss that returns the bare tensor: its contract named, not 'iteration over a 0-d tensor'
    with pytest.raises(ConfigError, match=r"mine: its Task.loss returned a Tensor, not \(a scalar loss tensor"):
        checked_loss(type("T", (), {"loss": lambda self, m, b: torch.tensor(1.0)})(), None, None, "mine")


ERROR_RATE = '''
import dataclasses

import digits_mlp


class ErrorRateTask(digits_mlp.DigitsTask):
    quality_metric = "error_rate"
    quality_mode = "min"  # lower is better, as in Ray Tune's mode

    def evaluate(self, model, batches):
        return {"error_rate": 1.0 - super().evaluate(model, batches)["accuracy"]}


# the quality metric and mode follow the new task (the original's were filled in from its own)
WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_error", task=ErrorRateTask())
'''


@pytest.mark.slow  # ~30 s; the objectives' mode is unit-tested in test_tune_space.py
def test_a_sweep_minimises_a_quality_where_lower_is_better(project):
    """A workload whose quality is an error rate (``quality_mode = "min"``): the front, the
    recommendation and the best quality are the lowest error's, and the searcher minimises it. The
    hopeless learning rate has the higher error: maximising would recommend it."""
    (project / "error_rate.py").write_text(ERROR_RATE)
    (project / "space.yaml").write_text("workload: error_rate:WORKLOAD\npreset: quick\nfixed:\n  launch.workers: 0\n"
                                        "space:\n  optim.lr: {grid: [1.0e-6, 0.05]}\nobjectives:\n  tolerance: 0.0\n")
    proc = _run(["python", "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "2", "--name", "s"], project)
    assert proc.returncode == 0
    import csv

    with open(project / "raysys_runs" / "sweeps" / "s" / "report" / "trials.csv") as f:
        rows = {float(r["optim.lr"]): r for r in csv.DictReader(f)}
    good, hopeless = rows[0.05], rows[1e-6]
    assert float(good["quality"]) < float(hopeless["quality"])  # the premise: one lr learns, one does not
    assert good["recommended"] == "True" and hopeless["recommended"] == "False"
    assert "lower is better" in (project / "raysys_runs" / "sweeps" / "s" / "report" / "recommendation.md").read_text()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=50)
    (parent,) = [r for r in runs if r.data.tags.get("raysys.kind") == "sweep"]
    assert parent.data.params["sweep.quality_mode"] == "min"
    assert parent.data.metrics["sweep/best_quality"] == pytest.approx(float(good["quality"]), rel=1e-3)


TINY = Path(__file__).resolve().parent / "tiny_workload.py"


def _mlflow_run(store: Path, name: str, workload: str = "tiny"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    exp = client.get_experiment_by_name(f"raysys-{workload}")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("raysys.run_name") == name]
    return run


def test_a_train_fn_run_without_its_quality_metric_fails(workdir, capsys):
    """A ``train_fn`` that never reports ``eval/quality`` (its Workload.quality_metric) ends as a diverged
    run does: FAILED in MLflow with the reason as ``raysys.error``, in events.log, exit 1."""
    from raysys.cli import main

    assert main(["train", f"{TINY}:WORKLOAD", "--name", "noq", "--set", "train.omit_quality=true"]) == 1
    why = "no quality: the run ended without eval/quality (Workload.quality_metric)"
    assert f"run 'noq' FAILED: {why}" in capsys.readouterr().out
    assert why in (workdir / "raysys_runs" / "noq" / "events.log").read_text()
    run = _mlflow_run(workdir / "mlflow.db", "noq")
    assert run.info.status == "FAILED" and run.data.tags["raysys.error"].startswith(why)
    # a workload that declares no quality metric is not held to raysys's default name for one
    assert main(["train", f"{TINY}:UNDECLARED", "--name", "undeclared", "--set", "train.omit_quality=true"]) == 0


def test_each_resume_of_a_train_fn_run_is_in_its_events_log(workdir, capsys):
    """As a task run's: one ``resumed`` line per --resume that restored a checkpoint, none before."""
    from raysys.cli import main

    args = ["train", f"{TINY}:WORKLOAD", "--name", "r"]
    assert main([*args, "--set", "train.steps=5"]) == 0
    events = workdir / "raysys_runs" / "r" / "events.log"
    assert not events.exists() or "resumed" not in events.read_text()
    assert main([*args, "--set", "train.steps=10", "--resume"]) == 0
    assert main([*args, "--set", "train.steps=15", "--resume"]) == 0
    lines = [line.split(" ", 1)[1] for line in events.read_text().splitlines()]  # without the time
    resumed = [line for line in lines if line.startswith("resumed")]
    assert resumed == ["resumed step=5 from=step_000000005", "resumed step=10 from=step_000000010"]
    assert _mlflow_run(workdir / "mlflow.db", "r").info.status == "FINISHED"
    # each session ended the run, and each resume trained it further: what it ended with is kept each time
    run = workdir / "raysys_runs" / "r"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_000000005", "step_000000010", "step_000000015"]
    assert (run / "final_metrics.step_5.json").is_file() and (run / "final_metrics.step_10.json").is_file()
    # a resume that trains nothing leaves the checkpoint it restored as it was, whatever it changed
    ckpt = run / "checkpoints" / "step_000000015"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert main([*args, "--set", "train.steps=15", "--set", "opt.lr=0.2", "--set", "train.end_checkpoint=true",
                 "--resume"]) == 0
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    # resumed as another workload: said as that, not as a change in the workload's code
    capsys.readouterr()
    assert main(["train", "deep_gpcm", "--name", "r", "--resume"]) == 2
    assert capsys.readouterr().err.strip() == ("raysys: config error: run 'r' is a run of tiny, not deep_gpcm (its "
                                               "checkpoints say so): resume it with its own workload (tiny)")


MISTAKES = '''
import dataclasses

import digits_mlp


class EmptyTask(digits_mlp.DigitsTask):
    def datasets(self, cfg):
        return [], super().datasets(cfg)[1]  # a filter that kept nothing


class StuckTask(digits_mlp.DigitsTask):  # its optimized path computes the loss, but no gradient
    def loss(self, model, batch):
        loss, stats = super().loss(model, batch)
        return (loss.detach() + 0 * sum(p.sum() for p in model.parameters()) if model.path == "optimized"
                else loss), stats


class SkewedTask(digits_mlp.DigitsTask):  # its optimized path computes another function: logits x 1.1
    def loss(self, model, batch):
        if model.path == "optimized":
            import torch.nn.functional as F

            return F.cross_entropy(model(batch["x"]) * 1.1, batch["y"]), {"samples": len(batch["y"])}
        return super().loss(model, batch)


class FrozenTask(digits_mlp.DigitsTask):  # its optimized path trains only the last layer: the same loss at the start
    def loss(self, model, batch):
        if model.path == "optimized":
            import torch.nn.functional as F

            net = model.net
            return F.cross_entropy(net[6](net[:6](batch["x"]).detach()), batch["y"]), {"samples": len(batch["y"])}
        return super().loss(model, batch)


class HalvesTask(digits_mlp.DigitsTask):  # BatchNorm: its naive path normalises each half of the batch on its own
    def build_model(self, cfg):
        import torch

        model = super().build_model(cfg)
        model.bn = torch.nn.BatchNorm1d(64)
        return model

    def loss(self, model, batch):
        import torch
        import torch.nn.functional as F

        x, half = batch["x"], len(batch["x"]) // 2
        h = torch.cat([model.bn(x[:half]), model.bn(x[half:])]) if model.path == "naive" else model.bn(x)
        return F.cross_entropy(model.net(h), batch["y"]), {"samples": len(batch["y"])}


class NoisyTask(digits_mlp.DigitsTask):  # a loss that draws noise even in eval mode: the paths cannot be compared
    def loss(self, model, batch):
        import torch

        loss, stats = super().loss(model, batch)
        return loss + 1e-2 * torch.rand(()), stats


class NanTask(digits_mlp.DigitsTask):
    def loss(self, model, batch):
        loss, stats = super().loss(model, batch)
        return loss * float("nan"), stats


@dataclasses.dataclass
class Needs:
    fraction: float  # no default: the config class cannot be built


@dataclasses.dataclass
class NoDefaultConfig(digits_mlp.DigitsConfig):
    needs: Needs = dataclasses.field(default_factory=Needs)


class BrokenBuild(digits_mlp.DigitsTask):
    def build_model(self, cfg):
        raise ValueError(f"no model of width {cfg.model.hidden} here")


class BrokenData(digits_mlp.DigitsTask):
    def datasets(self, cfg):
        return {}["train"], None


@dataclasses.dataclass
class FoldData(digits_mlp.DataConfig):
    n_folds: int = 1  # 1: a plain split, as a workload may default
    fold: int = 0


@dataclasses.dataclass
class FoldConfig(digits_mlp.DigitsConfig):
    data: FoldData = dataclasses.field(default_factory=FoldData)


W = digits_mlp.WORKLOAD
ONEFOLD = dataclasses.replace(W, name="onefold", config_cls=FoldConfig, presets={"default": FoldConfig},
                              extra={"folds": ("data.n_folds", "data.fold")})
class PartialTask(digits_mlp.DigitsTask):  # a metric only odd folds report (an AUC needs both classes)
    def datasets(self, cfg):
        self.fold = cfg.data.fold
        return super().datasets(cfg)

    def evaluate(self, model, batches):
        return super().evaluate(model, batches) | ({"per_class": 0.5 + self.fold} if self.fold % 2 else {})


PARTIAL = dataclasses.replace(ONEFOLD, name="partial", task=PartialTask())
RECORD = dataclasses.replace(W, name="record", dataset=lambda cfg: {"name": "digits", "source": "sklearn",
                                                                    "profile": cfg.data.seedd})
SHAPE = dataclasses.replace(W, name="shape", dataset=lambda cfg: {"name": "digits", "source": "sklearn",
                                                                  "profile": "split 0.25"})
BUILD = dataclasses.replace(W, name="build", task=BrokenBuild())
DATA = dataclasses.replace(W, name="data", task=BrokenData())
EMPTY = dataclasses.replace(W, name="empty", task=EmptyTask())
NAN = dataclasses.replace(W, name="nan", task=NanTask())
STUCK = dataclasses.replace(W, name="stuck", task=StuckTask())
SKEWED = dataclasses.replace(W, name="skewed", task=SkewedTask())
NOISY = dataclasses.replace(W, name="noisy", task=NoisyTask())
FROZEN = dataclasses.replace(W, name="frozen", task=FrozenTask())
HALVES = dataclasses.replace(W, name="halves", task=HalvesTask())
NODEFAULT = dataclasses.replace(W, name="nodefault", config_cls=NoDefaultConfig, presets={"default": NoDefaultConfig})
NET = dataclasses.replace(W, name="net", extra={"identity_sections": ("data",)})  # its model section unchecked
'''


WIDER = '''

class WiderTask(digits_mlp.DigitsTask):  # the code changed after a run: its model is twice as wide
    def build_model(self, cfg):
        wide = dataclasses.replace(cfg.model, hidden=2 * cfg.model.hidden)
        return super().build_model(dataclasses.replace(cfg, model=wide))


NET = dataclasses.replace(NET, task=WiderTask())
'''


def test_a_users_mistakes_are_said_plainly(project):
    """An empty training set fails (not a 0-step run that 'finishes' with an untrained model); non-finite
    losses stop the run at the 20th in a row, not at the epoch's end, and leave no checkpoint of it; a
    config class that cannot be built is one line, exit 2, when the workload loads; the bench exits 1
    on a step that learns nothing."""
    (project / "mistakes.py").write_text(MISTAKES)
    args = ["--preset", "quick", "--workers", "0"]
    proc = _run(["python", "-m", "raysys", "train", "mistakes:EMPTY", *args, "--name", "e"], project)
    assert proc.returncode == 2 and "empty: its training set is empty (Task.datasets gave 0 items)" in proc.stderr

    proc = _run(["python", "-m", "raysys", "train", "mistakes:NAN", *args, "--name", "r"], project)
    assert proc.returncode == 1 and "20 non-finite losses in a row, the loop stopped itself at step 20" in proc.stdout
    assert "lr_scheduler" not in proc.stdout + proc.stderr  # torch's warning about the skipped steps
    assert not list((project / "raysys_runs" / "r").glob("checkpoints/step_*"))

    for cmd in (["train", "mistakes:NODEFAULT", *args, "--name", "d"], ["list", "mistakes:NODEFAULT"],
                ["list", "deep_gpcm", "mistakes:NODEFAULT"]):  # the good one not printed before the line (AY F11)
        proc = _run(["python", "-m", "raysys", *cmd], project)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.strip().splitlines() == [
            "raysys: config error: workload nodefault: its preset 'default' cannot be built: TypeError: "
            "Needs.__init__() missing 1 required positional argument: 'fraction'"]

    proc = _run(["python", "-m", "raysys.bench", "mistakes:NAN", "--quick"], project)
    assert proc.returncode == 1 and "raysys.bench: optimized: " in proc.stderr and "losses are not finite" in proc.stderr
    # the same loss on the same weights, but the optimized path learns nothing: the bench says so, exit 1
    proc = _run(["python", "-m", "raysys.bench", "mistakes:STUCK", "--quick"], project)
    assert proc.returncode == 1 and "raysys.bench: optimized: its loss on the same batches did not fall as the other path's" in proc.stderr
    # both learn, but the optimized path computes another function (its logits 10% larger): exit 1, said
    proc = _run(["python", "-m", "raysys.bench", "mistakes:SKEWED", "--quick"], project)
    assert proc.returncode == 1 and "raysys.bench: the paths compute different functions: on the same weights" in proc.stderr
    # the same loss on the same weights, and it learns, but only its last layer: its gradients differ (audit AX F1)
    proc = _run(["python", "-m", "raysys.bench", "mistakes:FROZEN", "--quick"], project)
    assert proc.returncode == 1 and "raysys.bench: the paths train differently: on the same weights and batch" in proc.stderr
    assert "most in net.0.weight" in proc.stderr or "most in net.3.weight" in proc.stderr, proc.stderr
    # alike in eval mode (BatchNorm's running statistics), but it trains on other statistics (audit BB F4)
    proc = _run(["python", "-m", "raysys.bench", "mistakes:HALVES", "--quick"], project)
    assert proc.returncode == 1 and "(train mode without dropout: BatchNorm on the batch's statistics)" in proc.stderr
    # a loss with noise of its own in eval mode: the comparison is not judged, and said so
    proc = _run(["python", "-m", "raysys.bench", "mistakes:NOISY", "--quick"], project)
    assert proc.returncode == 0 and "not judged: the loss differs between two evaluations" in proc.stdout


@pytest.mark.parametrize("attr, line", [
    ("BUILD", "build: its Task.build_model raised ValueError: no model of width 128 here (mistakes.py:"),
    ("DATA", "data: its Task.datasets raised KeyError: 'train' (mistakes.py:"),
    # the dataset record's hook ran after the run existed: a traceback, the run RUNNING, its name taken
    ("RECORD", "record: its Workload.dataset raised AttributeError: 'DataConfig' object has no attribute 'seedd' "
               "(mistakes.py:"),
    ("SHAPE", "shape: its Workload.dataset's profile is a str, not a mapping of names to values")])
def test_an_error_in_the_workloads_code_is_one_line_before_anything_exists(project, attr, line):
    """datasets and build_model run on the driver first: an error of the code itself is said at once (not
    the workers' traceback, restarted max_failures times), and no run folder or MLflow store is made."""
    (project / "mistakes.py").write_text(MISTAKES)
    proc = _run(["python", "-m", "raysys", "train", f"mistakes:{attr}", "--preset", "quick", "--workers", "1",
                 "--name", "x"], project)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"raysys: error in the workload's code: {line}") and "nothing was created" in proc.stderr
    assert not (project / "raysys_runs").exists() and not (project / "mlflow.db").exists()


def test_a_cross_validation_of_one_fold_is_refused(project):
    """--cv with k = 1 ran a '1-fold cross-validation' whose spread was 0.0000, as if measured."""
    (project / "mistakes.py").write_text(MISTAKES)
    proc = _run(["python", "-m", "raysys", "train", "mistakes:ONEFOLD", "--workers", "0", "--cv"], project)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "raysys: config error: --cv needs data.n_folds >= 2 folds, got 1 (--set data.n_folds=5, say)"], proc.stderr
    assert not (project / "raysys_runs").exists() and not (project / "mlflow.db").exists()


def test_a_metric_some_folds_do_not_report_is_said_of_the_folds_that_do(project):
    """Its mean was over the folds that report it, with nothing saying so (audit AW F4)."""
    from mlflow.tracking import MlflowClient

    (project / "mistakes.py").write_text(MISTAKES)
    proc = _run(["python", "-m", "raysys", "train", "mistakes:PARTIAL", "--workers", "0", "--cv", "--name", "p",
                 "--set", "data.n_folds=3", "--set", "train.epochs=1"], project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("[raysys] eval/per_class was reported by 1 of the 3 folds: its mean and std are of those 1 (MLflow: "
            "cv_n/per_class)") in proc.stdout, proc.stdout[-3000:]
    (parent,) = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs(
        ["1"], filter_string="tags.`raysys.kind` = 'cross_validation'")
    assert parent.data.metrics["cv_mean/per_class"] == 1.5 and parent.data.metrics["cv_n/per_class"] == 1
    assert "cv_n/accuracy" not in parent.data.metrics  # every fold reports it


@pytest.mark.slow  # ~25 s; the default suite's resume refusals are test_a_resume_after_the_workloads_code_changed_says_so and test_faults.py's
def test_a_resume_whose_model_no_longer_takes_the_weights_is_refused_before_anything(project):
    """A workload whose checkpoints compare only its data section (identity_sections): a resume that
    changes a shape in another section is still refused, in one line, before anything is written (the
    printed resume command then still works); one that changes no shape goes on."""
    from mlflow.tracking import MlflowClient

    (project / "mistakes.py").write_text(MISTAKES)
    args = ["python", "-m", "raysys", "train", "mistakes:NET", "--preset", "quick", "--workers", "0", "--name", "n"]
    assert _run([*args, "--set", "train.epochs=1"], project).returncode == 0
    run_dir = project / "raysys_runs" / "n"
    before = sorted(p.name for p in run_dir.iterdir())
    proc = _run([*args, "--resume", "--set", "model.hidden=32"], project)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "does not fit the model this config builds (net.0.bias: checkpoint [128], now [32])" in proc.stderr
    assert "model.hidden: 128 -> 32" in proc.stderr and "resuming with changed config" not in proc.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == before
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-net").experiment_id])
    assert run.info.status == "FINISHED"
    # the same settings, but the workload's code now builds another model: refused alike, naming the cause
    (project / "mistakes.py").write_text(MISTAKES + WIDER)
    proc = _run([*args, "--resume"], project)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the workload's code changed since the run's last session (mistakes.py (" in proc.stderr
    # with a --set that changes no shape, the code is still what is named first (it blamed the --set)
    proc = _run([*args, "--resume", "--set", "train.epochs=3"], project)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the workload's code changed since the run's last session (mistakes.py (" in proc.stderr
    assert "), and on this resume train.epochs: 1 -> 3. Resume with that code and settings" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    (project / "mistakes.py").write_text(MISTAKES)
    proc = _run([*args, "--resume", "--set", "model.dropout=0.2", "--set", "train.epochs=2"], project)
    assert proc.returncode == 0 and "resumed step=" in (run_dir / "events.log").read_text()
    assert "[raysys] resuming with changed config: model.dropout: " in proc.stdout


def test_a_resume_with_another_batch_size_or_worker_count_trains_the_epochs_left(project, monkeypatch):
    """Steps per epoch change with the batch size or the worker count: a resume goes on from the same share
    of its epoch and trains every epoch left (not the old run's step count), and says what changed."""
    from mlflow.tracking import MlflowClient

    args = ["python", "-m", "raysys", "train", "digits_mlp:WORKLOAD", "--preset", "quick", "--workers", "0",
            "--name", "b"]
    assert _run([*args, "--set", "train.max_steps=10"], project).returncode == 0  # stops in epoch 1 of 3
    proc = _run([*args, "--resume", "--set", "train.max_steps=null", "--set", "train.batch_size=128"], project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming with changed config: train.batch_size: 64 -> 128; train.max_steps: 10 -> None" in proc.stdout
    assert "epoch 3/3 done" in proc.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-digits_mlp").experiment_id])
    epochs = [m.value for m in client.get_metric_history(run.info.run_id, "train/epoch")]
    assert run.info.status == "FINISHED" and max(epochs) == 3.0
    # the share of epoch 1 left after 10 steps of 64 samples, in batches of 128, then two whole epochs
    from raysys import cli
    from raysys import workload as registry

    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    wl = registry.get("digits_mlp:WORKLOAD")
    n = len(wl.task.datasets(wl.config("quick"))[0])
    final = json.loads((project / "raysys_runs" / "b" / "final_metrics.json").read_text())
    assert final["step"] == 10 + math.ceil((n - 640) / 128) + 2 * math.ceil(n / 128), (final["step"], n)

    # a worker count given on a resume is a change like any other (the global batch, the data's order)
    parsed = cli.build_parser().parse_args(["train", "digits_mlp:WORKLOAD", "--name", "b", "--resume", "--workers", "2"])
    cli.build_config(parsed)
    assert parsed.resume_changes == "launch.workers: 0 -> 2"


def test_a_resume_after_the_workloads_config_grew_or_renamed_a_field(project):
    """A field added with a default since the checkpoint: the resume goes on and says its value. A field
    renamed: one line that the run's saved config no longer fits the code, exit 2, nothing written."""
    code = project / "digits_mlp.py"
    args = ["python", "-m", "raysys", "train", "digits_mlp:WORKLOAD", "--preset", "quick", "--workers", "0",
            "--name", "g"]
    assert _run([*args, "--set", "train.max_steps=5"], project).returncode == 0
    grown = code.read_text().replace("    hidden: int = 128\n", "    hidden: int = 128\n    act: str = 'relu'\n", 1)
    assert "act: str" in grown
    code.write_text(grown)
    proc = _run([*args, "--resume", "--set", "train.max_steps=8"], project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the checkpoint predates config key model.act (now 'relu'): the run goes on with it as it is now" in proc.stdout
    assert "the workload's code changed since this run's last session: digits_mlp.py (changed)" in proc.stdout
    code.write_text(grown.replace("hidden", "width"))
    run_dir = project / "raysys_runs" / "g"
    before = sorted(p.name for p in run_dir.rglob("*"))
    proc = _run([*args, "--resume", "--set", "train.max_steps=12"], project)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "does not fit digits_mlp's config: unknown config key 'model.hidden'" in proc.stderr
    assert "Its code changed since the run began" in proc.stderr
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_a_resume_after_the_workloads_code_changed_says_so(project):
    """A change that keeps every shape (a fix to the loss, say) loads the checkpoint as before, so nothing
    refused it, and nothing said it either: the run's curve then mixes two codes without a word. Now the
    resume names the files that changed since the run's last session, events.log keeps it, and the MLflow
    tag raysys.code tells the sessions' codes apart. The same code again: not a word."""
    from mlflow.tracking import MlflowClient

    code = project / "digits_mlp.py"
    args = ["python", "-m", "raysys", "train", "digits_mlp:WORKLOAD", "--preset", "quick", "--workers", "0",
            "--name", "c"]
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")

    def code_tag() -> str:
        (run,) = client.search_runs([client.get_experiment_by_name("raysys-digits_mlp").experiment_id])
        return run.data.tags["raysys.code"]

    assert _run([*args, "--set", "train.max_steps=3"], project).returncode == 0
    first = code_tag()
    proc = _run([*args, "--resume", "--set", "train.max_steps=5"], project)
    assert proc.returncode == 0 and "code changed" not in proc.stdout, proc.stdout[-2000:]
    assert code_tag() == first
    code.write_text(code.read_text() + "\n\ndef helper():  # an edit that keeps every shape\n    return 1\n")
    proc = _run([*args, "--resume", "--set", "train.max_steps=7"], project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("note: the workload's code changed since this run's last session: digits_mlp.py (changed); the run "
            "goes on from its checkpoint with the code as it is now") in proc.stdout
    assert "resumed with changed code: digits_mlp.py (changed)" in (project / "raysys_runs" / "c" / "events.log").read_text()
    assert code_tag() != first
    proc = _run([*args, "--resume", "--set", "train.max_steps=9"], project)  # the new code is now the run's
    assert proc.returncode == 0 and "code changed" not in proc.stdout, proc.stdout[-2000:]


def test_a_module_beside_a_one_file_workload_is_its_code_too(project):
    """A workload file that imports its model from a module beside it (here lazily, in build_model): an edit
    of that module was not seen on a resume (only the workload's own file was digested, and carried to a
    cluster's nodes); it is said like an edit of the workload file."""
    (project / "split_model.py").write_text("def make(model):\n    return model  # v1\n")
    (project / "split_wl.py").write_text(
        "import dataclasses\n\nimport digits_mlp\n\n\nclass SplitTask(digits_mlp.DigitsTask):\n"
        "    def build_model(self, cfg):\n        import split_model\n\n"
        "        return split_model.make(super().build_model(cfg))\n\n\n"
        "WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name='split', task=SplitTask())\n")
    args = ["python", "-m", "raysys", "train", "split_wl:WORKLOAD", "--preset", "quick", "--workers", "0", "--name", "s"]
    assert _run([*args, "--set", "train.max_steps=3"], project).returncode == 0
    code = json.loads((project / "raysys_runs" / "s" / "code.json").read_text())
    assert {"split_wl.py", "split_model.py", "digits_mlp.py"} <= set(code), code
    (project / "split_model.py").write_text("def make(model):\n    return model  # v2\n")
    proc = _run([*args, "--resume", "--set", "train.max_steps=5"], project)
    assert proc.returncode == 0 and "code changed since this run's last session: split_model.py (changed)" in proc.stdout


# slow (~60 s). It once hung in CI: the trial's own failure report met a report of Train's still in Ray's
# second queue, and each waited on the other (fixed: trial.QueueReports, one route for every report)
@pytest.mark.slow
def test_a_sweep_whose_every_trial_has_a_config_error_exits_2(project):
    """A quality metric evaluate() never returns fails every trial alike: the workload's configuration
    error, exit 2 as for one run (not 1, an error of the training)."""
    (project / "failing.py").write_text(FAILING)
    (project / "space.yaml").write_text("workload: failing:MISNAMED\npreset: quick\nfixed:\n  train.epochs: 1\n"
                                        "space:\n  optim.lr: {choice: [0.05, 0.1]}\n")
    proc = _run(["python", "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "2", "--name", "s"], project)
    assert proc.returncode == 2
    assert ("raysys.tune: every trial failed; the first: ConfigError: misnamed: its Task.quality_metric 'acc' is not "
            "among the metrics its evaluate() returned: accuracy") in proc.stderr


SLOW_PREPARE = '''
import dataclasses
import pathlib
import time

import digits_mlp


class SlowTask(digits_mlp.DigitsTask):
    def prepare(self, cfg):  # a long download, say: the sweep has saved nothing yet
        pathlib.Path("preparing").touch()
        time.sleep(600)
        return cfg


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="slowprep", task=SlowTask())
'''


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_run_or_sweep_stopped_while_its_data_is_prepared_stops_at_once(project, command):
    """One Ctrl-C while the data is prepared (a long download, say) stops at once: there is no run yet
    to checkpoint, so nothing to wait for, and no --resume hint (nothing to resume). Exit 130."""
    import signal
    import time

    (project / "slowprep.py").write_text(SLOW_PREPARE)
    (project / "space.yaml").write_text("workload: slowprep:WORKLOAD\npreset: quick\nspace:\n"
                                        "  optim.lr: {choice: [0.05, 0.1]}\n")
    args = (["raysys", "train", "slowprep:WORKLOAD", "--preset", "quick", "--name", "r"] if command == "train" else
            ["raysys.tune", "--space", "space.yaml", "--name", "s"])
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=project, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (project / "preparing").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    print(out[-2000:], err[-2000:])
    assert proc.returncode == 130
    prog = "raysys" if command == "train" else "raysys.tune"
    what = "run" if command == "train" else "sweep"
    assert err.strip().splitlines()[-1] == f"{prog}: stopped before the {what} started; nothing to resume"
    assert not (project / "raysys_runs").exists()


@pytest.mark.parametrize("number", ["numpy", "jax"])
def test_numpy_and_jax_scalars_are_metrics_and_judged_as_floats(workdir, capsys, number):
    """A numpy/JAX loop's own scalars: logged, judged (a NaN loss is divergence: FAILED, exit 1), and
    the final quality is a number."""
    from raysys.cli import main

    args = ["train", f"{TINY}:WORKLOAD", "--set", f"train.number={number}"]
    assert main([*args, "--name", "ok"]) == 0
    final = json.loads((workdir / "raysys_runs" / "ok" / "final_metrics.json").read_text())
    assert isinstance(final["eval/quality"], float) and final["eval/quality"] < 0
    assert main([*args, "--name", "nan", "--set", "train.nan_after=3"]) == 1
    assert "run 'nan' FAILED: diverged" in capsys.readouterr().out
    assert _mlflow_run(workdir / "mlflow.db", "nan").info.status == "FAILED"


def test_a_metric_that_is_not_a_number_is_named(workdir, capsys):
    from raysys.cli import main

    assert main(["train", f"{TINY}:WORKLOAD", "--name", "s", "--set", "train.number=str"]) == 2
    err = capsys.readouterr().err
    assert "raysys: config error: tiny: session.log: metric 'train/loss' is a str" in err and "not a number" in err


def test_a_loop_that_ran_to_its_end_after_a_signal_is_a_complete_run(workdir, capsys):
    """Ctrl-C during a loop that never asks should_stop(): the loop trains to its end, and that run is
    complete (FINISHED, final metrics), not KILLED without them."""
    from raysys.cli import main

    assert main(["train", f"{TINY}:WORKLOAD", "--name", "end", "--set", "train.signal_at=3",
                 "--set", "train.ask_stop=false"]) == 0
    assert "reached its end before it could act on the stop request" in capsys.readouterr().out
    final = json.loads((workdir / "raysys_runs" / "end" / "final_metrics.json").read_text())
    assert final["eval/quality"] < 0
    assert _mlflow_run(workdir / "mlflow.db", "end").info.status == "FINISHED"


def test_a_resume_from_another_folder_tracks_to_the_runs_own_store(tmp_path, monkeypatch, capsys):
    """A run stopped in folder a, resumed from folder b (its runs named with --storage-path): the same MLflow
    run in a's store continues, not a second run in b's (before: a silent new run, tagged preset
    'default'). Where that store is gone (another machine), a new run in b's store, and it says so."""
    from raysys.cli import main

    (a := tmp_path / "a").mkdir(), (b := tmp_path / "b").mkdir()
    for k in ("MLFLOW_TRACKING_URI", "RAYSYS_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(a)
    args = ["train", f"{TINY}:WORKLOAD", "--storage-path", str(a / "raysys_runs")]
    assert main([*args, "--name", "r", "--set", "train.signal_at=3"]) == 130
    assert main([*args, "--name", "s", "--set", "train.signal_at=3"]) == 130
    monkeypatch.chdir(b)
    assert main([*args, "--name", "r", "--resume", "--set", "train.signal_at=0"]) == 0
    assert not (b / "mlflow.db").exists()
    assert _mlflow_run(a / "mlflow.db", "r").info.status == "FINISHED"
    (a / "mlflow.db").rename(a / "gone.db")
    capsys.readouterr()
    assert main([*args, "--name", "s", "--resume", "--set", "train.signal_at=0"]) == 0
    out = capsys.readouterr().out
    assert "is not here (on another machine, moved or deleted): tracking to this command's store instead" in out and "has no MLflow run of 's'" in out
    run = _mlflow_run(b / "mlflow.db", "s")
    assert run.info.status == "FINISHED" and "raysys.preset" not in run.data.tags


def test_a_run_killed_before_its_mlflow_run_existed_resumes_into_a_described_one(workdir, capsys):
    """A kill between the run's config snapshot and its MLflow run (a folder with no MLflow run): the resume
    says so (it said the run had tracked to another store), and the new MLflow run gets the Description."""
    import shutil as sh

    from raysys.cli import main
    from raysys.tracking import NOTE_TAG

    assert main(["train", f"{TINY}:WORKLOAD", "--name", "a", "--set", "train.signal_at=3"]) == 130
    sh.copytree(workdir / "raysys_runs" / "a", workdir / "raysys_runs" / "k")  # as a kill leaves it: no MLflow run
    (workdir / "raysys_runs" / "k" / ".raysys.lock").unlink(missing_ok=True)
    capsys.readouterr()
    assert main(["train", f"{TINY}:WORKLOAD", "--name", "k", "--resume", "--set", "train.signal_at=0"]) == 0
    out = capsys.readouterr().out
    assert "'k' has no MLflow run yet (its first session ended before it made one)" in out
    assert "tracked to another store" not in out
    run = _mlflow_run(workdir / "mlflow.db", "k")
    assert run.info.status == "FINISHED" and "--name k --resume" in run.data.tags[NOTE_TAG]
    # MLflow's Source and User columns, as mlflow.start_run fills them: the raysys command, not Ray's worker script
    assert run.data.tags["mlflow.source.name"].startswith("python -m raysys train") and run.data.tags["mlflow.user"]


@pytest.mark.slow  # 35 s: a Ray Train worker group
def test_a_distributed_loop_that_ran_to_its_end_after_a_signal_is_a_complete_run(workdir, capsys):
    """The same on a Ray Train worker: the driver's Ctrl-C reaches the worker's session, the loop never
    acts on it, and the driver learns from rank 0 that the run reached its end."""
    from raysys.cli import main

    assert main(["train", f"{TINY}:DISTRIBUTED", "--name", "end", "--workers", "1", "--set", "train.signal_at=3",
                 "--set", f"train.signal_pid={os.getpid()}", "--set", "train.ask_stop=false"]) == 0
    assert "reached its end before it could act on the stop request" in capsys.readouterr().out
    final = json.loads((workdir / "raysys_runs" / "end" / "final_metrics.json").read_text())
    assert final["eval/quality"] < 0 and final["world_size"] == 1
    assert _mlflow_run(workdir / "mlflow.db", "end", "tiny_distributed").info.status == "FINISHED"


def test_a_run_stopped_at_its_last_checkpoint_resumes_to_its_logged_metrics(workdir):
    """Stopped by Ctrl-C right at a checkpoint; resumed with that step as its end, it trains nothing
    and returns nothing: its final metrics are those it had logged (the checkpoint keeps them), so it
    ends FINISHED with its quality, not FAILED for want of one."""
    from raysys.cli import main

    args = ["train", f"{TINY}:WORKLOAD", "--name", "cut"]
    assert main([*args, "--set", "train.signal_at=5"]) == 130
    run_dir = workdir / "raysys_runs" / "cut"
    assert not (run_dir / "final_metrics.json").exists()
    assert main([*args, "--resume", "--set", "train.steps=5"]) == 0
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert final["eval/quality"] < 0 and "train/loss" in final
    assert _mlflow_run(workdir / "mlflow.db", "cut").info.status == "FINISHED"


CONFIG_MISTAKES = '''
import dataclasses

import tiny_workload as tiny
from raysys.workload import Workload


@dataclasses.dataclass
class NoLaunch:
    train: tiny.TrainConfig = dataclasses.field(default_factory=tiny.TrainConfig)


class Plain:
    pass


def typo():
    cfg = tiny.TinyConfig()
    cfg.train.stepz = 5  # meant steps: silently ignored before
    return cfg


W = tiny.WORKLOAD
NOLAUNCH = dataclasses.replace(W, name="nolaunch", config_cls=NoLaunch, presets={"default": NoLaunch})
PLAIN = dataclasses.replace(W, name="plain", config_cls=Plain, presets={"default": Plain})
ADICT = dataclasses.replace(W, presets={"default": tiny.TinyConfig, "adict": lambda: {"train": {"steps": 5}}})
TYPO = dataclasses.replace(W, presets={"default": tiny.TinyConfig, "typo": typo})
'''

NO_DEFAULT_PRESET = '''
import tiny_workload as tiny
from raysys.workload import Workload

WORKLOAD = Workload(name="nd", description="no default preset", config_cls=tiny.TinyConfig,
                    presets={"quick": tiny.TinyConfig}, train_fn=tiny.train)
'''


@pytest.mark.parametrize("attr, preset, line", [
    ("NOLAUNCH", "default", "workload nolaunch: its config NoLaunch has no launch section; add launch: LaunchConfig"),
    ("PLAIN", "default", "workload plain: its config_cls 'Plain' is not a dataclass (decorate it with @dataclass)"),
    ("ADICT", "adict", "workload tiny: its preset 'adict' returned a dict, not a TinyConfig"),
    ("TYPO", "typo", "workload tiny: its preset 'typo' sets train.stepz, not a field of TrainConfig (its fields: "),
    ("WORKLOAD", "quick", "workload nd: presets must include 'default' ({here}/no_default_preset.py, line 5)"),
])
def test_mistakes_in_a_workloads_config_are_one_line_and_exit_2(workdir, capsys, attr, preset, line):
    import shutil as sh

    from raysys.cli import main

    sh.copy(TINY, workdir / "tiny_workload.py")
    (workdir / "config_mistakes.py").write_text(CONFIG_MISTAKES)
    (workdir / "no_default_preset.py").write_text(NO_DEFAULT_PRESET)  # refused as it is imported
    module = "no_default_preset" if attr == "WORKLOAD" else "config_mistakes"
    assert main(["train", f"{module}:{attr}", "--preset", preset]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line.format(here=workdir) in err[0], err
    assert not (workdir / "raysys_runs").exists()


def test_a_second_signal_stops_at_once_and_says_how_to_resume(workdir, capsys):
    from raysys.cli import main

    args = ["train", f"{TINY}:WORKLOAD", "--set", "train.signal_at=3", "--set", "train.signal_again_at=4",
            "--set", "train.ask_stop=false"]
    assert main([*args, "--name", "twice", "--set", "train.checkpoint_every=2"]) == 130
    err = capsys.readouterr().err
    assert "raysys: interrupted; the run keeps its last checkpoint, resume it with:" in err
    assert "python -m raysys train" in err and "--name twice --resume" in err
    # stopped before its first checkpoint (every 5 steps): said as it is, and so is the resume's new start
    assert main([*args, "--name", "early"]) == 130
    assert "raysys: interrupted; the run had no checkpoint yet (a resume starts it again from step 0), resume it " \
           "with:" in capsys.readouterr().err
    assert main(["train", f"{TINY}:WORKLOAD", "--name", "early", "--resume", "--set", "train.signal_at=0",
                 "--set", "train.signal_again_at=0"]) == 0
    assert "[raysys] --resume: run 'early' has no checkpoint yet (it stopped before its first); it starts again " \
           "from step 0" in capsys.readouterr().out


LOOP_MISTAKES = '''
import dataclasses

import numpy as np

import tiny_workload as tiny
from raysys.train.config import LaunchConfig


def train(cfg, session):
    session.checkpoint(np.ones(3), 1)  # a state that is not a dict
    return {}


@dataclasses.dataclass
class OneWorker(tiny.TinyConfig):
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)  # workers=1 by default


ARRAY_STATE = dataclasses.replace(tiny.WORKLOAD, name="array_state", train_fn=train, population=None)
ONE_WORKER = dataclasses.replace(tiny.WORKLOAD, name="one_worker", config_cls=OneWorker,
                                 presets={"default": OneWorker}, population=None)
'''


@pytest.mark.parametrize("attr, line", [
    ("ARRAY_STATE", "array_state: session.checkpoint: the state is a ndarray; it must be a dict"),
    ("ONE_WORKER", "one_worker has no multi-worker launcher, and launch.workers is 1 (LaunchConfig's default is 1): "
                   "pass --workers 0"),
])
def test_a_train_fn_loops_mistakes_are_one_line(workdir, capsys, attr, line):
    import shutil as sh

    from raysys.cli import main

    sh.copy(TINY, workdir / "tiny_workload.py")
    (workdir / "loop_mistakes.py").write_text(LOOP_MISTAKES)
    assert main(["train", f"loop_mistakes:{attr}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err


def test_workers_asked_of_an_in_process_loop_are_one_line(workdir, capsys):
    """Its config already says workers=0: the line names the flag given, not the config to change."""
    import shutil as sh

    from raysys.cli import main

    sh.copy(TINY, workdir / "tiny_workload.py")
    assert main(["train", "tiny_workload:WORKLOAD", "--workers", "2"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "trains in this process (it has no multi-worker launcher): launch.workers=2 cannot be" in err
    assert not (workdir / "raysys_runs").exists()


BATCHNORM = '''
import dataclasses

import torch

import digits_mlp


class BNTask(digits_mlp.DigitsTask):
    def build_model(self, cfg):
        model = digits_mlp.MLP(cfg.model)
        model.net.insert(1, torch.nn.BatchNorm1d(cfg.model.hidden))
        return model


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_bn", task=BNTask())
'''


def test_a_batch_of_one_for_batchnorm_is_said_and_drop_last_trains(project):
    """1,347 training digits in batches of 673 end each epoch with a batch of one, which BatchNorm
    cannot train on: said in one line before the first step (it was BatchNorm's ValueError at the
    epoch's end, restarted max_failures times); loader.drop_last leaves that batch out."""
    (project / "digits_bn.py").write_text(BATCHNORM)
    args = ["python", "-m", "raysys", "train", "digits_bn:WORKLOAD", "--preset", "quick", "--workers", "0",
            "--set", "train.batch_size=673", "--set", "train.epochs=2"]
    bad = _run([*args, "--name", "bn1"], project)
    assert bad.returncode == 2 and "set loader.drop_last=true" in bad.stderr
    assert "restarting" not in bad.stdout + bad.stderr
    ok = _run([*args, "--name", "bn2", "--set", "loader.drop_last=true"], project)
    assert ok.returncode == 0
    final = json.loads((project / "raysys_runs" / "bn2" / "final_metrics.json").read_text())
    assert final["step"] == 2 * 2  # two whole batches an epoch, the sample left over dropped


OWN_OPTIMIZER = '''
import dataclasses

import torch

import digits_mlp


class GroupsTask(digits_mlp.DigitsTask):
    def param_groups(self, model, cfg):
        # nanoGPT's split: weight decay on matrices, none on biases
        return [{"params": [p for p in model.parameters() if p.ndim >= 2]},
                {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]

    def scheduler(self, optimizer, cfg, total_steps):
        # no epoch ever improves on the best by a whole 1.0 of accuracy: the LR halves at each evaluation after the first
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0,
                                                          threshold=1.0, threshold_mode="abs")


class WrongModeTask(GroupsTask):
    def scheduler(self, optimizer, cfg, total_steps):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min")


class LeftOutTask(digits_mlp.DigitsTask):
    def param_groups(self, model, cfg):
        return [{"params": [p for p in model.parameters() if p.ndim >= 2]}]


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_own", task=GroupsTask())
WRONG_MODE = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_wrong", task=WrongModeTask())
LEFT_OUT = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_left", task=LeftOutTask())
'''


STREAM = """
import dataclasses
import torch
import digits_mlp

class Stream(torch.utils.data.IterableDataset):
    def __init__(self, ds):
        self.ds = ds
    def __iter__(self):
        return (self.ds[i] for i in range(len(self.ds)))

class StreamTask(digits_mlp.DigitsTask):
    def datasets(self, cfg):
        train, test = super().datasets(cfg)
        return Stream(train), test

WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_stream", task=StreamTask())
"""


def test_a_stream_for_a_dataset_is_one_line_before_anything(project):
    """An IterableDataset has no index to shard, shuffle or resume an epoch by: train and bench say so in one
    line, exit 2, with no run folder or MLflow store made (train made the run, then failed in len())."""
    (project / "stream.py").write_text(STREAM)
    line = ("digits_stream: its Task.datasets gave a Stream as the training set, which cannot be indexed: raysys "
            "shards, shuffles and resumes an epoch by index, so it takes map-style datasets (__len__ and "
            "__getitem__: a list, a torch Dataset); make the stream a list, or index its source")
    train = _run(["python", "-m", "raysys", "train", "stream:WORKLOAD", "--preset", "quick", "--workers", "0"], project)
    assert train.returncode == 2
    assert train.stderr.strip().splitlines() == [f"raysys: error in the workload's code: {line}"]
    bench = _run(["python", "-m", "raysys.bench", "stream:WORKLOAD", "--quick"], project)
    assert bench.returncode == 2
    assert bench.stderr.strip().splitlines()[-1] == f"raysys.bench: error in the workload's code: {line}"
    assert sorted(p.name for p in project.iterdir()) == ["digits_mlp.py", "digits_space.yaml", "stream.py"]


PLAIN_TORCH = """
import dataclasses
from collections import namedtuple
import torch
import torch.nn.functional as F
import digits_mlp

Pair = namedtuple("Pair", "x y")

class PlainTask(digits_mlp.DigitsTask):
    collate = None  # torch's default_collate: (x, y) items become one [x, y] batch

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y), {}  # no counts: the batch's own

    def evaluate(self, model, batches):
        right = total = 0
        for x, y in batches:
            right += int((model(x).argmax(-1) == y).sum())
            total += len(y)
        return {"accuracy": right / total}

class PairTask(PlainTask):
    def collate(self, items):
        return Pair(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))

@dataclasses.dataclass(frozen=True)
class Batch:  # a batch as a (frozen) dataclass: moved to the device field by field, counted by its first tensor
    x: torch.Tensor
    y: torch.Tensor

class BoxTask(PlainTask):
    def collate(self, items):
        return Batch(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))

    def loss(self, model, batch):
        return F.cross_entropy(model(batch.x), batch.y), {}

    def evaluate(self, model, batches):  # a metric as a 0-d tensor is a number too
        right = sum((model(b.x).argmax(-1) == b.y).sum() for b in batches)
        return {"accuracy": right / sum(len(b.y) for b in batches)}

PLAIN = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_plain", task=PlainTask())
PAIRS = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_pairs", task=PairTask())
BOXES = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_boxes", task=BoxTask())
"""


def test_a_task_written_as_plain_torch_trains_with_tuple_batches_and_no_counts(project):
    """What a torch user writes by habit: no collate (torch's default_collate), an (x, y) batch, a namedtuple
    one, a dataclass one, a loss without sample counts and a metric as a tensor. Each trains and learns, its
    throughput counted from the batch."""
    from mlflow.tracking import MlflowClient

    (project / "plain.py").write_text(PLAIN_TORCH)
    for attr in ("PLAIN", "PAIRS", "BOXES"):
        out = _run(["python", "-m", "raysys", "train", f"plain:{attr}", "--preset", "quick", "--workers", "0"], project)
        assert out.returncode == 0, out.stderr[-2000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    for name in ("digits_plain", "digits_pairs", "digits_boxes"):
        (run,) = client.search_runs([client.get_experiment_by_name(f"raysys-{name}").experiment_id])
        assert run.info.status == "FINISHED" and run.data.metrics["eval/accuracy"] > 0.8
        assert run.data.metrics["perf/samples_per_s"] > 0
        assert run.data.metrics["perf/tokens_per_s"] == pytest.approx(run.data.metrics["perf/samples_per_s"])
    bench = _run(["python", "-m", "raysys.bench", "plain:PLAIN", "--quick"], project)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert float(re.search(r"same weights and batch: ([\d.e+-]+)", bench.stdout).group(1)) < 1e-5


def _digits():
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_mlp_example", EXAMPLE / "digits_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_the_loop_would_refuse_of_a_plugin_is_one_line_before_the_run():
    """``code_checks.built`` runs before the run exists: what the workers' loop refuses of the model and data
    (SyncBatchNorm on CPU workers, length bucketing of a dataset without lengths), a loss that breaks its
    contract (a bare tensor, a loss per sample) and, for DDP, parameters its loss leaves without a gradient are
    said then; a model that only meta tensors cannot build (numpy in its build_model) is left to the workers,
    not refused."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from raysys.train.code_checks import built

    digits = _digits()
    base = digits.DigitsTask

    class SyncBN(base):
        def build_model(self, cfg):
            return torch.nn.SyncBatchNorm.convert_sync_batchnorm(
                torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10)))

    class Bare(base):
        def loss(self, model, batch):
            return F.cross_entropy(model(batch["x"]), batch["y"])

    class PerSample(base):
        def loss(self, model, batch):
            return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none"), {}

    class Numpy(base):
        def build_model(self, cfg):
            net = super().build_model(cfg)
            first = net.net[0].weight
            scale = float(np.abs(np.asarray(first.detach())).mean())  # only a real tensor has values
            with torch.no_grad():
                first.div_(scale)
            return net

    cfg = digits.quick()
    assert built(base(), "fine", cfg) is not None and built(Numpy(), "numpy", cfg) is None
    two_cpus = digits.quick()
    two_cpus.launch.workers = 2
    assert built(SyncBN(), "sbn", cfg) is not None  # one worker: plain BatchNorm
    with pytest.raises(ConfigError, match=r"^sbn: its model has SyncBatchNorm, which torch synchronises on GPUs only, "
                                          r"and its 2 workers train on CPUs"):
        built(SyncBN(), "sbn", two_cpus)
    bucketed = digits.quick()
    bucketed.loader.bucket_batches = 4
    with pytest.raises(ConfigError, match=r"^loader.bucket_batches=4 sorts batches by the training set's `lengths` "
                                          r"\(one per sample\), and digits's list has none for its 1347 samples"):
        built(base(), "digits", bucketed)
    with pytest.raises(ConfigError, match=r"^bare: its Task.loss returned a Tensor, not \(a scalar loss tensor"):
        built(Bare(), "bare", cfg)
    with pytest.raises(ConfigError, match=r"^each: its Task.loss returned a loss of shape \[64\], not a scalar"):
        built(PerSample(), "each", cfg)

    class Unused(base):  # a head the loss never reaches: DDP would fail at its second step
        def build_model(self, cfg):
            net = super().build_model(cfg)
            net.aux = torch.nn.Linear(64, 2)
            return net

    assert built(Unused(), "aux", cfg) is not None  # one worker: no DDP
    with pytest.raises(ConfigError, match=r"^aux: its Task.loss gives no gradient to trainable parameters aux.weight, "
                                          r"aux.bias, on which DDP's 2 workers fail at their second step: set "
                                          r"launch.find_unused_parameters=true"):
        built(Unused(), "aux", two_cpus)
    two_cpus.launch.find_unused_parameters = True
    assert built(Unused(), "aux", two_cpus) is not None

    # an epoch ending on one sample (1347 % 2): a BatchNorm1d on features cannot train on it; a BatchNorm2d on
    # images can (one value per channel is what fails), and so can a frozen one its train() keeps in eval
    class BN1d(base):
        def build_model(self, cfg):
            return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10))

    class BN2d(base):
        def build_model(self, cfg):
            return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                                       torch.nn.Flatten(), torch.nn.Linear(144, 10))

    class Frozen(torch.nn.Sequential):
        def train(self, mode=True):
            super().train(mode)
            self[1].eval()  # the "pretrained" backbone's statistics stay as they are
            return self

    class FrozenBN(base):
        def build_model(self, cfg):
            return Frozen(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10))

    odd = digits.quick()
    odd.train.batch_size = 2
    with pytest.raises(ConfigError, match=r"^bn: each epoch would end with a batch of one sample"):
        built(BN1d(), "bn", odd)
    assert built(BN2d(), "bn2", odd) is not None and built(FrozenBN(), "frozen", odd) is not None

    class Lazy(base):  # a loss that builds its criterion on its first call, on the batch's device
        crit = None

        def loss(self, model, batch):
            if self.crit is None:
                self.crit = torch.nn.CrossEntropyLoss(weight=torch.ones(10, device=batch["x"].device))
            return self.crit(model(batch["x"]), batch["y"]), {}

    lazy = Lazy()
    assert built(lazy, "lazy", cfg) is not None
    assert lazy.crit is None  # no meta tensor left for the run this process trains next (--workers 0)


AUX_HEAD = """
import dataclasses
import torch
import digits_mlp

class AuxTask(digits_mlp.DigitsTask):  # an auxiliary head its loss never reaches
    def build_model(self, cfg):
        net = super().build_model(cfg)
        net.aux = torch.nn.Linear(64, 2)
        return net

WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_aux", task=AuxTask())
"""


@pytest.mark.slow  # ~1 min: a Ray Train run of 2 workers
def test_a_model_with_parameters_its_loss_never_reaches_trains_under_ddp_with_the_knob(project):
    """DDP fails at the second step of a model whose loss leaves parameters without gradients: refused in one
    line, exit 2, before the run exists; with launch.find_unused_parameters=true it trains on 2 workers."""
    (project / "aux.py").write_text(AUX_HEAD)
    args = ["python", "-m", "raysys", "train", "aux:WORKLOAD", "--preset", "quick", "--workers", "2"]
    refused = _run(args, project)
    assert refused.returncode == 2 and not (project / "raysys_runs").exists()
    assert refused.stderr.strip().splitlines() == [
        "raysys: config error: digits_aux: its Task.loss gives no gradient to trainable parameters aux.weight, "
        "aux.bias, on which DDP's 2 workers fail at their second step: set launch.find_unused_parameters=true "
        "(a branch the data picks), or freeze them (requires_grad=False)"]
    out = _run([*args, "--set", "launch.find_unused_parameters=true"], project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(re.search(r"done: .* eval/accuracy ([\d.]+)", out.stdout).group(1)) > 0.5  # chance: 0.1


def test_a_metric_evaluate_gives_must_be_one_number():
    """A list or a tensor of several values for a metric is one line naming the key, not float()'s traceback
    in the worker after the first epoch; a number, a numpy scalar and a one-element tensor are numbers."""
    import numpy as np
    import torch

    from raysys.train.loop import _number

    assert [_number(v, "k", "w") for v in (1, 0.5, np.float32(2), torch.tensor(3.0), np.array([4.0]))] == [1, .5, 2, 3, 4]
    with pytest.raises(ConfigError, match=r"^w: its Task.evaluate gave a list for 'acc', not a number"):
        _number([0.5, 0.6], "acc", "w")
    with pytest.raises(ConfigError, match=r"^w: its Task.evaluate gave a Tensor of shape \[3\] for 'acc'"):
        _number(torch.zeros(3), "acc", "w")


def test_a_batch_as_a_dataclass_goes_to_the_device_and_is_counted():
    import dataclasses

    import torch

    from raysys.train.data import batch_len, to_device

    @dataclasses.dataclass(frozen=True)
    class B:
        note: str
        x: torch.Tensor

    b = B("n", torch.zeros(5, 3))
    moved = to_device(b, torch.device("meta"))
    assert moved.x.is_meta and moved.note == "n" and not b.x.is_meta and batch_len(b) == 5
    assert batch_len(object()) == 0


def test_a_batch_of_its_own_type_goes_to_the_device_as_it_is():
    """A mapping of its own type (a tokenizer's BatchEncoding: keys read as attributes) stays that type, the
    original untouched; an object with its own ``.to(device)`` (a graph library's batch) is moved by it; a
    read-only mapping becomes a dict of its moved values."""
    import types
    from collections import UserDict

    import torch

    from raysys.train.data import batch_len, to_device

    class Encoding(UserDict):
        def __getattr__(self, key):
            try:
                return self.data[key]
            except KeyError:
                raise AttributeError(key) from None

    class Graph:
        def __init__(self, x):
            self.x = x

        def to(self, device):
            return Graph(self.x.to(device))

    enc = Encoding(x=torch.zeros(4, 2), ids=["a", "b", "c", "d"])
    moved = to_device(enc, torch.device("meta"))
    assert type(moved) is Encoding and moved.x.is_meta and moved.ids == enc.ids and not enc.x.is_meta
    assert batch_len(moved) == 4
    assert to_device(Graph(torch.zeros(3)), torch.device("meta")).x.is_meta
    frozen = to_device(types.MappingProxyType({"x": torch.zeros(2)}), torch.device("meta"))
    assert type(frozen) is dict and frozen["x"].is_meta


FINE_TUNED = """
import dataclasses
from collections import UserDict

import torch
import torch.nn.functional as F
import digits_mlp


class Encoding(UserDict):  # what a tokenizer gives: keys read as attributes
    def __getattr__(self, key):
        try:
            return self.data[key]
        except KeyError:
            raise AttributeError(key) from None


class Tuned(digits_mlp.DigitsTask):
    def collate(self, items):
        return Encoding(x=torch.stack([x for x, _ in items]), y=torch.stack([y for _, y in items]))

    def build_model(self, cfg):  # a lazy first layer: its shape comes from the first batch
        return torch.nn.Sequential(torch.nn.LazyLinear(128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                   torch.nn.Linear(128, 10))

    def param_groups(self, model, cfg):  # fine-tuning: the "pretrained" middle layer frozen here
        model[2].requires_grad_(False)
        return [{"params": model[0].parameters()}, {"params": model[4].parameters(), "weight_decay": 0.0}]

    def loss(self, model, batch):
        return F.cross_entropy(model(batch.x), batch.y), {}

    def evaluate(self, model, batches):
        return super().evaluate(model, [dict(b) for b in batches])


class Experts(torch.nn.Module):  # top-1 routing that skips an expert no sample chose, as MoE code does
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(64, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(64, 10) for _ in range(16))

    def forward(self, x):
        route = self.router(x).argmax(-1)
        out = torch.zeros(len(x), 10)
        for e, expert in enumerate(self.experts):
            if (route == e).any():
                out[route == e] = expert(x[route == e])
        return out + self.router(x)[:, :10]


class Routed(digits_mlp.DigitsTask):
    def build_model(self, cfg):
        return Experts()


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="tuned", task=Tuned())
ROUTED = dataclasses.replace(digits_mlp.WORKLOAD, name="routed", task=Routed())
"""


def test_a_fine_tuned_lazy_model_of_its_own_batches_trains_in_process(project):
    """A batch of the task's own type (attribute access) reaches its loss as that type, a lazy layer gets its
    shape before the optimizer holds it, and a layer the param_groups hook freezes stays as it was built."""
    (project / "tuned.py").write_text(FINE_TUNED)
    out = _run(["python", "-m", "raysys", "train", "tuned:WORKLOAD", "--preset", "quick", "--workers", "0",
                "--name", "t"], project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(re.search(r"done: .* eval/accuracy ([\d.]+)", out.stdout).group(1)) > 0.5  # chance: 0.1
    bench = _run(["python", "-m", "raysys.bench", "tuned:WORKLOAD", "--quick"], project)  # its models shaped too
    assert bench.returncode == 0 and "naive" in bench.stdout and "optimized" in bench.stdout, bench.stderr[-3000:]


@pytest.mark.slow  # ~1.5 min: two Ray Train runs of 2 workers
def test_what_ddp_needs_of_a_model_is_done_or_said_on_two_workers(project):
    """DDP wraps what the loop built: the optimizer hooks run first (a layer they freeze is not one DDP waits
    for) and lazy layers get their shapes first, so the fine-tuned model trains on 2 workers; a model whose
    data leaves an expert without gradient fails at once, in raysys's words, with the setting that fixes it."""
    (project / "tuned.py").write_text(FINE_TUNED)
    args = ["python", "-m", "raysys", "train", "--preset", "quick", "--workers", "2"]
    out = _run([*args[:4], "tuned:WORKLOAD", *args[4:]], project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(re.search(r"done: .* eval/accuracy ([\d.]+)", out.stdout).group(1)) > 0.5
    routed = _run([*args[:4], "tuned:ROUTED", *args[4:]], project)
    assert routed.returncode == 2 and "restarting" not in routed.stdout + routed.stderr
    assert routed.stderr.strip().splitlines()[-1] == (
        "raysys: config error: routed: at step 1 some trainable parameters had no gradient from the step before (a "
        "branch the data picks, a layer its loss skipped), which DDP's 2 workers cannot reduce: set "
        "launch.find_unused_parameters=true, or freeze them (requires_grad=False)")
    fixed = _run([*args[:4], "tuned:ROUTED", *args[4:], "--set", "launch.find_unused_parameters=true"], project)
    assert fixed.returncode == 0, fixed.stderr[-3000:]


OWN_BENCH = """
import dataclasses
import digits_mlp


def bench(quick, overrides=None):
    raise SystemExit(f"the bench ran with {overrides!r}")


WORKLOAD = dataclasses.replace(digits_mlp.WORKLOAD, name="digits_own_bench", bench=bench)
"""


@pytest.mark.parametrize("given, said", [("model.nosuch=3", "model.nosuch"), ("model.hidden=0", "model.hidden")])
def test_a_bench_of_its_own_is_not_started_with_a_set_no_config_takes(project, given, said):
    """A workload's own bench(quick, overrides) may never apply an override: an unknown key or a value its
    config refuses is one line, exit 2, before the banner (the key was printed as "measured with" instead)."""
    (project / "own_bench.py").write_text(OWN_BENCH)
    out = _run(["python", "-m", "raysys.bench", "own_bench:WORKLOAD", "--quick", "--set", given], project)
    assert out.returncode == 2 and "the bench ran" not in out.stderr and "measuring" not in out.stdout
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("raysys.bench: config error: ") and said in line


def test_a_bench_of_its_own_gets_set_values_typed_as_its_config(project):
    """Audit BD F5: --set values reached a workload's own bench as the strings typed ('128'), --config's as
    YAML's types: one dict mixed both, and a number used as a shape failed inside the user's jit."""
    (project / "own_bench.py").write_text(OWN_BENCH)
    out = _run(["python", "-m", "raysys.bench", "own_bench:WORKLOAD", "--quick", "--set", "model.hidden=8",
                "--set", "model.dropout=0.0", "--set", "optim.nesterov=false"], project)
    assert "the bench ran with {'model.hidden': 8, 'model.dropout': 0.0, 'optim.nesterov': False}" in out.stderr


def test_a_training_set_drop_last_leaves_without_a_batch_is_one_line_before_anything(project):
    """Fewer samples per worker than one batch, with loader.drop_last: the loop said so after the run and its
    MLflow run existed (a FAILED run and a traceback file for a mistake in the command)."""
    out = _run(["python", "-m", "raysys", "train", "digits_mlp:WORKLOAD", "--preset", "quick", "--workers", "0",
                "--set", "loader.drop_last=true", "--set", "train.batch_size=2000"], project)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "raysys: data error: loader.drop_last leaves no batch: 1347 training samples per worker, fewer than "
        "train.batch_size=2000 (digits_mlp; nothing was created)"]
    assert sorted(p.name for p in project.iterdir()) == ["digits_mlp.py", "digits_space.yaml"]


def test_a_sweep_searching_an_optim_knob_its_task_never_reads_says_so(project, monkeypatch, capsys):
    """A sweep whose space searches optim.schedule for a task with its own scheduler: one note before the
    trials start (the meta-device model the note needs is the launcher's own driver-side build)."""
    from raysys import workload as registry
    from raysys.tune import runner

    (project / "digits_own.py").write_text(OWN_OPTIMIZER)
    monkeypatch.chdir(project)
    wl = registry.get("digits_own:WORKLOAD")
    runner._say_unread_knobs(wl, wl.config("quick"), {"optim.schedule": ["cosine", "constant"], "optim.lr": [0.1]})
    assert capsys.readouterr().out.strip() == (
        "[raysys.tune] note: the space searches optim.schedule, which digits_own's Task.scheduler never reads: "
        "trials that differ only there train alike")


@pytest.mark.slow  # ~25 s; a task's param_groups hook runs by default in test_a_fine_tuned_lazy_model_of_its_own_batches_trains_in_process
def test_a_tasks_own_param_groups_and_plateau_schedule_train_and_resume(project):
    """Task.param_groups (no weight decay on biases) under the config's optimizer, and a ReduceLROnPlateau
    stepped with the quality metric after each evaluation: its state (the best so far) comes back with a
    resume, so the third epoch's evaluation halves the LR again rather than counting as a first best. A plateau
    whose mode is the quality's opposite, and groups that leave a parameter out, are one line, exit 2."""
    from mlflow.tracking import MlflowClient

    (project / "digits_own.py").write_text(OWN_OPTIMIZER)
    args = ["python", "-m", "raysys", "train", "digits_own:WORKLOAD", "--preset", "quick", "--workers", "0",
            "--name", "own", "--set", "optim.lr=0.08", "--set", "optim.weight_decay=0.01",
            "--set", "optim.schedule=cosine"]  # replaced by Task.scheduler: said to change nothing
    first = _run([*args, "--set", "train.epochs=2"], project)
    assert first.returncode == 0
    assert ("[raysys] note: optim.schedule='cosine' changes nothing: digits_own's Task.scheduler never reads it "
            "(the run's MLflow params still show the value)") in first.stdout
    assert _run([*args, "--set", "train.epochs=4", "--resume"], project).returncode == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-digits_own").experiment_id])
    per_epoch = {int(m.value) for m in client.get_metric_history(run.info.run_id, "train/epoch")}
    lrs = sorted({(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/lr")})
    assert per_epoch >= {1, 2, 3, 4} and lrs[0][1] == 0.08
    # the LR of epoch 4: halved after the evaluations of epochs 2 and 3, not after epoch 1's (its first best)
    assert lrs[-1][1] == pytest.approx(0.02)
    assert run.data.metrics["eval/accuracy"] > 0.8

    bad = _run(["python", "-m", "raysys", "train", "digits_own:WRONG_MODE", "--preset", "quick", "--workers", "0",
                "--name", "wrong"], project)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "raysys: config error: digits_wrong: its ReduceLROnPlateau has mode='min', but it is stepped with "
        "eval/accuracy, which is maximised: use mode='max'")
    assert not (project / "raysys_runs" / "wrong").exists()  # found before the run existed
    bad = _run(["python", "-m", "raysys", "train", "digits_own:LEFT_OUT", "--preset", "quick", "--workers", "0"], project)
    assert bad.returncode == 2
    assert "Task.param_groups leaves out trainable parameters net.0.bias, net.3.bias, net.6.bias: they would " in bad.stderr


def test_param_groups_keep_their_own_options_under_the_configs_optimizer():
    import torch

    from raysys.config import ConfigError
    from raysys.train.config import OptimConfig
    from raysys.train.optim import task_optimizer

    class Task:
        def param_groups(self, model, cfg):
            return [{"params": [model.weight]}, {"params": (model.bias,), "weight_decay": 0.0, "lr": 1e-4}]

    class Cfg:
        optim = OptimConfig(name="adamw", lr=3e-3, weight_decay=0.1)

    opt = task_optimizer(Task(), Cfg(), torch.nn.Linear(3, 2), "t")
    assert isinstance(opt, torch.optim.AdamW)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(3e-3, 0.1), (1e-4, 0.0)]

    class Twice(Task):
        def param_groups(self, model, cfg):
            return [{"params": list(model.parameters())}, {"params": [model.bias]}]

    with pytest.raises(ConfigError, match="more than one group"):
        task_optimizer(Twice(), Cfg(), torch.nn.Linear(3, 2), "t")

    class Own:
        def optimizer(self, model, cfg):
            return torch.optim.RMSprop(model.parameters(), lr=0.01)

    assert isinstance(task_optimizer(Own(), Cfg(), torch.nn.Linear(3, 2), "t"), torch.optim.RMSprop)


def test_hook_mistakes_are_one_line_and_torchs_other_group_forms_are_taken():
    import torch

    from raysys.config import ConfigError
    from raysys.train.config import OptimConfig
    from raysys.train.optim import task_optimizer, task_scheduler

    class Cfg:
        optim = OptimConfig(name="sgd", lr=0.1)

    def groups(fn):
        return type("Task", (), {"param_groups": lambda self, model, cfg: fn(model)})()

    net = torch.nn.Linear(3, 2)
    # what torch itself takes: the parameters, or a group whose 'params' is one tensor
    assert len(task_optimizer(groups(lambda m: m.parameters()), Cfg(), net, "t").param_groups) == 1
    opt = task_optimizer(groups(lambda m: [{"params": m.weight}, {"params": m.bias, "lr": 0.01}]), Cfg(), net, "t")
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    with pytest.raises(ConfigError, match="returned nothing \\(a missing return\\?\\)"):
        task_optimizer(groups(lambda m: None), Cfg(), net, "t")
    both = type("Task", (), {"param_groups": lambda s, m, c: [], "optimizer": lambda s, m, c: None})()
    with pytest.raises(ConfigError, match="both Task.optimizer and Task.param_groups"):
        task_optimizer(both, Cfg(), net, "t")
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    stray = type("Task", (), {"scheduler": lambda s, o, c, n: torch.optim.lr_scheduler.StepLR(other, 1)})()
    with pytest.raises(ConfigError, match="another optimizer"):
        task_scheduler(stray, Cfg(), torch.optim.SGD(net.parameters(), lr=0.1), 10, "t", "eval/q", "max")


def test_optim_values_a_tasks_own_hooks_never_read_are_named():
    """--set optim.lr (or a sweep's knob) changes nothing when Task.optimizer builds its own without reading it:
    the fields the hooks replace and never read are found by building them once with cfg.optim watched."""
    import dataclasses

    import torch

    from raysys.train.config import OptimConfig
    from raysys.train.optim import unread_optim

    @dataclasses.dataclass
    class Cfg:
        optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)

    class Fixed:
        def optimizer(self, model, cfg):
            return torch.optim.SGD(model.parameters(), lr=0.1)

    class ReadsLr:
        def optimizer(self, model, cfg):
            return torch.optim.RMSprop(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)

        def scheduler(self, opt, cfg, total_steps):
            return torch.optim.lr_scheduler.LinearLR(opt, total_iters=cfg.optim.warmup_steps or 1)

    class AllOfIt:
        def optimizer(self, model, cfg):
            return torch.optim.SGD(model.parameters(), **{k: v for k, v in vars(cfg.optim).items() if k == "lr"})

    class Fails:
        def optimizer(self, model, cfg):
            raise RuntimeError("needs a real device")

    net = torch.nn.Linear(3, 2)
    assert unread_optim(Fixed(), Cfg(), net, "t") == ["name", "lr", "weight_decay", "betas", "momentum", "nesterov"]
    assert unread_optim(ReadsLr(), Cfg(), net, "t") == ["name", "betas", "momentum", "nesterov", "schedule",
                                                          "min_lr_ratio", "restart_period", "restart_mult"]
    assert unread_optim(AllOfIt(), Cfg(), net, "t") == []  # vars(): every field counts as read
    assert unread_optim(Fails(), Cfg(), net, "t") == []  # no verdict
    assert unread_optim(object(), Cfg(), net, "t") == []  # no hooks: the config's optimizer reads them all
    groups = type("G", (), {"param_groups": lambda s, m, c: m.parameters()})()
    assert unread_optim(groups, Cfg(), net, "t") == []  # param_groups keep the config's optimizer


@pytest.mark.parametrize("peak", ["given", "read_from_the_group"])
def test_a_schedule_fixed_to_the_runs_length_is_rebuilt_when_a_resume_changes_it(peak):
    """OneCycleLR restored with its old total_steps fails past it (torch's ValueError), and a cosine climbs
    back to its peak: rebuilt for the new length and taken to the run's step, the LR is the new schedule's.
    A schedule that reads its peak from the optimizer's groups reads the LR they were built with, not the
    checkpoint's (OneCycleLR's start, 25 times lower)."""
    import torch

    from raysys.train.optim import fast_forward, group_settings

    class Task:
        def scheduler(self, opt, cfg, total_steps):
            top = 0.1 if peak == "given" else [g["lr"] for g in opt.param_groups]
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=top, total_steps=total_steps)

    def new_opt():
        torch.manual_seed(0)
        return torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)

    first = new_opt()
    sched = Task().scheduler(first, None, 44)
    for _ in range(20):
        first.step(), sched.step()
    resumed = new_opt()
    as_built = group_settings(resumed)
    Task().scheduler(resumed, None, 88)  # the loop builds it before the checkpoint is loaded
    resumed.load_state_dict(first.state_dict())
    sched = fast_forward(Task(), None, resumed, 88, 20, as_built)
    alone = new_opt()
    ref = Task().scheduler(alone, None, 88)
    for _ in range(20):
        alone.step(), ref.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(alone.param_groups[0]["lr"])
    assert resumed.param_groups[0]["max_lr"] == pytest.approx(0.1)
    for _ in range(88 - 20 - 1):  # to the new end, where the restored state failed at its step 45
        resumed.step(), sched.step()
