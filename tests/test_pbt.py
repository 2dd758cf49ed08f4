"""Population-based training inside a vectorized program (raysys/train/pbt.py, ``--scheduler pbt``)."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from raysys.config import ConfigError, apply_overrides
from raysys.train import pbt

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import tiny_workload as tiny  # noqa: E402

LR = {"kind": "loguniform", "values": [], "low": 1e-3, "high": 0.2}


def test_the_worst_quantile_takes_from_the_best_and_unranked_members_sit_out():
    rng = np.random.default_rng(0)
    scores = [0.1, 0.9, float("nan"), 0.5, 0.7, 0.2, 0.8, 0.3]  # seven ranked: a quarter is one
    for _ in range(20):
        (dst, src), = pbt.plan(scores, 0.25, "max", rng)
        assert dst == 0 and src == 1
    moves = pbt.plan(scores, 0.5, "max", rng)  # three each way
    assert sorted(d for d, _ in moves) == [0, 5, 7] and {s for _, s in moves} <= {1, 6, 4}
    assert pbt.plan(scores, 0.25, "min", rng)[0] == (1, 0)  # lower is better: the worst is the highest
    assert pbt.plan([0.3, float("nan")], 0.25, "max", rng) == []  # one ranked member: nothing to compare
    assert pbt.plan([0.3, 0.3], 0.25, "max", rng) == []  # a tie moves nothing


def test_explore_stays_in_the_domain_and_always_moves_a_number():
    rng = np.random.default_rng(1)
    domains = {"lr": LR, "n": {"kind": "randint", "values": [], "low": 1, "high": 5},
               "c": {"kind": "choice", "values": [0.0, 0.01, 0.05, 0.1], "low": 0, "high": 0}}
    seen = {k: set() for k in domains}
    for _ in range(300):
        out = pbt.explore({"lr": 0.19, "n": 1, "c": 0.01}, domains, rng)
        assert 1e-3 <= out["lr"] <= 0.2 and out["lr"] in (pytest.approx(0.19 * 0.8), 0.2)
        assert out["n"] == 2 and isinstance(out["n"], int)  # 1 x 0.8 rounds back to 1, below the bounds: up by one
        assert out["c"] in domains["c"]["values"]
        for k, v in out.items():
            seen[k].add(v)
    assert seen["c"] == {0.0, 0.01, 0.05, 0.1}  # neighbours, and now and then any value


def test_a_members_ended_knobs_keep_what_pbt_left():
    from raysys.tune.population import ended_knobs

    proposed = {"ppo.ent_coef": 0, "train.num": 3, "optim.lr": 1e-3, "flag": False, "train.seed": 7}
    ended = ended_knobs(proposed, {"pbt/ppo.ent_coef": 0.1, "pbt/train.num": 4.0, "pbt/optim.lr": 1.2e-3, "pbt/flag": 1.0})
    assert ended == {"ppo.ent_coef": 0.1, "train.num": 4, "optim.lr": 1.2e-3, "flag": True, "train.seed": 7}
    assert isinstance(ended["train.num"], int)


def test_a_program_whose_members_all_turn_unstable_ends_each_with_its_verdict():
    """The report that makes the trial unstable (Tune's stopper ends it there) carries every member's last
    state, so the members halted before it are unstable trials too, not ones stopped before their end."""
    from raysys.tune import objectives as obj
    from raysys.tune.population import Reports, member_results

    sent = []
    trackers = [obj.ObjectiveTracker("perf/x", "eval/q", obj.StabilityRules(bounds={"charts/entropy": {"min": 0.5}}))
                for _ in range(3)]
    reports = Reports(["t_0", "t_1", "t_2"], trackers, sent.append)
    members = [reports.reporter(j) for j in range(3)]
    for step, entropies in ((1, (1.0, 1.0, 1.0)), (2, (0.1, 1.0, 1.0)), (3, (None, 0.1, 1.0)), (4, (None, None, 0.1))):
        for j, e in enumerate(entropies):
            if e is not None:
                members[j]({"perf/x": 1.0, "eval/q": -1.0, "charts/entropy": e, "step": step})
    reports.flush()
    last = sent[-1]
    assert last[obj.UNSTABLE] == 1.0 and "every member unstable, the last: charts/entropy" in last[obj.REASON]
    ended = member_results(last, {"population": [{}, {}, {}]}, "t")
    assert [m[obj.UNSTABLE] for _, _, m in ended] == [1.0, 1.0, 1.0]
    assert all("charts/entropy" in m[obj.REASON] for _, _, m in ended)


def test_a_chunk_is_sent_once_every_member_still_training_has_reported():
    """The chunk whose checkpoints a stopped program kept went to Tune only at the next chunk's first report,
    which never came: each member's objective history lost that step on every resume. A chunk now goes
    once each member still training reported: a halted member holds none back, and one that ended unseen
    (a shorter train.steps) only the chunk it missed."""
    from raysys.tune import objectives as obj
    from raysys.tune.population import Reports

    sent = []
    trackers = [obj.ObjectiveTracker("perf/x", "eval/q", obj.StabilityRules(bounds={"charts/entropy": {"min": 0.5}}))
                for _ in range(3)]
    reports = Reports(["t_0", "t_1", "t_2"], trackers, sent.append)
    reports.training = {0, 1, 2}
    members = [reports.reporter(j) for j in range(3)]

    def chunk(step, *entropies):
        for j, e in enumerate(entropies):
            if e is not None:
                members[j]({"perf/x": 1.0, "eval/q": -1.0, "charts/entropy": e, "step": step})

    def steps(report):
        return sorted(k for k in report if k.endswith("/step"))

    chunk(1, 1.0, 1.0, 1.0)
    assert len(sent) == 1 and steps(sent[0]) == ["members/t_0/step", "members/t_1/step", "members/t_2/step"]
    chunk(2, 0.1, 1.0, 1.0)  # t_0 halts (unstable) on its report: it is sent with the others
    assert len(sent) == 2 and sent[1][f"members/t_0/{obj.UNSTABLE}"] == 1.0
    chunk(3, None, 1.0, 1.0)
    assert len(sent) == 3 and sent[2]["members/t_1/step"] == 3 == sent[2]["members/t_2/step"]
    chunk(4, None, 1.0, None)  # t_2 ended unseen: chunk 4 waits, sent at t_1's next report, then no more waits
    assert len(sent) == 3
    chunk(5, None, 1.0, None)
    assert len(sent) == 5 and sent[3]["members/t_1/step"] == 4 and sent[4]["members/t_1/step"] == 5


def _members(tmp_path, lrs, steps=6, name="m"):
    cfgs = []
    for i, lr in enumerate(lrs):
        cfgs.append(apply_overrides(tiny.TinyConfig(), {
            "opt.lr": lr, "train.steps": steps, "train.checkpoint_every": 2, "launch.name": f"{name}{i}",
            "launch.storage_path": str(tmp_path / "runs"), "launch.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}))
    return cfgs


def _history(tmp_path, run_name, key):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run, = client.search_runs(["0"], f"attributes.run_name = '{run_name}'") or \
        client.search_runs([e.experiment_id for e in client.search_experiments()], f"attributes.run_name = '{run_name}'")
    return run, {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def test_a_round_hands_the_best_members_weights_and_a_perturbed_rate_to_the_worst(tmp_path):
    """Through real sessions, runs and MLflow: after each round the exploiting member's next step starts
    from the weights its source had (and the rate it was given), its knobs are charted as pbt/opt.lr,
    the round is on its run's raysys.pbt tag, and its checkpoints carry the knobs: a resume of the
    program (and a lone --resume of one member's run) goes on with them."""
    from raysys.session import run_population

    config = pbt.PBTConfig(explore={"opt.lr": LR}, metric="eval/quality", interval=2, seed=3)
    lrs = [0.002, 0.05, 0.004, 0.03]  # the slow learners fall behind and are replaced
    res = run_population(tiny.PBT, _members(tmp_path, lrs), pbt=config)
    assert all(r.failure == "" for r in res)
    moved = [i for i, r in enumerate(res) if r.metrics["pbt/exploits"] > 0]
    assert moved and set(moved) <= {0, 2}  # a quarter of four: the worst one each round (of two rounds)
    x = np.random.default_rng(0).normal(size=(32, 4))
    y = x @ np.linspace(-1.0, 1.0, 4)
    for i in moved:
        run, lr = _history(tmp_path, f"m{i}", "pbt/opt.lr")
        assert "took m" in run.data.tags["raysys.pbt"]
        for rnd in run.data.tags["raysys.pbt"].split(" | "):
            at, src = int(rnd.split(":")[0].split()[1]), int(rnd.split("took m")[1][0])
            w_src = np.array([_history(tmp_path, f"m{src}", f"w/{j}")[1][at] for j in range(4)])
            w_next = np.array([_history(tmp_path, f"m{i}", f"w/{j}")[1][at + 1] for j in range(4)])
            expected = w_src - lr[at + 1] * 2 * x.T @ (x @ w_src - y) / len(y)  # its source's weights, its new rate
            np.testing.assert_allclose(w_next, expected, rtol=1e-12)
            assert lr[at + 1] != lr[at] and 1e-3 <= lr[at + 1] <= 0.2
    # the program again, longer: each member resumes with the rate its last checkpoint was trained with
    last = {i: res[i].metrics["pbt/opt.lr"] for i in range(4)}
    again = run_population(tiny.PBT, [apply_overrides(c, {"launch.resume": True, "train.steps": 8})
                                      for c in _members(tmp_path, lrs)], pbt=config)
    for i in range(4):
        _, lr = _history(tmp_path, f"m{i}", "pbt/opt.lr")
        assert lr[7] == pytest.approx(last[i])  # the first step of the resume: not the proposed rate
        assert again[i].metrics["pbt/exploits"] >= res[i].metrics["pbt/exploits"]
    # the rounds went on where they were: the clock counts the program's chunks over both sessions
    newest = sorted((tmp_path / "runs" / "m0" / "checkpoints").glob("step_*"))[-1]
    clock = json.loads((newest / "meta.json").read_text())[pbt.CLOCK]
    assert clock["chunks"] == 8 and clock["rounds"] == 4 and clock["seen"] == []  # a round every 2 chunks
    assert pbt.checkpoint_knobs(tmp_path / "runs" / f"m{moved[0]}", "tiny_pbt")["opt.lr"] == \
        pytest.approx(again[moved[0]].metrics["pbt/opt.lr"])


def test_batched_put_replaces_one_member_and_in_turn_put_copies():
    import jax.numpy as jnp

    from raysys.train.population import Batched, InTurn

    b = Batched({"w": jnp.zeros((3, 2))}, None, 0.0, 1.0)
    b.put(1, {"w": jnp.ones(2)})
    assert b.states["w"].tolist() == [[0, 0], [1, 1], [0, 0]]
    t = InTurn([{"w": jnp.zeros(2)}, {"w": jnp.ones(2)}], None, 0.0)
    t.put(0, t.state(1))
    assert t.states[0]["w"].unsafe_buffer_pointer() != t.states[1]["w"].unsafe_buffer_pointer()  # a donated input frees only its own
    with pytest.raises(ConfigError, match="retune"):
        t.retune([])
    with pytest.raises(ConfigError, match="different shapes"):
        t.put(0, {"w": jnp.zeros(3)})


def _space(tmp_path, workload, space, preset="quick", fixed=(), **top):
    path = tmp_path / f"space{len(list(tmp_path.glob('space*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({"workload": workload, "preset": preset, "fixed": {"launch.workers": 0, **dict(fixed)},
                                    "space": space, **top}))
    return str(path)


def test_the_cli_refuses_pbt_where_it_cannot_run_before_anything_starts(workdir, capsys):
    from raysys.tune.__main__ import main

    hm = _space(workdir, "hackmatrix_ppo", {"optim.lr": {"loguniform": [1e-4, 1e-3]}, "train.seed": {"randint": [0, 9]}})
    cases = [
        (["--space", hm, "--scheduler", "pbt"], "needs --vectorize K with K >= 2"),
        (["--space", hm, "--scheduler", "pbt", "--vectorize", "4", "--pbt-quantile", "0.7"], "--pbt-quantile must be in (0, 0.5]"),
        (["--space", hm, "--scheduler", "pbt", "--vectorize", "4", "--pbt-interval", "0"], "--pbt-interval must be >= 1"),
        (["--space", hm, "--vectorize", "4", "--pbt-interval", "2"], "--pbt-interval is a setting of --scheduler pbt"),
        (["--space", hm, "--scheduler", "pbt", "--vectorize", "2", "--num-samples", "1"],
         "a program of one member has no other to exploit"),  # it ran PBT on one member, without a word (AY F9)
        (["--space", _space(workdir, "hackmatrix_ppo", {"train.seed": {"randint": [0, 9]}}), "--scheduler", "pbt",
          "--vectorize", "4"], "searches none of the knobs PBT may perturb in hackmatrix_ppo (optim.lr"),
        (["--space", _space(workdir, f"{TESTS / 'tiny_workload.py'}:WORKLOAD", {"opt.lr": {"uniform": [0.01, 0.1]}},
                            preset="default", objectives={"throughput": "perf/samples_per_s"}),
          "--scheduler", "pbt", "--vectorize", "2"], "runs no PBT rounds (Population.explore_knobs is empty"),
    ]
    for args, words in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert not (workdir / "raysys_runs").exists() and not (workdir / "mlflow.db").exists()


@pytest.mark.timeout(600)
def test_a_pbt_sweep_of_hackmatrix_reports_the_knobs_each_member_ended_with(workdir):
    """The real thing, small: four members of one program, a round after every chunk. The report, the CSV
    and the MLflow child runs say what PBT did; a member's run resumes alone with its last knobs."""
    import subprocess

    from mlflow.tracking import MlflowClient

    space = _space(workdir, "hackmatrix_ppo", {"optim.lr": {"loguniform": [1e-4, 2e-3]},
                                                "ppo.ent_coef": {"choice": [0.0, 0.01, 0.05]}},
                   objectives={"throughput": "perf/env_steps_per_s", "quality": "eval/quality"})
    proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", space, "--vectorize", "4", "--num-samples",
                           "4", "--scheduler", "pbt", "--pbt-interval", "1", "--name", "p"], cwd=workdir,
                          capture_output=True, text=True, timeout=500)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    report = workdir / "raysys_runs" / "sweeps" / "p" / "report"
    assert "Population-based training" in (report / "pbt.md").read_text()
    with open(report / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    children = {r.data.tags["raysys.trial_id"]: r for r in client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.`raysys.kind` != 'sweep'")}
    assert len(rows) == len(children) == 4
    took = [r for r in children.values() if "raysys.pbt" in r.data.tags]
    assert took, "three rounds of four members moved nobody"
    for row in rows:  # the CSV's knobs: those the member ended with, as its MLflow run charts them
        run = client.get_run(children[row["trial_id"]].info.run_id)
        assert float(row["optim.lr"]) == pytest.approx(run.data.metrics["pbt/optim.lr"])
        assert float(row["ppo.ent_coef"]) == run.data.metrics["pbt/ppo.ent_coef"]
        assert 1e-4 <= float(row["optim.lr"]) <= 2e-3 and float(row["ppo.ent_coef"]) in (0.0, 0.01, 0.05)
        assert f"--set ppo.ent_coef={row['ppo.ent_coef']}" in run.data.tags["raysys.command"]  # the knobs it ended with
        if row["recommended"] == "True":  # its weights came from a schedule: the recommendation says so, and where
            said = f"PBT: trial {row['trial_id']} took other members' weights" in proc.stdout
            assert said == bool(run.data.metrics["pbt/exploits"]), proc.stdout[-2000:]
            assert not said or f"--name {row['run_name']} --resume" in proc.stdout
    member = took[0]
    end_lr = member.data.metrics["pbt/optim.lr"]
    assert float(member.data.params["optim.lr"]) != pytest.approx(end_lr) or \
        member.data.metrics["pbt/ppo.ent_coef"] != float(member.data.params["ppo.ent_coef"])
    name = member.info.run_name.split(" ")[0]
    run_name = next(p.name for p in (workdir / "raysys_runs" / "sweeps" / "p" / "runs").iterdir() if p.name.endswith(name))
    alone = subprocess.run([sys.executable, "-m", "raysys", "train", "hackmatrix_ppo", "--storage-path",
                            "raysys_runs/sweeps/p/runs", "--name", run_name, "--resume", "--set",
                            "train.total_timesteps=25600"], cwd=workdir, capture_output=True, text=True, timeout=300)
    print(alone.stdout[-2000:], alone.stderr[-2000:])
    assert alone.returncode == 0
    assert "population-based training left this run at optim.lr=" in alone.stdout
    snapshot = yaml.safe_load((workdir / "raysys_runs" / "sweeps" / "p" / "runs" / run_name / "config.resume-1.yaml").read_text())
    assert snapshot["optim"]["lr"] == pytest.approx(end_lr)
    again = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", space, "--vectorize", "4", "--name", "p",
                            "--resume"], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "this sweep ran with --scheduler pbt --pbt-interval 1" in again.stderr


@pytest.mark.slow  # ~2-3 min
def test_an_interrupted_pbt_sweep_resumes_each_member_with_the_knobs_it_had(workdir):
    """Ctrl-C once a member of a PBT sweep has taken another's weights, then --resume: each member's first
    chunk after its checkpoint runs with the knobs that checkpoint holds (not those it was proposed with)."""
    import json
    import subprocess

    from conftest import interrupt_sweep
    from mlflow.tracking import MlflowClient

    space = _space(workdir, "hackmatrix_ppo",
                   {"optim.lr": {"loguniform": [1.0e-4, 2.0e-3]}, "ppo.ent_coef": {"choice": [0.0, 0.01, 0.05]}},
                   fixed={"train.total_timesteps": 81920, "train.checkpoint_every_minutes": 0.001,
                          "train.compilation_cache_dir": ""})
    args = ["--space", space, "--num-samples", "4", "--vectorize", "4", "--name", "pr", "--scheduler", "pbt",
            "--pbt-interval", "1"]
    runs = workdir / "raysys_runs" / "sweeps" / "pr" / "runs"

    def exploited():
        for meta in runs.glob("*/checkpoints/step_*/meta.json"):
            try:
                if json.loads(meta.read_text()).get("pbt", {}).get("exploits"):
                    return True
            except ValueError:  # being written
                pass
        return False

    returncode, out = interrupt_sweep(args, workdir, exploited)
    assert returncode == 130, out[-3000:]
    held = {}
    for run in runs.iterdir():
        knobs = pbt.checkpoint_knobs(run, "hackmatrix_ppo")
        steps = sorted(int(p.parent.name[len("step_"):]) for p in run.glob("checkpoints/step_*/meta.json"))
        if knobs and steps:
            held[run.name] = (steps[-1], knobs)
    assert any(k["optim.lr"] != float(yaml.safe_load((runs / r / "config.yaml").read_text())["optim"]["lr"])
               or k["ppo.ent_coef"] != yaml.safe_load((runs / r / "config.yaml").read_text())["ppo"]["ent_coef"]
               for r, (_, k) in held.items()), held
    resumed = subprocess.run([sys.executable, "-m", "raysys.tune", *args, "--resume"], cwd=workdir, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    children = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`raysys.kind` != 'sweep'")
    by_name = {next(n for n in held if n.endswith(c.data.tags["raysys.trial_id"])): c for c in children
               if any(n.endswith(c.data.tags["raysys.trial_id"]) for n in held)}
    assert len(by_name) == len(held)
    for name, (step, knobs) in held.items():
        run = by_name[name]
        assert run.data.tags["raysys.trial_status"] == "ok"
        for key, value in knobs.items():
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"pbt/{key}")}
            assert history[step + 1024 * 5] == pytest.approx(value), (name, key, step, history)


def test_the_searcher_learns_only_from_members_pbt_left_as_proposed():
    """A member that took another's weights ended as no proposal would: Optuna is not told its result
    (as for a failed trial); a member PBT never touched is told as usual."""
    from ray.tune.search import Searcher

    from raysys.tune import objectives as obj
    from raysys.tune.population import PopulationSearcher

    class Recorder(Searcher):
        def __init__(self):
            super().__init__(metric=[obj.THROUGHPUT, obj.QUALITY], mode=["max", "max"])
            self.n, self.told = 0, {}

        def suggest(self, trial_id):
            self.n += 1
            return {"optim.lr": 1e-3 * self.n}

        def on_trial_complete(self, trial_id, result=None, error=False):
            self.told[trial_id] = (result, error)

    inner = Recorder()
    outer = PopulationSearcher(inner, 2, 2, ("optim.lr",))
    assert len(outer.suggest("t")["population"]) == 2
    outer.on_trial_complete("t", {f"members/t_{j}/{k}": v for j in (0, 1) for k, v in
                                  ((obj.THROUGHPUT, 10.0), (obj.QUALITY, -1.0 - j), ("pbt/exploits", float(j)))})
    assert inner.told == {"t~0": ({obj.THROUGHPUT: 10.0, obj.QUALITY: -1.0}, False), "t~1": (None, True)}


def test_a_member_found_unstable_before_a_resume_is_known_unstable_from_the_sweeps_log(tmp_path):
    """What the sweep's objective log keeps of a vectorized trial's reports is enough for a resumed trial to
    keep a member frozen with its verdict (population.unstable_before) instead of training it afresh."""
    from types import SimpleNamespace

    from raysys.tune import objectives as obj
    from raysys.tune.population import unstable_before
    from raysys.tune.progress import OBJECTIVES_DIR, ObjectiveLog

    log = ObjectiveLog(str(tmp_path / OBJECTIVES_DIR))
    trial = SimpleNamespace(trial_id="t")
    log.on_trial_result(0, [], trial, {"members/t_0/step": 1, "members/t_0/stability/unstable": 0.0,
                                       "members/t_1/step": 1, "members/t_1/stability/unstable": 0.0})
    log.on_trial_result(1, [], trial, {"members/t_1/step": 2, "members/t_1/stability/unstable": 1.0,
                                       f"members/t_1/{obj.REASON}": "charts/entropy = 0.1 below its floor 0.5"})
    setup = SimpleNamespace(sweep_dir=str(tmp_path))
    verdicts = unstable_before(setup, "t")
    assert verdicts.get("t_0") is None
    assert verdicts.get("t_1") == "charts/entropy = 0.1 below its floor 0.5"
    assert unstable_before(setup, "other").get("other_0") is None
