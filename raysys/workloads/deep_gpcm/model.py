"""Deep-GPCM: a DKVMN memory network with a GPCM (generalized partial credit) head.

One parameter set, two implementations of the same function, chosen by ``path``:

* ``naive``: the original's per-timestep loops, kept as the reference (dense K*Q one-hot input to
  the value embedding at every step, autograd through every memory write).
* ``optimized``: everything that does not depend on the memory is computed for all steps at once
  (the value embedding without the dense input, erase/add once per distinct (question, response)
  pair); only the memory recurrence runs step by step, in a custom autograd function with in-place
  updates, a hand-written backward, and no work on padded steps.

Both read the memory *before* writing the current response into it, so the logits at step t
depend on responses < t only. Fixes to the original: the head returns the K logits (callers use
``cross_entropy`` on logits, not on probabilities), question ids are 1..Q with 0 reserved for
padding, and ``masked_loss`` ignores padded steps.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

ModelPath = Literal["naive", "optimized"]
Recurrence = Literal["auto", "loop", "triton"]


def triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def linear_decay(n_cats: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[K, K] table: row r is the "linear decay" code of response r, max(0, 1 - |k - r| / (K - 1))."""
    k = torch.arange(n_cats, device=device, dtype=dtype)
    return (1 - (k[None, :] - k[:, None]).abs() / max(n_cats - 1, 1)).clamp(min=0)


def _write(m: torch.Tensor, w_col: torch.Tensor, e_row: torch.Tensor, a_row: torch.Tensor,
           scratch: torch.Tensor, out: torch.Tensor) -> None:
    """out = M + w (a - e*M) = M * (1 - w e^T) + w a^T, in two fused passes."""
    torch.addcmul(a_row, m, e_row, value=-1, out=scratch)
    torch.addcmul(m, w_col, scratch, out=out)


def _step_views(x: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """[x[t, :rows[t]] for each t], sliced once per run of equal counts (Python-level indexing in
    the loop would cost about as much as the small ops themselves)."""
    views, t = [], 0
    while t < len(rows):
        end = t
        while end < len(rows) and rows[end] == rows[t]:
            end += 1
        views += x[t:end, : rows[t]].unbind(0)
        t = end
    return views


class _Rows(dict):
    """Lazily cached row-prefix views x[:n] of one tensor."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.x = x

    def __missing__(self, n: int) -> torch.Tensor:
        self[n] = self.x[:n]
        return self[n]


@contextmanager
def _cpu_threads(n: int | None, device: torch.device):
    """Run the block with n intra-op threads on CPU (None: leave the setting alone)."""
    if n is None or device.type != "cpu" or torch.get_num_threads() == n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _MemoryScan(torch.autograd.Function):
    """DKVMN memory recurrence, read before write, for all steps; returns the reads.

    With w [T,B,N] (attention), e, a [T,B,Dv] (erase, add) and M_0 [N,Dv]:
        r_t     = w_t^T M_t                            (read the memory as it was before step t)
        M_{t+1} = M_t + w_t (a_t - e_t * M_t)          (= M_t * (1 - w_t e_t^T) + w_t a_t^T)

    Autograd through this loop would allocate and save ~5 [B,N,Dv] tensors per step. Here the
    forward updates one state in place (it stays in cache) and keeps a copy every ``chunk`` steps;
    the backward recomputes one chunk of states at a time into a reused buffer and walks it in
    reverse with in-place updates. (Storing all T states instead measured slower on CPU: the
    first-touch page faults of a fresh T*B*N*Dv buffer cost more than recomputing.)

    ``active[t]`` is how many leading batch rows are still inside their sequence at step t (rows
    sorted longest first, so non-increasing in t): padded steps are skipped; their reads and
    gradients are 0.
    """

    @staticmethod
    def forward(ctx, w: torch.Tensor, e: torch.Tensor, a: torch.Tensor, m0: torch.Tensor, active: list[int],
                chunk: int, threads: int | None) -> torch.Tensor:
        ctx.threads = threads
        with _cpu_threads(threads, w.device):
            return _MemoryScan._forward(ctx, w, e, a, m0, active, chunk)

    @staticmethod
    def backward(ctx, grad_reads: torch.Tensor):
        with _cpu_threads(ctx.threads, grad_reads.device):
            return *_MemoryScan._backward(ctx, grad_reads), None

    @staticmethod
    def _forward(ctx, w: torch.Tensor, e: torch.Tensor, a: torch.Tensor, m0: torch.Tensor, active: list[int],
                 chunk: int) -> torch.Tensor:
        T, B, N = w.shape
        # clone, not .contiguous(): at B=1 the expanded view is contiguous, and is m0 itself
        m = m0.expand(B, N, e.shape[-1]).clone(memory_format=torch.contiguous_format)
        ckpts = m.new_empty((T + chunk - 1) // chunk, *m.shape)
        reads = e.new_zeros(T, B, 1, e.shape[-1])
        nxt = active[1:] + [0]  # rows that read again later: only they need the write
        w_read = _step_views(w.unsqueeze(2), active)  # [n,1,N] rows
        w_write = _step_views(w.unsqueeze(3), nxt)  # [n1,N,1] columns
        e_write, a_write = _step_views(e.unsqueeze(2), nxt), _step_views(a.unsqueeze(2), nxt)  # [n1,1,Dv]
        r_out = _step_views(reads, active)
        m_rows, scratch = _Rows(m), _Rows(torch.empty_like(m))
        for t in range(T):
            n, n1 = active[t], nxt[t]
            if t % chunk == 0:
                ckpts[t // chunk, :n].copy_(m_rows[n])
            torch.bmm(w_read[t], m_rows[n], out=r_out[t])
            if n1:
                _write(m_rows[n1], w_write[t], e_write[t], a_write[t], scratch[n1], out=m_rows[n1])
        ctx.save_for_backward(w, e, a, ckpts)
        ctx.active, ctx.chunk = active, chunk
        return reads.squeeze(2)

    @staticmethod
    def _backward(ctx, grad_reads: torch.Tensor):
        w, e, a, ckpts = ctx.saved_tensors
        active, chunk = ctx.active, ctx.chunk
        T = w.shape[0]
        nxt = active[1:] + [0]
        gr = grad_reads.unsqueeze(2).contiguous()  # [T,B,1,Dv]
        dw = torch.zeros_like(w.unsqueeze(2))
        neg_de, da = torch.zeros_like(gr), torch.zeros_like(gr)
        # Products are written as (row vector) @ matrix: on CPU, bmm with a [1,n] left factor is
        # several times faster than the same product as matrix @ (column vector).
        w_read, g_read, dw_read = (_step_views(x, active) for x in (w.unsqueeze(2), gr, dw))
        w_upd, e_upd = _step_views(w.unsqueeze(3), active), _step_views(e.unsqueeze(2), active)
        w_row, w_col = _step_views(w.unsqueeze(2), nxt), _step_views(w.unsqueeze(3), nxt)
        e_row, a_row = _step_views(e.unsqueeze(2), nxt), _step_views(a.unsqueeze(2), nxt)
        dw_write, de_write, da_write = (_step_views(x, nxt) for x in (dw, neg_de, da))
        g = _Rows(torch.zeros_like(ckpts[0]))  # G = dL/dM_{t+1}; 0 for rows that never read again
        gm = _Rows(torch.empty_like(ckpts[0]))
        buf = ckpts.new_empty(min(chunk, T), *ckpts.shape[1:])
        states = [_Rows(s) for s in buf.unbind(0)]
        for c in range(len(ckpts) - 1, -1, -1):
            start, stop = c * chunk, min((c + 1) * chunk, T)
            states[0][active[start]].copy_(ckpts[c, : active[start]])
            for t in range(start, stop - 1):  # recompute M_start .. M_{stop-1}
                n1 = nxt[t]
                _write(states[t - start][n1], w_col[t], e_row[t], a_row[t], gm[n1], out=states[t - start + 1][n1])
            for t in range(stop - 1, start - 1, -1):
                n, n1 = active[t], nxt[t]
                m = states[t - start]
                torch.bmm(g_read[t], m[n].transpose(1, 2), out=dw_read[t])  # from the read r_t = w_t^T M_t
                if n1:  # from the write M_{t+1} = M_t + w (a - e*M_t), for rows that read M_{t+1}
                    torch.bmm(w_row[t], g[n1], out=da_write[t])  # da = sum_i w_i G_i
                    torch.mul(g[n1], m[n1], out=gm[n1])
                    torch.bmm(w_row[t], gm[n1], out=de_write[t])  # de = -sum_i w_i (G*M)_i
                    dw_write[t].baddbmm_(a_row[t], g[n1].transpose(1, 2))  # dw += G a - (G*M) e
                    dw_write[t].baddbmm_(e_row[t], gm[n1].transpose(1, 2), alpha=-1)
                # dL/dM_t = G * (1 - w e^T) + w dr^T = G - w (e*G - dr); rows n1..n have G = 0 here
                torch.addcmul(g_read[t], g[n], e_upd[t], value=-1, out=gm[n])
                g[n].addcmul_(w_upd[t], gm[n])
        return dw.squeeze(2), neg_de.squeeze(2).neg_(), da.squeeze(2), g.x.sum(0), None, None


# torch.compile runs this eagerly (a graph break): the loop's step count and row counts are Python
# ints read from the batch, so a traced loop would be unrolled and specialised on them, and recompiled
# for every batch (~1 minute each on CPU, measured with TORCH_LOGS=recompiles).
@torch.compiler.disable
def _loop_scan(w: torch.Tensor, erase_add: torch.Tensor, m0: torch.Tensor, inside: torch.Tensor, chunk: int,
               threads: int | None) -> torch.Tensor:
    """``_MemoryScan`` of rows sorted longest first; ``inside`` [T,B] marks the steps in a sequence."""
    active = inside.sum(1).tolist()  # one host sync
    erase, add = erase_add.chunk(2, dim=-1)
    return _MemoryScan.apply(w, erase, add, m0, active, chunk, threads)


class DeepGPCM(nn.Module):
    """DKVMN + GPCM head; ``forward(questions, responses)`` returns the K GPCM logits per step.

    questions [B,T] long in 1..Q (0 = padding), responses [B,T] long in 0..K-1, padding on the right.
    The prediction for step t uses the question at t and the memory of responses before t.

    ``path`` picks the implementation ("naive" or "optimized"); both use the same parameters, so a
    state_dict saved from one loads into the other. ``chunk`` (optimized only) is how many steps
    the memory backward recomputes at a time: memory ~ (T/chunk + chunk) * B*N*Dv floats instead of
    T * B*N*Dv; speed is flat between 8 and 32 on CPU, and 8 is faster than 16 on a GPU.
    ``recurrence_threads`` (CPU only) runs the memory loop with that many intra-op threads, then restores the setting; None leaves it alone.
    Its ops are small, so each thread-team barrier is a large share of them: 1 is ~25% slower on
    an idle 2-core host but several times faster when other jobs load the cores (a descheduled
    team member stalls every op). ``recurrence`` (optimized only) picks how the memory recurrence
    runs: ``loop`` is ``_MemoryScan``, ``triton`` the fused kernels of ``memory_kernel.py`` (a CUDA
    device, or Triton's interpreter on a CPU), ``auto`` the kernels on CUDA where Triton is
    installed and the loop elsewhere. Logits at padded steps are unspecified
    (the optimized path returns 0 there, the naive path whatever its loop computes): mask them.
    """

    def __init__(self, n_questions: int, n_cats: int = 4, memory_size: int = 50, key_dim: int = 50,
                 value_dim: int = 200, final_fc_dim: int = 50, path: ModelPath = "optimized",
                 chunk: int = 8, recurrence_threads: int | None = None, recurrence: Recurrence = "auto"):
        super().__init__()
        if path not in ("naive", "optimized"):
            raise ValueError(f"path must be 'naive' or 'optimized', got {path!r}")
        if recurrence not in ("auto", "loop", "triton"):
            raise ValueError(f"recurrence must be 'auto', 'loop' or 'triton', got {recurrence!r}")
        self.n_questions, self.n_cats, self.path = n_questions, n_cats, path
        self.chunk, self.recurrence_threads, self.recurrence = chunk, recurrence_threads, recurrence
        self.q_embed = nn.Embedding(n_questions + 1, key_dim, padding_idx=0)
        # The original's input: a K*Q linear-decay code of (question, response). Block q-1 holds
        # the K-vector of response r; everything else is 0.
        self.gpcm_value_embed = nn.Linear(n_cats * n_questions, value_dim)
        self.key_memory = nn.Parameter(torch.empty(memory_size, key_dim))
        self.init_value_memory = nn.Parameter(torch.empty(memory_size, value_dim))
        self.erase = nn.Linear(value_dim, value_dim)
        self.add = nn.Linear(value_dim, value_dim)
        self.summary = nn.Linear(value_dim + key_dim, final_fc_dim)
        self.theta_head = nn.Linear(final_fc_dim, 1)  # student ability
        self.beta_head = nn.Linear(key_dim, n_cats - 1)  # item thresholds
        self.alpha_head = nn.Linear(final_fc_dim + key_dim, 1)  # item discrimination
        self.register_buffer("decay", linear_decay(n_cats), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for p in (self.q_embed.weight, self.gpcm_value_embed.weight, self.key_memory,
                  self.init_value_memory, self.summary.weight):
            nn.init.kaiming_normal_(p)
        for b in (self.gpcm_value_embed.bias, self.summary.bias):
            nn.init.zeros_(b)
        with torch.no_grad():
            self.q_embed.weight[0].zero_()  # kaiming overwrote the padding row; padding must embed to 0

    def forward(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        if self.path == "naive":
            return self._forward_naive(questions, responses)
        return self._forward_optimized(questions, responses)

    def _gpcm_head(self, reads: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """GPCM cumulative logits z_k = sum_{h<k} alpha (theta - beta_h), z_0 = 0, from memory reads
        and question embeddings, for all steps at once."""
        summary = torch.tanh(self.summary(torch.cat([reads, q], dim=-1)))
        theta = self.theta_head(summary)
        beta = torch.tanh(self.beta_head(q))
        alpha = F.softplus(self.alpha_head(torch.cat([summary, q], dim=-1)))
        steps = alpha * (theta - beta)  # [..., K-1]
        # the running sum written out: K is a handful, and CUDA's cumsum over so short a last
        # dimension was ~1 ms per call at B=256 on an H200, more than the whole head
        z = [torch.zeros_like(steps[..., 0])]
        for h in range(self.n_cats - 1):
            z.append(z[-1] + steps[..., h])
        return torch.stack(z, dim=-1)

    def _use_triton(self, device: torch.device) -> bool:
        if self.recurrence == "auto":
            return device.type == "cuda" and triton_available()
        return self.recurrence == "triton"

    # ---- naive: the original's per-timestep loops ---------------------------------------------

    def _forward_naive(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        B, T = questions.shape
        Q, K = self.n_questions, self.n_cats
        q_one_hot = F.one_hot(questions, Q + 1).float()[:, :, 1:]  # drop the padding column
        q_embeds = self.q_embed(questions)
        memory = self.init_value_memory.unsqueeze(0).expand(B, -1, -1)
        cats = torch.arange(K, device=questions.device, dtype=torch.float32)
        logits = []
        for t in range(T):
            q_t = q_embeds[:, t]
            # linear-decay code of (q_t, r_t): [B, Q, K] -> [B, Q*K]
            r_t = responses[:, t].float().unsqueeze(1)
            decay_t = (1 - (cats - r_t).abs() / (K - 1)).clamp(min=0)
            x_t = (q_one_hot[:, t].unsqueeze(2) * decay_t.unsqueeze(1)).reshape(B, Q * K)
            value_t = self.gpcm_value_embed(x_t)
            w_t = torch.softmax(q_t @ self.key_memory.t(), dim=-1)  # [B,N]
            read_t = torch.bmm(w_t.unsqueeze(1), memory).squeeze(1)  # read before write
            summary_t = torch.tanh(self.summary(torch.cat([read_t, q_t], dim=-1)))
            theta_t = self.theta_head(summary_t).squeeze(-1)
            beta_t = torch.tanh(self.beta_head(q_t))
            alpha_t = F.softplus(self.alpha_head(torch.cat([summary_t, q_t], dim=-1))).squeeze(-1)
            z = [torch.zeros_like(theta_t)]
            for k in range(1, K):
                z.append(z[-1] + alpha_t * (theta_t - beta_t[:, k - 1]))
            logits.append(torch.stack(z, dim=-1))
            if t + 1 < T:
                erase_t = torch.sigmoid(self.erase(value_t))
                add_t = torch.tanh(self.add(value_t))
                memory = (memory * (1 - w_t.unsqueeze(2) * erase_t.unsqueeze(1))
                          + w_t.unsqueeze(2) * add_t.unsqueeze(1))
        return torch.stack(logits, dim=1)

    # ---- optimized: vectorised over time, one tight recurrence --------------------------------

    def _value_inputs(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Erase and add vectors, side by side in one [T,B,2Dv] tensor, without the dense K*Q input.

        The K*Q code of (q, r) has non-zeros only in block q, so value_embed(code) = W[:, block q] @
        decay[r] + bias. It depends on the pair (q, r) alone, so erase/add are computed once per
        distinct pair in the batch (at most Q*K + K of them), or once per possible pair where there
        are no more of those than steps in the batch, and gathered per step.
        """
        K, Q = self.n_cats, self.n_questions
        pair = questions.t() * K + responses.t()  # [T,B]: time-major for the recurrence
        if (Q + 1) * K <= pair.numel():
            # Every possible pair costs no more than the gather below, and needs no host sync
            # (unique's output size does): on a GPU the step then queues ahead of the device.
            uniq, inv = torch.arange((Q + 1) * K, device=pair.device), pair
        else:
            uniq, inv = torch.unique(pair, return_inverse=True)
        uq, ur = uniq // K, uniq % K
        weight = self.gpcm_value_embed.weight  # [Dv, Q*K], column (q-1)*K + k
        blocks = weight.t().reshape(self.n_questions, K, -1)[(uq - 1).clamp(min=0)]  # [U,K,Dv]
        blocks = blocks * (uq > 0).to(blocks.dtype)[:, None, None]  # padding (q = 0) has no input
        value = torch.bmm(self.decay[ur].unsqueeze(1), blocks).squeeze(1) + self.gpcm_value_embed.bias
        table = torch.cat([torch.sigmoid(self.erase(value)), torch.tanh(self.add(value))], dim=-1)  # [U, 2*Dv]
        # A lookup, not table[inv]: T*B rows gather from a few hundred, and one pair (the padding)
        # can fill half the batch. On CUDA the gradient of table[inv] adds a pair's rows one after
        # another, so that pair's tens of thousands of rows serialize; embedding's backward splits
        # long runs into segments summed in parallel.
        return F.embedding(inv, table)  # [T,B,2Dv]: erase, then add

    def _forward_optimized(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        B, T = questions.shape
        steps = torch.arange(T, device=questions.device)
        lengths = ((questions != 0) * (steps + 1)).amax(1)  # up to the last non-padding id
        fused = self._use_triton(questions.device)
        if not fused:
            # Sort rows longest first so that the rows still inside their sequence at step t are a
            # prefix of the batch: the loop then skips padded steps by slicing. (The kernels take
            # each row's length instead.)
            order = torch.argsort(lengths, descending=True, stable=True)
            questions, responses = questions[order], responses[order]
            lengths = lengths[order]
        inside = steps[:, None] < lengths[None, :]  # [T,B]

        q_embeds = self.q_embed(questions.t())  # [T,B,Dk], time-major for the recurrence
        w = torch.softmax(q_embeds @ self.key_memory.t(), dim=-1)  # [T,B,N]
        erase_add = self._value_inputs(questions, responses)
        # the recurrence runs in float32 whatever autocast did upstream: errors compound over T steps
        w, erase_add, m0 = w.float(), erase_add.float(), self.init_value_memory.float()
        if fused:
            from raysys.workloads.deep_gpcm.memory_kernel import memory_scan

            # No host sync on this path, so a GPU step queues ahead of the device instead of waiting
            # on its launches: the head runs on every step, padded ones too (cheap next to a sync).
            reads = memory_scan(w, erase_add, m0, lengths, self.chunk)  # [T,B,Dv], 0 on padded steps
            z = self._gpcm_head(reads, q_embeds) * inside[..., None]  # padded steps: logits 0
            return z.transpose(0, 1)
        reads = _loop_scan(w, erase_add, m0, inside, self.chunk, self.recurrence_threads)

        # The head runs on steps inside a sequence only (padding is ~40% of a synthetic_OC batch);
        # its logits land straight in [B,T] order, unsorted. Padded steps get logits 0.
        keep = inside.flatten().nonzero().squeeze(1)
        dest = (order[None, :] * T + steps[:, None]).flatten()[keep]
        z = self._gpcm_head(reads.flatten(0, 1)[keep], q_embeds.flatten(0, 1)[keep])
        return z.new_zeros(B * T, self.n_cats).index_copy(0, dest, z).view(B, T, self.n_cats)


def masked_loss(logits: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the GPCM logits over valid (unpadded) steps only. Weighted by the mask,
    not indexed by it: boolean indexing waits for the GPU to count the steps (a host sync)."""
    losses = F.cross_entropy(logits.flatten(0, 1), responses.flatten(), reduction="none")
    mask = mask.flatten().bool()
    return torch.where(mask, losses, 0.0).sum() / mask.sum()
