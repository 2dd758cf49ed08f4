"""RolloutPool on a real local Ray cluster: shapes, episode ids, weight broadcast, fault tolerance."""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import pytest
import ray
import torch

from raysys.rl.rollout import RolloutPool, concat_actor_batches
from raysys.workloads.mpn_dqn.env import make_env
from raysys.workloads.mpn_dqn.model import MPNDQN

ENVS, ACTORS, EP_LEN, H = 4, 2, 12, 32


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_cluster):
    p = RolloutPool(
        env_factory=functools.partial(make_env, "ContextDecisionMaking-v0", max_episode_steps=EP_LEN),
        policy_factory=functools.partial(MPNDQN, 7, 3, hidden=H),
        num_actors=ACTORS,
        envs_per_actor=ENVS,
        steps_per_call=30,
        num_cpus_per_actor=0.5,
        seed=123,
    )
    yield p
    p.shutdown()


def _forcing_weights(action: int) -> dict:
    """MPNDQN weights whose Q head always prefers ``action``."""
    m = MPNDQN(7, 3, hidden=H)
    with torch.no_grad():
        m.q.weight.zero_()
        m.q.bias.zero_()
        m.q.bias[action] = 5.0
    return m.state_dict()


def test_sample_shapes_and_episode_ids(pool):
    first = pool.sample(epsilon=0.5)
    second = pool.sample(epsilon=0.5)
    assert len(first) == ACTORS
    for b in first:
        assert b["obs"].shape == (30, ENVS, 7) and b["next_obs"].shape == (30, ENVS, 7)
        for k in ("action", "reward", "terminated", "truncated", "done", "episode_id"):
            assert b[k].shape == (30, ENVS), k
        assert b["state"].shape == (30, ENVS, H, 7) and b["state"].dtype == np.float16
        assert not b["terminated"].any()  # NeuroGym only truncates
        assert (b["done"] == b["truncated"]).all()
        assert (b["episode_lengths"] == EP_LEN).all() and len(b["episode_lengths"]) == 2 * ENVS  # 30 steps, 12 per episode
        assert set(np.unique(b["action"])) <= {0, 1, 2}

    all_ids = set()
    for b1, b2 in zip(first, second):
        ids = np.concatenate([b1["episode_id"], b2["episode_id"]])  # [60, ENVS], one actor's two calls
        done = np.concatenate([b1["done"], b2["done"]])
        obs = np.concatenate([b1["obs"], b2["obs"]])
        nxt = np.concatenate([b1["next_obs"], b2["next_obs"]])
        st = np.concatenate([b1["state"], b2["state"]])
        # an env's id changes exactly after its episode ends, also across sample() calls
        assert ((ids[1:] != ids[:-1]) == done[:-1]).all()
        # episodes continue across calls: next_obs[t] is obs[t+1] unless the episode ended
        assert np.array_equal(nxt[:-1][~done[:-1]], obs[1:][~done[:-1]])
        # the recorded state is zero exactly at episode starts (first step of a new id)
        starts = np.zeros_like(done)
        starts[1:] = done[:-1]
        assert (np.abs(st[starts]).max(axis=(1, 2)) == 0).all()
        assert (np.abs(st[1:][~starts[1:]]).max(axis=(1, 2)) > 0).all()
        # ids of finished episodes match the steps where episodes ended
        assert np.array_equal(np.sort(b1["episode_ids_done"]), np.sort(b1["episode_id"][b1["done"]]))
        actor_ids = set(np.unique(ids).tolist())
        assert not (actor_ids & all_ids)  # globally unique across actors
        all_ids |= actor_ids
    joined = concat_actor_batches(first)
    assert joined["obs"].shape == (30, ACTORS * ENVS, 7)


def test_weight_broadcast_changes_actions(pool):
    v0 = pool.set_weights(_forcing_weights(0))
    for b in pool.sample(epsilon=0.0):
        assert (b["action"] == 0).all() and b["weights_version"] == v0
    v2 = pool.set_weights(_forcing_weights(2))
    assert v2 == v0 + 1
    for b in pool.sample(epsilon=0.0):
        assert (b["action"] == 2).all() and b["weights_version"] == v2
    # epsilon is per call: full exploration gives other actions again
    pending = pool.sample_async(epsilon=1.0)
    assert any((b["action"] != 2).any() for b in pending())


def test_killed_actor_is_replaced_mid_run(pool, caplog):
    pool.set_weights(_forcing_weights(2))
    restarts_before = pool.num_restarts
    victim = pool.actors[0]
    old_ids = {int(i) // 2**32 for b in pool.sample(epsilon=0.0) for i in b["episode_id"].ravel()}
    killer = threading.Timer(0.2, ray.kill, args=(victim,))  # lands while the loop below runs
    caplog.set_level(logging.WARNING, logger="raysys.rl.rollout")
    killer.start()
    batches = []
    for _ in range(6):  # the training loop: sample, sample, ... (each call ~0.1-1 s here)
        batches.append(pool.sample(steps=60, epsilon=0.0))
    killer.join()
    batches.append(pool.sample(steps=60, epsilon=0.0))
    assert pool.num_restarts - restarts_before == 1
    assert pool.actors[0] is not victim
    assert any("died" in r.getMessage() for r in caplog.records)
    for call in batches:
        assert len(call) == ACTORS
        for b in call:
            assert b["obs"].shape == (60, ENVS, 7)
            assert (b["action"] == 2).all()  # the replacement starts from the latest weights
            assert b["weights_version"] == pool.weights_version
    # the replacement has a fresh uid, so its episode ids cannot collide with earlier ones
    new_uid = batches[-1][0]["actor_uid"]
    assert new_uid not in old_ids and new_uid >= ACTORS
