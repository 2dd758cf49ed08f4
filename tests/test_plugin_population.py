"""A user's own JAX workload with a population program (examples/digits_jax): each member of one
program ends as its lone run, and ``python -m raysys.tune --vectorize K`` sweeps it as a plug-in found
by ``module:attr`` from the user's folder, its members K separate MLflow child runs."""

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_like_a_lone_trial
from raysys.checkpoint import read_state

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits_jax"


def _example():
    spec = importlib.util.spec_from_file_location("digits_jax", EXAMPLE / "digits_jax.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("digits_jax", mod)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["digits_jax"])
    mod = sys.modules["digits_jax"]
    return mod


def _cfg(mod, tmp_path, name, population, lr, wd, seed):
    cfg = mod.quick()
    cfg.train.steps, cfg.train.lr, cfg.train.weight_decay, cfg.train.seed = 300, lr, wd, seed
    cfg.train.population, cfg.train.compilation_cache_dir = population, str(tmp_path / "jax-cache")
    cfg.launch.storage_path, cfg.launch.name = str(tmp_path / "runs"), name
    cfg.launch.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return cfg


def _tiny_cfgs(tmp_path, settings):
    import tiny_workload as tiny

    cfgs = []
    for i, (width, lr) in enumerate(settings):
        cfg = tiny.TinyConfig()
        cfg.model.width, cfg.opt.lr = width, lr
        cfg.launch.storage_path, cfg.launch.name = str(tmp_path / "runs"), f"m{i}"
        cfg.launch.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        cfgs.append(cfg)
    return cfgs


def _state(tmp_path, name):
    last = sorted((tmp_path / "runs" / name / "checkpoints").glob("step_*"))[-1]
    return read_state(last)["state"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("population", ["loop", "vmap"])
def test_each_member_of_a_users_population_ends_as_its_lone_run(tmp_path, population):
    """Three members differing in learning rate, weight decay and seed; the second is found unstable at
    its first report and stops there while the others go on."""
    from raysys.session import run_custom, run_population

    mod = _example()
    settings = [(3e-3, 1e-4, 0), (3e-2, 0.0, 7), (1e-3, 1e-2, 3)]
    cfgs = [_cfg(mod, tmp_path, f"pop-{i}", population, *s) for i, s in enumerate(settings)]
    assert len({mod.WORKLOAD.population.program_key(c) for c in cfgs}) == 1
    seen = []

    def unstable(metrics):
        seen.append(metrics["step"])
        return "loss spike"

    together = run_population(mod.WORKLOAD, cfgs, reports=[None, unstable, None])
    assert seen == [100]
    assert int(_state(tmp_path, "pop-1")[-1]) == 100  # halted: its checkpoint is its first chunk's
    for i in (0, 2):
        alone = run_custom(mod.WORKLOAD, _cfg(mod, tmp_path, f"alone-{i}", population, *settings[i]))
        mine, lone = _state(tmp_path, f"pop-{i}"), _state(tmp_path, f"alone-{i}")
        err = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(mine, lone))
        # loop: the lone program itself, bit for bit; vmap: the same arithmetic batched
        assert err == 0.0 if population == "loop" else err < 1e-5, (i, err)
        assert int(mine[-1]) == 300
        assert together[i].metrics["eval/accuracy"] == pytest.approx(alone.metrics["eval/accuracy"], abs=1e-6)
        assert together[i].metrics["eval/accuracy"] > 0.9  # it learned
        assert together[i].metrics["perf/samples_per_s"] > 0


@pytest.mark.timeout(300)
def test_a_resume_of_the_jax_example_trains_with_a_changed_seed(tmp_path, capsys):
    """BA F5: the restored state holds its PRNG key, so a resume with another train.seed had been said and
    tagged but trained bit-identically to the old seed. The example keeps the seed in its checkpoint."""
    from raysys.session import run_custom

    mod = _example()

    def run(name, steps, seed, resume=False):
        cfg = _cfg(mod, tmp_path, name, "loop", 3e-3, 1e-4, seed)
        cfg.train.steps, cfg.launch.resume = steps, resume
        return run_custom(mod.WORKLOAD, cfg)

    for name in ("same", "other"):
        run(name, 200, 0)
    capsys.readouterr()
    same, other = run("same", 400, 0, resume=True), run("other", 400, 5, resume=True)
    out = capsys.readouterr().out
    assert out.count("train.seed 0 -> 5: the minibatches' random stream starts from the new seed here") == 1
    assert other.metrics["losses/train_loss"] != same.metrics["losses/train_loss"]
    assert other.metrics["eval/accuracy"] > 0.9
    # the checkpoint now holds the new seed: a further resume with it goes on without re-keying
    run("other", 500, 5, resume=True)
    assert "train.seed" not in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_the_lone_program_refuses_members_of_different_shapes_naming_the_knob(tmp_path):
    """A workload that declares its width (``model.hidden``) a member knob: the in-turn carrier, given
    members of two widths (and two learning rates across them), fails with a ConfigError naming the
    width, not the learning rate, before a step runs with the wrong shapes."""
    import dataclasses

    from raysys.config import ConfigError
    from raysys.session import run_population
    from raysys.workload import Population

    mod = _example()
    wl = dataclasses.replace(mod.WORKLOAD, population=Population(mod.train_population,
                                                                 (*mod.MEMBER_KNOBS, "model.hidden")))
    cfgs = [_cfg(mod, tmp_path, f"w-{i}", "loop", lr, 1e-4, 0) for i, lr in enumerate([3e-3, 3e-3, 1e-2, 1e-2])]
    for cfg, hidden in zip(cfgs, [16, 32, 16, 32]):
        cfg.model.hidden = hidden
    with pytest.raises(ConfigError) as e:
        run_population(wl, cfgs)
    msg = str(e.value)
    assert "members of one program have states of different shapes" in msg
    assert "model.hidden (16, 32) differs between them" in msg and "remove it from Population.member_knobs" in msg
    assert "train.lr" not in msg
    assert not list((tmp_path / "runs").glob("w-*/checkpoints/step_*"))


def test_members_checkpointing_states_of_different_shapes_fail_naming_the_knob(tmp_path):
    """A population whose own loop raysys never sees (numpy, members in turn) declares ``model.width`` a
    member knob: the states its members checkpoint through their sessions differ in shape, and the
    program fails with a ConfigError naming the width; each member's run is FAILED with it."""
    import tiny_workload as tiny
    from mlflow.tracking import MlflowClient

    from raysys.config import ConfigError
    from raysys.session import run_population

    with pytest.raises(ConfigError, match=r"\['w'\]: float64\[4\] vs float64\[8\]") as e:
        run_population(tiny.WIDTH_AS_MEMBER, _tiny_cfgs(tmp_path, [(4, 0.1), (8, 0.1), (4, 0.05)]))
    assert "model.width (4, 8) differs between them" in str(e.value) and "opt.lr" not in str(e.value)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("raysys-tiny_width").experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FAILED" for r in runs)
    assert all("model.width (4, 8)" in r.data.tags["raysys.error"] for r in runs)


def test_the_shape_check_waits_for_the_members_that_tell_the_knob_and_reads_any_checkpoint_state():
    """Audit BD F3: two members that differ in width, lr and seed saved first, and the refusal named all three
    (and told the user to remove the lr and the seed); it now waits for the members that tell which knob
    follows the shapes. BD F1: a state with a dict JAX cannot sort (str and int keys), which checkpoints
    take, crashed the check of every vectorized member."""
    pytest.importorskip("jax")  # the check flattens states with JAX where it is imported

    import tiny_workload as tiny
    from raysys.config import ConfigError
    from raysys.train.population import SameShapes, leaf_shapes

    cfgs = []
    for width, lr in [(8, 0.1), (16, 0.2), (8, 0.3), (16, 0.4)]:
        cfg = tiny.TinyConfig()
        cfg.model.width, cfg.opt.lr = width, lr
        cfgs.append(cfg)
    shapes = SameShapes(cfgs, ("opt.lr", "model.width"))
    state = lambda w: {"w": np.zeros(w), "flags": {"ok": True, 3: "int key", None: 1}}  # noqa: E731
    assert leaf_shapes(state(8)) == {"['w']": ((8,), "float64")}
    shapes.saw(0, state(8), 10)
    shapes.saw(1, state(16), 10)  # lr and width both split these two: not said yet
    with pytest.raises(ConfigError) as e:
        shapes.saw(2, state(8), 10)
    msg = str(e.value)
    assert msg.startswith("members of one program have states of different shapes: model.width (8, 16) differs "
                          "between them: remove it from Population.member_knobs"), msg
    assert "opt.lr" not in msg
    # audit BI F2: a mismatch that waits is said once every member has saved, wherever the last one saved
    shapes = SameShapes(cfgs[:3], ("opt.lr", "model.width"))
    shapes.saw(0, state(8), 10)
    shapes.saw(1, state(16), 10)
    with pytest.raises(ConfigError, match=r"one of opt.lr \(0.1, 0.2\), model.width \(8, 16\) differs between them"):
        shapes.saw(2, state(8), 20)


def test_a_member_knob_that_is_no_config_key_is_a_config_error_before_anything(workdir, capsys):
    """``member_knobs`` naming ``opt.lrr`` (a typo of ``opt.lr``): one line, exit 2, nothing created."""
    import yaml

    from raysys.tune.__main__ import main

    (workdir / "space.yaml").write_text(yaml.safe_dump({
        "workload": f"{Path(__file__).parent / 'tiny_workload.py'}:TYPO",
        "space": {"opt.lr": {"choice": [0.1, 0.05]}}}))
    assert main(["--space", "space.yaml", "--vectorize", "2", "--num-samples", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["raysys.tune: config error: workload tiny_typo: Population.member_knobs names opt.lrr, not a key "
                   "of its config (did you mean opt.lr?)"]
    assert sorted(p.name for p in workdir.iterdir()) == ["space.yaml"]


@pytest.mark.timeout(900)
def test_a_vectorized_sweep_of_a_users_jax_workload(tmp_path):
    """From the user's folder, with no install: 6 configurations, up to 4 per trial, split by the one
    shape knob (model.hidden). Every configuration is a trial of the report and an MLflow child run with
    its own params and metric history, like a trial of a sweep that is not vectorized."""
    from mlflow.tracking import MlflowClient

    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project)
    cmd = [sys.executable, "-m", "raysys.tune", "--space", "digits_jax_space.yaml", "--vectorize", "4",
           "--num-samples", "6", "--name", "vec"]
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=800)
    print(proc.stdout[-5000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0
    assert "6 trials — 6 ok" in proc.stdout
    assert ("note: a program packs configurations that differ only in train.lr, train.weight_decay, train.seed; "
            "the space also searches model.hidden, so configurations that differ there train as separate "
            "programs") in proc.stdout

    with open(project / "raysys_runs" / "sweeps" / "vec" / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and all(float(r["quality"]) > 0.8 for r in rows)
    programs: dict[str, set] = {}
    for r in rows:  # member ids are <Tune trial id>_<j>: one Tune trial, one program
        programs.setdefault(r["trial_id"].rsplit("_", 1)[0], set()).add(r["model.hidden"])
    assert all(len(widths) == 1 for widths in programs.values())  # a program never mixes shapes
    assert len(programs) < 6  # some configurations shared a program

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-digits_jax")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("raysys.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 6
    by_config = {(r["train.lr"], r["model.hidden"]): r for r in rows}
    for child in children:
        p = child.data.params
        row = by_config[(p["train.lr"], p["model.hidden"])]
        assert int(p["train.seed"]) == int(row["train.seed"])
        assert float(p["train.weight_decay"]) == float(row["train.weight_decay"])
        history = client.get_metric_history(child.info.run_id, "eval/accuracy")
        assert [m.step for m in history] == [100, 200, 300, 400]
        assert history[-1].value == pytest.approx(float(row["quality"]))
        assert child.info.status == "FINISHED"

    # the same space swept one configuration per trial, into the same store: a member's run has the
    # form of a lone trial's (params, metrics, raysys tags), so the MLflow UI cannot tell them apart
    lone = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", "digits_jax_space.yaml", "--num-samples", "1",
                           "--name", "lone"], cwd=project, env=env, capture_output=True, text=True, timeout=800)
    print(lone.stdout[-3000:], lone.stderr[-3000:], sep="\n")
    assert lone.returncode == 0 and "1 trials — 1 ok" in lone.stdout
    runs = client.search_runs([exp.experiment_id])
    (lparent,) = [r for r in runs if r.data.tags.get("raysys.sweep") == "lone" and r.data.tags["raysys.kind"] == "sweep"]
    (trial,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == lparent.info.run_id]
    for child in children:
        assert_like_a_lone_trial(child, trial)
        assert {k for k in child.data.tags if k.startswith("raysys.")} == {k for k in trial.data.tags if k.startswith("raysys.")}
        assert child.data.tags["raysys.command"].startswith("python -m raysys train digits_jax:WORKLOAD --preset quick ")


@pytest.mark.slow  # ~45 s: two whole sweeps
@pytest.mark.timeout(900)
def test_sweep_bench_runs_a_plugins_sweep_both_ways(tmp_path):
    """``python -m raysys.tune.sweep_bench`` from the user's folder: its two sweeps run in folders of
    their own and still find the plug-in; on a CPU each member is its lone run, so every
    configuration's quality is the same both ways. (The fronts may differ: this space has two widths,
    two programs, whose speeds are measured, and trials two at a time measure them with noise.)"""
    import json

    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project)
    cmd = [sys.executable, "-m", "raysys.tune.sweep_bench", "--space", "digits_jax_space.yaml", "--configs", "4",
           "--json", "out.json"]
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=800)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0
    out = json.loads((project / "out.json").read_text())
    assert out["workload"] == "digits_jax:WORKLOAD" and out["configs"] == 4
    assert out["same_configurations"] and out["max_quality_difference"] == 0.0
    assert isinstance(out["same_front"], bool) and isinstance(out["same_recommendation"], bool)
    assert len(out["trials"]["one_trial_each"]) == len(out["trials"]["vectorized"]) == 4
    assert out["wall_s"]["one_trial_each"] > 0 and out["wall_s"]["vectorized"] > 0


def _digits_jax_sweep(tmp_path, space: str, fixed: dict) -> tuple[Path, dict]:
    """A copy of the digits_jax example with a one-program space (lr and seed), and the sweep's environment."""
    import yaml

    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project)
    (project / space).write_text(yaml.safe_dump({
        "workload": "digits_jax:WORKLOAD", "preset": "quick", "fixed": {**fixed, "train.compilation_cache_dir": ""},
        "space": {"train.lr": {"loguniform": [1.0e-3, 1.0e-2]}, "train.seed": {"randint": [0, 1000]}},
        "objectives": {"throughput": "perf/samples_per_s", "quality": "eval/accuracy"}}))
    return project, {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}


@pytest.mark.timeout(900)
def test_a_killed_vectorized_trial_starts_again_from_its_members_checkpoints(tmp_path):
    """The trial's process is killed (as the OOM killer would) once every member has a checkpoint: Tune
    starts the trial again (--max-failures), each member continues from its own checkpoint, not from
    step 0, and the sweep ends with every configuration ok."""
    import os
    import signal
    import time

    from mlflow.tracking import MlflowClient

    project, env = _digits_jax_sweep(tmp_path, "one_program.yaml",
                                     {"train.steps": 20_000, "train.checkpoint_every_minutes": 0.01})
    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", "--space", "one_program.yaml", "--vectorize", "3",
                             "--num-samples", "3", "--name", "kill"], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = project / "raysys_runs" / "sweeps" / "kill" / "runs"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        members = [p for p in runs.glob("kill-*") if p.is_dir()]
        if len(members) == 3 and all(list(p.glob("checkpoints/step_*/meta.json")) for p in members):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended before its trial could be killed"
    pid = int((members[0] / ".raysys.lock").read_text().split()[1])  # "process <pid> on <host>"
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    print(out[-5000:])
    assert proc.returncode == 0
    assert ("failed: the trial's process died (killed, or out of memory); starting again from the last "
            "checkpoint (restart 1 of 2; details: ") in out
    assert "3 trials — 3 ok" in out
    assert "Trial task failed" not in out  # the traceback is in the trial's error.txt, not on the console

    events = (project / "raysys_runs" / "sweeps" / "kill" / "trial_events.log").read_text().splitlines()
    starts = sorted(line.split()[4] for line in events if line.split()[1] == "start")
    assert starts == ["resume=False"] * 3 + ["resume=True"] * 3
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-digits_jax")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 3  # the same three runs, continued
    for c in children:
        steps = [m.step for m in client.get_metric_history(c.info.run_id, "eval/accuracy")]
        assert max(steps) == 20_000 and steps.count(100) == 1, "started over instead of resuming"
        assert c.info.status == "FINISHED"


@pytest.mark.slow  # ~1.5 min; the default suite stops a lone trial's run the same way (test_tune_sweep)
def test_a_vectorized_sweep_stopped_with_ctrl_c_checkpoints_every_member_at_its_step_boundary(tmp_path):
    """Tune ends a trial by returning from its stop at once, and its process is gone within a second:
    the program in Tune's thread died mid-step or mid-save, and each member kept only its last periodic
    checkpoint (here: none). Now the trial's stop waits for the program to stop as Ctrl-C stops a run."""
    from mlflow.tracking import MlflowClient

    from conftest import interrupt_sweep

    project, env = _digits_jax_sweep(tmp_path, "long.yaml", {"train.steps": 10_000_000, "train.checkpoint_every_minutes": 60})
    runs = project / "raysys_runs" / "sweeps" / "cut" / "runs"
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")

    def training() -> bool:  # both members have logged an evaluation
        try:
            exp = client.get_experiment_by_name("raysys-digits_jax")
            kids = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
        except Exception:
            return False
        return len(kids) == 2 and all("eval/accuracy" in r.data.metrics for r in kids)

    rc, out = interrupt_sweep(["--space", "long.yaml", "--vectorize", "2", "--num-samples", "2", "--name", "cut"],
                              project, training, env=env, timeout=600, poll_s=1.0)
    assert rc == 130 and "--resume" in out
    members = sorted(p for p in runs.glob("cut-*") if p.is_dir())
    steps = [[int(m.name.split("_")[1]) for m in p.glob("checkpoints/step_*") if (m / "meta.json").is_file()]
             for p in members]
    assert len(members) == 2 and all(steps), f"a member kept no checkpoint: {steps}"
    assert steps[0] == steps[1], "the members stopped at different steps of one program"


NARROW_ONLY = '''
import dataclasses
import os

from raysys.config import ConfigError
from raysys.workload import Population

import digits_jax


def train_population(cfgs, sessions):
    if cfgs[0].model.hidden != 32:  # this program's width is refused: all its members fail
        with open(os.environ["ATTEMPTS_FILE"], "a") as f:
            f.write("attempt\\n")
        raise ConfigError(f"model.hidden={cfgs[0].model.hidden} does not fit this device")
    return digits_jax.train_population(cfgs, sessions)


@dataclasses.dataclass
class PickyConfig(digits_jax.DigitsJaxConfig):
    def validate(self):  # one combination of knobs, each valid alone, is refused
        if self.model.hidden == 32 and self.train.seed == 2:
            raise ConfigError("hidden 32 with seed 2 is refused")


WORKLOAD = dataclasses.replace(digits_jax.WORKLOAD, name="narrow_only", config_cls=PickyConfig,
                               presets={k: (lambda f=f: PickyConfig(**vars(f()))) for k, f in
                                        digits_jax.WORKLOAD.presets.items()},
                               population=Population(train_population, digits_jax.MEMBER_KNOBS))
'''


@pytest.mark.timeout(900)
@pytest.mark.parametrize("returned, said", [(lambda outs: outs[:-1], "returned a list of 2, not a list of 3 results"),
                                             (lambda outs: dict(enumerate(outs)), "returned a dict of 3, not a list of 3")])
def test_a_population_that_returns_other_than_one_result_per_member_fails_them_in_one_line(tmp_path, returned, said):
    """A train_fn of a population returning one result too few (or a dict): each member's run FAILED with one
    line naming Population.train_fn; before, zip cut the last member off unclosed, and its sweep read as
    interrupted and exited 130 on every --resume. None is no results, as a lone train_fn's."""
    import dataclasses

    import tiny_workload as tiny
    from mlflow.tracking import MlflowClient

    from raysys.config import ConfigError
    from raysys.session import run_population
    from raysys.workload import Population

    wrong = dataclasses.replace(tiny.WORKLOAD, name="tiny_wrong", population=Population(
        lambda cfgs, sessions: returned(tiny.train_population(cfgs, sessions)), ("opt.lr",)))
    with pytest.raises(ConfigError, match=f"tiny_wrong: its Population.train_fn {said}"):
        run_population(wrong, _tiny_cfgs(tmp_path, [(4, 0.1), (4, 0.05), (4, 0.02)]))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("raysys-tiny_wrong").experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FAILED" for r in runs)
    assert all("Population.train_fn returned" in r.data.tags["raysys.error"] for r in runs)

    silent = dataclasses.replace(tiny.WORKLOAD, name="tiny_silent", population=Population(
        lambda cfgs, sessions: tiny.train_population(cfgs, sessions) and None, ("opt.lr",)))
    results = run_population(silent, _tiny_cfgs(tmp_path / "s", [(4, 0.1), (4, 0.05)]))
    assert len(results) == 2 and not any(r.failure for r in results)


def test_members_that_differ_in_a_knob_yet_end_alike_are_said(tmp_path, capfd):
    """A population that trains every member with the lead's learning rate: their metrics come out identical,
    which is said in one note (a sweep ranked them as two configurations, silently)."""
    import copy
    import dataclasses

    import tiny_workload as tiny

    from raysys.session import run_population
    from raysys.workload import Population

    def leads_lr(cfgs, sessions):
        same = [copy.deepcopy(cfgs[0]) for _ in cfgs]
        for c, own in zip(same, cfgs):
            c.launch = own.launch  # each member's own run, the lead's learning rate
        return tiny.train_population(same, sessions)

    forgetful = dataclasses.replace(tiny.WORKLOAD, name="tiny_forgetful",
                                    population=Population(leads_lr, ("opt.lr",)))
    results = run_population(forgetful, _tiny_cfgs(tmp_path, [(4, 0.1), (4, 0.05)]))
    assert ("note: two members that differ in opt.lr ended with the very same metrics; does its "
            "Population.train_fn give each member its own value of it?") in capfd.readouterr().out
    # and to a sweep, whose console does not see the trial's lines (audit BD F2): each member's result says it
    assert {r.note for r in results} == {"tiny_forgetful: two members that differ in opt.lr ended with the very same "
                                         "metrics; does its Population.train_fn give each member its own value of it?"}
    results = run_population(tiny.WORKLOAD, _tiny_cfgs(tmp_path / "own", [(4, 0.1), (4, 0.05)]))
    assert "very same metrics" not in capfd.readouterr().out and {r.note for r in results} == {""}


def test_a_config_error_in_a_vectorized_program_fails_its_members_once(tmp_path):
    """Two programs (two widths) of two members each: the one whose train_population raises a ConfigError
    fails at once, both its members `error` with the message (no --max-failures restart), while the
    other program's members train, but for one whose knobs together are no valid config: it fails alone,
    as its lone trial would, and the program runs its other member."""
    import os

    import yaml

    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project)
    (project / "narrow_only.py").write_text(NARROW_ONLY)
    (project / "space.yaml").write_text(yaml.safe_dump({
        "workload": "narrow_only:WORKLOAD", "preset": "quick", "fixed": {"train.compilation_cache_dir": ""},
        "space": {"model.hidden": {"grid": [32, 64]}, "train.seed": {"grid": [1, 2]}},
        "objectives": {"throughput": "perf/samples_per_s", "quality": "eval/accuracy"}}))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    attempts = project / "attempts.txt"
    proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", "space.yaml", "--vectorize", "4",
                           "--num-samples", "4", "--name", "v", "--max-failures", "2"], cwd=project,
                          env={**env, "ATTEMPTS_FILE": str(attempts)}, capture_output=True, text=True, timeout=800)
    print(proc.stdout[-4000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0
    assert attempts.read_text().count("attempt") == 1
    failed = [l for l in proc.stdout.splitlines() if " FAILED: " in l]
    assert len(failed) == 3 and sum("ConfigError: model.hidden=64 does not fit this device (not restarted" in l
                                    for l in failed) == 2
    assert sum("hidden 32 with seed 2 is refused" in l for l in failed) == 1
    assert "4 trials — 1 ok, 3 error" in proc.stdout and "starting again" not in proc.stdout
    assert "not acceptable" not in proc.stderr  # Optuna is told the failures, not their NaN objectives
    with open(project / "raysys_runs" / "sweeps" / "v" / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["model.hidden"], r["train.seed"], r["status"]) for r in rows) == [
        ("32", "1", "ok"), ("32", "2", "error"), ("64", "1", "error"), ("64", "2", "error")]
    assert all("does not fit this device" in r["reason"] for r in rows if r["model.hidden"] == "64")


PID_RECORDING = '''
import dataclasses
import os

import digits_jax


def train(cfg, session):
    with open(os.environ["PIDS_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return digits_jax.train(cfg, session)


WORKLOAD = dataclasses.replace(digits_jax.WORKLOAD, name="pid_recording", train_fn=train, population=None)
'''


@pytest.mark.timeout(900)
@pytest.mark.parametrize("flags, processes", [([], 1), pytest.param(["--fresh-processes"], 3, marks=pytest.mark.slow)])
def test_trials_share_a_process_unless_asked_not_to(tmp_path, flags, processes):
    """Three trials one at a time: by default one process trains them all (Tune's reuse_actors);
    --fresh-processes starts each in its own."""
    import os

    import yaml

    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project)
    (project / "pid_recording.py").write_text(PID_RECORDING)
    (project / "space.yaml").write_text(yaml.safe_dump({
        "workload": "pid_recording:WORKLOAD", "preset": "quick",
        "fixed": {"train.compilation_cache_dir": str(tmp_path / "jax-cache")},
        "space": {"train.seed": {"grid": [1, 2, 3]}},
        "objectives": {"throughput": "perf/samples_per_s", "quality": "eval/accuracy"}}))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    pids = project / "pids.txt"
    proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", "3",
                           "--max-concurrent", "1", "--name", "p", *flags], cwd=project,
                          env={**env, "PIDS_FILE": str(pids)}, capture_output=True, text=True, timeout=800)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0 and "3 trials — 3 ok" in proc.stdout
    assert len(pids.read_text().split()) == 3 and len(set(pids.read_text().split())) == processes


@pytest.mark.slow  # ~30 s
@pytest.mark.timeout(900)
def test_members_that_end_before_the_others_are_finished_trials(tmp_path):
    """The tiny population trains its members in turn, so each ends before the next reports: every one
    is a finished trial (ok, in the front and the searcher's study), and the sweep ends with its report,
    exit 0. Before, only the last member's end reached the trial's last report: the others were taken
    for trials stopped before their end, and the sweep said it was interrupted (exit 130) on every
    --resume."""
    import os

    import yaml

    (tmp_path / "space.yaml").write_text(yaml.safe_dump({
        "workload": f"{Path(__file__).parent / 'tiny_workload.py'}:WORKLOAD",
        "fixed": {"train.steps": 6, "train.checkpoint_every": 3},
        "space": {"opt.lr": {"grid": [0.1, 0.05, 0.02]}}}))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", "space.yaml", "--vectorize", "3",
                           "--num-samples", "3", "--name", "seq"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=800)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0 and "3 trials — 3 ok" in proc.stdout
    assert "stopped before the end" not in proc.stdout and "interrupted" not in proc.stdout
