"""Double-DQN TD loss over replayed sequences, two ways with the same result.

Both unroll each window over the stream ``obs_0 .. obs_{L-1}, next_obs_{L-1}`` (L+1 inputs), so
position t+1 holds Q(s'_t | M_{t+1}) with the state that really follows step t. Then

    y_t    = r_t + gamma * (1 - done_t) * Q_tgt(s'_t, argmax_a Q_onl(s'_t, a))
    loss   = mean over valid steps of smooth_l1(Q_onl(s_t, a_t), y_t)

Deliberate fixes against the original (EulerFrog/mpn-rl ``compute_td_loss_sequences``):
* its last window step used ``y = r`` (as if every window ended in a terminal state); here the
  extra input next_obs_{L-1} gives that step a proper bootstrap;
* its target net unrolled over next_obs from a zero state, so the target's M lagged the online
  net's by one observation; here both nets see the same stream.

``done`` is the bootstrap cut: store ``terminated`` there, not ``terminated or truncated`` (the
original's choice), or every TimeLimit truncation is learned as a true end of the task; NeuroGym
tasks never terminate, so with ``terminated`` the target always bootstraps.

``td_loss_naive`` is the seed's *before* (one sequence at a time, batch 1, one call per step per
net, a Python scalar loss per transition); ``td_loss_optimized`` is the *after* (all sequences as
one [B, L, D] batch, loop over time only, one masked reduction), with optional AMP and compile.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from raysys.workloads.mpn_dqn.model import MPNDQN


def _stream(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, L+1, D] and reset flags [B, L+1] for the unroll (no reset at the extra step)."""
    obs, next_obs, reset = batch["obs"], batch["next_obs"], batch["reset"].bool()
    stream = torch.cat([obs, next_obs[:, -1:]], dim=1)
    return stream, torch.cat([reset, torch.zeros_like(reset[:, :1])], dim=1)


# --------------------------------------------------------------------------- naive (before)


def td_loss_naive(online: MPNDQN, target: MPNDQN, batch: dict, gamma: float = 0.99) -> torch.Tensor:
    stream, reset = _stream(batch)
    B, L1, _ = stream.shape
    k = int(batch.get("burn_in", 0))
    M0 = batch.get("M0")
    # The original held each window as a list of per-transition Python dicts.
    actions, rewards = batch["action"].tolist(), batch["reward"].tolist()
    dones, mask, resets = batch["done"].tolist(), batch["mask"].tolist(), reset.tolist()
    total, n = 0.0, 0
    for b in range(B):
        M = online.init_state(1, stream.device) if M0 is None else M0[b : b + 1]
        Mt = M.clone()
        q_list, qt_list = [], []
        for t in range(L1):
            if resets[b][t]:
                M = online.init_state(1, stream.device)
            with torch.set_grad_enabled(t >= k and torch.is_grad_enabled()):
                q, M = online(stream[b, t : t + 1], M)
            q_list.append(q)
        with torch.no_grad():
            for t in range(L1):
                if resets[b][t]:
                    Mt = target.init_state(1, stream.device)
                q, Mt = target(stream[b, t : t + 1], Mt)
                qt_list.append(q)
        for t in range(k, L1 - 1):
            if mask[b][t] == 0:
                continue
            q_sa = q_list[t][0, actions[b][t]]
            with torch.no_grad():
                a_star = q_list[t + 1][0].argmax()
                y = rewards[b][t] + gamma * (1.0 - dones[b][t]) * qt_list[t + 1][0, a_star]
            total = total + F.smooth_l1_loss(q_sa, y)
            n += 1
    return total / n if n else torch.zeros((), device=stream.device, requires_grad=True)


# --------------------------------------------------------------------------- optimized (after)


def _td_core(
    online: MPNDQN,
    target: MPNDQN,
    stream: torch.Tensor,
    reset: torch.Tensor,
    M0: Optional[torch.Tensor],
    action: torch.Tensor,
    reward: torch.Tensor,
    done: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    burn_in: int,
    amp_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    device_type = stream.device.type
    with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        M_on = M_tg = M0
        if burn_in:
            # R2D2 burn-in: warm the state up on the first steps without learning from them.
            with torch.no_grad():
                _, M_on = online.unroll(stream[:, :burn_in], M0, reset[:, :burn_in])
                _, M_tg = target.unroll(stream[:, :burn_in], M0, reset[:, :burn_in])
            stream, reset = stream[:, burn_in:], reset[:, burn_in:]
            action, reward, done, mask = (x[:, burn_in:] for x in (action, reward, done, mask))
        q_on, _ = online.unroll(stream, M_on, reset)  # [B, L+1, A]
        with torch.no_grad():
            q_tg, _ = target.unroll(stream, M_tg, reset)
    q_on, q_tg = q_on.float(), q_tg.float()
    q_sa = q_on[:, :-1].gather(-1, action.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        a_star = q_on[:, 1:].argmax(-1, keepdim=True)
        y = reward + gamma * (1.0 - done) * q_tg[:, 1:].gather(-1, a_star).squeeze(-1)
    per_step = F.smooth_l1_loss(q_sa, y, reduction="none")
    return (per_step * mask).sum() / mask.sum().clamp_min(1.0)


_compiled: dict[str, Callable] = {}


def _core_fn(compile: bool | str) -> Callable:
    """``compile``: False (eager), True (torch.compile's default mode) or a torch.compile mode name."""
    if not compile or _compiled.get("failed"):
        return _td_core
    mode = compile if isinstance(compile, str) else "default"
    if mode not in _compiled:
        _compiled[mode] = torch.compile(_td_core, mode=mode, dynamic=False)
    return _compiled[mode]


def amp_dtype_for(device: torch.device | str) -> torch.dtype:
    # bf16 needs no loss scaling; CUDA fp16 does (the training loop owns a GradScaler).
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


def td_loss_optimized(
    online: MPNDQN,
    target: MPNDQN,
    batch: dict,
    gamma: float = 0.99,
    amp: bool | torch.dtype = False,
    compile: bool | str = False,
) -> torch.Tensor:
    """``amp``: False (fp32), True (bf16 on CPU, fp16 on CUDA) or an explicit autocast dtype.
    ``compile``: False, True, or a torch.compile mode (e.g. "reduce-overhead")."""
    stream, reset = _stream(batch)
    amp_dtype = amp if isinstance(amp, torch.dtype) else (amp_dtype_for(stream.device) if amp else None)
    args = (
        online, target, stream, reset, batch.get("M0"), batch["action"].long(), batch["reward"].float(),
        batch["done"].float(), batch["mask"].float(), float(gamma), int(batch.get("burn_in", 0)), amp_dtype,
    )
    fn = _core_fn(compile)
    if fn is _td_core:
        return fn(*args)
    try:
        return fn(*args)
    except Exception as e:  # compile is an optimisation: never let it break training
        warnings.warn(f"torch.compile of the TD loss failed ({type(e).__name__}: {e}); using eager", RuntimeWarning)
        _compiled["failed"] = True
        return _td_core(*args)


# --------------------------------------------------------------------------- benchmark helpers


def synthetic_batch(
    B: int = 64,
    L: int = 10,
    obs_dim: int = 7,
    n_actions: int = 3,
    seed: int = 0,
    hidden: Optional[int] = None,
    burn_in: int = 0,
) -> dict:
    """A replay-shaped batch drawn from a real SequenceReplay with short random episodes, so
    masks and resets across episode boundaries are exercised. ``hidden`` adds stored M0."""
    from raysys.workloads.mpn_dqn.replay import SequenceReplay, as_tensors

    rng = np.random.default_rng(seed)
    T, N = 400, 4
    state_shape = None if hidden is None else (hidden, obs_dim)
    rb = SequenceReplay(obs_dim, capacity=T * N, n_envs=N, state_shape=state_shape)
    ends = rng.random((T, N)) < 0.15  # mean episode ~7 steps: many windows cross a boundary
    eid = np.cumsum(np.concatenate([np.zeros((1, N), bool), ends[:-1]]), axis=0) * N + np.arange(N)
    obs = rng.normal(size=(T + 1, N, obs_dim)).astype(np.float32)
    rb.extend(
        obs[:-1], rng.integers(0, n_actions, (T, N)), rng.normal(size=(T, N)).astype(np.float32),
        obs[1:], ends.astype(np.float32), eid,
        None if hidden is None else (0.1 * rng.normal(size=(T, N, hidden, obs_dim))).astype(np.float16),
    )
    return as_tensors(rb.sample(B, L, rng, burn_in=burn_in))


@contextlib.contextmanager
def _threads(n: Optional[int]):
    """Temporarily set torch's intra-op threads. On this 2-vCPU shared machine 2 threads made the
    optimized step erratic (medians of 10 ms to 2.5 s: every parallel region waits for both
    vCPUs), while 1 thread gave a stable ~15-20 ms; the learner shares the box with rollout
    actors anyway."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _setup(B: int, L: int, H: int, obs_dim: int, n_actions: int, device: str, seed: int):
    torch.manual_seed(seed)
    online = MPNDQN(obs_dim, n_actions, hidden=H).to(device)
    target = MPNDQN(obs_dim, n_actions, hidden=H).to(device)
    target.load_state_dict(online.state_dict())
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in synthetic_batch(B, L, obs_dim, n_actions, seed).items()}
    return online, target, batch


def _step_fn(impl: str, online: MPNDQN, target: MPNDQN, batch: dict, amp: bool, compile: bool, device: str) -> Callable[[], float]:
    """One timed TD-loss step: zero grads, loss (online + target unrolls), backward."""

    def step() -> float:
        t0 = time.perf_counter()
        online.zero_grad(set_to_none=True)
        if impl == "naive":
            loss = td_loss_naive(online, target, batch)
        else:
            loss = td_loss_optimized(online, target, batch, amp=amp, compile=compile)
        loss.backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return step


def compare_td_loss(
    rounds: int = 15,
    opt_per_round: int = 5,
    B: int = 64,
    L: int = 10,
    H: int = 128,
    obs_dim: int = 7,
    n_actions: int = 3,
    amp: bool = False,
    compile: bool = False,
    device: str = "cpu",
    seed: int = 0,
    threads: Optional[int] = 1,
) -> dict:
    """Naive vs optimized on the same weights and batch, interleaved finely: each round times one
    naive step and ``opt_per_round`` optimized steps back to back, so load from other jobs on a
    shared machine hits both alike. Reports medians and the median of per-round ratios."""
    with _threads(threads):
        online, target, batch = _setup(B, L, H, obs_dim, n_actions, device, seed)
        naive = _step_fn("naive", online, target, batch, amp, compile, device)
        opt = _step_fn("optimized", online, target, batch, amp, compile, device)
        naive(), opt(), opt(), opt()  # warm-up (and compile, if on)
        n_t, o_t, ratios = [], [], []
        for _ in range(rounds):
            n = naive()
            o = float(np.median([opt() for _ in range(opt_per_round)]))
            n_t.append(n), o_t.append(o), ratios.append(n / o)
        n_threads = torch.get_num_threads()
        loss_gap, grad_gap = _parity(online, target, batch)
    return {
        "setup": dict(B=B, L=L, H=H, obs_dim=obs_dim, n_actions=n_actions, amp=amp, compile=compile, device=device,
                      threads=n_threads),
        "naive_s": float(np.median(n_t)),
        "optimized_s": float(np.median(o_t)),
        "speedup": float(np.median(ratios)),
        "speedup_iqr": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
        "loss_abs_diff": loss_gap,
        "grad_rel_diff": grad_gap,
    }


def _parity(online: MPNDQN, target: MPNDQN, batch: dict) -> tuple[float, float]:
    """|loss_naive - loss_optimized| and |g_naive - g_optimized| / |g_naive| on the timed weights and batch, in
    full fp32 (TF32 alone moves a loss by ~1e-3 of it): the fast path must be the same function and train alike."""
    from raysys.bench_generic import _no_tf32

    with _no_tf32():
        params = list(online.parameters())
        ln = td_loss_naive(online, target, batch)
        gn = torch.autograd.grad(ln, params)
        lo = td_loss_optimized(online, target, batch)
        go = torch.autograd.grad(lo, params)
    gap = sum(float((a - b).norm()) ** 2 for a, b in zip(gn, go)) ** 0.5
    scale = sum(float(g.norm()) ** 2 for g in gn) ** 0.5
    return abs(ln.item() - lo.item()), gap / max(scale, 1e-12)
