"""Sequence replay: a numpy ring buffer of transitions, sampled as fixed-length windows.

Layout is [rows, n_envs, ...]: each column is one env's stream in time order, so a window is
always contiguous in one env's history even when many envs (or rollout actors) write at once.
``capacity`` counts transitions (rows * n_envs), like the original's 50k deque.

Sampling follows the original (DRQN-style): pick a random end step, look back L steps, and mask
out every step that belongs to another episode than the end step. Masked steps are zero-filled,
and the first valid step after them is flagged in ``reset`` so the learner zeroes M there:
with zero observations the original got the same effect implicitly (M stays 0 when x = 0), but
with R2D2-style stored state the start state may be another episode's M, so the reset is explicit.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class SequenceReplay:
    def __init__(
        self,
        obs_dim: int,
        capacity: int = 50_000,
        n_envs: int = 1,
        state_shape: Optional[tuple[int, ...]] = None,
        state_dtype: np.dtype | str = np.float16,
    ):
        if capacity < n_envs:
            raise ValueError(f"capacity ({capacity}) must be at least n_envs ({n_envs})")
        self.rows, self.n_envs, self.obs_dim = capacity // n_envs, n_envs, obs_dim
        R, N = self.rows, n_envs
        self.obs = np.zeros((R, N, obs_dim), np.float32)
        self.next_obs = np.zeros((R, N, obs_dim), np.float32)
        self.action = np.zeros((R, N), np.int64)
        self.reward = np.zeros((R, N), np.float32)
        self.done = np.zeros((R, N), np.float32)
        self.episode_id = np.full((R, N), -1, np.int64)
        # Stored recurrent state M_t (the state *before* acting on obs_t), float16 by default:
        # H*D floats per transition is by far the biggest field.
        self.state = None if state_shape is None else np.zeros((R, N, *state_shape), state_dtype)
        self.ptr = 0  # next row to write
        self.size = 0  # rows filled

    def __len__(self) -> int:
        return self.size * self.n_envs

    @property
    def capacity(self) -> int:
        return self.rows * self.n_envs

    def add(self, obs, action, reward, next_obs, done, episode_id, state=None) -> None:
        """One time step for all n_envs (leading dim n_envs, or none when n_envs == 1)."""
        self.extend(*(None if x is None else np.asarray(x)[None] for x in (obs, action, reward, next_obs, done, episode_id, state)))

    def extend(self, obs, action, reward, next_obs, done, episode_id, state=None) -> None:
        """T time steps at once: arrays [T, n_envs, ...] (e.g. one rollout actor's sample)."""
        T = len(obs)
        if T > self.rows:  # only the newest rows survive anyway
            sl = slice(T - self.rows, T)
            obs, action, reward, next_obs, done, episode_id = (x[sl] for x in (obs, action, reward, next_obs, done, episode_id))
            state = None if state is None else state[sl]
            T = self.rows
        idx = (self.ptr + np.arange(T)) % self.rows
        N = self.n_envs
        self.obs[idx] = np.reshape(obs, (T, N, self.obs_dim))
        self.next_obs[idx] = np.reshape(next_obs, (T, N, self.obs_dim))
        self.action[idx] = np.reshape(action, (T, N))
        self.reward[idx] = np.reshape(reward, (T, N))
        self.done[idx] = np.reshape(done, (T, N))
        self.episode_id[idx] = np.reshape(episode_id, (T, N))
        if self.state is not None:
            if state is None:
                raise ValueError("this buffer stores recurrent state: pass state=")
            self.state[idx] = np.reshape(state, (T, N, *self.state.shape[2:]))
        self.ptr = (self.ptr + T) % self.rows
        self.size = min(self.size + T, self.rows)

    def sample(self, batch: int, seq_len: int, rng: np.random.Generator, burn_in: int = 0) -> dict[str, np.ndarray]:
        """``batch`` windows of ``burn_in + seq_len`` steps ending at random steps.

        Returns obs/next_obs [B,L,D], action/reward/done [B,L], mask [B,L] (1 = same episode as
        the window's last step), reset [B,L] (bool, zero M before this step), burn_in (int) and,
        with stored state, M0 [B,...] = the stored state at the window's first step.
        """
        if self.size == 0:
            raise ValueError("cannot sample from an empty buffer")
        L = burn_in + seq_len
        # Like the original, end windows where a full look-back exists once there is enough data.
        low = min(L - 1, self.size - 1)
        end = rng.integers(low, self.size, size=batch)  # chronological index, 0 = oldest row
        col = rng.integers(0, self.n_envs, size=batch)
        chrono = end[:, None] + np.arange(1 - L, 1)[None, :]  # [B, L]
        oldest = (self.ptr - self.size) % self.rows
        rows = (oldest + chrono) % self.rows
        cols = col[:, None]
        eid = self.episode_id[rows, cols]
        # chrono >= 0 keeps windows inside the stored history, so the ring's newest and oldest
        # rows are never glued together.
        valid = (chrono >= 0) & (eid == eid[:, -1:])
        vf = valid.astype(np.float32)
        out = {
            "obs": self.obs[rows, cols] * vf[..., None],
            "next_obs": self.next_obs[rows, cols] * vf[..., None],
            "action": np.where(valid, self.action[rows, cols], 0),
            "reward": self.reward[rows, cols] * vf,
            "done": self.done[rows, cols] * vf,
            "mask": vf,
            "reset": np.concatenate([np.zeros((batch, 1), bool), valid[:, 1:] & ~valid[:, :-1]], axis=1),
            "burn_in": burn_in,
        }
        if self.state is not None:
            out["M0"] = self.state[rows[:, 0], col].astype(np.float32)
        return out


def as_tensors(batch: dict, device: torch.device | str = "cpu") -> dict:
    """numpy batch -> torch tensors on ``device`` (ints stay ints)."""
    return {k: torch.as_tensor(v, device=device) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
