"""MPN-DQN pieces: the MPN update, unroll, TD losses (naive == optimized), replay, env."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysys.workloads.mpn_dqn.env import make_env
from raysys.workloads.mpn_dqn.loss import synthetic_batch, td_loss_naive, td_loss_optimized
from raysys.workloads.mpn_dqn.model import MPNDQN, MPNLayer
from raysys.workloads.mpn_dqn.replay import SequenceReplay, as_tensors


# ---------------------------------------------------------------- model


def test_mpn_step_hand_computed():
    layer = MPNLayer(in_dim=2, hidden=2, eta=0.1, lam=0.95)
    with torch.no_grad():
        layer.W.copy_(torch.tensor([[1.0, 2.0], [0.5, -1.0]]))
        layer.b.copy_(torch.tensor([0.1, -0.2]))
    M = torch.tensor([[[0.5, 0.0], [0.0, 1.0]]])
    x = torch.tensor([[1.0, 2.0]])
    h, M_new = layer(x, M)
    # W ⊙ (M+1) = [[1.5, 2], [0.5, -2]];  (..) x = [5.5, -3.5];  + b = [5.6, -3.7]
    h0, h1 = math.tanh(5.6), math.tanh(-3.7)
    assert torch.allclose(h, torch.tensor([[h0, h1]]), atol=1e-6)
    expected = torch.tensor([[[0.95 * 0.5 + 0.1 * h0 * 1, 0.1 * h0 * 2], [0.1 * h1 * 1, 0.95 * 1.0 + 0.1 * h1 * 2]]])
    assert torch.allclose(M_new, expected, atol=1e-6)
    assert M_new.shape == (1, 2, 2)  # [B, H, D]


def test_init_and_shapes():
    torch.manual_seed(0)
    m = MPNDQN(obs_dim=7, n_actions=3, hidden=4096)
    W = m.mpn.W.detach()
    assert W.shape == (4096, 7) and m.mpn.b.abs().sum() == 0
    assert abs(W.std().item() - math.sqrt(2 / 7)) < 0.02  # randn * sqrt(2/D)
    Q = m.q.weight.detach()
    assert torch.allclose(Q @ Q.T, 1e-4 * torch.eye(3), atol=1e-7)  # orthogonal rows, gain 0.01
    assert m.q.bias.abs().sum() == 0
    M = m.init_state(5)
    assert M.shape == (5, 4096, 7) and M.abs().sum() == 0
    q, M1 = m(torch.randn(5, 7), M)
    assert q.shape == (5, 3) and M1.shape == (5, 4096, 7)


def test_freeze_plasticity_keeps_M_zero():
    torch.manual_seed(0)
    m = MPNDQN(7, 3, hidden=16, freeze_plasticity=True)
    x = torch.randn(4, 7)
    q, M = m(x, m.init_state(4))
    assert M.abs().sum() == 0
    h_expected = torch.tanh(x @ m.mpn.W.T + m.mpn.b)
    assert torch.allclose(q, m.q(h_expected), atol=1e-6)
    qs, M_L = m.unroll(torch.randn(4, 6, 7))
    assert M_L.abs().sum() == 0 and qs.shape == (4, 6, 3)
    # the plastic model does change M
    p = MPNDQN(7, 3, hidden=16)
    assert p(x, p.init_state(4))[1].abs().sum() > 0


def test_unroll_equals_step_by_step():
    torch.manual_seed(1)
    m = MPNDQN(7, 3, hidden=32)
    B, L = 5, 9
    obs = torch.randn(B, L, 7)
    M0 = 0.2 * torch.randn(B, 32, 7)  # a [B,H,D]-contiguous stored state
    reset = torch.zeros(B, L, dtype=torch.bool)
    reset[0, 3] = reset[2, 1] = reset[2, 6] = True
    q_unroll, M_unroll = m.unroll(obs, M0, reset)
    M, qs = M0, []
    for t in range(L):
        M = torch.where(reset[:, t, None, None], torch.zeros(()), M)
        q, M = m(obs[:, t], M)
        qs.append(q)
    assert torch.allclose(q_unroll, torch.stack(qs, 1), atol=1e-6)
    assert torch.allclose(M_unroll, M, atol=1e-6)
    # and so do the gradients through the whole unroll
    g_unroll = torch.autograd.grad((q_unroll ** 2).sum() + M_unroll.sum(), list(m.parameters()))
    g_steps = torch.autograd.grad((torch.stack(qs, 1) ** 2).sum() + M.sum(), list(m.parameters()))
    for a, b in zip(g_unroll, g_steps):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_act_resets_state_and_explores():
    torch.manual_seed(0)
    m = MPNDQN(7, 3, hidden=16)
    x = torch.randn(4, 7)
    M = 0.5 * torch.randn(4, 16, 7)
    start = torch.tensor([True, False, True, False])
    _, M_new = m.act(x, M, start, epsilon=0.0)
    _, M_ref = m(x, torch.where(start[:, None, None], torch.zeros(()), M))
    assert torch.allclose(M_new, M_ref, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    a, _ = m.act(torch.randn(1000, 7), m.init_state(1000), torch.ones(1000, dtype=torch.bool), 1.0, g)
    assert set(a.tolist()) == {0, 1, 2}


# ---------------------------------------------------------------- TD loss


@pytest.mark.parametrize("stored_state,burn_in", [(False, 0), (True, 0), (True, 3)])
def test_naive_equals_optimized(stored_state, burn_in):
    torch.manual_seed(0)
    online, target = MPNDQN(7, 3, hidden=128), MPNDQN(7, 3, hidden=128)
    # a trained-looking head so argmax choices are not ties
    with torch.no_grad():
        online.q.weight.normal_(0, 0.3), target.q.weight.normal_(0, 0.3)
    batch = synthetic_batch(B=16, L=10, hidden=128 if stored_state else None, burn_in=burn_in, seed=3)
    mask = batch["mask"]
    assert (mask == 0).any() and (mask == 1).any() and batch["reset"].any()  # crosses episode boundaries
    assert batch["done"].any()
    l_naive = td_loss_naive(online, target, batch)
    g_naive = torch.autograd.grad(l_naive, list(online.parameters()))
    l_opt = td_loss_optimized(online, target, batch)
    g_opt = torch.autograd.grad(l_opt, list(online.parameters()))
    assert abs(l_naive.item() - l_opt.item()) <= 1e-5
    for a, b in zip(g_naive, g_opt):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    # the target net gets no gradient
    assert all(p.grad is None for p in target.parameters())


def test_the_bench_judges_the_paths_td_loss_and_gradients(monkeypatch):
    """python -m raysys.bench mpn_dqn fails a fast path that is another function, or the same loss value with
    other gradients (a part of the unroll cut from backprop would learn less, the loss on the console alike)."""
    from raysys.workloads.mpn_dqn import bench, loss

    td = loss.compare_td_loss(rounds=1, opt_per_round=1, B=8)
    assert bench.parity_problems(td) == [] and td["loss_abs_diff"] < 1e-5 and td["grad_rel_diff"] < 1e-5, td
    real = loss.td_loss_optimized
    monkeypatch.setattr(loss, "td_loss_optimized", lambda *a, **k: 2 * real(*a, **k))
    (a, b) = bench.parity_problems(loss.compare_td_loss(rounds=1, opt_per_round=1, B=8))
    assert "different TD losses" in a and "train differently" in b

    def half_gradient(*a, **k):
        value = real(*a, **k)
        return value.detach() + 0.5 * (value - value.detach())

    monkeypatch.setattr(loss, "td_loss_optimized", half_gradient)
    (only,) = bench.parity_problems(loss.compare_td_loss(rounds=1, opt_per_round=1, B=8))
    assert "gradients differ from the naive one's by 5.00e-01" in only, only


def test_td_loss_masks_and_bootstraps():
    torch.manual_seed(0)
    online, target = MPNDQN(7, 3, hidden=32), MPNDQN(7, 3, hidden=32)
    batch = synthetic_batch(B=8, L=6, seed=5)
    base = td_loss_optimized(online, target, batch).item()
    # garbage in masked steps changes nothing
    b2 = dict(batch)
    b2["reward"] = torch.where(batch["mask"] > 0, batch["reward"], torch.full_like(batch["reward"], 1e3))
    assert td_loss_optimized(online, target, b2).item() == pytest.approx(base, abs=1e-6)
    # the last step bootstraps from next_obs (the original used y = r there); done cuts it off
    b3 = dict(batch)
    b3["next_obs"] = batch["next_obs"].clone()
    b3["next_obs"][:, -1] += 5.0
    b3["done"] = torch.zeros_like(batch["done"])
    b4 = dict(b3, done=torch.ones_like(batch["done"]))
    b5 = dict(batch, done=torch.ones_like(batch["done"]))
    assert td_loss_optimized(online, target, b3).item() != pytest.approx(td_loss_optimized(online, target, dict(b3, next_obs=batch["next_obs"])).item(), abs=1e-9)
    assert td_loss_optimized(online, target, b4).item() == pytest.approx(td_loss_optimized(online, target, b5).item(), abs=1e-7)


def test_amp_path_runs():
    torch.manual_seed(0)
    online, target = MPNDQN(7, 3, hidden=16), MPNDQN(7, 3, hidden=16)
    batch = synthetic_batch(B=4, L=5, seed=1)
    ref = td_loss_optimized(online, target, batch).item()
    amp = td_loss_optimized(online, target, batch, amp=True)  # bf16 autocast on CPU
    assert amp.item() == pytest.approx(ref, rel=0.05, abs=1e-3)
    amp.backward()
    assert online.mpn.W.grad is not None


def test_compile_failure_falls_back_to_eager(monkeypatch):
    from raysys.workloads.mpn_dqn import loss as loss_mod

    def broken_compile(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(loss_mod, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    torch.manual_seed(0)
    online, target = MPNDQN(7, 3, hidden=16), MPNDQN(7, 3, hidden=16)
    batch = synthetic_batch(B=4, L=5, seed=1)
    with pytest.warns(RuntimeWarning, match="compile"):
        out = td_loss_optimized(online, target, batch, compile=True)
    assert out.item() == pytest.approx(td_loss_optimized(online, target, batch).item())
    assert loss_mod._compiled.get("failed")


# ---------------------------------------------------------------- replay


def _stream_replay(episode_lengths, capacity, n_envs=1, state=False):
    """One env stream whose obs[0] is the global step index and whose episodes have the given lengths."""
    eids = np.concatenate([np.full(n, i) for i, n in enumerate(episode_lengths)])
    T = len(eids)
    steps = np.arange(T, dtype=np.float32)
    obs = np.stack([steps, np.ones(T, np.float32)], axis=1)
    done = np.zeros(T, np.float32)
    done[np.cumsum(episode_lengths) - 1] = 1
    rb = SequenceReplay(obs_dim=2, capacity=capacity, n_envs=n_envs, state_shape=(3, 2) if state else None)
    st = np.broadcast_to(steps[:, None, None], (T, 3, 2)).astype(np.float16) if state else None
    for t in range(T):  # one step at a time, like the original's push()
        rb.add(obs[t], t % 3, float(t), obs[t] + 0.5, done[t], eids[t], None if st is None else st[t])
    return rb, eids


def test_replay_masks_other_episodes():
    rb, eids = _stream_replay([3, 7, 2, 9, 4], capacity=100)
    rng = np.random.default_rng(0)
    b = rb.sample(256, 6, rng)
    assert b["obs"].shape == (256, 6, 2) and b["mask"].shape == (256, 6)
    steps = b["obs"][..., 0]
    for i in range(256):
        end = int(steps[i, -1])
        expect = np.array([0 <= end - 5 + k and eids[end - 5 + k] == eids[end] for k in range(6)])
        assert (b["mask"][i] == expect).all()
        # valid steps are the window's own consecutive steps; masked steps are zero-filled
        assert (steps[i][expect] == np.arange(end - expect.sum() + 1, end + 1)).all()
        assert (b["obs"][i][~expect] == 0).all() and (b["reward"][i][~expect] == 0).all()
        # reset marks the first valid step after masked ones
        first = np.argmax(expect)
        assert b["reset"][i].sum() == (1 if first > 0 else 0) and (first == 0 or b["reset"][i, first])
    assert (b["mask"] == 0).any()
    assert b["reward"][b["mask"] > 0].tolist() == steps[b["mask"] > 0].tolist()  # fields stay aligned


def test_replay_ring_wraparound_never_glues_old_and_new():
    # one long episode spanning the wrap point: only the age check can keep windows contiguous
    rb, _ = _stream_replay([25], capacity=10)
    assert len(rb) == 10
    assert sorted(rb.obs[:, 0, 0].tolist()) == list(range(15, 25))
    b = rb.sample(500, 4, np.random.default_rng(1))
    steps = b["obs"][..., 0]
    for i in range(500):
        valid = b["mask"][i] > 0
        s = steps[i][valid]
        assert (s >= 15).all() and (np.diff(s) == 1).all() and valid[-1]
    # a window longer than the stored history: the missing steps are masked, not taken from the
    # other end of the ring (which holds the same episode here)
    b = rb.sample(8, 12, np.random.default_rng(3))
    assert (b["mask"][:, :2] == 0).all() and (b["obs"][:, 2:, 0] == np.arange(15, 25)).all()
    # with episodes, across the wrap too
    rb, eids = _stream_replay([4, 6, 5, 8, 3], capacity=12)
    b = rb.sample(500, 5, np.random.default_rng(2))
    steps = b["obs"][..., 0]
    for i in range(500):
        valid = b["mask"][i] > 0
        s = steps[i][valid].astype(int)
        assert (s >= 26 - 12).all() and (np.diff(s) == 1).all() and (eids[s] == eids[s[-1]]).all()


def test_replay_stored_state_and_multi_env():
    rb, _ = _stream_replay([5, 5, 5], capacity=50, state=True)
    b = rb.sample(64, 4, np.random.default_rng(0))
    assert b["M0"].shape == (64, 3, 2)
    # M0 is the stored state at the window's first (possibly masked) step: step index end - 3
    end = b["obs"][:, -1, 0]
    assert np.allclose(b["M0"][:, 0, 0], end - 3)
    # [T, N] batches from a rollout keep each env's column separate
    T, N = 20, 3
    rb = SequenceReplay(obs_dim=1, capacity=T * N, n_envs=N)
    obs = (np.arange(T)[:, None] * 10 + np.arange(N)[None, :]).astype(np.float32)[..., None]
    eid = np.broadcast_to(np.arange(N), (T, N))
    rb.extend(obs, np.zeros((T, N)), np.zeros((T, N)), obs, np.zeros((T, N)), eid)
    b = rb.sample(100, 5, np.random.default_rng(0))
    cols = b["obs"][..., 0] % 10
    assert (cols == cols[:, :1]).all() and (np.diff(b["obs"][..., 0], axis=1) == 10).all()
    assert as_tensors(b)["obs"].dtype == torch.float32


# ---------------------------------------------------------------- env


def test_make_env_context_decision_making():
    env = make_env("ContextDecisionMaking-v0", max_episode_steps=25)
    assert env.observation_space.shape == (7,) and env.action_space.n == 3
    obs, _ = env.reset(seed=0)
    assert obs.shape == (7,) and obs[5:].sum() == 1  # explicit context cue
    for t in range(25):
        obs, r, terminated, truncated, _ = env.step(env.action_space.sample())
        assert not terminated  # NeuroGym never terminates by itself
        assert truncated == (t == 24)
    # reset(seed) seeds NeuroGym's own RNG: identical trial streams
    a, b = make_env(max_episode_steps=50), make_env(max_episode_steps=50)
    oa, _ = a.reset(seed=7)
    ob, _ = b.reset(seed=7)
    for _ in range(40):
        oa = a.step(0)[0]
        ob = b.step(0)[0]
        assert np.array_equal(oa, ob)


def test_make_env_any_gymnasium_id():
    env = make_env("CartPole-v1", max_episode_steps=10)
    env.reset(seed=0)
    for t in range(10):
        *_, terminated, truncated, _ = env.step(0)
        if terminated:
            break
    assert terminated or truncated


def test_an_env_registered_with_a_class_is_made_and_actions_numbered_from_one_are_refused():
    """gymnasium takes a callable as an env's entry point: it was refused as "cannot be made" (the class's
    unbound __str__ raised). A Discrete(n, start=1) task would get actions 0..n-1 it never defined."""
    import gymnasium as gym

    from raysys.config import ConfigError
    from raysys.workloads.mpn_dqn.env import env_spaces

    class Cue(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)

        def __init__(self, start: int = 0):
            self.action_space = gym.spaces.Discrete(3, start=start)

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            return np.zeros(4, np.float32), {}

        def step(self, action):
            assert self.action_space.contains(action), action
            return np.zeros(4, np.float32), 0.0, True, False, {}

    gym.register("RaysysTestCue-v0", entry_point=Cue)
    gym.register("RaysysTestCueFromOne-v0", entry_point=Cue, kwargs={"start": 1})
    assert env_spaces("RaysysTestCue-v0") == (4, 3)
    env = make_env("RaysysTestCue-v0", 5)
    assert env.reset(seed=0)[0].shape == (4,) and env.step(2)[2]
    with pytest.raises(ConfigError, match=r"^task 'RaysysTestCueFromOne-v0': its actions are Discrete\(3, start=1\), "
                                          r"numbered from 1; DQN's are 0..n-1"):
        env_spaces("RaysysTestCueFromOne-v0")


def test_a_registered_episode_limit_gives_way_to_max_episode_steps():
    """gymnasium's CartPole-v1 is registered with a 500-step limit, which gym.make wrapped inside ours: a
    max_episode_steps of 1000 was cut to 500 without a word."""
    import gymnasium as gym

    env, limits = make_env("CartPole-v1", 1000), []
    while isinstance(env, gym.Wrapper):
        if isinstance(env, gym.wrappers.TimeLimit):
            limits.append(env._max_episode_steps)
        env = env.env
    assert limits and set(limits) == {1000}
