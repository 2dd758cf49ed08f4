"""End to end through the CLI, Ray Train and MLflow, on deep_gpcm's small `quick` preset."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from raysys.cli import main

QUICK = ["--preset", "quick"]


def _mlflow_run(workdir: Path, name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-deep_gpcm")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`raysys.run_name` = '{name}'")
    return client, run


def _final(workdir: Path, name: str) -> dict:
    return json.loads((workdir / "raysys_runs" / name / "final_metrics.json").read_text())


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", configure_logging=False)
    yield
    ray.shutdown()


def test_in_process_run_is_tracked(workdir):
    assert main(["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "inproc"]) == 0
    client, run = _mlflow_run(workdir, "inproc")
    assert run.info.status == "FINISHED"
    assert run.data.params["model.path"] == "optimized" and run.data.params["train.epochs"] == "2"
    qwk = client.get_metric_history(run.info.run_id, "eval/qwk")
    assert len(qwk) == 2  # one evaluation per epoch
    for name in ("perf/samples_per_s", "perf/tokens_per_s", "stability/nonfinite_loss", "perf/step_ms",
                 "perf/data_wait_share"):
        assert name in run.data.metrics, name
    # charts only for what changes in training: bookkeeping as tags, the breakdown as a table
    assert not {"step", "world_size", "steps_this_session"} & set(run.data.metrics)
    assert not any(m.startswith("breakdown/") for m in run.data.metrics)
    assert run.data.tags["raysys.world_size"] == "1" and run.data.tags["raysys.kind"] == "run"
    for key in ("train/loss", "perf/tokens_per_s"):  # one value per step, also at the last one
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), key
    # how to run it again, and what it trained on
    assert run.data.tags["raysys.preset"] == "quick"
    assert run.data.tags["raysys.command"].startswith("python -m raysys train deep_gpcm --preset quick")
    # as a new run, from this folder: the run's --name is taken now
    again = f"Run again: `cd {workdir} && python -m raysys train deep_gpcm --preset quick "
    assert again in run.data.tags["mlflow.note.content"]
    assert "--name inproc" not in run.data.tags["mlflow.note.content"].split("Run again")[1].split("\n")[0]
    (ds,) = run.inputs.dataset_inputs
    assert ds.dataset.name == "synthetic_OC_quick" and "students" in ds.dataset.profile
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"breakdown.md", "config.yaml"} <= artifacts
    table = (workdir / "raysys_runs" / "inproc" / "breakdown.md").read_text()
    assert "| forward |" in table and "| data_wait |" in table


def test_the_original_projects_data_folder_trains(workdir, capsys):
    """The seed project's own layout: <name>_train.txt / <name>_test.txt, three lines per student with
    0-based question ids, and its metadata.json. raysys pools both files, shifts the ids (saying so)
    and trains as on the same students in its own format."""
    from raysys.workloads.deep_gpcm.data import generate_synthetic_oc

    df, _ = generate_synthetic_oc(n_students=120, n_questions=50, min_len=20, max_len=60, seed=5)
    folder = workdir / "synthetic_OC"
    folder.mkdir()
    (folder / "metadata.json").write_text(json.dumps({"dataset_name": "synthetic_OC", "n_questions": 50, "n_cats": 4}))
    text = ["".join(f"{len(q)}\n{','.join(str(x - 1) for x in q)}\n{','.join(map(str, r))}\n"
                    for q, r in zip(part.questions, part.responses)) for part in (df[:96], df[96:])]
    (folder / "synthetic_oc_train.txt").write_text(text[0])
    (folder / "synthetic_oc_test.txt").write_text(text[1])
    assert main(["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "orig", "--set", "data.path=synthetic_OC"]) == 0
    assert "question ids start at 0" in capsys.readouterr().out
    client, run = _mlflow_run(workdir, "orig")
    assert run.info.status == "FINISHED" and run.data.params["data.path"] == "synthetic_OC"
    assert run.data.params["data.base_dir"] == str(workdir)  # where it was read from: the command's folder
    (ds,) = run.inputs.dataset_inputs
    assert ds.dataset.name == "synthetic_OC"
    # the same students as raysys's own parquet (ids 1..Q) train to the same numbers: nothing was misread
    df[["questions", "responses"]].to_parquet(workdir / "same.parquet")
    assert main(["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "same", "--set", "data.path=same.parquet"]) == 0
    assert _final(workdir, "orig")["eval/qwk"] == _final(workdir, "same")["eval/qwk"]


def test_a_run_on_shared_storage_resumes_from_another_folder(workdir, monkeypatch, capsys):
    """Where the data lives on this machine is not what the run is (audit s3): a run on shared or remote
    storage resumes from another working directory, as on another machine after losing a node, with the
    same relative data folder or a new one. Data that really differs is still refused."""
    import shutil

    import yaml

    store, a, b, c = (workdir / d for d in ("store", "A", "B", "C"))
    for d in (a, b, c):
        d.mkdir()
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "r", "--storage-path", str(store),
            "--tracking-uri", f"sqlite:///{workdir / 'mlflow.db'}"]
    monkeypatch.chdir(a)
    assert main([*args, "--set", "train.epochs=1"]) == 0
    # the first folder's data is gone, and its path cannot be made here (another machine)
    shutil.rmtree(a / "raysys_data")
    (a / "raysys_data").write_text("")
    monkeypatch.chdir(b)
    assert main([*args, "--resume", "--set", "train.epochs=2"]) == 0, capsys.readouterr().err
    assert (b / "raysys_data" / "synthetic_OC_quick" / "meta.json").is_file()  # made here, where it was asked for
    monkeypatch.chdir(c)
    assert main([*args, "--resume", "--set", "train.epochs=3", "--set", f"data.data_dir={c / 'elsewhere'}"]) == 0, \
        capsys.readouterr().err
    assert (c / "elsewhere" / "meta.json").is_file()
    events = (store / "r" / "events.log").read_text()
    assert "resumed step=6 " in events and "resumed step=12 " in events
    final = json.loads((store / "r" / "final_metrics.json").read_text())
    assert final["step"] == 18 and final["steps_this_session"] == 6
    # the config snapshot keeps the folder as written: a later resume resolves it where it runs
    assert yaml.safe_load((store / "r" / "config.yaml").read_text())["data"]["data_dir"] == "raysys_data/synthetic_OC_quick"
    # other data is another run
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "train.epochs=4", "--set", "data.seed=7"]) == 2
    assert "different config: data.seed" in capsys.readouterr().err


def test_a_run_on_your_data_resumes_from_a_copy_elsewhere_but_not_on_other_data(workdir, monkeypatch, capsys):
    """data.path is where your file is, not what it holds: a copy of it in another folder resumes the run;
    a file with other sequences (a fixed row) does not, whatever its path."""
    from raysys.workloads.deep_gpcm.data import generate_synthetic_oc

    df, _ = generate_synthetic_oc(n_students=40, n_questions=20, min_len=5, max_len=10, seed=3)
    df = df[["questions", "responses"]]
    a, b = workdir / "A", workdir / "B"
    a.mkdir(), b.mkdir()
    df.to_parquet(a / "mine.parquet")
    df.to_parquet(b / "copy.parquet")
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "u", "--storage-path", str(workdir / "store"),
            "--tracking-uri", f"sqlite:///{workdir / 'mlflow.db'}"]
    monkeypatch.chdir(a)
    assert main([*args, "--set", "data.path=mine.parquet", "--set", "train.epochs=1"]) == 0
    monkeypatch.chdir(b)
    assert main([*args, "--resume", "--set", "data.path=copy.parquet", "--set", "train.epochs=2"]) == 0, \
        capsys.readouterr().err
    assert "resumed step=" in (workdir / "store" / "u" / "events.log").read_text()
    first = df.at[0, "responses"]
    df.at[0, "responses"] = [(first[0] + 1) % 4, *first[1:]]  # one response fixed, the same path
    df.to_parquet(b / "copy.parquet")
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "train.epochs=3"]) == 2
    err = capsys.readouterr().err
    assert "different config: data.digest" in err and "the data files now hold other data than the run trained on" in err


def test_two_ddp_workers_match_one(workdir, ray_cluster):
    # Same global batch (2 x 8 vs 1 x 16) and data order: ShardSampler interleaves one permutation.
    common = [*QUICK, "--set", "train.epochs=3"]
    assert main(["train", "deep_gpcm", *common, "--workers", "1", "--set", "train.batch_size=16", "--name", "one"]) == 0
    assert main(["train", "deep_gpcm", *common, "--workers", "2", "--set", "train.batch_size=8", "--name", "two"]) == 0
    one, two = _final(workdir, "one"), _final(workdir, "two")
    assert one["world_size"] == 1 and two["world_size"] == 2 and one["step"] == two["step"]
    # DDP averages per-rank token means, one worker takes one token mean: close, not bit-equal
    assert abs(one["eval/qwk"] - two["eval/qwk"]) < 0.08, (one["eval/qwk"], two["eval/qwk"])
    assert abs(one["eval/categorical_acc"] - two["eval/categorical_acc"]) < 0.05


def _train_worker_pids() -> list[int]:
    """This test's Ray Train workers: under the raylet this process started, not another job's on the machine."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        try:
            if "RayTrainWorker" in cmd and os.getpid() in (q.pid for q in p.parents()):
                pids.append(p.pid)
        except psutil.Error:  # gone meanwhile
            pass
    return pids


def test_killed_worker_resumes_from_checkpoint(workdir, ray_cluster):
    run_dir = workdir / "raysys_runs" / "killed"
    killed = []

    def killer():
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            ckpts = list((run_dir / "checkpoints").glob("step_*/meta.json")) if run_dir.exists() else []
            pids = _train_worker_pids()
            if ckpts and pids:
                os.kill(pids[0], signal.SIGKILL)  # a real crash: the worker process dies
                killed.append(pids[0])
            time.sleep(0.2)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    rc = main(["train", "deep_gpcm", *QUICK, "--set", "train.epochs=4", "--set", "train.checkpoint_every_steps=2",
               "--workers", "1", "--max-failures", "2", "--name", "killed"])
    t.join(timeout=5)
    assert killed, "no worker was killed"
    assert rc == 0
    events = (run_dir / "events.log").read_text()
    assert "resumed step=" in events and events.count(" restart ") == 1, events  # one kill, one restart
    final = _final(workdir, "killed")
    resumed_at = int(events.split("resumed step=")[1].split()[0])
    assert resumed_at > 0 and final["steps_this_session"] == final["step"] - resumed_at
    assert final["step"] == 4 * 6  # 96 training sequences / batch 16 = 6 steps per epoch


def test_a_runs_placement_group_is_removed_only_under_a_controller_ray_says_is_dead(ray_cluster):
    """Ray Train's cleaner took the State API's "not found" (another cluster's dashboard answering, AU F3)
    for a dead controller and removed the group under a live run; raysys's trainers launch one that does not."""
    import ray
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
    from ray.util.placement_group import placement_group, placement_group_table

    from raysys.train.cleaner import CleanerCallback, TorchTrainer, _Cleaner

    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    assert sum(isinstance(c, CleanerCallback) for c in trainer._create_default_callbacks()) == 1

    @ray.remote(num_cpus=0)
    class Controller:
        def ping(self):
            return 1

    # Ray's cleaner asks the State API of whichever Ray it finds: with another Ray on the machine (another
    # job's) it finds several and fails instead; pointed at this cluster, it shows what it does with "not found"
    here = {"env_vars": {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}}

    def watched(cleaner_cls, controller_id):
        pg = placement_group([{"CPU": 0.01}])
        ray.get(pg.ready())
        options = {"runtime_env": here} if cleaner_cls is PlacementGroupCleaner else {}
        cleaner = ray.remote(num_cpus=0)(cleaner_cls).options(**options).remote(
            controller_actor_id=controller_id, check_interval_s=0.2, get_actor_timeout_s=10, stop_timeout=None)
        ray.get(cleaner.register_placement_group.remote(pg))
        ray.get(cleaner.start_monitoring.remote())
        return pg, cleaner

    def removed(pg, within=60.0):
        deadline = time.time() + within
        while time.time() < deadline:
            if placement_group_table(pg)["state"] == "REMOVED":
                return True
            time.sleep(0.2)
        return False

    unknown = "ab" * 16  # an id this cluster never had: the State API answers "not found"
    ours, ours_cleaner = watched(_Cleaner, unknown)
    rays, _ = watched(PlacementGroupCleaner, unknown)
    assert removed(rays)  # Ray's own cleaner takes "not found" for dead ...
    assert placement_group_table(ours)["state"] == "CREATED"  # ... ours, checking since before it, does not
    controller = Controller.remote()
    ray.get(controller.ping.remote())
    dead, _ = watched(_Cleaner, controller._actor_id.hex())
    ray.kill(controller)
    assert removed(dead)  # a controller Ray says is dead: its group goes
    ray.get(ours_cleaner.stop.remote())
    ray.util.remove_placement_group(ours)

def test_interrupted_run_resumes_without_repeating(workdir):
    cmd = [sys.executable, "-m", "raysys", "train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "intr",
           "--set", "train.epochs=12", "--set", "train.checkpoint_every_steps=3"]
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_root = workdir / "raysys_runs" / "intr" / "checkpoints"
    deadline = time.time() + 180
    while time.time() < deadline and not (ckpt_root.exists() and any(ckpt_root.glob("step_*/meta.json"))):
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)  # the hardest interruption: no cleanup at all
    proc.wait()
    saved = max(int(p.name.split("_")[1]) for p in ckpt_root.glob("step_*") if (p / "meta.json").exists())
    assert main(["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "intr", "--resume",
                 "--set", "train.epochs=12", "--set", "train.checkpoint_every_steps=3"]) == 0
    final = _final(workdir, "intr")
    assert 0 < saved < 72, "the run was not interrupted mid-way"
    assert final["step"] == 72 and final["steps_this_session"] == 72 - saved
    assert f"resumed step={saved}" in (workdir / "raysys_runs" / "intr" / "events.log").read_text()
    client, run = _mlflow_run(workdir, "intr")  # the same MLflow run continued
    assert run.info.status == "FINISHED"


def test_resume_at_the_last_step_of_an_epoch_reports_a_finite_loss(workdir):
    # A run stopped between the in-epoch checkpoint of an epoch's last step and the epoch-end one
    # resumes into an empty remainder of that epoch; its epoch-end report used to say loss NaN,
    # which a Tune sweep reads as divergence and stops the trial.
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "edge", "--set", "train.checkpoint_every_steps=2"]
    assert main([*args, "--set", "train.max_steps=6"]) == 0  # the quick preset has 6 steps per epoch
    import torch

    (ckpt,) = sorted((workdir / "raysys_runs" / "edge" / "checkpoints").glob("step_000000006"))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert (state["epoch"], state["micro_in_epoch"]) == (1, 0) and state["loss"] == state["loss"]
    state["epoch"], state["micro_in_epoch"] = 0, 6  # what the in-epoch save of step 6 holds
    del state["epoch_samples"]  # as an earlier version saved it: the epoch's place in micro-batches alone
    torch.save(state, ckpt / "state.pt")
    assert main([*args, "--resume", "--set", "train.max_steps=none"]) == 0  # the saved config had max_steps=6
    client, run = _mlflow_run(workdir, "edge")
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert len(losses) > 3 and all(v == v for v in losses), losses
    assert _final(workdir, "edge")["step"] == 12


def test_a_run_ended_by_max_steps_mid_epoch_is_judged_on_its_last_model(workdir):
    """Evaluated at the end of epoch 1 (step 6) and then trained on to max_steps 9: its final quality is
    that of the step-9 model, evaluated then, not step 6's."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "mid", "--set", "train.epochs=3",
            "--set", "train.max_steps=9"]
    assert main(args) == 0
    client, run = _mlflow_run(workdir, "mid")
    evals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/quality")}
    assert sorted(evals) == [6, 9]
    final = _final(workdir, "mid")
    assert final["step"] == 9 and final["eval/quality"] == evals[9]


def test_a_resume_says_it_keeps_its_own_config_over_another_preset(workdir, capsys):
    args = ["train", "deep_gpcm", "--workers", "0", "--name", "p", "--set", "train.max_steps=2"]
    assert main([*args, *QUICK]) == 0
    assert main([*args, *QUICK, "--resume"]) == 0  # the same command again: nothing to say
    assert "continues from the run's own config" not in capsys.readouterr().out
    assert main([*args, "--preset", "parity", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "[raysys] --resume continues from the run's own config, not from preset 'parity' (which sets " in out
    assert main([*args, "--preset", "default", "--resume"]) == 0  # the default preset too (audit BA F4)
    out = capsys.readouterr().out
    assert "not from preset 'default' (which sets " in out and "train.epochs=30, the run has 2" in out, out


def test_a_resume_with_another_optimizer_or_schedule_trains_with_it(workdir, capsys):
    """Audit BA: sgd -> adam on a resume failed after the run reopened ("'step'": SGD's state is no Adam's); a
    new schedule's first step trained with the LR the old schedule had left in the optimizer."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "opt"]
    assert main([*args, "--set", "train.max_steps=2", "--set", "optim.name=sgd", "--set", "optim.momentum=0.9"]) == 0
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "train.max_steps=4", "--set", "optim.name=adam"]) == 0
    out = capsys.readouterr().out
    assert "the optimizer changed (SGD -> Adam): it starts with fresh state" in out
    assert "goes on with its changed settings" not in out  # not SGD's momentum -> Adam's betas (BA F6)
    assert main([*args, "--resume", "--set", "train.max_steps=6", "--set", "optim.schedule=linear"]) == 0
    out = capsys.readouterr().out  # step 4 of 6 on a linear decay to 0: 1/3 of the peak, from the first step
    assert "the optimizer goes on with its changed settings: lr at this step: 0.001 -> 0.000333" in out, out
    client, run = _mlflow_run(workdir, "opt")
    lrs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/lr")}
    assert lrs[6] == 0.0 and run.info.status == "FINISHED", lrs


def test_a_resume_with_another_seed_finishes_its_epoch_in_the_order_it_began(workdir, capsys):
    """Audit BA F2: the new seed's order from mid-epoch on trained some of the epoch's samples twice and
    skipped others. The epoch now finishes in its own order (bit-exact with the run never stopped)."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0"]  # 6 steps an epoch
    assert main([*args, "--name", "ref", "--set", "train.max_steps=6"]) == 0
    assert main([*args, "--name", "s", "--set", "train.max_steps=3"]) == 0
    capsys.readouterr()
    assert main([*args, "--name", "s", "--resume", "--set", "train.max_steps=6", "--set", "train.seed=5"]) == 0
    assert "train.seed 0 -> 5: epoch 1 finishes in the order it began" in capsys.readouterr().out
    losses = []
    for name in ("ref", "s"):
        client, run = _mlflow_run(workdir, name)
        losses.append({m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss") if m.step > 3})
    assert losses[0] == losses[1] and len(losses[0]) >= 1, losses


def test_a_resume_writes_only_into_a_runs_folder_and_sweeps_is_no_run_name(workdir, capsys):
    """A folder under the storage path that holds no run (a user's, or the sweeps' own) is not adopted by a
    --resume, and `sweeps` -- where raysys.tune keeps its sweeps -- is not a run name there (AY F12)."""
    foreign = workdir / "raysys_runs" / "notes"
    (foreign / "checkpoints").mkdir(parents=True)
    (foreign / "mine.txt").write_text("keep")
    assert main(["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "notes", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {foreign} holds no run (none of a run's config.yaml" in err and len(err.splitlines()) == 1
    for extra in ([], ["--resume"]):
        assert main(["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "sweeps", *extra]) == 2
        assert "raysys_runs/sweeps is where `python -m raysys.tune` keeps its sweeps" in capsys.readouterr().err
    assert sorted(p.name for p in workdir.rglob("*")) == ["checkpoints", "mine.txt", "notes", "raysys_runs"]


def test_bad_config_key_fails_before_anything(workdir, capsys):
    assert main(["train", "deep_gpcm", *QUICK, "--set", "train.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "train.lrr" in err and "batch_size" in err
    # an unset shell variable (--storage-path "$RUNS") put the run's folder straight into this one (AY F6)
    for flag in ("--storage-path", "--tracking-uri", "--address"):
        with pytest.raises(SystemExit) as e:
            main(["train", "deep_gpcm", *QUICK, flag, ""])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: empty (an unset shell variable?)" in err, err
    with pytest.raises(SystemExit) as e:  # a config reads it as no name: the run got a default one (audit BA F7)
        main(["train", "deep_gpcm", *QUICK, "--name", "none"])
    assert e.value.code == 2 and "'none' reads as no name in a config" in capsys.readouterr().err
    assert list(workdir.iterdir()) == []


def test_corrupt_checkpoint_and_existing_run(workdir, capsys):
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "c"]
    assert main(args) == 0
    run_dir = workdir / "raysys_runs" / "c"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    # same name without --resume: refused, nothing touched
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    # corrupt the newest checkpoint: one clear error, nothing overwritten or deleted
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    (newest / "state.pt").write_bytes(b"\x00" * 100)
    before[newest / "state.pt"] = b"\x00" * 100
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err and str(newest) in err and err.count("\n") <= 2
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


def test_a_resume_to_another_tracking_store_says_where_each_part_is(workdir, capsys):
    """--tracking-uri on a resume: a new MLflow run in that store holds this session, and the note says so
    (and where the earlier steps are), not that the run had none."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "t"]
    assert main([*args, "--set", "train.max_steps=2"]) == 0
    # what the first store did not take (an outage): it is kept for that store, not sent into the new one's run
    run_dir = workdir / "raysys_runs" / "t"
    planted = json.dumps({"kind": "metrics", "data": {"train/planted": 1.0}, "step": 1, "ts": 1})
    (run_dir / "tracking-buffer.jsonl").write_text(planted + "\n")
    other = f"sqlite:///{workdir / 'other.db'}"
    assert main([*args, "--resume", "--set", "train.max_steps=4", "--tracking-uri", other]) == 0
    out = capsys.readouterr().out
    first = f"sqlite:///{workdir / 'mlflow.db'}"
    assert f"'t' tracked to {first}; this session tracks to {other}: a new MLflow run there holds it from step 2, " \
        f"the earlier steps stay in {first} (its 1 records not sent there are kept in {run_dir}/" \
        f"tracking-buffer.unsent.jsonl) (resume with --tracking-uri {first} to go on in that run)" in out, out[-3000:]
    assert "has no MLflow run yet" not in out
    assert (run_dir / "tracking-buffer.unsent.jsonl").read_text() == planted + "\n"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=other)
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-deep_gpcm").experiment_id])
    assert "train/planted" not in run.data.metrics


def test_a_resume_says_it_keeps_its_store_over_the_environments(workdir, capsys, monkeypatch):
    """$RAYSYS_TRACKING_URI set after the run began: the resume goes on in the run's own store, and says so."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "e"]
    assert main([*args, "--set", "train.max_steps=2"]) == 0
    other = f"sqlite:///{workdir / 'other.db'}"
    monkeypatch.setenv("RAYSYS_TRACKING_URI", other)
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "train.max_steps=4"]) == 0
    assert (f"[raysys] note: this resume tracks to sqlite:///{workdir / 'mlflow.db'}, not to {other} from the "
            "environment: a run stays in its own MLflow store unless --tracking-uri moves it") in capsys.readouterr().out


def test_a_resume_to_a_store_made_anew_says_it_lost_the_run(workdir):
    """The same store, made anew (its database replaced): the run trained, so it had an MLflow run; the note
    says the store lost it (it said the run's first session had ended before making one)."""
    args = [sys.executable, "-m", "raysys", "train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "n", "--set",
            "train.max_steps=2"]
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    assert subprocess.run([*args, "--tracking-uri", uri], cwd=workdir, env=env, timeout=600).returncode == 0
    (workdir / "mlflow.db").unlink()  # (in its own process: this one's MLflow keeps an engine on the old file)
    again = subprocess.run([*args, "--resume", "--set", "train.max_steps=4", "--tracking-uri", uri], cwd=workdir,
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    out = again.stdout
    assert f"note: {uri} no longer has the MLflow run of 'n' (the store was made anew, or the run deleted): a new " \
        "MLflow run holds it from step 2" in out, out[-3000:]


def test_a_resume_that_shortens_the_run_below_its_checkpoint_says_so(workdir, capsys):
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "short", "--set", "train.epochs=3"]
    assert main([*args, "--set", "train.max_steps=4"]) == 0
    (workdir / "raysys_runs" / "short" / "final_metrics.json").unlink()  # as a run stopped at step 4 leaves it
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "train.max_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "the run's length (3 epochs, train.max_steps=2) ends before its checkpoint at step 4: nothing left to " \
           "train; that model is evaluated and recorded as the run's result" in out, out[-2000:]


def test_a_bare_resume_takes_the_newest_run_that_has_not_ended(workdir, capsys):
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--set", "train.max_steps=2"]
    assert main(args) == 0
    time.sleep(1.1)  # default names differ by the second
    assert main(args) == 0
    older, newer = sorted(p for p in (workdir / "raysys_runs").iterdir() if p.name.startswith("deep_gpcm-"))
    (older / "final_metrics.json").unlink()  # as a run stopped before its end leaves it
    capsys.readouterr()
    assert main(["train", "deep_gpcm", "--resume", "--set", "train.max_steps=3"]) == 0
    assert f"run '{older.name}'" in capsys.readouterr().out
    assert (older / "final_metrics.json").is_file()
    for run in (older, newer):
        shutil.rmtree(run)
    assert main(["train", "deep_gpcm", "--resume"]) == 2
    assert "no earlier deep_gpcm run named by default (deep_gpcm-<date>-<time>)" in capsys.readouterr().err


def test_extending_a_finished_run_keeps_what_it_ended_with(workdir):
    """A --resume that trains a finished run further: the model it ended with (its checkpoint) and what it
    recorded then (final metrics, breakdown) are kept beside the new ones, not rotated away or overwritten."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "ext"]
    assert main([*args, "--set", "train.epochs=1"]) == 0  # the quick preset has 6 steps per epoch
    run = workdir / "raysys_runs" / "ext"
    first = json.loads((run / "final_metrics.json").read_text())
    assert first["step"] == 6
    assert main([*args, "--resume", "--set", "train.epochs=4"]) == 0  # keep_checkpoints=2 rotates steps 12 .. 24
    assert json.loads((run / "final_metrics.json").read_text())["step"] == 24
    assert json.loads((run / "final_metrics.step_6.json").read_text()) == first
    assert (run / "breakdown.step_6.md").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_000000006", "step_000000018", "step_000000024"]


def test_the_resume_changes_tag_keeps_every_resumes_changes(workdir):
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "tag"]
    assert main([*args, "--set", "train.max_steps=2"]) == 0
    assert main([*args, "--resume", "--set", "train.max_steps=4"]) == 0
    assert main([*args, "--resume", "--set", "train.max_steps=6", "--set", "optim.lr=0.002"]) == 0
    client, run = _mlflow_run(workdir, "tag")
    assert run.data.tags["raysys.resume_changes"] == (
        "resume-1: train.max_steps: 2 -> 4 | resume-2: optim.lr: 0.001 -> 0.002; train.max_steps: 4 -> 6")
    # and trained with: the checkpoint's optimizer state had put its own lr back (AZ F1)
    lrs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/lr")}
    assert {s: v for s, v in lrs.items() if s > 4} == {6: 0.002}, lrs  # logged every 2 steps
    assert all(v == 0.001 for s, v in lrs.items() if s <= 4), lrs


def test_a_resume_that_trains_nothing_does_not_keep_or_tag_its_changes(workdir, capsys):
    """BA F8: a resume of a finished run with another lr trained nothing; it had been said to go on with
    it and tagged, yet the next extension trained with the old lr."""
    args = ["train", "deep_gpcm", *QUICK, "--workers", "0", "--name", "done"]
    assert main([*args, "--set", "train.max_steps=2"]) == 0
    assert main([*args, "--resume", "--set", "optim.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "goes on with its changed settings" not in out
    assert "the changed config trained nothing, so it is not kept (optim.lr: 0.001 -> 0.01)" in out
    client, run = _mlflow_run(workdir, "done")
    assert "raysys.resume_changes" not in run.data.tags and "raysys.params_changed" not in run.data.tags
    assert main([*args, "--resume", "--set", "train.max_steps=4"]) == 0
    client, run = _mlflow_run(workdir, "done")
    assert run.data.tags["raysys.resume_changes"] == "resume-1: train.max_steps: 2 -> 4"
    assert run.data.tags["raysys.params_changed"] == "train.max_steps: 2 -> 4"
    lrs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/lr")}
    assert lrs == {2: 0.001, 4: 0.001}, lrs  # the lr the run's config keeps: the untrained change was not kept
    # what a sweep's space may name outside eval/ for a task (raysys.tune.space refuses others before it starts)
    from raysys.metrics import TASK_LOOP_METRICS

    assert {k for k in run.data.metrics if not k.startswith("eval/")} == TASK_LOOP_METRICS
