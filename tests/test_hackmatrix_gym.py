"""Gymnasium adapters: check_env, registration, and the JAX vector env's auto-reset."""
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

from raysys.envs import hackmatrix as hm


def masked_actions(rng, masks):
    return np.array([rng.choice(np.flatnonzero(m)) for m in masks])


def test_check_env_passes():
    env = hm.HackMatrixGymEnv()
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=1)
    assert obs["observations"].shape == (1545,) and obs["action_mask"].shape == (28,)
    assert env.observation_space.contains(obs)


def test_episode_runs_to_the_end_and_render():
    env = hm.HackMatrixGymEnv(render_mode="ansi")
    obs, info = env.reset(seed=3)
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = int(rng.choice(np.flatnonzero(obs["action_mask"])))
        assert env.action_masks()[a]
        obs, r, terminated, truncated, info = env.step(a)
        assert set(info["reward_terms"]) == set(hm.REWARD_TERMS) and not info["invalid_action"]
        if terminated or truncated:
            break
    assert terminated or truncated
    assert "stage" in env.render()


def test_registration_is_idempotent_and_make_works():
    assert hm.register_envs() == hm.register_envs() == hm.ENV_ID
    env = gym.make(hm.ENV_ID)
    obs, _ = env.reset(seed=0)
    assert obs["observations"].shape == (1545,)
    venv = gym.make_vec(hm.ENV_ID, num_envs=3)
    assert isinstance(venv.unwrapped, hm.HackMatrixVectorEnv) and venv.num_envs == 3


@pytest.fixture(scope="module")
def run_vector():
    def run(mode, steps=80, n=16):
        env = hm.make_vector_env(n, autoreset_mode=mode)
        obs, _ = env.reset(seed=5)
        rng = np.random.default_rng(1)
        history = []
        for _ in range(steps):
            actions = masked_actions(rng, obs["action_mask"])
            nxt = env.step(actions)
            history.append((obs, actions) + nxt)
            obs = nxt[0]
        return env, history
    return run


def test_vector_env_next_step_autoreset(run_vector):
    env, history = run_vector(AutoresetMode.NEXT_STEP)
    assert env.observation_space.contains(history[0][0])
    finished = 0
    for (_, _, obs, rew, term, trunc, info), nxt in zip(history, history[1:]):
        done = term | trunc
        finished += done.sum()
        assert (info["episode_length"][done] > 0).all() and (info["episode_length"][~done] == 0).all()
        _, _, obs2, rew2, term2, trunc2, info2 = nxt
        # the step after `done` only reveals the new episode
        assert (rew2[done] == 0).all() and not term2[done].any() and not trunc2[done].any()
        assert (obs2["observations"][done, 5] == 0).all() and (info2["stage"][done] == 1).all()
    assert finished > 0


def test_vector_env_same_step_autoreset(run_vector):
    env, history = run_vector(AutoresetMode.SAME_STEP)
    finished = 0
    for _, _, obs, rew, term, trunc, info in history:
        done = term | trunc
        if done.any():
            finished += done.sum()
            assert (info["_final_obs"] == done).all()
            for i in np.flatnonzero(done):
                assert info["final_obs"][i]["observations"].shape == (1545,)
                assert obs["observations"][i, 5] == 0          # already the new episode (stage 1)
    assert finished > 0
