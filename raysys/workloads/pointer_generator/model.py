"""The pointer-generator (See et al., 2017) as the seed built it, with its slow and fast paths.

Encoder: Embedding(V, E) -> L-layer BiLSTM (hidden H). Decoder: L-layer LSTM fed [embedding of the
previous token; previous context] ("input feeding"), initialised from the encoder's forward final
states. Attention over the encoder outputs (additive, as the original, or scaled dot-product).
Output features f_t = [s_t; c_t; e_t] give the vocabulary distribution softmax(W f_t) and the
generation probability p_gen = sigmoid(w f_t). The final distribution is

    P(w) = p_gen * P_vocab(w) + (1 - p_gen) * sum_{i: x_i = w} a_t,i

so a word of the note can be produced by pointing at it even when the vocabulary softmax gives it
no mass. Loss: the NLL of each target token under P, pads ignored.

Two computations of the same function (``path``):

* ``naive`` (the original): every example encoded on its own; at every decoder step the full
  vocabulary softmax, the scatter of the attention onto the vocabulary and the NLL of that step.
* ``optimized``: one packed BiLSTM call for the batch; only what the recurrence needs (LSTM step,
  attention, context) inside the time loop; the vocabulary projection, p_gen and the mixture for all
  steps at once, in log space: log P(y) = logaddexp(log p_gen + log P_vocab(y), log(1 - p_gen) +
  log sum_i a_i [x_i = y]) -- a gather, not a scatter over V.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

PAD, BOS, EOS = 0, 2, 3
TINY = 1e-12  # the floor of a probability before its log (the original clamps the same way)


def _lstm_kernels(x: torch.Tensor):
    """oneDNN's LSTM refuses bf16 autocast on CPUs without bf16 units; ATen's own kernel runs it."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.backends.mkldnn.flags(enabled=False)
    return contextlib.nullcontext()


# ---- additive scores without a tanh per element ---------------------------------------------------------
# v^T tanh(k + q) = sum(v) - 2 v^T r with r = 1 / (1 + e^{2k} e^{2q}): e^{2k} once per batch (the keys do not
# change over the decoder's steps), e^{2q} once per step, and the [B, K, S, H] work becomes a multiply, add
# and divide per element instead of a tanh, fused with the reduction over H by torch.compile. On a CPU the
# tanh was the largest cost of both training (18% of a step, plus its saved activations) and beam search.

EXP_RANGE = 40.0  # |x| <= 40: e^{2x} and the product of two such stay finite and nonzero in float32
SOURCE_BLOCK = 64  # beam search: source positions in blocks of this many (see chunked_context)


def chunked_context(attn: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
    """attn [B, K, S] @ enc [B, S, D] -> [B, K, D], with S a multiple of SOURCE_BLOCK: one product per
    block of positions, then the blocks added in order. Why not one bmm: its sum over S is associated
    differently for different S (BLAS blocks and unrolls its inner dimension by the length), so an
    example's context would depend on how far the other examples of its batch pad it. Here trailing
    blocks of padding add exact zeros, so an example's context is bit-identical alone or in any batch
    (its decoder states too: every other product has fixed inner sizes), and a batched beam search
    returns exactly what a per-example one does."""
    B, K, S = attn.shape
    n = S // SOURCE_BLOCK
    blocks = torch.bmm(attn.view(B, K, n, SOURCE_BLOCK).transpose(1, 2).reshape(B * n, K, SOURCE_BLOCK),
                       enc.view(B * n, SOURCE_BLOCK, -1)).view(B, n, K, -1)
    out = blocks[:, 0]
    for i in range(1, n):  # in order: a sum's own reduction could associate by n as well
        out = out + blocks[:, i]
    return out


def _scores_from_exp(ek: torch.Tensor, eq: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ek = e^{2k} [B, S, H], eq = e^{2q} [B, K, H] -> v^T tanh(k + q) [B, K, S]."""
    return v.sum() - 2 * (v / (ek[:, None] * eq[:, :, None] + 1)).sum(-1)


def _scores_grads(ek: torch.Tensor, eq: torch.Tensor, v: torch.Tensor, g: torch.Tensor):
    """d/dk, d/dq, d/dv of sum(g * v^T tanh(k + q)), from the same e^{2k} e^{2q}: tanh = 1 - 2r and
    1 - tanh^2 = 4r(1 - r). Recomputed in the backward instead of saving [B, K, S, H] activations."""
    r = 1 / (ek[:, None] * eq[:, :, None] + 1)
    w = (4 * g)[..., None] * v * r * (1 - r)
    return w.sum(1), w.sum(2), (g[..., None] * (1 - 2 * r)).sum((0, 1, 2))


_compiled: dict = {}


def fused(fn, *args: torch.Tensor):
    """``fn(*args)`` as fused loops (torch.compile: no [B, K, S, H] temporaries), eager where the compiler
    cannot run (no C++ compiler, no Triton). The batch and source sizes (dims 0 and 1 of e^{2k}) are
    unbacked: one program for every size, 1 included, so no recompiles as examples leave a search."""
    key = (fn, args[0].device.type)
    comp = _compiled.get(key)
    if comp is None:
        comp = _compiled[key] = torch.compile(fn, dynamic=True)
    if comp is not fn:
        for d in (0, 1):
            torch._dynamo.decorators.mark_unbacked(args[0], d)
        try:
            return comp(*args)
        except Exception as e:  # noqa: BLE001 -- any compiler failure: the same formula, eager
            warnings.warn(f"torch.compile of the additive attention failed ({type(e).__name__}); running it eagerly")
            _compiled[key] = fn
    return fn(*args)


class AdditiveScores(torch.autograd.Function):
    """v^T tanh(keys + q) [B, K, S] for keys [B, S, H], queries q [B, K, H], from ek = e^{2 keys} (made
    once, outside the graph): the same function and gradients as the tanh, without its activations."""

    @staticmethod
    def forward(ctx, keys, ek, q, v):
        eq = torch.exp(2 * q)
        ctx.save_for_backward(ek, eq, v)
        return fused(_scores_from_exp, ek, eq, v)

    @staticmethod
    def backward(ctx, g):
        ek, eq, v = ctx.saved_tensors
        gk, gq, gv = fused(_scores_grads, ek, eq, v, g.contiguous())
        return gk, None, gq, gv


# ---- the context's gradient w.r.t. the encodings, once per batch instead of once per step ---------------

class Context(torch.autograd.Function):
    """ctx_t = a_t @ enc [N, 2H] for attention a_t [N, S]. Its gradient w.r.t. enc, a_t^T g_t, would be a
    [N, S, 2H] outer product per decoder step, added into enc's gradient T times (a third of a CPU
    training step); it is stashed instead, and :class:`CollectContextGrads` sums all steps as one
    batched matmul A^T G."""

    @staticmethod
    def forward(ctx, attn, enc, stash: list):
        ctx.save_for_backward(attn, enc)
        ctx.stash = stash
        return torch.bmm(attn[:, None], enc)[:, 0]

    @staticmethod
    def backward(ctx, g):
        attn, enc = ctx.saved_tensors
        g = g.to(enc.dtype)  # under autocast the forward ran in bf16/fp16; its inputs are saved as they came
        ctx.stash.append((attn, g))
        return torch.bmm(g[:, None], enc.transpose(1, 2))[:, 0].to(attn.dtype), None, None


class CollectContextGrads(torch.autograd.Function):
    """enc, as the steps' :class:`Context` read it; its backward runs after all of theirs (they consume
    its output) and adds their stashed gradients: sum_t a_t^T g_t = A^T G."""

    @staticmethod
    def forward(ctx, enc, stash: list):
        ctx.stash = stash
        return enc.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.stash:
            a, gs = zip(*ctx.stash)
            g = g + torch.bmm(torch.stack(a, 2).to(gs[0].dtype), torch.stack(gs, 1))  # [N, S, T] @ [N, T, 2H]
            ctx.stash.clear()
        return g, None


class PointerGenerator(nn.Module):
    def __init__(self, vocab_size: int, emb_dim: int = 128, hidden: int = 256, layers: int = 2, dropout: float = 0.3,
                 attention: str = "additive", copy: bool = True, path: str = "optimized"):
        super().__init__()
        self.V, self.E, self.H, self.L = vocab_size, emb_dim, hidden, layers
        self.attention, self.copy, self.path = attention, copy, path
        drop = dropout if layers > 1 else 0.0
        self.embed = nn.Embedding(vocab_size, emb_dim, padding_idx=PAD)
        self.encoder = nn.LSTM(emb_dim, hidden, layers, batch_first=True, bidirectional=True, dropout=drop)
        self.decoder = nn.LSTM(emb_dim + 2 * hidden, hidden, layers, batch_first=True, dropout=drop)
        if attention == "additive":  # Bahdanau: v^T tanh(W_h h_i + W_s s_t + b)
            self.W_h = nn.Linear(2 * hidden, hidden, bias=False)
            self.W_s = nn.Linear(hidden, hidden)
            self.v = nn.Linear(hidden, 1, bias=False)
        elif attention == "dot":  # scaled dot-product of a projected decoder state with h_i
            self.W_q = nn.Linear(hidden, 2 * hidden, bias=False)
        else:
            raise ValueError(f"attention must be 'additive' or 'dot', got {attention!r}")
        feat = hidden + 2 * hidden + emb_dim
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(feat, vocab_size)
        self.gen = nn.Linear(feat, 1)
        if not copy:  # the ablation never reads p_gen: frozen, so that DDP waits for no gradient of it (the layer
            self.gen.requires_grad_(False)  # stays, and checkpoints keep one layout)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- encoder -------------------------------------------------------------------------------------

    def encode(self, src: torch.Tensor, src_len: torch.Tensor, naive: Optional[bool] = None):
        """-> enc [B, S, 2H], its attention keys, the source mask [B, S] and the decoder's initial state."""
        naive = self.path == "naive" if naive is None else naive
        B, S = src.shape
        emb = self.drop(self.embed(src))
        with _lstm_kernels(emb):
            return self._encode(src, src_len, emb, naive)

    def _encode(self, src, src_len, emb, naive: bool):
        B, S = src.shape
        if not naive and not src.is_cuda:  # CPU: PyTorch's packed LSTM backward is ~10x slower than this
            enc, state = self._encode_padded(emb, src_len)
        else:
            if naive:  # one example at a time, each at its own length (batch 1 in the original)
                outs, hs, cs = [], [], []
                for b in range(B):
                    n = int(src_len[b])
                    o, (h, c) = self.encoder(emb[b:b + 1, :n])
                    outs.append(F.pad(o, (0, 0, 0, S - n))), hs.append(h), cs.append(c)
                enc, h, c = torch.cat(outs), torch.cat(hs, 1), torch.cat(cs, 1)
            else:  # one packed call: cuDNN, no compute on pads
                packed = pack_padded_sequence(emb, src_len.cpu(), batch_first=True, enforce_sorted=False)
                o, (h, c) = self.encoder(packed)
                enc, _ = pad_packed_sequence(o, batch_first=True, total_length=S)
            # the decoder starts from the forward direction's final states of each layer
            state = (h.view(self.L, 2, B, self.H)[:, 0].contiguous(), c.view(self.L, 2, B, self.H)[:, 0].contiguous())
        mask = torch.arange(S, device=src.device)[None] < src_len[:, None]
        keys = self.W_h(enc) if self.attention == "additive" else enc
        return enc, keys, mask, state

    def _encode_padded(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The packed BiLSTM's function on a padded batch, with the few long LSTM calls a CPU likes.
        Forward direction: the batch, longest first, runs in segments between distinct lengths, each
        sequence leaving at its own end with its final (h, c). Backward direction: each sequence
        reversed within its length, one call (pads trail, so they never reach a real position)."""
        B, S, _ = x.shape
        lengths = lengths.to(x.device)
        pos = torch.arange(S, device=x.device)
        rev = (lengths[:, None] - 1 - pos[None]).clamp_min(0)          # reversal within each length
        valid = (pos[None] < lengths[:, None])[..., None]
        order = torch.argsort(lengths, descending=True, stable=True)
        ends = sorted(set(lengths.tolist()))
        hs, cs = [], []
        for layer in range(self.L):
            p = [getattr(self.encoder, f"{w}_l{layer}") for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            pr = [getattr(self.encoder, f"{w}_l{layer}_reverse") for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            xs = x[order]
            zeros = x.new_zeros(1, B, self.H)
            h, c, start, outs = zeros, zeros, 0, []
            h_fin, c_fin = [], []
            for end in ends:  # ascending; the running sequences are the first n (longest first)
                n, m = int((lengths >= end).sum()), int((lengths == end).sum())
                o, hn, cn = torch.lstm(xs[:n, start:end], (h[:, :n], c[:, :n]), p, True, 1, 0.0, self.training, False, True)
                outs.append(F.pad(o, (0, 0, 0, 0, 0, B - n)))
                h_fin.append(hn[:, n - m:n]), c_fin.append(cn[:, n - m:n])  # the m that end here
                h, c, start = hn, cn, end
            out_f = torch.cat(outs, 1) if outs else x.new_zeros(B, 0, self.H)
            out_f = F.pad(out_f, (0, 0, 0, S - out_f.shape[1]))
            inv = torch.argsort(order)
            out_f = out_f[inv]
            hf, cf = torch.cat(h_fin[::-1], 1)[:, inv], torch.cat(c_fin[::-1], 1)[:, inv]
            xr = torch.gather(x, 1, rev[..., None].expand_as(x))
            o_r = torch.lstm(xr, (zeros, zeros), pr, True, 1, 0.0, self.training, False, True)[0]
            out_b = torch.gather(o_r, 1, rev[..., None].expand_as(o_r))
            x = torch.cat([out_f, out_b], -1) * valid                  # zeros on pads, as pad_packed gives
            hs.append(hf), cs.append(cf)
            if layer < self.L - 1:
                x = F.dropout(x, self.encoder.dropout, self.training)
        return x, (torch.cat(hs), torch.cat(cs))  # forward direction's final states, [L, B, H]

    # ---- one decoder step (both paths, and beam search) ----------------------------------------------

    def exp_keys(self, keys: torch.Tensor) -> Optional[torch.Tensor]:
        """e^{2 keys} for :class:`AdditiveScores`, or None where it does not apply: dot attention, not
        float32 (autocast), or keys or queries beyond its range. Queries W_s s + b of decoder states s
        in (-1, 1) (LSTM outputs) are bounded by W_s's row L1 norms plus |b|: checked once here, so the
        decoder's steps need no check of their own."""
        if self.attention != "additive" or keys.dtype != torch.float32:
            return None
        q_bound = float((self.W_s.weight.detach().abs().sum(1) + self.W_s.bias.detach().abs()).max())
        if q_bound > EXP_RANGE or float(keys.detach().abs().max()) > EXP_RANGE:
            return None
        return torch.exp(2 * keys.detach())

    def _additive_scores(self, keys: torch.Tensor, q: torch.Tensor, ekeys: Optional[torch.Tensor]) -> torch.Tensor:
        """v^T tanh(keys + q): keys [B, S, H], queries [B, K, H] -> [B, K, S]; without the tanh given ekeys."""
        if ekeys is not None and q.dtype == torch.float32:
            return AdditiveScores.apply(keys, ekeys, q, self.v.weight[0])
        return self.v(torch.tanh(keys[:, None] + q[:, :, None]))[..., 0]

    def attend(self, s: torch.Tensor, enc: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
               weights: bool = True, group: int = 1, ekeys: Optional[torch.Tensor] = None,
               stash: Optional[list] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Context [N, 2H] (and attention weights [N, S] if asked) of decoder states s [N, H].
        ``group`` > 1: N = B x group states (beams) share each of the B encodings, which are read
        once per example instead of once per beam. ``ekeys`` (:meth:`exp_keys`): the additive scores
        through :class:`AdditiveScores`, without a tanh per (state, position, unit). ``stash``: the
        context through :class:`Context` (``enc`` from :class:`CollectContextGrads` with that stash)."""
        if group > 1:
            B, K = enc.shape[0], group
            if self.attention == "additive":
                scores = self._additive_scores(keys, self.W_s(s).view(B, K, -1), ekeys)
            else:  # [B, S, D] @ [B, D, K]: a K-wide product per position (MKL: ~2x faster than K rows x S)
                q = self.W_q(s).view(B, K, -1)
                scores = torch.bmm(enc, q.transpose(1, 2)).transpose(1, 2) / math.sqrt(enc.shape[-1])
            attn = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)  # [B, K, S]
            ctx = chunked_context(attn, enc) if enc.shape[1] % SOURCE_BLOCK == 0 else torch.bmm(attn, enc)
            return ctx.view(B * K, -1), attn.view(B * K, -1)
        if self.attention == "additive":
            scores = self._additive_scores(keys, self.W_s(s)[:, None], ekeys)[:, 0]
        else:
            q = self.W_q(s)
            if not weights:  # the context alone: one fused kernel (flash attention on a GPU)
                ctx = F.scaled_dot_product_attention(q[:, None, None], enc[:, None], enc[:, None], attn_mask=mask[:, None, None])
                return ctx[:, 0, 0], None
            scores = torch.einsum("nd,nsd->ns", q, enc) / math.sqrt(enc.shape[-1])
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        if stash is not None:
            return Context.apply(attn, enc, stash), attn
        return torch.bmm(attn[:, None], enc)[:, 0], attn

    def step(self, emb_t, ctx, state, enc, keys, mask, weights: bool = True):
        with _lstm_kernels(emb_t):
            out, state = self.decoder(torch.cat([emb_t, ctx], -1)[:, None], state)
        s = out[:, 0]
        ctx, attn = self.attend(s, enc, keys, mask, weights)
        return s, ctx, attn, state

    def step_fused(self, pre_t, ctx, state, enc, keys, mask, weights: bool = True, group: int = 1, ekeys=None,
                   stash=None):
        """``step`` with the decoder LSTM written out: the embedding's share of the first layer's gates
        (``pre_t``, see :meth:`embedding_gates`) is computed for all steps before the loop, so the
        loop does only what depends on the previous step (the same function as ``nn.LSTM``)."""
        h0, c0 = state[0].unbind(0), state[1].unbind(0)
        hs, cs, x = [], [], None
        for layer in range(self.L):
            w_hh = getattr(self.decoder, f"weight_hh_l{layer}")
            if layer == 0:
                gates = torch.addmm(pre_t, ctx, self.decoder.weight_ih_l0[:, self.E:].t())
            else:
                x = F.dropout(x, self.decoder.dropout, self.training)
                w_ih, b = getattr(self.decoder, f"weight_ih_l{layer}"), getattr(self.decoder, f"bias_ih_l{layer}")
                gates = torch.addmm(b + getattr(self.decoder, f"bias_hh_l{layer}"), x, w_ih.t())
            gates = torch.addmm(gates, h0[layer], w_hh.t())
            i, f, g, o = gates.chunk(4, 1)
            c = torch.sigmoid(f) * c0[layer] + torch.sigmoid(i) * torch.tanh(g)
            x = torch.sigmoid(o) * torch.tanh(c)
            hs.append(x), cs.append(c)
        ctx, attn = self.attend(x, enc, keys, mask, weights, group, ekeys, stash)
        return x, ctx, attn, (torch.stack(hs), torch.stack(cs))

    def embedding_gates(self, emb: torch.Tensor) -> torch.Tensor:
        """The first decoder layer's gate pre-activations from the token embeddings (and both biases),
        for every step at once: [..., E] -> [..., 4H]."""
        d = self.decoder
        return F.linear(emb, d.weight_ih_l0[:, : self.E], d.bias_ih_l0 + d.bias_hh_l0)

    def features(self, s, ctx, emb_t) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocabulary logits and the p_gen logit of output features [s; c; e]."""
        f = torch.cat([s, ctx, emb_t], -1)
        return self.out(self.drop(f)), self.gen(f)[..., 0]

    def final_probs(self, logits, gen_logit, attn, src, exact: bool = False) -> torch.Tensor:
        """P(w) over the whole vocabulary [N, V]: the softmax, mixed with the attention scattered
        onto the source words. ``exact`` (beam search): p_gen's sigmoid in float64, rounded once. ATen
        computes a tensor's last (numel mod 2 x SIMD width) elements, and each thread's, with scalar
        code, and a transcendental function's scalar and SIMD results can differ in the last bit, so
        in float32 a row's p_gen would depend on how many rows its batch has; in float64 the two agree
        after rounding (but for values ~1e-9 from a tie). Everything else here works row by row or
        is exactly rounded arithmetic, the same alone or batched."""
        p = torch.softmax(logits.float(), -1)
        if not self.copy:
            return p
        pg = torch.sigmoid(gen_logit.double() if exact else gen_logit.float()).float()[:, None]
        return (pg * p).scatter_add(1, src, (1 - pg) * attn.float())

    # ---- training loss ------------------------------------------------------------------------------

    def forward(self, src, src_len, tgt) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sum of token NLLs, number of target tokens); ``tgt`` ends with EOS, padded with PAD."""
        enc, keys, mask, state = self.encode(src, src_len)
        B, T = tgt.shape
        dec_in = torch.cat([torch.full((B, 1), BOS, dtype=tgt.dtype, device=tgt.device), tgt[:, :-1]], 1)
        emb = self.drop(self.embed(dec_in))
        valid = tgt != PAD
        ctx = enc.new_zeros(B, 2 * self.H)
        if self.path == "naive":
            total = enc.new_zeros((), dtype=torch.float32)
            for t in range(T):  # everything, every step, as the original
                s, ctx, attn, state = self.step(emb[:, t], ctx, state, enc, keys, mask)
                logits, g = self.features(s, ctx, emb[:, t])
                p = self.final_probs(logits, g, attn, src).gather(1, tgt[:, t:t + 1])[:, 0]
                total = total + (-torch.log(p.clamp_min(TINY)) * valid[:, t]).sum()
            return total, valid.sum()
        # optimized: the recurrence only, then every step's output at once
        need_weights = self.attention == "additive"  # dot: weights for all steps after the loop
        # [B, T, 4H]: one GEMM instead of T. unbind, not pre[:, t]: the backward of T slices would
        # zero-fill a whole [B, T, 4H] gradient per step (quadratic in T)
        pre = self.embedding_gates(emb).unbind(1)
        # eager: additive scores without a tanh per element (or its activations), enc's gradient once
        # instead of per step; under torch.compile (train.compile) the compiler fuses the plain ops
        eager = not torch.compiler.is_compiling()
        ekeys = self.exp_keys(keys) if eager else None
        stash = [] if need_weights and eager and torch.is_grad_enabled() else None
        enc_c = CollectContextGrads.apply(enc, stash) if stash is not None else enc
        states, ctxs, attns = [], [], []
        for t in range(T):
            s, ctx, attn, state = self.step_fused(pre[t], ctx, state, enc_c, keys, mask, weights=need_weights,
                                                 ekeys=ekeys, stash=stash)
            states.append(s), ctxs.append(ctx), attns.append(attn)
        s_all, c_all = torch.stack(states, 1), torch.stack(ctxs, 1)
        logits, g = self.features(s_all, c_all, emb)                       # [B, T, V], [B, T]
        log_pv = -F.cross_entropy(logits.float().transpose(1, 2), tgt, reduction="none")  # log P_vocab(y_t)
        if self.copy:
            if need_weights:
                attn = torch.stack(attns, 1)
            else:
                scores = torch.einsum("btd,bsd->bts", self.W_q(s_all), enc) / math.sqrt(enc.shape[-1])
                attn = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1)
            copy = (attn.float() * (src[:, None, :] == tgt[:, :, None])).sum(-1)   # attention on the target word
            g = g.float()
            log_p = torch.logaddexp(F.logsigmoid(g) + log_pv, F.logsigmoid(-g) + torch.log(copy.clamp_min(TINY)))
        else:
            log_p = log_pv
        # the same floor as the naive path's clamp, so both compute one function
        log_p = log_p.clamp_min(math.log(TINY))
        return -(log_p * valid).sum(), valid.sum()
