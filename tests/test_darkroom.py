"""Darkroom (raysys/envs/darkroom.py) and the population PPO that writes its learning histories."""

import json
import subprocess
import sys

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from raysys.envs import darkroom as dr


def test_gymnasium_adapter_passes_the_env_checker_and_registers():
    check_env(dr.DarkroomEnv(goal=12), skip_render_check=False)
    env = gym.make(dr.ENV_ID, goal=3)
    obs, info = env.reset(seed=0)
    assert obs.tolist() == [4, 4] and info["goal"] == 3


def test_split_is_fixed_73_and_8_and_optimum_is_walk_then_stay():
    train, held = dr.goal_split()
    assert len(train) == 73 and len(held) == 8 and not set(train) & set(held)
    again = dr.goal_split()  # fixed: the same split every time
    assert np.array_equal(again[0], train) and np.array_equal(again[1], held)
    assert dr.optimal_return(40) == 20  # the centre: every step
    assert dr.optimal_return(0) == 20 - 8 + 1  # a corner: 8 moves, then 13 steps on it


@pytest.mark.parametrize("goal", [0, 40, 44, 80])
def test_numpy_adapter_and_jax_functions_step_alike(goal):
    rng = np.random.default_rng(goal)
    env = dr.DarkroomEnv(goal=goal)
    params = dr.params_for(goal)
    step = jax.jit(dr.step_no_reset)
    for _ in range(3):
        obs, _ = env.reset()
        jobs, state = dr.reset(None, params)
        total = 0.0
        for t in range(dr.HORIZON):
            a = int(rng.integers(dr.N_ACTIONS))
            obs, r, term, trunc, _ = env.step(a)
            jobs, state, jr, done, info = step(None, state, jnp.int32(a), params)
            assert obs.tolist() == np.asarray(jobs).tolist() and r == float(jr) and trunc == bool(done)
            total += r
        assert float(info["episode_return"]) == total
    with pytest.raises(gym.error.ResetNeeded):
        env.step(0)


def test_walking_to_the_goal_earns_the_optimum():
    for goal in (0, 22, 40, 62, 80):
        env = dr.DarkroomEnv(goal=goal)
        pos, _ = env.reset()
        total, gr, gc = 0.0, *divmod(goal, dr.SIZE)
        for _ in range(dr.HORIZON):  # the original's scripted optimal policy
            r, c = pos
            a = 0 if r < gr else 1 if r > gr else 2 if c < gc else 3 if c > gc else 4
            pos, rew, *_ = env.step(a)
            total += rew
        assert total == dr.optimal_return(goal)


def test_auto_reset_step_returns_the_next_episode_and_the_real_last_cell():
    params = dr.params_for(41)  # (4, 5): one step right of the centre
    obs, state = dr.reset(None, params)
    for t in range(dr.HORIZON):
        obs, state, r, done, info = dr.step(None, state, 2 if t == 0 else 4, params)
    assert bool(done) and np.asarray(obs).tolist() == [4, 4] and np.asarray(info["next_obs"]).tolist() == [4, 5]
    assert float(info["episode_return"]) == dr.optimal_return(41)


def test_population_ppo_learns_every_goal_and_writes_consistent_histories(tmp_path):
    """The generator as a user runs it (a pinned subprocess, see histories.py), small: 3 goals near the
    centre, 20 streams (the far corners need the full 100 streams x 100k steps; docs/benchmarks.md)."""
    from raysys.workloads.ad_transformer import histories

    out = tmp_path / "hist"
    cfg = {"streams": 20, "steps_per_goal": 24000, "epochs": 10, "updates_per_call": 20}
    r = subprocess.run([sys.executable, "-m", "raysys.workloads.ad_transformer.histories", "--out", str(out),
                        "--config", json.dumps(cfg), "--goals", "50,40,30"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = histories.manifest(out)
    assert m["goals"] == [50, 40, 30] and m["streams"] == 20 and m["steps"] == 24000 // 20
    h = histories.load(out, [30, 50])
    assert h.goals.tolist() == [30, 50] and h.actions.shape == (2, 20, 1200) and h.states.shape == (2, 20, 1200, 2)
    # the records are real transitions: s' follows from (s, a), the reward is s' == goal, episodes are 20 steps
    moved = np.clip(h.states.astype(int) + dr.MOVES[h.actions.astype(int)], 0, dr.SIZE - 1)
    assert np.array_equal(moved, h.next_states)
    goal_cells = np.stack(np.divmod(h.goals, dr.SIZE), -1)[:, None, None, :]
    assert np.array_equal(h.rewards, np.all(h.next_states == goal_cells, -1).astype(np.int8))
    assert np.all(h.states[:, :, ::dr.HORIZON] == dr.SIZE // 2)  # every episode starts at the centre
    cont = np.ones(1200, bool)
    cont[dr.HORIZON - 1::dr.HORIZON] = False
    assert np.array_equal(h.next_states[:, :, :-1][:, :, cont[:-1]], h.states[:, :, 1:][:, :, cont[:-1]])
    # and every learner learns: the last updates' return near the optimum, far above the first
    final = np.asarray(m["final_return"])
    assert np.all(final >= 0.8 * np.asarray(m["optimal_return"])), (final, m["optimal_return"])
    assert np.all(h.returns[:, :3].mean(1) < 0.5 * final[[2, 0]])
    # never overwritten
    again = subprocess.run([sys.executable, "-m", "raysys.workloads.ad_transformer.histories", "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "never overwritten" in again.stderr
