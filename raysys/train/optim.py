"""Optimizers and learning-rate schedules from an :class:`OptimConfig`."""

from __future__ import annotations

import math

import torch

from raysys.train.config import OptimConfig


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, **fused_kwargs(params))


def fused_kwargs(params) -> dict:
    """``fused=True`` where every parameter is a floating-point CUDA tensor: Adam's whole step is
    then one kernel launch instead of a dozen. A GPU step that is short on compute is bound by
    launches on the host (measured on an H200, docs/benchmarks.md), so this is time off every step."""
    params = list(params)
    return {"fused": True} if params and all(p.is_cuda and p.is_floating_point() for p in params) else {}


def lr_factor(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    t = step - cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "linear":
        return floor + (1 - floor) * max(0.0, 1 - t / span)
    if cfg.schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t / span, 1.0)))
    # cosine_warm_restarts (SGDR): period restart_period, multiplied by restart_mult after each restart
    period = cfg.restart_period
    while t >= period:
        t -= period
        period *= cfg.restart_mult
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t / period))


def build_scheduler(cfg: OptimConfig, opt: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step, total_steps))
