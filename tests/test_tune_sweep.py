"""End-to-end sweeps of deep_gpcm through `python -m raysys.tune` (Ray Tune + Optuna + MLflow).

Each sweep runs in a subprocess (its own Ray instance), on the `quick` preset's data with 2 epochs
and compile pinned off, so that a trial takes seconds on 2 cores; see docs/tune.md for the
full-size command and its timing.
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import assert_like_a_lone_trial, interrupt_sweep

REPO = Path(__file__).resolve().parents[1]
SPACE = REPO / "tune_spaces" / "deep_gpcm.yaml"
# The quick preset's data (96 training sequences of 20..59 steps), 2 epochs, compile off.
TINY = ["--preset", "quick", "--set", "data.n_students=120", "--set", "data.data_dir=raysys_data/synthetic_OC_quick",
        "--set", "train.epochs=2", "--set", "train.compile=false", "--set", "train.log_every_steps=2"]


def _sweep(workdir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "raysys.tune", *args]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-6000:], proc.stderr[-4000:], sep="\n")  # shown by pytest on failure
    return proc


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(uri: str, workload: str = "deep_gpcm"):
    client = _client(uri)
    exp = client.get_experiment_by_name(f"raysys-{workload}")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    (parent,) = [r for r in runs if r.data.tags.get("raysys.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return client, runs, parent, children


def test_sweep_prints_front_and_tracks_parent_with_six_children(workdir, mlflow_server):
    proc = _sweep(workdir, "--space", str(SPACE), "--num-samples", "6", "--max-concurrent", "2", *TINY,
                  "--tracking-uri", mlflow_server, "--name", "six")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # a calm console: raysys's own lines, not Tune's experiment table or Optuna's study notices
    for chatter in ("Configuration for experiment", "View detailed results here", "tensorboard", "A new study created",
                    "View run", "View experiment"):
        assert chatter not in out + proc.stderr, chatter
    assert "Pareto front" in out and "| # | trial | front | recommended | status | perf/tokens_per_s | eval/qwk |" in out
    assert "Recommended: trial" in out
    assert f"Train it (from any folder):\n\n    cd {workdir} && python -m raysys train deep_gpcm --preset quick " in out
    assert "ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m raysys train deep_gpcm" in out

    client, runs, parent, children = _runs(mlflow_server)
    assert len(runs) == 7 and len(children) == 6
    assert parent.info.status == "FINISHED"
    knobs = [k for k in yaml.safe_load(SPACE.read_text())["space"] if k != "train.compile"]  # pinned by TINY
    for child in children:
        assert child.info.status in ("FINISHED", "KILLED")
        assert child.data.tags["raysys.trial_status"] in ("ok", "unstable")
        for k in knobs:
            assert k in child.data.params, k
        for m in ("objective/throughput", "objective/quality", "perf/tokens_per_s", "eval/qwk"):
            assert m in child.data.metrics, (m, child.info.run_name)
        history = client.get_metric_history(child.info.run_id, "objective/throughput")
        assert len(history) >= 2  # one per report, not just the final value
    # the grid knob: both paths were tried
    assert {c.data.params["model.path"] for c in children} == {"naive", "optimized"}
    for m in ("sweep/trials", "sweep/front_size", "sweep/recommended_throughput", "sweep/recommended_quality"):
        assert m in parent.data.metrics, m
    # the parent never ranks among its trials by an objective, and says what it recommends
    assert not any(m.startswith("objective/") for m in parent.data.metrics)
    rec_id = parent.data.tags["raysys.recommended_trial"]
    assert f"Recommended: trial {rec_id}" in parent.data.tags["mlflow.note.content"]
    assert parent.data.tags["raysys.command"].startswith("python -m raysys.tune --space ")
    # trials: told apart by name (id first), marked, described, reproducible
    names = [c.info.run_name for c in children]
    assert len(set(names)) == 6 and all(n.split(" ")[0] == c.data.tags["raysys.trial_id"] for n, c in zip(names, children))
    assert [c.data.tags["raysys.recommended"] for c in children].count("true") == 1
    (rec,) = [c for c in children if c.data.tags["raysys.recommended"] == "true"]
    assert rec.data.tags["raysys.trial_id"] == rec_id and rec.data.tags["raysys.on_front"] == "true"
    assert sum(c.data.tags["raysys.on_front"] == "true" for c in children) == parent.data.metrics["sweep/front_size"]
    for c in children:
        assert c.data.tags["raysys.preset"] == "quick"
        assert c.data.tags["raysys.command"].startswith("python -m raysys train deep_gpcm --preset quick ")
        assert "of sweep six" in c.data.tags["mlflow.note.content"]
        assert not {"step", "world_size", "steps_this_session"} & set(c.data.metrics)
        assert not any(m.startswith("breakdown/") for m in c.data.metrics) and "perf/step_ms" in c.data.metrics
        steps = [m.step for m in client.get_metric_history(c.info.run_id, "objective/quality")]
        assert len(steps) == len(set(steps))  # one value per step: no jump at the last one
        (ds,) = c.inputs.dataset_inputs
        assert ds.dataset.name == "synthetic_OC_quick"
    assert parent.data.metrics["sweep/trials"] == 6
    assert "space.optim.lr" in parent.data.params
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"pareto.png", "pareto.md", "recommendation.md", "trials.csv"} <= artifacts
    png = client.download_artifacts(parent.info.run_id, "pareto.png", str(workdir))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # audit AS D6: summarised again (a resume with a wide tolerance: the fastest eligible trial), the parent kept
    # its first summary's figures (a step already logged keeps its value); each summary is a step of its own now
    again = _sweep(workdir, "--space", str(SPACE), "--num-samples", "6", "--max-concurrent", "2", *TINY,
                   "--tracking-uri", mlflow_server, "--name", "six", "--resume", "--tolerance", "10")
    assert again.returncode == 0, again.stderr[-3000:]
    parent = client.get_run(parent.info.run_id)
    assert parent.data.metrics["sweep/recommended_throughput"] == parent.data.metrics["sweep/best_throughput"]
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "sweep/recommended_quality")] == [0, 1]


@pytest.mark.slow  # ~15 s
def test_a_sweep_that_ended_at_its_budget_resumes_to_its_report_not_to_an_interruption(workdir):
    """Audit AS D10: Tune's restored time budget was spent, so a --resume of a sweep that ended at its --budget
    ran nothing, called itself interrupted (exit 130), turned its FINISHED parent run KILLED and printed a resume
    line that did the same for ever. The resume now says that nothing is left to run and reports the sweep
    again; a budget that no trial finished in is exit 1, both times."""
    args = ["--space", str(SPACE), "--num-samples", "4", "--max-concurrent", "1", *TINY, "--name", "short"]
    first = _sweep(workdir, *args, "--budget", "0.01")  # 0.6 s: no trial ends, and a script sees it (audit AS D14)
    assert first.returncode == 1 and "(time budget reached)" in first.stdout, first.stderr[-3000:]
    assert "raysys.tune: no trial finished within the --budget (1 stopped by it)" in first.stderr
    again = _sweep(workdir, *args, "--resume")
    assert again.returncode == 1 and "no trial finished within the --budget" in again.stderr, again.stderr[-3000:]
    assert "nothing left to run: this sweep ended at an earlier session's --budget" in again.stdout
    assert "interrupted" not in again.stdout and "not started" in again.stdout
    _, _, parent, _ = _runs(f"sqlite:///{workdir / 'mlflow.db'}")
    assert parent.info.status == "FINISHED"


# workers=0 (~45 s) is slow-only; by default workers=1 checks the same verdict, stop and next trial
@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_diverging_trial_is_marked_unstable_and_the_sweep_completes(workdir, workers):
    """The unstable trial first, one trial at a time: its run stops cleanly (a checkpoint) and its
    process takes the stable trial next (reuse_actors). With workers=0 (a child process) Tune's 2 s
    wait for that failed the next trial; with workers=1 (Ray Train in the trial) the unread reports
    blocked Train's controller and the sweep hung."""
    space = workdir / "diverge.yaml"
    space.write_text(yaml.safe_dump({
        "workload": "deep_gpcm", "preset": "quick",
        "fixed": {"train.epochs": 2, "train.log_every_steps": 1, "launch.workers": workers, "model.path": "optimized"},
        "space": {"optim.lr": {"grid": [1.0e6, 1.0e-3]}},  # 1e6: an absurd learning rate, tried first
        "stability": {"bounds": {"train/loss": {"max": 20.0}}}}))
    proc = _sweep(workdir, "--space", str(space), "--num-samples", "2", "--max-concurrent", "1", "--name", "div")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNSTABLE" in proc.stdout and "1 ok, 1 unstable" in proc.stdout, proc.stdout[-3000:]
    assert "re-use actor" not in proc.stdout + proc.stderr
    events = _events(workdir / "raysys_runs" / "sweeps" / "div")
    # workers=0: the unstable trial's child is stopped as its function is ended, so it logs no "end"
    assert [e[0] for e in events] == (["start", "end", "start", "end"] if workers else ["start", "start", "end"])
    assert "Recommended: trial" in proc.stdout  # the stable one

    _, _, parent, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}")
    by_lr = {float(c.data.params["optim.lr"]): c for c in children}
    bad, good = by_lr[1e6], by_lr[1e-3]
    assert bad.data.tags["raysys.trial_status"] == "unstable" and bad.data.tags["raysys.unstable"] == "true"
    assert "train/loss" in bad.data.tags["raysys.trial_reason"] or "non-finite" in bad.data.tags["raysys.trial_reason"]
    assert bad.data.metrics["objective/quality"] == -1.0 and bad.data.metrics["objective/throughput"] == 0.0
    assert bad.info.status in ("KILLED", "FINISHED")
    if workers:  # stopped through its StopFlag at a step boundary, as Ctrl-C would: with a checkpoint
        bad_run = workdir / "raysys_runs" / "sweeps" / "div" / "runs" / f"div-{bad.data.tags['raysys.trial_id']}"
        assert list((bad_run / "checkpoints").glob("step_*"))
    assert good.data.tags["raysys.trial_status"] == "ok" and parent.info.status == "FINISHED"
    csv = (workdir / "raysys_runs" / "sweeps" / "div" / "report" / "trials.csv").read_text()
    assert ",unstable," in csv


@pytest.mark.slow  # ~30 s
@pytest.mark.timeout(600)
def test_a_vectorized_program_whose_members_all_turn_unstable_ends_the_sweep_with_their_verdicts(workdir):
    """Every member of one program found unstable one after another (a policy entropy floor): the trial's
    stop keeps each member's verdict, and the sweep ends whole (exit 0, a report), not 'interrupted'
    with members 'stopped before the end' that no --resume could ever finish."""
    space = workdir / "floor.yaml"
    space.write_text(yaml.safe_dump({
        "workload": "hackmatrix_ppo", "preset": "quick", "fixed": {"launch.workers": 0, "train.compilation_cache_dir": ""},
        "space": {"optim.lr": {"loguniform": [1.0e-3, 2.0e-3]}, "train.seed": {"randint": [0, 99]}},
        "stability": {"bounds": {"charts/entropy": {"min": 0.6}}}}))
    proc = _sweep(workdir, "--space", str(space), "--num-samples", "3", "--vectorize", "3", "--name", "floor")
    assert proc.returncode == 0 and "interrupted" not in proc.stdout
    assert "3 trials — 3 unstable" in proc.stdout and "UNSTABLE: None" not in proc.stdout
    with open(workdir / "raysys_runs" / "sweeps" / "floor" / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["unstable"] * 3 and all("charts/entropy" in r["reason"] for r in rows)


def _events(sweep_dir: Path) -> list[list[str]]:
    path = sweep_dir / "trial_events.log"
    return [line.split()[1:] for line in path.read_text().splitlines()] if path.exists() else []


def _checkpointed_sweep(workdir: Path, args: list, **popen: object) -> subprocess.Popen:
    """``python -m raysys.tune *args`` started, once a trial of it has saved a checkpoint (killed if none comes)."""
    import time

    driver = subprocess.Popen([sys.executable, "-m", "raysys.tune", *args], cwd=workdir, **popen)
    deadline = time.time() + 400
    try:
        while not list(workdir.glob("raysys_runs/sweeps/*/runs/*/checkpoints/step_*/meta.json")):
            assert driver.poll() is None and time.time() < deadline
            time.sleep(0.3)
    except BaseException:
        driver.kill()
        raise
    return driver


@pytest.mark.slow  # ~1.5 min; by default test_faults checks a killed train run's watcher and one's children
def test_a_killed_sweep_driver_leaves_its_runs_killed_and_resumes_whole(workdir):
    """SIGKILL of the sweep's driver (or the OOM killer): nothing in it can close its MLflow runs. Its
    watcher closes the parent and the trial that was training KILLED, saying how to resume; the resume
    finishes both trials and the sweep, FINISHED, the killed session's error tag gone."""
    import time

    args = ["--space", str(SPACE), "--num-samples", "2", "--max-concurrent", "1", *TINY, "--set", "train.epochs=30",
            "--set", "train.checkpoint_every_steps=3", "--name", "kil"]
    driver = _checkpointed_sweep(workdir, args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver.kill()
    driver.wait()
    deadline = time.time() + 400
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    while (parent := _runs(uri)[2]).info.status == "RUNNING":
        assert time.time() < deadline, "the killed sweep's parent stayed RUNNING"
        time.sleep(0.5)
    _, _, parent, children = _runs(uri)
    assert parent.info.status == "KILLED" and "--name kil" in parent.data.tags["raysys.error"]
    assert [c.info.status for c in children] == ["KILLED"]
    resumed = _sweep(workdir, *args, "--resume")
    assert resumed.returncode == 0 and "Recommended: trial" in resumed.stdout
    _, _, parent, children = _runs(uri)
    assert parent.info.status == "FINISHED" and "raysys.error" not in parent.data.tags
    assert sorted(c.info.status for c in children) == ["FINISHED", "FINISHED"]


@pytest.mark.slow  # ~1 min
def test_a_sweep_stopped_at_once_closes_its_training_trials_run_and_prints_its_resume(workdir):
    """A second stop signal (stop at once): the trial that was training dies with the driver, before it could close
    its MLflow run; the driver closes it KILLED as it does the parent, and prints the exact resume line
    (the sweep's name was generated)."""
    import signal
    import time

    args = ["--space", str(SPACE), "--num-samples", "2", "--max-concurrent", "1", *TINY, "--set", "train.epochs=30",
            "--set", "train.checkpoint_every_steps=3"]
    driver = _checkpointed_sweep(workdir, args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        driver.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        driver.send_signal(signal.SIGINT)  # another signal (the same one within 1 s is taken as its echo)
        _, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 130 and "stopped at once" in err, err[-3000:]
    (name,) = [p.name for p in (workdir / "raysys_runs" / "sweeps").iterdir()]
    assert f"python -m raysys.tune --space {SPACE} --name {name} " in err and " --resume" in err
    _, _, parent, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}")
    assert parent.info.status == "KILLED" and [c.info.status for c in children] == ["KILLED"]
    resumed = _sweep(workdir, *args, "--name", name, "--resume")
    assert resumed.returncode == 0 and "Recommended: trial" in resumed.stdout
    _, _, parent, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}")
    assert parent.info.status == "FINISHED" and all(c.info.status == "FINISHED" for c in children), children


def test_a_trial_ray_lost_is_no_error_of_its_code():
    """What Tune records when a trial's process or node died (restarts spent) runs again on --resume;
    an error of the code, or Ray's out-of-memory kill, does not."""
    import ray.exceptions as rex
    from ray.tune.error import TuneError

    from raysys.tune.trial import lost_to_ray

    lost = [rex.ActorDiedError(), rex.WorkerCrashedError(), rex.NodeDiedError("node 10.0.0.7 died"),
            rex.LocalRayletDiedError()]
    assert all(lost_to_ray(e) for e in lost)
    wrapped = TuneError("trial failed")
    wrapped.__cause__ = rex.ActorDiedError()
    assert lost_to_ray(wrapped)
    assert not any(lost_to_ray(e) for e in (ValueError("bad"), rex.OutOfMemoryError("killed"), TuneError("x")))


@pytest.mark.slow  # ~1.5 min
def test_a_trial_whose_process_died_runs_again_on_resume(workdir):
    """A trial whose Ray process was killed (the OOM killer, a lost node) once its restarts are spent is
    failed in Tune's state, and Tune's restore does not run a failed trial: the resume said there was
    nothing left. It is no error of its code: the resume continues it from its checkpoint."""
    import os
    import signal

    args = ["--space", str(SPACE), "--num-samples", "1", *TINY, "--set", "train.epochs=30",
            "--set", "train.checkpoint_every_steps=3", "--max-failures", "0", "--name", "died"]
    sweep_dir = workdir / "raysys_runs" / "sweeps" / "died"
    driver = _checkpointed_sweep(workdir, args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import psutil

        trials = [p for p in psutil.Process(driver.pid).children(recursive=True)  # its Ray's, not another's
                  if "ray::ResourceTrainable" in " ".join(p.cmdline())]
        assert trials, "no trial process"
        for p in trials:
            os.kill(p.pid, signal.SIGKILL)
        out, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    print(out[-3000:])
    assert "a --resume of the sweep runs them again from their checkpoints" in out
    resumed = _sweep(workdir, *args, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "1 lost with its Ray process or node: they run again from their checkpoints" in resumed.stdout
    (row,) = csv.DictReader(open(sweep_dir / "report" / "trials.csv"))
    assert row["status"] == "ok"
    (run_dir,) = [p for p in (sweep_dir / "runs").iterdir() if p.is_dir()]
    assert "resumed step=" in (run_dir / "events.log").read_text()  # from its checkpoint, not from scratch


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGUSR2", "SIGTERM"])
def test_every_stop_signal_takes_tunes_clean_stop_and_names_itself(sig):
    """What fit does first (Tune's own ``_setup_signal_catching`` installs its SIGUSR1 stop), then the
    signal: Tune's clean stop is set, the sweep knows which signal came (it exits 128 + it), and the
    handlers it found are back afterwards. Before, a SIGUSR1 (Slurm's ``--signal=USR1@90`` warning)
    took Tune's stop directly, without telling the trials to stop at a step boundary, and the sweep
    exited 130 as if Ctrl-C; a SIGUSR2 (Grid Engine's ``-notify``) killed it."""
    import os
    import signal
    import time

    import ray.tune.tune as tune_run

    from raysys.lifecycle import STOP_SIGNALS
    from raysys.tune.runner import _signals_stop_like_ctrl_c

    signum = getattr(signal, sig)
    found = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    setup = tune_run._setup_signal_catching
    with _signals_stop_like_ctrl_c() as got:
        stopped = tune_run._setup_signal_catching()
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 10
        while not stopped.is_set() and time.monotonic() < deadline:  # the handler runs between bytecodes
            time.sleep(0.01)
        assert stopped.is_set()
    assert got["signum"] == signum
    assert tune_run._setup_signal_catching is setup
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == found


# the same interruption on S3 storage runs in the default suite (tests/test_storage.py)
@pytest.mark.slow
def test_interrupted_sweep_resumes_without_rerunning_finished_trials(workdir):
    """SIGTERM to the sweep's whole process group, then --resume: finished trials are kept, the
    interrupted one continues from its checkpoint."""
    args = ["--space", str(SPACE), "--num-samples", "3", "--max-concurrent", "1", *TINY,
            "--set", "train.epochs=8", "--set", "train.checkpoint_every_steps=2", "--name", "intr"]
    sweep_dir = workdir / "raysys_runs" / "sweeps" / "intr"

    def ready():  # one trial has finished and the next one is under way (and has a checkpoint)
        ev = _events(sweep_dir)
        ended = {e[1] for e in ev if e[0] == "end"}
        running = [e[1] for e in ev if e[0] == "start" and e[1] not in ended]
        return bool(ended and running and any((sweep_dir / "runs").glob(f"*{running[0]}/checkpoints/step_*/meta.json")))

    returncode, out = interrupt_sweep(args, workdir, ready, group_sigterm=True)  # timeout, Slurm, systemd
    assert returncode == 143, out[-3000:]
    assert f"cd {workdir} && python -m raysys.tune --space {SPACE} --name intr" in out  # works from any folder
    before = _events(sweep_dir)
    finished = {e[1] for e in before if e[0] == "end"}
    assert finished

    resumed = _sweep(workdir, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Recommended: trial" in resumed.stdout
    after = _events(sweep_dir)
    starts = {}
    for e in after:
        if e[0] == "start":
            starts.setdefault(e[1], []).append(e)
    assert len(starts) == 3  # three trials in all, none duplicated under a new id
    for tid in finished:  # finished before the interruption: never started again
        assert len(starts[tid]) == 1, (tid, after)
    interrupted = [tid for tid, s in starts.items() if len(s) > 1]
    assert interrupted and all(starts[t][-1][-1] == "resume=True" for t in interrupted)
    # its training run continued from its own checkpoint rather than from scratch
    (run_dir,) = (sweep_dir / "runs").glob(f"*{interrupted[0]}")
    assert "resumed step=" in (run_dir / "events.log").read_text()
    # its objective history has no hole where it resumed: the quality it had holds until its next evaluation
    import json
    import math

    rows = [json.loads(line) for line in (sweep_dir / "objectives" / f"{interrupted[0]}.jsonl").read_text().splitlines()]
    q = [r.get("objective/quality") for r in rows]
    first = next((i for i, v in enumerate(q) if v is not None and math.isfinite(v)), len(q))
    assert first < len(q) and all(v is not None and math.isfinite(v) for v in q[first:]), q

    # its seconds in the report are both its sessions' (Tune's clock restarts at the resume)
    import csv

    from raysys.tune.trial import report_times, run_seconds

    table = {r["trial_id"]: r for r in csv.DictReader(open(sweep_dir / "report" / "trials.csv"))}
    both = run_seconds(sweep_dir, interrupted[0], report_times(sweep_dir / "objectives", interrupted[0]))
    assert both is not None and float(table[interrupted[0]]["seconds"]) == pytest.approx(both)
    assert both >= run_seconds(sweep_dir, interrupted[0])  # more than its last session alone
    assert f"trial {interrupted[0]} done in {both:.0f}s" in resumed.stdout  # the console says the same

    _, _, parent, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}")
    assert len(children) == 3 and parent.info.status == "FINISHED"
    assert all(c.data.tags["raysys.trial_status"] == "ok" for c in children)
    assert len([p for p in sweep_dir.iterdir() if (p / "result.json").exists()]) == 3


@pytest.mark.slow  # ~2.5 min: 3 JAX programs; by default test_plugin_population sweeps a JAX train_fn
def test_sweep_of_a_train_fn_workload(workdir):
    """hackmatrix_ppo runs its own JAX loop (Workload.train_fn), not the shared PyTorch loop: its
    trials go through the Session path, report per chunk and land as MLflow child runs too. Then the
    same workload vectorized: members of one program land exactly like lone trials."""
    space = REPO / "tune_spaces" / "hackmatrix_ppo.yaml"
    proc = _sweep(workdir, "--space", str(space), "--num-samples", "2", "--preset", "quick", "--name", "jax",
                  "--set", "train.total_timesteps=10240", "--set", "train.num_envs=32", "--set", "train.num_steps=32",
                  "--set", "train.compilation_cache_dir=")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| # | trial | front | recommended | status | perf/env_steps_per_s | eval/quality |" in proc.stdout
    assert "python -m raysys train hackmatrix_ppo --preset quick " in proc.stdout
    client, _, _, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}", "hackmatrix_ppo")
    assert len(children) == 2
    for child in children:
        assert child.data.tags["raysys.trial_status"] == "ok"
        assert {"train.precision", "optim.lr"} <= set(child.data.params)
        assert child.data.metrics["perf/env_steps_per_s"] > 0 and child.data.metrics["eval/quality"] < 0
        assert len(client.get_metric_history(child.info.run_id, "charts/episode_return")) == 2  # one per chunk

    # The same workload vectorized (--vectorize 4) into the same store: 4 configurations in 2 programs
    # (train.population is not a member knob: one program batches its members with vmap, the other runs
    # them in turn), each member its own child run, in the same form as the trials above. The stability
    # rule caps the learning rate, so each program's lr=2e-3 member is unstable at its first report: it
    # is masked, and the other member goes on.
    vspace = workdir / "vec.yaml"
    vspace.write_text(yaml.safe_dump({
        "workload": "hackmatrix_ppo", "preset": "quick",
        "fixed": {"launch.workers": 0, "train.total_timesteps": 10240, "train.num_envs": 32,
                  "train.compilation_cache_dir": ""},
        "space": {"train.population": {"grid": ["vmap", "loop"]}, "optim.lr": {"grid": [2.0e-4, 2.0e-3]}},
        "objectives": {"tolerance": 0.5},
        "stability": {"bounds": {"charts/learning_rate": {"max": 1.0e-3}}}}))
    proc = _sweep(workdir, "--space", str(vspace), "--num-samples", "4", "--vectorize", "4", "--name", "vec")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("started as one program") == 2
    runs = client.search_runs([children[0].info.experiment_id], max_results=100)
    (vparent,) = [r for r in runs if r.data.tags.get("raysys.sweep") == "vec" and r.data.tags["raysys.kind"] == "sweep"]
    members = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == vparent.info.run_id]
    assert len(members) == 4 and len({r.data.tags["raysys.trial_id"] for r in members}) == 4
    ok = [r for r in members if r.data.tags["raysys.trial_status"] == "ok"]
    bad = [r for r in members if r.data.tags["raysys.trial_status"] == "unstable"]
    assert len(ok) == 2 and len(bad) == 2
    for r in bad:
        assert float(r.data.params["optim.lr"]) == 2.0e-3 and "charts/learning_rate" in r.data.tags["raysys.trial_reason"]
        assert len(client.get_metric_history(r.info.run_id, "charts/episode_return")) == 1  # masked after one chunk
    for r in ok:
        assert_like_a_lone_trial(r, children[0])  # every config value and metric, as a lone trial's
        chunks = 10240 // (5 * 32 * 32)  # quick: 5 updates of 32 envs x 32 steps per chunk
        assert len(client.get_metric_history(r.info.run_id, "charts/episode_return")) == chunks
        assert r.data.metrics["perf/env_steps_per_s"] > 0 and r.data.metrics["eval/quality"] < 0
        assert r.data.tags["raysys.command"].startswith("python -m raysys train hackmatrix_ppo --preset quick ")
    assert sorted(r.data.params["train.population"] for r in members) == ["loop", "loop", "vmap", "vmap"]
    table = (workdir / "raysys_runs" / "sweeps" / "vec" / "report" / "trials.csv").read_text()
    assert sum(line.split(",")[1] in {r.data.tags["raysys.trial_id"] for r in members} for line in table.splitlines()) == 4


@pytest.mark.slow  # ~3-5 min: one naive and one optimized summarizer trial, beam-search evaluation
def test_sweep_of_the_summarizer(workdir):
    """tune_spaces/pointer_generator.yaml as shipped (its grid puts one trial on each path), on a
    small corpus and 3 optimizer steps: both trials finish and land as MLflow child runs with ROUGE."""
    space = REPO / "tune_spaces" / "pointer_generator.yaml"
    proc = _sweep(workdir, "--space", str(space), "--num-samples", "2", "--max-concurrent", "2", "--preset", "quick",
                  "--name", "pg", "--set", "data.n_train=120", "--set", "data.n_eval=20",
                  "--set", "data.data_dir=raysys_data/pg_sweep", "--set", "train.max_steps=3",
                  "--set", "model.max_len=24", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, _, _, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}", "pointer_generator")
    assert sorted(c.data.params["model.path"] for c in children) == ["naive", "optimized"]
    for child in children:
        assert child.data.tags["raysys.trial_status"] == "ok"
        assert 0.0 <= child.data.metrics["eval/rouge2"] <= 1.0 and child.data.metrics["perf/tokens_per_s"] > 0


@pytest.mark.slow  # ~2-3 min
def test_interrupted_vectorized_sweep_resumes_every_member_from_its_checkpoint(workdir):
    """Ctrl-C during a --vectorize sweep, then --resume: every member of the program continues from its
    own checkpoint (no member starts over, none is duplicated) and all end ok."""
    space = workdir / "vec.yaml"
    space.write_text(yaml.safe_dump({
        "workload": "hackmatrix_ppo", "preset": "quick",
        "fixed": {"launch.workers": 0, "train.total_timesteps": 61440, "train.checkpoint_every_minutes": 0.001,
                  "train.compilation_cache_dir": ""},
        "space": {"optim.lr": {"loguniform": [1.0e-4, 1.0e-3]}, "ppo.ent_coef": {"choice": [0.0, 0.05, 0.1]}}}))
    args = ["--space", str(space), "--num-samples", "3", "--vectorize", "3", "--name", "vr"]
    sweep_dir = workdir / "raysys_runs" / "sweeps" / "vr"
    ready = lambda: len({p.parents[2] for p in (sweep_dir / "runs").glob("*/checkpoints/step_*/meta.json")}) == 3  # noqa: E731
    returncode, out = interrupt_sweep(args, workdir, ready)  # once every member has a checkpoint
    assert returncode == 130 and "--resume --vectorize 3" in out, out[-3000:]

    resumed = _sweep(workdir, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = [e for e in _events(sweep_dir) if e[0] == "start"]
    assert len({e[1] for e in starts}) == 3 and len(starts) == 6
    assert sorted(e[3] for e in starts) == ["resume=False"] * 3 + ["resume=True"] * 3
    runs = [p for p in (sweep_dir / "runs").glob("vr-*") if p.is_dir()]
    assert len(runs) == 3 and all((p / "config.resume-1.yaml").is_file() for p in runs)
    client, _, parent, children = _runs(f"sqlite:///{workdir / 'mlflow.db'}", "hackmatrix_ppo")
    assert len(children) == 3 and parent.info.status == "FINISHED"
    for c in children:
        assert c.data.tags["raysys.trial_status"] == "ok"
        steps = [m.step for m in client.get_metric_history(c.info.run_id, "charts/episode_return")]
        # continued from its checkpoint: the first chunk was logged once (a restart would log it again)
        assert max(steps) == 61440 and steps.count(5120) == 1, steps
        # the sweep's objective at every step, the one its checkpoint holds too (it was sent only with the
        # next chunk, which the stop never trained)
        objective = sorted(m.step for m in client.get_metric_history(c.info.run_id, "objective/throughput"))
        assert objective == sorted(set(steps)), objective
