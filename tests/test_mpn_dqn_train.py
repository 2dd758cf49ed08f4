"""The mpn_dqn workload end to end: CLI, learning above random, resume, Ray rollout actors."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from raysys import workload as registry
from raysys.cli import main
from raysys.config import ConfigError, apply_overrides
from raysys.workloads.mpn_dqn.train import epsilon_at, sync_period


def _final(workdir, name: str) -> dict:
    return json.loads((workdir / "raysys_runs" / name / "final_metrics.json").read_text())


def test_seed_command_translates_and_schedules():
    cfg = apply_overrides(registry.get("mpn_dqn").config(), {
        "sequence_length": "10", "sequence_batch_size": "64", "train_freq": "4", "num_episodes": "100",
        "max_episode_steps": "200", "print_freq": "5", "checkpoint_freq": "25", "device": "cpu"})
    assert (cfg.sequence_batch_size, cfg.train_freq, cfg.path) == (64, 4, "optimized")
    # ε: 1.0 -> 0.01 over the first 30% of episodes, then flat
    assert epsilon_at(cfg, 0) == 1.0 and epsilon_at(cfg, 15) == pytest.approx(0.505)
    assert epsilon_at(cfg, 30) == pytest.approx(0.01) and epsilon_at(cfg, 99) == pytest.approx(0.01)
    # the target syncs about 50 times in this run (the original's 10k-update period: never)
    assert sync_period(cfg) == (100 * 200 - 1000) // 4 // 50
    with pytest.raises(ConfigError, match="sequence_lenght"):
        apply_overrides(cfg, {"sequence_lenght": 10})
    with pytest.raises(ConfigError, match="precision, compile and cuda_graph"):
        apply_overrides(registry.get("mpn_dqn").config("original"), {"precision": "bf16"})
    # a replay that never holds learning_starts transitions: the run trained nothing and ended as a success
    quick = registry.get("mpn_dqn").config("quick")
    with pytest.raises(ConfigError, match=rf"learning_starts \(200\) is more than buffer_capacity \(130\) ever "
                                          rf"holds \({130 // quick.num_envs * quick.num_envs} transitions"):
        apply_overrides(quick, {"buffer_capacity": 130})
    with pytest.raises(ConfigError, match=r"8 episodes of at most 100 steps give at most 900 transitions, fewer than "
                                          r"learning_starts \(200\) \+ train_freq \(100000\): no update would run"):
        apply_overrides(quick, {"train_freq": 100_000})
    for bad, said in (({"lam": -5}, "lam, the plastic memory's decay, must be in"), ({"max_seconds": 0}, "max_seconds")):
        with pytest.raises(ConfigError, match=said):
            apply_overrides(quick, bad)
    # the CUDA-graphed update (tests/test_gpu.py runs it): its limits are config errors, found up front
    for bad, fragment in (({"device": "cpu"}, "needs a CUDA learner"), ({"precision": "fp16"}, "fp16"),
                          ({"compile": True}, "pick one"), ({"launch.workers": 2}, "across learners")):
        with pytest.raises(ConfigError, match=fragment):
            apply_overrides(cfg, {"cuda_graph": True, "device": "cuda", **bad})


@pytest.mark.timeout(300)
# naive (~25 s) is slow-only: both paths' TD losses are checked equal in test_mpn_dqn_model by default
@pytest.mark.parametrize("path", ["optimized", pytest.param("naive", marks=pytest.mark.slow)])
def test_learns_above_random_policy(workdir, path):
    """Both TD-loss paths learn ContextDecisionMaking: the greedy policy's reward per trial beats a
    uniformly random policy's on fresh trials (the quick preset: 8 episodes of 100 steps)."""
    extra = ["--set", "path=naive", "--set", "sequence_batch_size=16"] if path == "naive" else []
    assert main(["train", "mpn_dqn", "--preset", "quick", "--name", "q", *extra]) == 0
    m = _final(workdir, "q")
    assert m["charts/episodes"] == 8 and m["perf/updates"] > 100
    assert m["eval/reward_per_trial"] > m["eval/random_reward_per_trial"] + 0.2, m
    for key in ("charts/final_avg_reward", "losses/td_loss", "perf/env_steps_per_s", "perf/updates_per_s",
                "charts/epsilon", "eval/quality"):
        assert key in m


@pytest.mark.timeout(300)
def test_resume_continues_episodes_and_replay(workdir, capsys):
    args = ["train", "mpn_dqn", "--preset", "quick", "--name", "r", "--set", "eval_trials=0"]
    assert main([*args, "--set", "num_episodes=4"]) == 0
    first = _final(workdir, "r")
    assert first["charts/episodes"] == 4
    # the replay's filled rows only (400 of 50,000): the whole allocation made every checkpoint megabytes
    (state,) = (workdir / "raysys_runs" / "r" / "checkpoints").glob("step_*/state.pt")
    assert state.stat().st_size < 500_000
    capsys.readouterr()
    assert main([*args, "--set", "num_episodes=6", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed at episode 4" in out
    second = _final(workdir, "r")
    assert second["charts/episodes"] == 6
    # only the new episodes were stepped (plus the rest of the last 16-step sample call), and
    # learning went on at once: the replay came back, so learning_starts=200 did not wait again
    steps = second["perf/env_steps_this_session"]
    assert 200 <= steps < 200 + 16 and second["perf/env_steps"] == first["perf/env_steps"] + steps
    assert second["perf/updates_this_session"] == steps // 4
    # resumed after its end: nothing trains, and the final metrics it recorded stay as they were (its
    # speed used to become 0 and its evaluation ran again with any --set given now)
    kept = (workdir / "raysys_runs" / "r" / "final_metrics.json").read_text()
    assert main([*args, "--set", "num_episodes=6", "--resume"]) == 0
    assert "nothing left to train" in capsys.readouterr().out
    assert (workdir / "raysys_runs" / "r" / "final_metrics.json").read_text() == kept


@pytest.mark.timeout(300)
def test_a_run_stopped_in_its_final_evaluation_resumes_into_it(workdir, capsys, monkeypatch):
    """The end checkpoint came before the evaluation: a run stopped (or killed) in it resumed as "done",
    FINISHED with no eval/* metrics. Now the evaluation heeds the stop, and the resume evaluates."""
    from raysys import lifecycle
    from raysys.workloads.mpn_dqn import train

    evaluate = train.evaluate

    def stopped_midway(model, cfg, trials, epsilon=0.0, seed=12345, stop=None):
        lifecycle.request_stop()  # as a SIGINT in the evaluation would: the next episode sees it
        return evaluate(model, cfg, trials, epsilon, seed, stop)

    args = ["train", "mpn_dqn", "--preset", "quick", "--name", "e", "--set", "eval_trials=40"]
    monkeypatch.setattr(train, "evaluate", stopped_midway)
    assert main(args) == 130
    out = capsys.readouterr().out
    assert "stopped in the final evaluation, after 8 episodes; checkpoint saved: the resume evaluates" in out
    run = workdir / "raysys_runs" / "e"
    assert not (run / "final_metrics.json").exists()
    monkeypatch.setattr(train, "evaluate", evaluate)
    lifecycle.reset()
    assert main([*args, "--resume"]) == 0
    assert "its training had ended; its final evaluation had not: evaluating now" in capsys.readouterr().out
    m = _final(workdir, "e")
    assert m["charts/episodes"] == 8 and "eval/reward_per_trial" in m and "eval/random_reward_per_trial" in m
    assert m["perf/env_steps_per_s"] > 0  # the training session's, kept with its end


@pytest.mark.timeout(420)
def test_rollout_actors_survive_a_killed_actor(workdir, monkeypatch):
    """2 Ray actors x 4 envs on a real local Ray cluster; one actor's process is SIGKILLed just before
    the second collection round (a fixed point, not a race with a polling thread), the pool replaces
    it and the run completes, saying so in its metrics."""
    import ray

    from raysys.rl import rollout

    killed = []
    real = rollout.RolloutPool.sample_async

    def sample_async(self, *args, **kw):
        if not killed and getattr(self, "_rounds", 0) == 1:
            pid = ray.get(self.actors[0].__ray_call__.remote(lambda worker: os.getpid()))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        self._rounds = getattr(self, "_rounds", 0) + 1
        return real(self, *args, **kw)

    monkeypatch.setattr(rollout.RolloutPool, "sample_async", sample_async)
    try:
        assert main(["train", "mpn_dqn", "--preset", "actors", "--name", "a", "--set", "num_episodes=24",
                     "--set", "max_episode_steps=50", "--set", "learning_starts=200", "--set", "print_freq=4",
                     "--set", "eval_trials=20"]) == 0
    finally:
        ray.shutdown()
    m = _final(workdir, "a")
    assert killed
    assert m["charts/actor_restarts"] >= 1
    assert m["charts/episodes"] >= 24
    assert m["perf/env_steps"] >= 24 * 50


@pytest.mark.slow  # ~45 s: two Ray Train workers; test_train_deep_gpcm checks DDP against one worker by default
@pytest.mark.timeout(300)
def test_data_parallel_learners_stay_in_step(workdir):
    """launch.workers=2: two Ray Train workers, each with its own envs and replay, average their
    gradients every update; they end with identical weights, and only rank 0 logs/checkpoints."""
    import ray
    import torch

    try:
        assert main(["train", "mpn_dqn", "--preset", "quick", "--workers", "2", "--name", "dp",
                     "--set", "num_episodes=6", "--set", "eval_trials=20"]) == 0
    finally:
        ray.shutdown()
    m = _final(workdir, "dp")
    assert m["world_size"] == 2 and m["charts/episodes"] >= 6 and m["perf/updates"] > 0
    # rank 0's checkpoint is the run's; each rank also left a fingerprint of its final weights
    prints = sorted((workdir / "raysys_runs" / "dp").glob("weights_rank*.txt"))
    assert len(prints) == 2 and prints[0].read_text() == prints[1].read_text()
    ckpt = sorted((workdir / "raysys_runs" / "dp" / "checkpoints").glob("step_*"))[-1]
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["counters"]["episodes"] >= 6


def test_device_flag_maps_to_the_device_key():
    from raysys.cli import build_config, build_parser

    _, cfg = build_config(build_parser().parse_args(["train", "mpn_dqn", "--device", "cpu", "--experiment", "fast"]))
    assert cfg.device == "cpu" and cfg.launch.experiment == "fast"
    with pytest.raises(ConfigError, match="no `device` key"):
        build_config(build_parser().parse_args(["train", "deep_gpcm", "--device", "cpu"]))


@pytest.mark.timeout(120)
def test_an_episode_limit_shorter_than_a_trial_still_ends_the_evaluation():
    """A NeuroGym task whose trial outlasts max_episode_steps never says a trial ended: each cut episode
    counts as one (before, the evaluation of such a run looped for ever, deaf to SIGTERM)."""
    from raysys.workloads.mpn_dqn.train import evaluate, policy_factory

    cfg = apply_overrides(registry.get("mpn_dqn").config("quick"), {"max_episode_steps": 3, "learning_starts": 0})
    res = evaluate(policy_factory(cfg)(), cfg, trials=3)
    assert 0.0 <= res["correct_rate"] <= 1.0 and math.isfinite(res["reward_per_trial"])


def test_evaluation_of_a_task_without_trials_counts_episodes():
    """``task`` may be any gymnasium id (a flat Box observation, Discrete actions). One that never says
    ``new_trial`` (CartPole) is evaluated per episode: before, its evaluation waited for ever."""
    from raysys.workloads.mpn_dqn.train import evaluate, policy_factory

    cfg = apply_overrides(registry.get("mpn_dqn").config("quick"), {"task": "CartPole-v1", "max_episode_steps": 50})
    model = policy_factory(cfg)()
    res = evaluate(model, cfg, trials=4)
    # a trial is a whole episode (CartPole pays +1 a step, an episode lasts 8+ steps; counted per step,
    # a trial would be worth exactly 1), cut at the 50-step limit: the mean of the same 4 greedy episodes
    alone = [evaluate(model, cfg, trials=1, seed=12345 + i)["reward_per_trial"] for i in range(4)]
    assert res["reward_per_trial"] == pytest.approx(sum(alone) / 4) and all(5 < a <= 50 for a in alone), (res, alone)


@pytest.mark.timeout(300)
def test_a_tasks_own_keyword_arguments_reach_its_envs_and_its_identity(workdir, capsys):
    """``task_kwargs`` (a mapping, set entry by entry or as YAML) are the task's constructor arguments: every
    env the run makes gets them, a wrong one is one line before anything exists, and a resume with others
    is refused (they change the task the agent learned)."""
    from raysys.workloads.mpn_dqn.train import env_factory

    quick = registry.get("mpn_dqn").config("quick")
    cfg = apply_overrides(quick, {"task_kwargs.dt": "20", "task_kwargs.timing.fixation": "60"})
    assert cfg.task_kwargs == {"dt": 20, "timing": {"fixation": 60}}
    assert apply_overrides(quick, {"task_kwargs": "{dt: 20, timing: {fixation: 60}}"}).task_kwargs == cfg.task_kwargs
    env = env_factory(cfg)()
    assert env.unwrapped.dt == 20 and env.unwrapped.timing["fixation"] == 60
    assert set(env.unwrapped.timing) == set(env_factory(quick)().unwrapped.timing)  # its other timings kept
    with pytest.raises(ConfigError, match="expected a mapping"):
        apply_overrides(quick, {"task_kwargs": "[20]"})

    args = ["train", "mpn_dqn", "--preset", "quick", "--set", "eval_trials=0", "--set", "num_episodes=2"]
    assert main([*args, "--name", "bad", "--set", "task_kwargs.no_such_arg=1"]) == 2
    err = capsys.readouterr().err
    assert "task_kwargs {'no_such_arg': 1}" in err and "no_such_arg" in err.strip().splitlines()[-1]
    assert not (workdir / "raysys_runs" / "bad").exists()

    assert main([*args, "--name", "k", "--set", "task_kwargs.dt=50"]) == 0
    assert _final(workdir, "k")["charts/episodes"] == 2
    capsys.readouterr()
    assert main([*args, "--name", "k", "--set", "task_kwargs.dt=100", "--set", "num_episodes=3", "--resume"]) == 2
    assert "task_kwargs.dt: checkpoint=50 now=100" in capsys.readouterr().err
