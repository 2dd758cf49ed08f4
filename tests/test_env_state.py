"""A running env's state as plain data: saved with torch.save, loaded with weights_only=True, written
into a fresh env, which then continues exactly as the original does."""

import io

import gymnasium as gym
import numpy as np
import pytest
import torch

from raysys.rl import env_state
from raysys.workloads.mpn_dqn.env import make_env


def _continue(env, actions) -> list:
    out = []
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out.append((np.asarray(obs).tobytes(), float(r), bool(term), bool(trunc)))
        if term or trunc:
            env.reset()
    return out


@pytest.mark.parametrize("make", [
    lambda: make_env(max_episode_steps=100),                        # NeuroGym: its own RandomStates, trials
    lambda: gym.make("CartPole-v1", disable_env_checker=True),      # gymnasium's np_random Generator
])
def test_a_restored_env_continues_exactly(make):
    rng = np.random.default_rng(0)
    env = make()
    env.reset(seed=3)
    n_actions = env.action_space.n
    for _ in range(57):  # mid-episode (and, for NeuroGym, mid-trial)
        _, _, term, trunc, _ = env.step(int(rng.integers(n_actions)))
        if term or trunc:
            env.reset()
    buf = io.BytesIO()
    torch.save(env_state.capture(env), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # plain data only: no unsafe unpickle

    actions = [int(a) for a in rng.integers(0, n_actions, size=600)]  # across resets and new trials
    fresh = make()
    fresh.reset(seed=12345)  # different on purpose: the state must overwrite all of it
    env_state.apply(fresh, state)
    assert _continue(fresh, actions) == _continue(env, actions)


def test_a_state_that_does_not_fit_is_refused():
    state = env_state.capture(make_env())
    cartpole = gym.make("CartPole-v1", disable_env_checker=True)
    cartpole.reset(seed=0)
    before = env_state.capture(cartpole)
    with pytest.raises(env_state.EnvStateMismatch):
        env_state.apply(cartpole, state)
    assert repr(env_state.capture(cartpole)) == repr(before)  # refused before anything changed
