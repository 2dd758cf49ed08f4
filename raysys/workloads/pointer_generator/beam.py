"""Beam search for the pointer-generator: many examples x beams per decoder step.

The original decoded one example at a time (``per_example``); :func:`beam_search` runs the same
search for a whole batch, all ``B x K`` hypotheses through one decoder step, with identical scoring:

* score = sum of log P(w) under the final (copy-mixed) distribution; a finished hypothesis is
  ranked by score / length ** ``length_penalty``;
* EOS is forbidden before ``min_len`` tokens; at ``max_len`` the open beams are finished as they are;
* trigram blocking: a token that would repeat a trigram already in the hypothesis gets -inf;
* an example is done once it holds ``beam`` finished hypotheses (the decoder keeps stepping it with
  the batch; its beams are ignored).
"""

from __future__ import annotations

import torch

from raysys.workloads.pointer_generator.model import BOS, EOS, PointerGenerator


def _block_trigrams(logp: torch.Tensor, hist: torch.Tensor) -> None:
    """-inf (in place) for every token that would complete a trigram already in ``hist`` [N, t]."""
    t = hist.shape[1]
    if t < 3:
        return
    a, b = hist[:, -2:-1], hist[:, -1:]
    seen = (hist[:, :-2] == a) & (hist[:, 1:-1] == b)        # [N, t-2]: where the last bigram occurred before
    rows, cols = seen.nonzero(as_tuple=True)
    logp[rows, hist[rows, cols + 2]] = float("-inf")          # ...and what followed it then


@torch.no_grad()
def beam_search(model: PointerGenerator, src: torch.Tensor, src_len: torch.Tensor, beam: int = 4, min_len: int = 1,
                max_len: int = 100, length_penalty: float = 1.0, block_trigrams: bool = True) -> list[list[int]]:
    """The best hypothesis (token ids, without EOS) of each example of the batch."""
    B, K, dev = src.shape[0], beam, src.device
    enc, keys, mask, (h, c) = model.encode(src, src_len, naive=False)
    rep = lambda x, dim=0: x.repeat_interleave(K, dim=dim)  # noqa: E731  [B, ...] -> [B*K, ...]
    srcK = rep(src)  # the encodings stay [B, ...]: the K beams of an example read them together
    state = (rep(h, 1), rep(c, 1))
    ctx = enc.new_zeros(B * K, enc.shape[-1])
    hist = torch.full((B * K, 0), BOS, dtype=torch.long, device=dev)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # one live beam at the start: no K copies of the same first token
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    prev = torch.full((B * K,), BOS, dtype=torch.long, device=dev)
    for t in range(max_len):
        emb = model.embed(prev)
        s, ctx, attn, state = model.step_fused(model.embedding_gates(emb), ctx, state, enc, keys, mask, group=K)
        logits, g = model.features(s, ctx, emb)
        logp = model.final_log_probs(logits, g, attn, srcK)   # [B*K, V]
        if t < min_len:
            logp[:, EOS] = float("-inf")
        if block_trigrams:
            _block_trigrams(logp, hist)
        V = logp.shape[1]
        cand = (scores.view(-1, 1) + logp).view(B, K * V)
        top_s, top_i = cand.topk(2 * K, dim=1)                 # enough to find K live continuations
        top_s, top_i = top_s.tolist(), top_i.tolist()
        new_scores = [[float("-inf")] * K for _ in range(B)]
        src_beam = [[b * K + k for k in range(K)] for b in range(B)]
        new_tok = [[EOS] * K for _ in range(B)]
        for b in range(B):
            if done[b]:
                continue
            k = 0
            for sc, idx in zip(top_s[b], top_i[b]):
                if sc == float("-inf"):
                    break
                beam_idx, tok = divmod(idx, V)
                if tok == EOS:
                    seq = hist[b * K + beam_idx].tolist()
                    finished[b].append((sc / max(1, len(seq) + 1) ** length_penalty, seq))
                    continue
                new_scores[b][k], src_beam[b][k], new_tok[b][k] = sc, b * K + beam_idx, tok
                k += 1
                if k == K:
                    break
            if len(finished[b]) >= K or k == 0:
                done[b] = True
        if all(done):
            break
        order = torch.tensor(src_beam, device=dev).view(-1)
        new_tok = torch.tensor(new_tok, device=dev).view(-1)
        state = (state[0][:, order], state[1][:, order])
        ctx = ctx[order]
        hist = torch.cat([hist[order], new_tok[:, None]], 1)
        prev, scores = new_tok, torch.tensor(new_scores, device=dev)
    out = []
    for b in range(B):
        if not done[b]:  # max_len reached: the open beams compete as they are
            for k in range(K):
                if scores[b, k] > float("-inf"):
                    seq = hist[b * K + k].tolist()
                    finished[b].append((float(scores[b, k]) / max(1, len(seq)) ** length_penalty, seq))
        out.append(max(finished[b], key=lambda x: x[0])[1] if finished[b] else [])
    return out


def per_example(model: PointerGenerator, src: torch.Tensor, src_len: torch.Tensor, **kw) -> list[list[int]]:
    """The original's decoding: the same search, one example at a time."""
    out = []
    for b in range(src.shape[0]):
        n = int(src_len[b])
        out += beam_search(model, src[b:b + 1, :n], src_len[b:b + 1], **kw)
    return out
