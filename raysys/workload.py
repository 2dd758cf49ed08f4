"""The small interface every workload implements, and the registry that finds them by name.

A workload is a config class, presets, and one of two ways to train:

* ``task`` (a :class:`TorchTask`): a supervised PyTorch job. It supplies data, a model, a loss and
  an evaluation; the shared loop in :mod:`raysys.train.loop` does everything else (DDP, AMP,
  accumulation, compile, checkpoints, metrics, tracking) under Ray Train.
* ``train_fn``: a workload with its own loop (RL learners, JAX). It receives the config and a
  :class:`raysys.session.Session` that gives it tracking, checkpoints and metrics.

Either way it also supplies ``bench``: naive vs optimized measured in one process.
Workload modules never import Ray; the shared layer does that for them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

import torch


class TorchTask(Protocol):
    """What a supervised PyTorch workload provides to the shared Ray Train loop."""

    quality_metric: str
    """Name of the evaluation metric that measures quality (higher is better), e.g. 'qwk'."""
    token_name: str
    """What a 'token' is for tokens/s (e.g. 'responses', 'tokens'); samples/s is always reported."""

    def prepare(self, cfg: Any) -> Any:
        """Make or validate the data; return the config with paths made absolute. Called once on the
        driver before workers start, and again (idempotently) in each worker, since on a cluster
        every node needs its own copy of generated data."""

    def datasets(self, cfg: Any) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        """(train, eval) datasets; the loop shards train across workers."""

    def collate(self, batch: list) -> Mapping[str, torch.Tensor]:
        """Build one batch (a dict of tensors) from dataset items."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        """Construct the model (on CPU; the loop moves it)."""

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Forward pass -> (scalar loss, {'samples': n, 'tokens': n_valid_tokens})."""

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Quality metrics over already-on-device eval batches."""


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    config_cls: type
    presets: Mapping[str, Callable[[], Any]]
    """Named config constructors; 'default' must exist. Presets derive from each other in code."""
    bench: Callable[..., dict]
    """bench(quick: bool) -> {'device', 'naive': {...}, 'optimized': {...}, 'speedup', ...}."""
    task: Optional[TorchTask] = None
    train_fn: Optional[Callable[[Any, Any], dict]] = None
    throughput_metric: str = "perf/samples_per_s"
    quality_metric: str = "eval/quality"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def config(self, preset: str = "default") -> Any:
        if preset not in self.presets:
            from raysys.config import ConfigError

            raise ConfigError(f"unknown preset '{preset}' for {self.name}; available: {', '.join(sorted(self.presets))}")
        return self.presets[preset]()


_REGISTRY: dict[str, Workload] = {}
# Built-in workloads: imported lazily so `python -m raysys --help` stays fast.
BUILTIN = {
    "deep_gpcm": "raysys.workloads.deep_gpcm.workload",
    "mpn_dqn": "raysys.workloads.mpn_dqn.workload",
    "hackmatrix_ppo": "raysys.workloads.hackmatrix_ppo.workload",
}


def register(workload: Workload) -> Workload:
    _REGISTRY[workload.name] = workload
    return workload


def available() -> list[str]:
    """Names of the built-in workloads whose module is importable, plus any registered ones."""
    names = set(_REGISTRY)
    for name, module in BUILTIN.items():
        if _has_workload(module):
            names.add(name)
    return sorted(names)


def _has_workload(module: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), "WORKLOAD")
    except ImportError:  # not built yet, or an optional dependency is missing
        return False


def get(name: str) -> Workload:
    if name not in _REGISTRY and name in BUILTIN:
        try:
            mod = importlib.import_module(BUILTIN[name])
        except ModuleNotFoundError:
            mod = None
        if mod is not None and hasattr(mod, "WORKLOAD"):
            register(mod.WORKLOAD)
    if name not in _REGISTRY:
        from raysys.config import ConfigError

        raise ConfigError(f"unknown workload '{name}'; available: {', '.join(available()) or '(none)'}")
    return _REGISTRY[name]
