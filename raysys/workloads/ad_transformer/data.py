"""Training samples cut from learning histories: the original's 80-step regions, on two paths.

A stream's steps are cut into regions of ``R`` steps (the original: 80). A sample asks for the model's
next output after a prefix of ``c`` steps of region ``r``::

    [cs, previous region (R transitions), ce, cs, current-region prefix (c transitions), query state]

(the first region of a stream has no previous region: ``[cs, prefix, query]``). ``cs``/``ce`` are the
compress-start/-end tokens, a transition is (s, a, r, s'), the query is the state of step ``start + c``
(``c`` in 0..R).
The target is that step's action for ``c < R``; at ``c == R`` (the region is full) it is the end-of-region
token type. The original asked for the end token in place of the region's last action, so its model
never chose that action at evaluation while its training regions held it; here every step's action is
a target and an evaluation's regions are the training regions (icl.py builds them with :func:`pack`).

Sequences are right-padded and the read-out is at each sample's own last (query) position: with causal
attention the padding is never seen. The original padded after the query and read ``output[:, -1]``,
i.e. a padding position for every sample shorter than its batch's longest.

An item is a region (its R + 1 samples), on both paths, so both see the same batches. ``naive``: each
sample built as the original's dataset did (numpy slices and concatenations) and the seed's "before"
collate (per-sample pad by concatenation, lists, stack). ``optimized``: the dataset's ``__getitems__``
packs the batch by index arithmetic and one gather per array (:func:`pack`); the collate passes it on.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from raysys.workloads.ad_transformer.histories import Histories

# token kinds (the model embeds each kind its own way)
TRANSITION, START, END, QUERY, PAD = 0, 1, 2, 3, 4
# token types (the type embedding and the type head): transition/query, compress-start, compress-end
TYPE_OF_KIND = np.array([0, 1, 2, 0, 0], np.int64)
ACTION, END_OF_REGION = 0, 2  # the two target types


class Streams(NamedTuple):
    """Histories flattened to streams: [N, T] arrays (N = goals x streams)."""

    states: np.ndarray  # int8[N, T, 2]
    actions: np.ndarray  # int8[N, T]
    rewards: np.ndarray  # int8[N, T]
    next_states: np.ndarray  # int8[N, T, 2]

    @classmethod
    def of(cls, h: Histories, streams: int | None = None) -> "Streams":
        def flat(x):
            x = x[:, :streams]
            return np.ascontiguousarray(x.reshape((-1,) + x.shape[2:]))

        return cls(flat(h.states), flat(h.actions), flat(h.rewards), flat(h.next_states))


def max_len(region: int) -> int:
    """Most tokens of a sample: cs + R + ce + cs + R (a full current region) + query."""
    return 2 * region + 4


class RegionIndex:
    """Item number -> (stream, region) by arithmetic. An item is one region: its ``R + 1`` samples."""

    def __init__(self, n_streams: int, steps: int, region: int):
        # the sample at c == R needs the query after the region's last step, so the last region ends before T
        self.region, self.n_regions = region, (steps - 1) // region
        self.n = n_streams * self.n_regions
        if self.n_regions < 1:
            raise ValueError(f"a stream of {steps} steps holds no full region of {region} steps plus a query")

    def __len__(self) -> int:
        return self.n

    def decode(self, idx):
        return np.divmod(np.asarray(idx, np.int64), self.n_regions)


def pack(s: Streams, stream, region_index, queries, region: int) -> dict:
    """Samples (stream, region, c) for every c in ``queries``, packed: one sequence per (stream, region).

    The context ``[cs, previous region, ce, cs, current prefix]`` appears once, followed by one query token
    per c. Causal attention makes a context token's state independent of what follows it, so query c,
    allowed to see the context up to its own prefix (``lim``) and itself, at the position it has in its
    own sample, computes exactly the single sample's output (a test checks it): a region's R + 1 samples
    cost one sequence of 3R + 4 tokens instead of R + 1 sequences of up to 2R + 4.

    -> the batch: per token ``kind``, the gathered (s, a, r, s'), its ``pos`` (learned position) and
    ``lim`` (the last slot it may attend to); per query ``target_action``/``target_type``. The queries
    are the last ``len(queries)`` slots."""
    stream, region_index = np.asarray(stream, np.int64), np.asarray(region_index, np.int64)
    queries = np.asarray(queries, np.int64)
    B, Q, cmax = len(stream), len(queries), int(queries.max())
    p = np.where(region_index > 0, region + 2, 0)[:, None]  # slot of the current region's cs
    n_ctx = int(p.max()) + 1 + cmax
    j = np.arange(n_ctx)[None, :]
    has_prev = (p > 0)
    kind = np.select([has_prev & (j == 0), has_prev & (j <= region), has_prev & (j == region + 1), j == p,
                      j <= p + cmax], [START, TRANSITION, END, START, TRANSITION], PAD)
    offset = np.where(has_prev & (j <= region + 1), j - 1 - region, j - p - 1)  # previous: -R..-1; current: 0..
    kind = np.concatenate([kind, np.full((B, Q), QUERY)], 1)
    offset = np.concatenate([np.where(kind[:, :n_ctx] == TRANSITION, offset, 0), np.broadcast_to(queries, (B, Q))], 1)
    pos = np.concatenate([np.broadcast_to(j, (B, n_ctx)), p + queries[None, :] + 1], 1)
    lim = np.concatenate([np.broadcast_to(j, (B, n_ctx)), p + queries[None, :]], 1)
    t = region_index[:, None] * region + offset
    row = stream[:, None]
    at = (row, region_index[:, None] * region + queries[None, :])  # each query's step
    full = np.broadcast_to(queries == region, (B, Q))
    n_real = int((kind != PAD).sum())
    return {
        "kind": torch.from_numpy(kind.astype(np.uint8)),
        "states": torch.from_numpy(s.states[row, t]),
        "actions": torch.from_numpy(s.actions[row, t]),
        "rewards": torch.from_numpy(s.rewards[row, t]),
        "next_states": torch.from_numpy(s.next_states[row, t]),
        "pos": torch.from_numpy(pos.astype(np.int64)),
        "lim": torch.from_numpy(lim.astype(np.int64)),
        "causal": Q == 1 and bool((kind[:, :n_ctx] != PAD).all()),  # one query, last: plain causal attention
        "target_action": torch.from_numpy(np.where(full, 0, s.actions[at]).astype(np.int64).reshape(-1)),
        "target_type": torch.from_numpy(np.where(full, END_OF_REGION, ACTION).astype(np.int64).reshape(-1)),
        "n_tokens": n_real,  # counted on the host: no device sync for tokens/s
    }


class RegionSamples(torch.utils.data.Dataset):
    """The samples of some streams, an item per region. ``__getitems__`` (the optimized path: the
    DataLoader hands it a batch's indices) packs the batch at once; ``__getitem__`` is the original's
    samples of one region, each built on its own."""

    def __init__(self, streams: Streams, region: int, batched: bool = True):
        self.s, self.region = streams, region
        self.index = RegionIndex(len(streams.actions), streams.actions.shape[1], region)
        if not batched:  # the naive path: torch's fetcher then takes items one by one
            self.__getitems__ = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitems__(self, indices: list[int]) -> dict:
        stream, r = self.index.decode(indices)
        return pack(self.s, stream, r, np.arange(self.region + 1), self.region)

    def __getitem__(self, i: int) -> list[dict]:
        stream, r = (int(x) for x in self.index.decode(i))
        return [self.sample(stream, r, c) for c in range(self.region + 1)]

    def sample(self, stream: int, r: int, c: int) -> dict:
        """The original's sample: the previous region and the current prefix as numpy slices, concatenated."""
        s, R = self.s, self.region
        start = r * R
        parts = [slice(start - R, start), slice(start, start + c)] if r > 0 else [slice(start, start + c)]
        return {
            "states": np.concatenate([s.states[stream, p] for p in parts]),
            "actions": np.concatenate([s.actions[stream, p] for p in parts]),
            "rewards": np.concatenate([s.rewards[stream, p] for p in parts]),
            "next_states": np.concatenate([s.next_states[stream, p] for p in parts]),
            "query_states": s.states[stream, start + c],
            "prev_region_len": R if r > 0 else 0,
            "curr_region_len": c,
            "target_actions": 0 if c == R else int(s.actions[stream, start + c]),
            "target_token_type": END_OF_REGION if c == R else ACTION,
        }


def collate_naive(batch: list) -> dict:
    """The seed's "before" collate: every sample (overlapping window) padded by concatenation, lists of
    arrays, then stack."""
    batch = [item for region in batch for item in region] if isinstance(batch[0], list) else batch
    max_n = max(len(item["states"]) for item in batch)
    states, actions, rewards, next_states = [], [], [], []
    for item in batch:
        pad = max_n - len(item["states"])
        states.append(np.concatenate([item["states"], np.zeros((pad, 2), item["states"].dtype)]))
        actions.append(np.concatenate([item["actions"], np.zeros(pad, item["actions"].dtype)]))
        rewards.append(np.concatenate([item["rewards"], np.zeros(pad, item["rewards"].dtype)]))
        next_states.append(np.concatenate([item["next_states"], np.zeros((pad, 2), item["next_states"].dtype)]))
    return {
        "states": torch.tensor(np.stack(states), dtype=torch.float),
        "actions": torch.nn.functional.one_hot(torch.tensor(np.stack(actions), dtype=torch.long), 5),
        "rewards": torch.tensor(np.stack(rewards), dtype=torch.float),
        "next_states": torch.tensor(np.stack(next_states), dtype=torch.float),
        "query_states": torch.tensor(np.array([item["query_states"] for item in batch]), dtype=torch.long),
        "n_tokens": sum(item["prev_region_len"] + (2 if item["prev_region_len"] else 0) + item["curr_region_len"] + 2
                        for item in batch),
        "prev_region_len": [item["prev_region_len"] for item in batch],
        "curr_region_len": [item["curr_region_len"] for item in batch],
        "target_action": torch.tensor([item["target_actions"] for item in batch], dtype=torch.long),
        "target_type": torch.tensor([item["target_token_type"] for item in batch], dtype=torch.long),
    }


def collate(batch) -> dict:
    """Either path's batch: a built batch passes through; a list of items gets the naive collate."""
    return batch if isinstance(batch, dict) else collate_naive(batch)
