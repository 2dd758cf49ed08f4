"""MPN-DQN: one multi-plasticity layer (Aitken & Mihalas, eLife 2023) and a linear Q head.

The MPN's recurrent state is not a hidden vector but a per-sample synaptic modulation matrix
``M`` [B, H, D]. Each step reads with weights modulated multiplicatively by ``M`` and then
writes a Hebbian outer product into it:

    h  = tanh(b + (W * (M + 1)) x)
    M' = lam * M + eta * h x^T

``W`` and ``b`` learn by backprop across episodes; ``M`` is fast, within-episode memory.
Mirrors EulerFrog/mpn-rl (``mpn_module.py``, ``mpn_dqn.py``); no Ray or MLflow here.

Memory layout: M is [B, H, D] to its users but lives in memory as [B, D, H] (a transposed
view). With D = 7 innermost every elementwise op and the reduction over D run on ragged 7-wide
rows; with H = 128 innermost they vectorise (forward+backward of a 64x11 unroll measured 1.7x
faster than the [B, H, D]-contiguous bmm of the original). A 3-operand einsum is worse still:
on CPU it lowers to a bmm over B*H tiny matrices (~4x slower than the bmm). A hand-written
backward-through-time (one autograd node for the unroll) was tried and measured no faster on
CPU at B=64: the per-step work is the same handful of [B, D, H] kernels either way.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn


def _step_t(Wt: torch.Tensor, b: torch.Tensor, x: torch.Tensor, Mt: torch.Tensor, lam: float, eta: float):
    """One MPN step in the [B, D, H] layout: Wt [D,H], x [B,D], Mt [B,D,H] -> h [B,H], Mt'."""
    # pre[b,h] = b[h] + sum_d Wt[d,h] (1 + Mt[b,d,h]) x[b,d]: x as a [B,1,D] row times [B,D,H]
    h = torch.tanh(torch.baddbmm(b.view(1, 1, -1), x.unsqueeze(1), torch.addcmul(Wt, Wt, Mt)).squeeze(1))
    # M' = lam M + eta x h^T as one fused batched rank-1 update
    return h, torch.baddbmm(Mt, x.unsqueeze(2), h.unsqueeze(1), beta=lam, alpha=eta)


class MPNLayer(nn.Module):
    def __init__(self, in_dim: int, hidden: int, eta: float = 0.1, lam: float = 0.95, freeze_plasticity: bool = False):
        super().__init__()
        self.in_dim, self.hidden = in_dim, hidden
        self.eta, self.lam = eta, lam
        self.freeze_plasticity = freeze_plasticity
        # He-style init as in the original: randn * sqrt(2 / fan_in).
        self.W = nn.Parameter(torch.randn(hidden, in_dim) * math.sqrt(2.0 / in_dim))
        self.b = nn.Parameter(torch.zeros(hidden))

    def init_state(self, batch: int, device: Optional[torch.device | str] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # [B, H, D] view of [B, D, H] memory (see the module docstring)
        return torch.zeros(batch, self.in_dim, self.hidden, device=device or self.W.device, dtype=dtype).transpose(1, 2)

    def forward(self, x: torch.Tensor, M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: x [B, D], M [B, H, D] -> (h [B, H], M' [B, H, D])."""
        if self.freeze_plasticity:
            # M stays 0, so W*(M+1) == W: a plain affine layer (the original's shortcut too).
            return torch.tanh(nn.functional.linear(x, self.W, self.b)), torch.zeros_like(M)
        h, Mt = _step_t(self.W.t().contiguous(), self.b, x, _dhview(M), self.lam, self.eta)
        return h, Mt.transpose(1, 2)

    def scan(self, obs: torch.Tensor, M0: torch.Tensor, reset_mask: Optional[torch.Tensor] = None):
        """All steps of obs [B, L, D] -> (h [B, L, H], M_L [B, H, D]); see MPNDQN.unroll."""
        if self.freeze_plasticity:
            return torch.tanh(nn.functional.linear(obs, self.W, self.b)), torch.zeros_like(M0)
        Wt, Mt = self.W.t().contiguous(), _dhview(M0.to(obs.dtype))
        L = obs.shape[1]
        keep = None if reset_mask is None else (~reset_mask.bool()).to(obs.dtype)
        # Eager: only steps where some sequence resets pay for the mask (one host sync); under
        # torch.compile or a CUDA graph capture mask every step rather than sync on .tolist().
        if keep is None:
            resets = [False] * L
        elif torch.compiler.is_compiling() or (obs.is_cuda and torch.cuda.is_current_stream_capturing()):
            resets = [True] * L
        else:
            resets = reset_mask.bool().any(0).tolist()
        hs = []
        for t in range(L):
            if resets[t]:
                Mt = Mt * keep[:, t, None, None]
            h, Mt = _step_t(Wt, self.b, obs[:, t], Mt, self.lam, self.eta)
            hs.append(h)
        return torch.stack(hs, 1), Mt.transpose(1, 2)


def _dhview(M: torch.Tensor) -> torch.Tensor:
    """[B, H, D] state -> contiguous [B, D, H]; free for states made by init_state/forward,
    one copy for a [B, H, D]-contiguous one (e.g. a stored state from replay)."""
    Mt = M.transpose(1, 2)
    return Mt if Mt.is_contiguous() else Mt.contiguous()


class MPNDQN(nn.Module):
    """Q(s_t | M_t): MPN layer -> Linear(H, A). ``forward`` is one environment step."""

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        hidden: int = 128,
        eta: float = 0.1,
        lam: float = 0.95,
        freeze_plasticity: bool = False,
    ):
        super().__init__()
        self.obs_dim, self.n_actions, self.hidden = obs_dim, n_actions, hidden
        self.mpn = MPNLayer(obs_dim, hidden, eta, lam, freeze_plasticity)
        self.q = nn.Linear(hidden, n_actions)
        # Small orthogonal head: initial Q-values near 0 so early TD targets are dominated by reward.
        nn.init.orthogonal_(self.q.weight, gain=0.01)
        nn.init.zeros_(self.q.bias)

    def init_state(self, batch: int, device: Optional[torch.device | str] = None) -> torch.Tensor:
        return self.mpn.init_state(batch, device)

    def forward(self, x: torch.Tensor, M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, M_new = self.mpn(x, M)
        return self.q(h), M_new

    def unroll(
        self,
        obs: torch.Tensor,
        M0: Optional[torch.Tensor] = None,
        reset_mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``obs`` [B, L, D] from ``M0`` (zeros if None). ``reset_mask`` [B, L] (bool) zeroes M
        *before* step t where a new episode starts inside the sequence. Returns (q [B,L,A], M_L)."""
        M0 = self.init_state(obs.shape[0], obs.device) if M0 is None else M0
        hs, M = self.mpn.scan(obs, M0, reset_mask)
        # The recurrence is sequential in t, the readout is not: apply the head once.
        return self.q(hs), M

    @torch.no_grad()
    def act(
        self,
        obs: torch.Tensor,
        M: torch.Tensor,
        episode_start: torch.Tensor,
        epsilon: float,
        generator: Optional[torch.Generator] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ε-greedy actions for a batch of envs (the policy API of raysys.rl.rollout).
        ``episode_start`` [N] bool zeroes the state of envs that just reset.

        Called once per vector-env step in every rollout actor, where its ~20 tiny torch ops are
        a third of the step's CPU time: it calls the step function and the head directly
        (no nn.Module dispatch) and skips the reset mask and exploration draws when unused."""
        mpn = self.mpn
        if mpn.freeze_plasticity:
            h, M_new = torch.tanh(nn.functional.linear(obs, mpn.W, mpn.b)), M
        else:
            Mt = _dhview(M)
            if bool(episode_start.any()):
                Mt = Mt * (~episode_start).to(Mt.dtype)[:, None, None]
            h, Mt = _step_t(mpn.W.t().contiguous(), mpn.b, obs, Mt, mpn.lam, mpn.eta)
            M_new = Mt.transpose(1, 2)
        actions = nn.functional.linear(h, self.q.weight, self.q.bias).argmax(dim=1)
        if epsilon > 0.0:
            n = obs.shape[0]
            explore = torch.rand(n, generator=generator) < epsilon
            actions = torch.where(explore, torch.randint(self.n_actions, (n,), generator=generator), actions)
        return actions, M_new
