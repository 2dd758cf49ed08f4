"""Beam search for the pointer-generator: many examples x beams per decoder step.

The original decoded one example at a time (``per_example``); :func:`beam_search` runs the same
search for a whole batch, all ``B x K`` hypotheses through one decoder step, with identical scoring:

* score = sum of log P(w) under the final (copy-mixed) distribution; a finished hypothesis is
  ranked by score / length ** ``length_penalty``;
* EOS is forbidden before ``min_len`` tokens; at ``max_len`` the open beams are finished as they are;
* trigram blocking: a token that would repeat a trigram already in the hypothesis gets -inf;
* an example is done once it holds ``beam`` finished hypotheses; it then leaves the batch, and the
  source positions shrink to the longest example still searching (so a batch costs what its live
  examples cost, not its longest one at every step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raysys.workloads.pointer_generator.model import BOS, EOS, SOURCE_BLOCK, TINY, PointerGenerator


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
                max_len: int = 100, length_penalty: float = 1.0, block_trigrams: bool = True,
                exp_scores: bool = True) -> list[list[int]]:
    """The best hypothesis (token ids, without EOS) of each example of the batch. ``exp_scores``: the
    additive attention's scores through e^{2k} e^{2q} (``model.AdditiveScores``, as the optimized
    training step; the same function to float rounding) instead of a tanh per element."""
    B, K, dev = src.shape[0], beam, src.device
    enc, keys, mask, (h, c) = model.encode(src, src_len, naive=False)
    # source positions padded to whole blocks (model.chunked_context): every product then has the
    # same inner sizes alone or batched, and an example's summary does not depend on its batch
    pad = -src.shape[1] % SOURCE_BLOCK
    src, mask = F.pad(src, (0, pad)), F.pad(mask, (0, pad))
    enc, keys = F.pad(enc, (0, 0, 0, pad)), F.pad(keys, (0, 0, 0, pad))
    ekeys = model.exp_keys(keys) if exp_scores else None
    rep = lambda x, dim=0: x.repeat_interleave(K, dim=dim)  # noqa: E731  [B, ...] -> [B*K, ...]
    srcK = rep(src)  # the encodings stay [B, ...]: the K beams of an example read them together
    state = (rep(h, 1), rep(c, 1))
    ctx = enc.new_zeros(B * K, enc.shape[-1])
    hist = torch.full((B * K, 0), BOS, dtype=torch.long, device=dev)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # one live beam at the start: no K copies of the same first token
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    live = list(range(B))  # the examples still searching; row block j of every tensor below is live[j]
    lens = src_len.to(dev)
    prev = torch.full((B * K,), BOS, dtype=torch.long, device=dev)
    for t in range(max_len):
        n = len(live)
        emb = model.embed(prev)
        s, ctx, attn, state = model.step_fused(model.embedding_gates(emb), ctx, state, enc, keys, mask, group=K,
                                             ekeys=ekeys)
        logits, g = model.features(s, ctx, emb)
        p = model.final_probs(logits, g, attn, srcK, exact=True)  # [n*K, V]
        if t < min_len:
            p[:, EOS] = float("-inf")
        if block_trigrams:
            _block_trigrams(p, hist)
        # A beam's best continuations by score + log p are its best by p: rank each beam's 2K on p,
        # then take the log of those alone (float64: see final_probs on why, and a log of [n*K, V]
        # cost more than the rest of the step's bookkeeping)
        k2 = min(2 * K, p.shape[1])                            # enough to find K live continuations
        p_top, tok_top = p.topk(k2, dim=1)                     # [n*K, k2]
        lp = torch.log(p_top.double().clamp_min(TINY)).float().masked_fill_(p_top == float("-inf"), float("-inf"))
        cand = (scores.view(-1, 1) + lp).view(n, K * k2)
        top_s, top_i = cand.topk(k2, dim=1)
        top_s, top_i, tok_top = top_s.tolist(), top_i.tolist(), tok_top.view(n, K * k2).tolist()
        keep, new_scores, src_beam, new_tok = [], [], [], []
        for j, b in enumerate(live):
            k, sc_j, beam_j, tok_j = 0, [float("-inf")] * K, [j * K] * K, [EOS] * K
            for sc, idx in zip(top_s[j], top_i[j]):
                if sc == float("-inf"):
                    break
                beam_idx, tok = idx // k2, tok_top[j][idx]
                if tok == EOS:
                    seq = hist[j * K + beam_idx].tolist()
                    finished[b].append((sc / max(1, len(seq) + 1) ** length_penalty, seq))
                    continue
                sc_j[k], beam_j[k], tok_j[k] = sc, j * K + beam_idx, tok
                k += 1
                if k == K:
                    break
            if len(finished[b]) < K and k > 0:  # else this example is done
                keep.append(j), new_scores.append(sc_j), src_beam.append(beam_j), new_tok.append(tok_j)
        if not keep:
            live = []
            break
        order = torch.tensor(src_beam, device=dev).view(-1)
        state = (state[0][:, order], state[1][:, order])
        ctx = ctx[order]
        prev = torch.tensor(new_tok, device=dev).view(-1)
        hist = torch.cat([hist[order], prev[:, None]], 1)
        scores = torch.tensor(new_scores, device=dev)
        if len(keep) < n:  # done examples leave the batch; the source shrinks to the longest live one
            rows = torch.tensor(keep, device=dev)
            live = [live[j] for j in keep]
            lens = lens[rows]
            S = -(-int(lens.max()) // SOURCE_BLOCK) * SOURCE_BLOCK  # whole blocks, as above
            enc, keys, mask = enc[rows, :S], keys[rows, :S], mask[rows, :S]
            ekeys = None if ekeys is None else ekeys[rows, :S].contiguous()
            srcK = srcK.view(n, K, -1)[rows, :, :S].reshape(len(keep) * K, S)
    for j, b in enumerate(live):  # max_len reached: the open beams compete as they are
        for k in range(K):
            if scores[j, k] > float("-inf"):
                seq = hist[j * K + k].tolist()
                finished[b].append((float(scores[j, k]) / max(1, len(seq)) ** length_penalty, seq))
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


def per_example(model: PointerGenerator, src: torch.Tensor, src_len: torch.Tensor, exp_scores: bool = False,
                **kw) -> list[list[int]]:
    """The original's decoding: the same search, one example at a time, the attention as written (or,
    ``exp_scores``, as the batched search computes it)."""
    out = []
    for b in range(src.shape[0]):
        n = int(src_len[b])
        out += beam_search(model, src[b:b + 1, :n], src_len[b:b + 1], exp_scores=exp_scores, **kw)
    return out
