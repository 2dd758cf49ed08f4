"""The AD transformer: the original's samples (read out at the query, never at padding), one function on
both paths, in-context evaluation, a run through the CLI, resume at the exact batch, DDP, a sweep."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raysys.config import apply_overrides
from test_faults import STOPPER as FAULTS_STOPPER
from raysys.workloads.ad_transformer import icl
from raysys.workloads.ad_transformer.data import (END, END_OF_REGION, PAD, QUERY, START, TRANSITION, RegionSamples,
                                                  collate, pack)
from raysys.workloads.ad_transformer.model import ADTransformer, loss_fn
from raysys.workloads.ad_transformer.workload import DistillationTask, quick

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The quick preset's histories (a real source PPO run, ~30 s), generated once for this module."""
    d = tmp_path_factory.mktemp("ad") / "data"
    cfg = apply_overrides(quick(), {"data.data_dir": str(d)})
    DistillationTask().prepare(cfg)
    return d


@pytest.fixture(scope="module")
def streams(data_dir):
    task = DistillationTask()
    cfg = task.prepare(apply_overrides(quick(), {"data.data_dir": str(data_dir)}))
    packed, evals = task.datasets(cfg)
    return packed, RegionSamples(packed.s, packed.region, batched=False), cfg


def _model(**kw):
    torch.manual_seed(0)
    return ADTransformer(**kw).eval()


def test_a_sample_is_the_originals_layout_with_the_query_last(streams):
    packed, naive, cfg = streams
    R = cfg.data.region
    s = naive.sample(3, 2, 7)  # stream 3, region 2, 7 steps into it
    start = 2 * R
    assert s["prev_region_len"] == R and s["curr_region_len"] == 7
    assert np.array_equal(s["actions"], packed.s.actions[3, start - R:start + 7])
    assert np.array_equal(s["query_states"], packed.s.states[3, start + 7])
    assert s["target_actions"] == packed.s.actions[3, start + 7] and s["target_token_type"] == 0
    assert naive.sample(3, 2, R)["target_token_type"] == END_OF_REGION  # a full region: its end is the target
    first = naive.sample(3, 0, 0)
    assert first["prev_region_len"] == 0 and len(first["states"]) == 0  # a stream's first step: no context
    # the packed layout of one query: [cs, prev, ce, cs, prefix, query], nothing after the query
    b = pack(packed.s, [3], [2], [7], R)
    kind = b["kind"][0].numpy()
    expect = [START] + [TRANSITION] * R + [END, START] + [TRANSITION] * 7 + [QUERY]
    assert kind.tolist() == expect and b["causal"]
    assert PAD not in kind.tolist()


def test_padding_never_reaches_the_read_out(streams):
    """The original padded after the query and read the last position; a short sample's output must not
    depend on the longer samples it is batched with."""
    packed, naive, cfg = streams
    m = _model()
    short = naive.sample(1, 0, 3)
    with torch.no_grad():
        alone = m(collate([short]))[0]
        batched = m(collate([short, naive.sample(2, 3, cfg.data.region - 1)]))[0][:1]
    assert torch.allclose(alone, batched, atol=1e-5)


@pytest.mark.parametrize("regions", [[0], [5], [0, 7, 13, 21]])
def test_both_paths_compute_the_same_loss(streams, regions):
    packed, naive, cfg = streams
    m = _model()
    with torch.no_grad():
        fast = loss_fn(m, collate(packed.__getitems__(regions)))[0]
        slow = loss_fn(m, collate([naive[i] for i in regions]))[0]
    assert abs(float(fast) - float(slow)) < 1e-4
    grads = []  # with gradients too: the same gradient on every parameter
    for batch in (collate(packed.__getitems__(regions)), collate([naive[i] for i in regions])):
        m.zero_grad()
        loss_fn(m, batch)[0].backward()
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in m.parameters()])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))


def test_the_benchs_learning_check_trains_both_paths_alike(streams):
    """The bench's learning parity (bench.learning_curves): both paths from the same weights on the same
    batches learn, step for step, the same curve."""
    from raysys.workloads.ad_transformer.bench import PARITY_TOL, learning_curves

    packed, naive, cfg = streams
    build = {"naive": lambda ids: collate([naive[i] for i in ids]),
             "optimized": lambda ids: collate(packed.__getitems__(ids))}
    order = np.random.default_rng(0).permutation(len(packed))
    curves = learning_curves(DistillationTask(), cfg, build, order, 2, 6, torch.device("cpu"))
    assert len(curves["naive"]) == 6 and curves["naive"][-1] < curves["naive"][0]
    assert max(abs(a - b) for a, b in zip(curves["naive"], curves["optimized"])) < PARITY_TOL * 1e-2


def test_bf16_autocast_runs_on_both_paths(streams):
    packed, naive, _ = streams
    m = _model()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        fast = float(loss_fn(m, collate(packed.__getitems__([4, 9])))[0])
        slow = float(loss_fn(m, collate([naive[i] for i in (4, 9)]))[0])
    assert np.isfinite(fast) and abs(fast - slow) < 0.05


def test_in_context_rollout_and_baselines():
    m = _model(max_len=2 * 10 + 4)
    out = icl.rollout(m, [3, 40], streams=2, episodes=3, region=10, seed=1)
    assert out["returns"].shape == (2, 2, 3) and 0.0 <= out["end_token_accuracy"] <= 1.0
    assert (out["returns"] >= 0).all() and (out["returns"] <= 20).all()
    again = icl.rollout(m, [3, 40], streams=2, episodes=3, region=10, seed=1)
    assert np.array_equal(out["returns"], again["returns"])  # seeded
    rnd = icl.random_returns([40, 3])  # 40 is the centre: a random walk sits on it often
    assert rnd[0] > rnd[1] > 0.0
    s = icl.summarize(out["returns"], 2, rnd, [3, 40], np.ones((2, 3)))
    assert {"icl_return_first", "icl_return_last", "random_return", "source_return_last", "optimal_return"} <= set(s)


def _train(cwd: Path, *args: str, env=None, timeout=900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "raysys", "train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(args, "->", proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return proc


def test_a_quick_run_trains_and_evaluates_in_context(tmp_path, data_dir, capsys):
    proc = _train(tmp_path, "ad_transformer", "--preset", "quick", "--workers", "0", "--name", "q",
                  "--set", f"data.data_dir={data_dir}")
    assert proc.returncode == 0
    final = json.loads((tmp_path / "raysys_runs" / "q" / "final_metrics.json").read_text())
    assert final["step"] == 6 and final["perf/samples_per_s"] > 0
    for k in ("eval/icl_return_first", "eval/icl_return_last", "eval/random_return", "eval/source_return_last",
              "eval/optimal_return", "eval/end_token_accuracy", "eval/icl_return_ep5"):
        assert k in final, k
    assert final["eval/source_return_last"] > 2 * final["eval/random_return"]  # the source PPO learned
    # the run evaluated again by the in-context CLI: a count of 0 was taken for "not given"
    assert icl.main([str(tmp_path / "raysys_runs" / "q"), "--episodes", "0"]) == 2
    assert icl.main([str(tmp_path / "raysys_runs" / "q"), "--episodes", "1", "--streams", "1"]) == 0
    out = capsys.readouterr()
    assert "raysys: --episodes must be at least 1, got 0" in out.err and "last 1 episode: " in out.out


@pytest.mark.parametrize("args, line", [
    (["--config", '{"foo": 1}'], "raysys: unknown config key 'foo'"),
    (["--config", "notjson"], "raysys: --config is not JSON"),
    (["--config", '{"streams": 3, "steps_per_goal": 100}'], "raysys: source.minibatch (50) must divide streams x "
                                                             "n_steps = 60"),
    (["--goals", "1,x"], "raysys: --goals must be 'all' or comma-separated cell numbers, got '1,x'"),
    (["--goals", "100,200"], "raysys: --goals must be distinct cells of the 9x9 grid, 0..80, got 100,200"),
])
def test_the_history_generators_mistakes_are_one_line(tmp_path, capsys, args, line):
    """Its user's mistakes were tracebacks, and goals off the grid made a 'finished' folder of unreachable goals."""
    from raysys.workloads.ad_transformer import histories

    assert histories.main(["--out", str(tmp_path / "h"), *args]) == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(line) and not (tmp_path / "h").exists()


def test_a_missing_histories_folder_is_one_line_and_creates_nothing(tmp_path):
    proc = _train(tmp_path, "ad_transformer", "--preset", "quick", "--workers", "0", "--name", "bad",
                  "--set", f"data.histories={tmp_path / 'nowhere'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("raysys:")]
    assert "data.histories" in line and "nowhere" in line
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("case, needle", [
    ("corrupt", "shard_000.npz is not a readable numpy .npz shard"),
    ("short", "its streams are 30 steps long: no full region of data.region=40 steps"),
    ("few_goals", "has no histories of goals [16, 19,"),
    ("bad_actions", "shard_000.npz: actions must lie in 0..4 (a 9x9 Darkroom with 5 actions), found 0..7"),
    ("bad_states", "shard_000.npz: states must lie in 0..8"),
    ("truncated", "shard_000.npz is not a readable numpy .npz shard (BadZipFile)"),
    ("twice", "manifest.json: its shards' goals are not its 'goals', each once"),
    ("renamed", "; the manifest says ["),
    ("steps", "manifest.json: 'steps' is 'abc', not a whole number of at least 1"),
    ("no_streams", "manifest.json: 'streams' is 0, not a whole number of at least 1"),
])
def test_histories_a_run_cannot_use_are_one_line_and_create_nothing(tmp_path, data_dir, case, needle):
    """A user's history folder is checked before the run exists: its shards open, it holds the goals the
    run trains on and streams long enough for a region (they were found in the first step, after the
    run folder and a FAILED MLflow run were made)."""
    import shutil

    from raysys.workloads.ad_transformer import histories as H

    (made,) = (m.parent for m in data_dir.glob("histories-*/manifest.json"))
    bad = tmp_path / "hist"
    if case == "corrupt":
        shutil.copytree(made, bad)
        (bad / "shard_000.npz").write_text("garbage")
    elif case == "truncated":  # a copy cut short: numpy's zip reader raised BadZipFile, a traceback
        shutil.copytree(made, bad)
        whole = (bad / "shard_000.npz").read_bytes()
        (bad / "shard_000.npz").write_bytes(whole[: len(whole) // 2])
    elif case in ("twice", "renamed", "steps", "no_streams"):  # a manifest edited by hand: goals dropped or trained twice
        shutil.copytree(made, bad)
        m = json.loads((bad / "manifest.json").read_text())
        if case == "twice":
            m["shards"].append(m["shards"][0])
        elif case == "renamed":  # the manifest's lists agree with each other, not with the shard's file
            from raysys.workloads.ad_transformer.workload import DistillationTask, quick

            cfg = quick()
            cfg.data.train_goals = 20
            trained = set(DistillationTask().goals(cfg)[0].tolist())  # a goal the run does not ask for: it loaded another
            shard, g = next((s, g) for s in m["shards"] for g in s["goals"] if g not in trained)
            m["goals"][m["goals"].index(g)] = 99
            shard["goals"][shard["goals"].index(g)] = 99
        elif case == "steps":
            m["steps"] = "abc"
        else:
            m["streams"] = 0
        (bad / "manifest.json").write_text(json.dumps(m))
    elif case == "short":
        h = H.load(made)
        H.save(H.Histories(h.goals, *(getattr(h, k)[:, :, :30] for k in ("states", "actions", "rewards", "next_states")),
                           h.returns), bad)
    elif case.startswith("bad_"):  # values a Darkroom never gives: they failed inside the model, mid-run
        h = H.load(made)
        h.actions[0, 0, 3] = 7 if case == "bad_actions" else h.actions[0, 0, 3]
        h.states[0, 0, 3] = 12 if case == "bad_states" else h.states[0, 0, 3]
        H.save(h, bad)
    else:
        H.save(H.load(made, list(range(9))), bad)
    proc = _train(tmp_path, "ad_transformer", "--preset", "quick", "--workers", "0", "--set", "data.histories=hist",
                  "--set", "data.train_goals=20")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("raysys:")]
    assert line.startswith("raysys: config error: data.histories: ") and needle in line, line
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


# ad_transformer stopped as test_faults stops its workloads: a request to stop when micro-batch STOP_AT begins
STOPPER = FAULTS_STOPPER.replace("from digits_mlp import WORKLOAD as BASE, DigitsTask",
                                 "from raysys.workloads.ad_transformer.workload import WORKLOAD as BASE, "
                                 "DistillationTask as DigitsTask").replace('"digits_stop"', '"ad_stop"')


def test_resume_continues_at_the_exact_batch(tmp_path, data_dir):
    """Stopped mid-epoch (dropout on), resumed: the loss of every step equals the uninterrupted run's."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "ad_stopper.py").write_text(STOPPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    common = ["ad_stopper:WORKLOAD", "--preset", "quick", "--workers", "0", "--set", f"data.data_dir={data_dir}",
              "--set", "train.max_steps=12", "--set", "train.log_every_steps=1", "--set", "eval.episodes=2",
              "--set", "eval.last_episodes=1"]
    assert _train(tmp_path, *common, "--name", "whole", env=env).returncode == 0
    assert _train(tmp_path, *common, "--name", "cut", env={**env, "STOP_AT": "7"}).returncode == 130
    assert _train(tmp_path, "ad_stopper:WORKLOAD", "--name", "cut", "--resume", env=env).returncode == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-ad_stop")
    ids = {r.info.run_name: r.info.run_id for r in client.search_runs([exp.experiment_id])}
    losses = {n: {m.step: m.value for m in client.get_metric_history(ids[n], "train/loss")} for n in ids}
    assert len(losses["whole"]) == 12 and losses["whole"] == losses["cut"]


@pytest.mark.slow  # ~20 s; test_train_deep_gpcm.py checks the same rule by default
def test_a_run_resumes_from_another_folder_on_a_copy_of_its_histories_but_not_on_others(tmp_path, data_dir):
    """Where the histories lie is not what the run is (a lost node: resume elsewhere from shared storage):
    the copy in another folder resumes the run; the same path holding other histories does not."""
    import shutil

    (made,) = (m.parent for m in data_dir.glob("histories-*/manifest.json"))
    a, b = tmp_path / "A", tmp_path / "B"
    for d in (a, b):
        shutil.copytree(made, d / "hist")
    from raysys.envs.darkroom import goal_split
    from raysys.workloads.ad_transformer import histories

    # the digest a run keeps comes from its check's one read of each shard, and is the folder's, wherever it is
    assert histories.check(a / "hist", goal_split()[0], 40) == histories.digest(b / "hist") == histories.digest(made)
    common = ["ad_transformer", "--preset", "quick", "--workers", "0", "--name", "r", "--storage-path",
              str(tmp_path / "store"), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--set",
              "data.histories=hist", "--set", "eval.episodes=2", "--set", "eval.last_episodes=1"]
    assert _train(a, *common, "--set", "train.max_steps=3").returncode == 0
    assert _train(b, *common, "--resume", "--set", "train.max_steps=6").returncode == 0
    assert "resumed step=3 " in (tmp_path / "store" / "r" / "events.log").read_text()
    shard = sorted((b / "hist").glob("shard_*.npz"))[0]
    with np.load(shard) as z:
        arrays = dict(z)
    arrays["actions"][0, 0, 0] = (arrays["actions"][0, 0, 0] + 1) % 5  # one action of one history
    np.savez(shard, **arrays)
    proc = _train(b, *common, "--resume", "--set", "train.max_steps=9")
    assert proc.returncode == 2 and "different config: data.digest" in proc.stderr


def test_a_resume_on_generated_histories_that_were_replaced_is_refused(tmp_path, data_dir):
    """Generated histories are named by their source settings, which a folder replaced by hand or copied from
    elsewhere keeps: the run resumed on them, trained on other data, its epoch ending at once."""
    import shutil

    shutil.copytree(data_dir, tmp_path / "data")
    (made,) = (m.parent for m in (tmp_path / "data").glob("histories-*/manifest.json"))
    common = ["ad_transformer", "--preset", "quick", "--workers", "0", "--name", "g", "--set", "data.data_dir=data",
              "--set", "eval.episodes=2", "--set", "eval.last_episodes=1"]
    assert _train(tmp_path, *common, "--set", "train.max_steps=3").returncode == 0
    shard = sorted(made.glob("shard_*.npz"))[0]
    with np.load(shard) as z:
        arrays = dict(z)
    arrays["actions"][0, 0, 0] = (arrays["actions"][0, 0, 0] + 1) % 5
    np.savez(shard, **arrays)
    proc = _train(tmp_path, *common, "--resume", "--set", "train.max_steps=6")
    assert proc.returncode == 2 and "different config: data.generated_digest" in proc.stderr
    assert "(data.generated_digest: the data files now hold other data than the run trained on)" in proc.stderr


def test_a_resume_that_changes_the_source_ppo_is_refused_before_it_generates_histories(tmp_path, data_dir):
    """The histories a changed source.* would need take minutes to generate, and the checkpoint refuses the
    run anyway: refused first, with nothing generated."""
    common = ["ad_transformer", "--preset", "quick", "--workers", "0", "--name", "s", "--set",
              f"data.data_dir={data_dir}", "--set", "eval.episodes=2", "--set", "eval.last_episodes=1"]
    assert _train(tmp_path, *common, "--set", "train.max_steps=2").returncode == 0
    before = sorted(p.name for p in data_dir.iterdir())
    proc = _train(tmp_path, *common, "--resume", "--set", "source.lr=0.001", timeout=120)
    assert proc.returncode == 2
    assert "different config: source.lr: checkpoint=0.0003 now=0.001" in proc.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in data_dir.iterdir()) == before


@pytest.mark.slow  # ~2 min: two Ray Train workers
def test_two_ddp_workers_match_one_on_the_same_global_batches(tmp_path, data_dir):
    common = ["ad_transformer", "--preset", "quick", "--set", f"data.data_dir={data_dir}", "--set", "model.dropout=0",
              "--set", "train.max_steps=5", "--set", "eval.episodes=2", "--set", "eval.last_episodes=1"]
    assert _train(tmp_path, *common, "--workers", "1", "--set", "train.batch_size=4", "--name", "one").returncode == 0
    assert _train(tmp_path, *common, "--workers", "2", "--set", "train.batch_size=2", "--name", "two").returncode == 0
    weights = {}
    for n in ("one", "two"):
        final = json.loads((tmp_path / "raysys_runs" / n / "final_metrics.json").read_text())
        assert final["step"] == 5
        (ckpt,) = sorted((tmp_path / "raysys_runs" / n / "checkpoints").glob("step_*"))[-1:]
        weights[n] = torch.load(next(ckpt.glob("*.pt")), weights_only=True)["model"]
        assert final["world_size"] == (1 if n == "one" else 2)
    diff = max(float((weights["one"][k] - weights["two"][k]).abs().max()) for k in weights["one"])
    assert diff < 1e-4, diff


# ~1 min: one naive and one optimized trial of the shipped space, 2 steps each
@pytest.mark.slow  # ~40 s; test_tune_sweep sweeps a Ray Train workload by default
def test_a_two_trial_sweep_of_the_shipped_space(tmp_path, data_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", str(REPO / "tune_spaces" / "ad_transformer.yaml"),
                           "--num-samples", "2", "--max-concurrent", "2", "--preset", "quick", "--name", "ad",
                           "--set", f"data.data_dir={data_dir}", "--set", "train.max_steps=2", "--set",
                           "train.batch_size=1", "--set", "eval.episodes=2", "--set", "eval.last_episodes=1",
                           "--set", "eval.streams=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-ad_transformer")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert sorted(c.data.params["model.path"] for c in children) == ["naive", "optimized"]
    for c in children:
        assert c.data.tags["raysys.trial_status"] == "ok"
        assert "eval/icl_return_last" in c.data.metrics and c.data.metrics["perf/samples_per_s"] > 0


def test_generated_histories_that_were_damaged_are_one_line_and_create_nothing(tmp_path, data_dir):
    """The generated folder is checked as a user's is (only its manifest was looked for): a shard cut short
    failed as a traceback after the run existed, a held-out goal's shard lost at the first evaluation, and the
    --resume the error advised met it again."""
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    (made,) = (m.parent for m in copy.glob("histories-*/manifest.json"))
    last = sorted(made.glob("shard_*.npz"))[-1]
    last.unlink()
    proc = _train(tmp_path, "ad_transformer", "--preset", "quick", "--workers", "0", "--set", f"data.data_dir={copy}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("raysys:")]
    assert line == (f"raysys: config error: the histories generated in {made} are damaged ({last} is not a readable "
                    "numpy .npz shard (FileNotFoundError)): delete that folder, and the next run generates them again")
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_region_longer_than_the_generated_streams_is_refused():
    """The streams are whole PPO rollouts long: 599 steps per goal over 10 streams of 20-step rollouts are 2
    rollouts, 40 steps (the check took 59, and the run failed after it existed)."""
    from raysys.config import ConfigError

    assert apply_overrides(quick(), {"source.steps_per_goal": 599, "data.region": 39}).data.region == 39
    with pytest.raises(ConfigError, match=r"the source's streams are 40 steps long .* data.region \(40\) must be "
                                          "shorter, with one step left for its query"):
        apply_overrides(quick(), {"source.steps_per_goal": 599, "data.region": 40})


def test_the_source_curve_is_per_episode_whatever_the_rollout_length(data_dir):
    """The source PPO's baseline "at the same episode" is each stream's episodes' returns (20 steps each): its
    per-update returns are that only where an update is one episode (n_steps 20, as the quick preset's). A
    rollout shorter than an episode, whose updates end none, is refused."""
    from raysys.config import ConfigError
    from raysys.workloads.ad_transformer import histories as H

    (made,) = (m.parent for m in data_dir.glob("histories-*/manifest.json"))
    h = H.load(made, [29, 33])
    np.testing.assert_allclose(icl.episode_returns(h.rewards), h.returns, atol=1e-5)
    rewards = np.zeros((1, 2, 50), np.int8)  # 2.5 episodes per stream: the cut one left out
    rewards[0, 0, [3, 4, 25, 45]] = 1
    rewards[0, 1, [21]] = 1
    np.testing.assert_allclose(icl.episode_returns(rewards), [[1.0, 1.0]])
    with pytest.raises(ConfigError, match=r"source.n_steps \(10\) must be at least Darkroom's episode length, 20"):
        apply_overrides(quick(), {"source.n_steps": 10, "source.minibatch": 10})


def test_asking_for_more_goals_or_streams_than_exist_is_refused():
    from raysys.config import ConfigError, apply_overrides
    from raysys.envs.darkroom import goal_split
    from raysys.workloads.ad_transformer.workload import quick

    n = len(goal_split()[0])
    assert apply_overrides(quick(), {"data.train_goals": n}).data.train_goals == n
    with pytest.raises(ConfigError, match=f"data.train_goals \\({n + 1}\\) must be <= {n}"):
        apply_overrides(quick(), {"data.train_goals": n + 1})
    with pytest.raises(ConfigError, match="data.streams \\(11\\) must be <= source.streams \\(10\\)"):
        apply_overrides(quick(), {"data.streams": 11})


def test_a_subset_of_training_goals_is_drawn_from_the_whole_grid():
    """The first k cells by number are the grid's top rows: a model trained on them never sees a goal below."""
    from raysys.envs.darkroom import SIZE, goal_split
    from raysys.workloads.ad_transformer.workload import DistillationTask, quick

    task, cfg = DistillationTask(), quick()
    train, held_out = task.goals(cfg)
    assert len(train) == cfg.data.train_goals == 8 and set(train) <= set(goal_split()[0])
    assert len(set((train // SIZE).tolist())) >= 4  # rows: 8 drawn of 73 lie in at least 4 of the 9
    assert (task.goals(cfg)[0] == train).all()  # the same subset every time: a resume trains on the same goals
    cfg.data.split_seed = 1
    assert set(task.goals(cfg)[0]) != set(train)
    cfg.data.train_goals = None
    assert (task.goals(cfg)[0] == goal_split(seed=1)[0]).all()
