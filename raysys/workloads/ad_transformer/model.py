"""The algorithm-distillation transformer (the original's ``AD`` with compressed context), both paths.

A causal ``TransformerEncoder`` (post-norm, GELU) over tokens of four kinds: a transition (s, one-hot a,
r, s') embedded by ``Linear(10 -> d)``, the query state by ``Embedding(81, d)``, and the learned
compress-start / compress-end tokens; each adds its token type's embedding and a learned position.
Two heads read the query position: the action (5) and the token type (3).

The two paths are one set of parameters and one function (a test compares their losses):

* naive (the seed's "before"): the sequence built per sample and per timestep in Python, a new
  ``torch.tensor([k])`` for every token's type, per-sample padding and stacking, an explicit float mask.
* optimized: every token of the batch embedded at once from the gathered batch (data.py), selected by
  kind with ``torch.where``; attention through ``scaled_dot_product_attention`` with ``is_causal``
  (flash or memory-efficient kernels on a GPU), which ``nn.MultiheadAttention`` calls when it gets the
  causal hint and needs no weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raysys.workloads.ad_transformer.data import QUERY, TRANSITION, TYPE_OF_KIND

N_ACTIONS, N_TYPES, GRID = 5, 3, 9
CONTEXT_DIM = 2 + N_ACTIONS + 1 + 2  # (row, col), one-hot action, reward, (row', col')


class ADTransformer(nn.Module):
    def __init__(self, d_model: int = 64, layers: int = 4, heads: int = 4, ffn: int = 256, dropout: float = 0.1,
                 max_len: int = 328, grid: int = GRID):
        super().__init__()
        self.grid, self.max_len = grid, max_len
        self.pos_embedding = nn.Parameter(torch.zeros(1, max_len, d_model))
        self.type_embedding = nn.Embedding(N_TYPES, d_model)
        self.embed_context = nn.Linear(CONTEXT_DIM, d_model)
        self.embed_query = nn.Embedding(grid * grid, d_model)
        self.compress_start = nn.Parameter(torch.zeros(d_model))
        self.compress_end = nn.Parameter(torch.zeros(d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.action_head = nn.Linear(d_model, N_ACTIONS)
        self.type_head = nn.Linear(d_model, N_TYPES)
        for p in (self.pos_embedding, self.compress_start, self.compress_end):
            nn.init.trunc_normal_(p, std=0.02)
        self.register_buffer("type_of_kind", torch.from_numpy(TYPE_OF_KIND), persistent=False)
        self._masks: dict[tuple, torch.Tensor] = {}

    def _mask(self, n: int, device) -> torch.Tensor:
        key = (n, str(device))
        if key not in self._masks:
            self._masks[key] = nn.Transformer.generate_square_subsequent_mask(n, device=device)
        return self._masks[key]

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (action logits [B, 5], token-type logits [B, 3]) at each sample's query position."""
        return self._optimized(batch) if "kind" in batch else self._naive(batch)

    def _heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.action_head(h), self.type_head(h)

    def _optimized(self, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        kind, pos = b["kind"].long(), b["pos"]
        if int(pos.max()) >= self.max_len:
            raise ValueError(f"a token at position {int(pos.max())} exceeds the model's {self.max_len} positions")
        s, s2 = b["states"].long(), b["next_states"].long()
        ctx = torch.cat([s.float(), F.one_hot(b["actions"].long(), N_ACTIONS).float(), b["rewards"].float()[..., None],
                         s2.float()], -1)
        x = self.embed_context(ctx)  # every token of the batch at once; kinds pick below
        q = self.embed_query(s[..., 0] * self.grid + s[..., 1]).to(x.dtype)
        zero = torch.zeros_like(self.compress_start)
        special = torch.stack([zero, self.compress_start, self.compress_end, zero, zero]).to(x.dtype)
        x = torch.where((kind == TRANSITION)[..., None], x, torch.where((kind == QUERY)[..., None], q, special[kind]))
        x = x + self.type_embedding(self.type_of_kind[kind]).to(x.dtype) + self.pos_embedding[0, pos].to(x.dtype)
        if b.get("causal"):
            mask = None
        else:  # token i sees slots up to lim[i], and a query sees no other query (data.pack)
            lim, L = b["lim"], kind.shape[1]
            j = torch.arange(L, device=x.device)
            mask = ((j <= lim[..., None]) & (kind != QUERY)[:, None, :]) | (j[:, None] == j)[None]
            mask = mask[:, None]  # [B, 1, L, L]: the same for every head
        h = self._encode(x, mask)
        n_q = len(b["target_type"]) // len(kind)
        return self._heads(h[:, -n_q:].reshape(-1, h.shape[-1]))  # the queries are the last slots

    def _encode(self, x: torch.Tensor, mask) -> torch.Tensor:
        """``self.encoder``'s function (post-norm layers), attention by ``scaled_dot_product_attention``:
        ``is_causal`` without a mask (flash on a GPU), else the packed batch's mask."""
        B, L, D = x.shape
        for layer in self.encoder.layers:
            a = layer.self_attn
            H = a.num_heads
            qkv = F.linear(x, a.in_proj_weight, a.in_proj_bias).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask, is_causal=mask is None,
                                               dropout_p=a.dropout if self.training else 0.0)
            o = a.out_proj(o.transpose(1, 2).reshape(B, L, D))
            x = layer.norm1(x + layer.dropout1(o))
            ff = layer.linear2(layer.dropout(layer.activation(layer.linear1(x))))
            x = layer.norm2(x + layer.dropout2(ff))
        return x

    def _naive(self, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.pos_embedding.device
        context = torch.cat([b["states"], b["actions"].float(), b["rewards"][..., None], b["next_states"]], -1)
        context_embed = self.embed_context(context.to(device))
        query = b["query_states"].to(device)
        query_embed = self.embed_query(query[:, 0] * self.grid + query[:, 1])
        seqs = []
        for i in range(len(query)):
            seq = []
            prev, curr = b["prev_region_len"][i], b["curr_region_len"][i]
            if prev > 0:
                seq.append(self.compress_start[None] + self.type_embedding(torch.tensor([1], device=device)))
                for t in range(prev):
                    seq.append(context_embed[i, t][None] + self.type_embedding(torch.tensor([0], device=device)))
                seq.append(self.compress_end[None] + self.type_embedding(torch.tensor([2], device=device)))
            seq.append(self.compress_start[None] + self.type_embedding(torch.tensor([1], device=device)))
            for t in range(curr):
                seq.append(context_embed[i, prev + t][None] + self.type_embedding(torch.tensor([0], device=device)))
            seq.append(query_embed[i][None] + self.type_embedding(torch.tensor([0], device=device)))
            seqs.append(torch.cat(seq))
        n = max(len(x) for x in seqs)
        padded = []
        for x in seqs:
            padded.append(torch.cat([x, torch.zeros(n - len(x), x.shape[1], device=device, dtype=x.dtype)]))
        x = torch.stack(padded) + self.pos_embedding[:, :n]
        h = self.encoder(x, mask=self._mask(n, device))
        # the read-out at each sample's query (the original read h[:, -1], a padding position)
        return self._heads(torch.stack([h[i, len(seqs[i]) - 1] for i in range(len(seqs))]))


def loss_fn(model: nn.Module, batch: dict, type_weight: float = 0.1) -> tuple[torch.Tensor, dict]:
    """Action CE on action targets + ``type_weight`` x token-type CE, summed and divided by the batch size
    (not by the number of action targets), so ranks' mean losses average to the whole batch's loss and
    two DDP workers compute one worker's gradient."""
    a_logits, t_logits = model(batch)
    target_type = batch["target_type"].to(a_logits.device)
    is_action = (target_type == 0).float()
    ce_a = F.cross_entropy(a_logits.float(), batch["target_action"].to(a_logits.device), reduction="none")
    ce_t = F.cross_entropy(t_logits.float(), target_type, reduction="none")
    n = len(target_type)
    loss = ((ce_a * is_action).sum() + type_weight * ce_t.sum()) / n
    return loss, {"samples": n, "tokens": batch.get("n_tokens", 0)}

