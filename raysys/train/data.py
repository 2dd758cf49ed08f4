"""Data sharding that can resume mid-epoch, and batch transfer to the device."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from raysys.train.config import LoaderConfig


class ShardSampler(Sampler[int]):
    """This rank's share of a per-epoch shuffled index order, starting at any position.

    Like ``DistributedSampler``, every rank gets the same number of indices (the order is padded
    by wrapping), because DDP and ``ray.train.report`` need all ranks to take the same number of
    steps. Unlike it, ``start`` skips already-consumed samples, so a run resumed mid-epoch sees
    exactly the batches it had not trained on, without loading and discarding the others.

    With ``lengths`` (one per sample) and ``bucket`` > 1, each window of ``bucket`` consecutive
    indices of this rank's order is sorted by length, so the loader's batches hold samples of similar
    length (little padding for text) while the windows stay shuffled. Still a pure function of
    (seed, epoch): resuming mid-epoch stays exact.
    """

    def __init__(self, n: int, rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True,
                 lengths=None, bucket: int = 0):
        self.n, self.rank, self.world, self.seed, self.shuffle = n, rank, world, seed, shuffle
        self.lengths, self.bucket = lengths, bucket
        self.per_rank = math.ceil(n / world)
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.per_rank * self.world
        order += order[: total - len(order)]
        mine = order[self.rank:total:self.world]
        if self.lengths is not None and self.bucket > 1:
            lengths = self.lengths
            mine = [i for w in range(0, len(mine), self.bucket)
                    for i in sorted(mine[w:w + self.bucket], key=lambda j: int(lengths[j]))]
        return mine

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start


def make_loader(ds: Dataset, batch_size: int, sampler: Sampler, collate, cfg: LoaderConfig, device: torch.device,
                seed: int = 0, train: bool = True) -> DataLoader:
    # A generator of its own: by default each new iterator draws its base seed from torch's global RNG,
    # which also drives dropout, so a run resumed mid-epoch (one iterator more) would drift off the
    # uninterrupted run's dropout masks. Seeded per epoch, loader workers get reproducible seeds too.
    kwargs = {"generator": torch.Generator().manual_seed(seed)}
    if cfg.num_workers > 0:
        kwargs.update(persistent_workers=cfg.persistent_workers)
        if cfg.prefetch_factor is not None:
            kwargs["prefetch_factor"] = cfg.prefetch_factor
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=collate, num_workers=cfg.num_workers,
                      pin_memory=cfg.pin_memory and device.type == "cuda", drop_last=train and cfg.drop_last, **kwargs)


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch on ``device``, whatever its structure: a dict of tensors (a mapping of its own type, as a
    tokenizer's ``BatchEncoding``, keeps it: a copy), an ``(x, y)`` tuple or list as torch's ``default_collate``
    gives (a namedtuple keeps its type), a dataclass of them (a copy, its other fields shared), or an object
    with its own ``.to(device)`` (a graph library's batch); what is not a tensor is left as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)  # non_blocking only helps from pinned memory; harmless otherwise
    if isinstance(batch, Mapping):
        items = {k: to_device(v, device) for k, v in batch.items()}
        if type(batch) is dict:
            return items
        try:  # its own type, with what it adds (attribute access to its keys): a loss may read them
            moved = copy.copy(batch)
            moved.update(items)
            return moved
        except (TypeError, AttributeError):  # a read-only mapping: a dict of it
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved = copy.copy(batch)
        for f in dataclasses.fields(batch):  # object.__setattr__: a frozen dataclass too
            object.__setattr__(moved, f.name, to_device(getattr(batch, f.name), device))
        return moved
    to = getattr(batch, "to", None)
    if callable(to) and not isinstance(batch, (str, bytes, type)):
        moved = to(device)
        return batch if moved is None else moved  # a .to() that moves in place
    return batch


def _parts(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return batch.values()
    if isinstance(batch, (list, tuple)):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return ()


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (0 where it has none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    return next((n for n in (batch_len(v) for v in _parts(batch)) if n), 0)
