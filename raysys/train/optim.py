"""Optimizers and learning-rate schedules from an :class:`OptimConfig`, or from a task's own hooks.

A task may bring its own (each optional, see :class:`raysys.workload.TorchTask`):

* ``param_groups(model, cfg)``: parameter groups (no weight decay for biases and norms, a smaller LR
  for an embedding) for the optimizer the config's ``optim`` section builds, so ``optim.lr`` and the
  rest stay knobs a sweep can search;
* ``optimizer(model, cfg)``: the optimizer itself (Lion, Adafactor, one of your own);
* ``scheduler(optimizer, cfg, total_steps)``: an LR scheduler stepped once per optimizer step, or a
  ``ReduceLROnPlateau`` stepped with the task's quality metric after each evaluation.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from raysys.config import ConfigError
from raysys.train.config import OptimConfig


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module,
                    groups: Optional[list[dict]] = None) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names, over ``groups`` (torch's parameter groups: each a dict with
    ``params`` and any per-group options) or else over every trainable parameter of ``model``."""
    flat = ([p for g in groups for p in g["params"]] if groups is not None
            else [p for p in model.parameters() if p.requires_grad])
    params = groups if groups is not None else flat
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, **fused_kwargs(flat))


def task_optimizer(task: Any, cfg: Any, model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """The task's own optimizer, or the config's over the task's parameter groups, or the config's."""
    own, make_groups = getattr(task, "optimizer", None), getattr(task, "param_groups", None)
    if own is not None and make_groups is not None:  # else param_groups would silently never be used
        raise ConfigError(f"{name}: its task defines both Task.optimizer and Task.param_groups; param_groups are for "
                          "the config's optimizer: build your groups inside Task.optimizer instead")
    if own is not None:
        opt = own(model, cfg)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"{name}: Task.optimizer returned {type(opt).__name__}, not a torch.optim.Optimizer")
        _check_covered(model, [p for g in opt.param_groups for p in g["params"]], name, "Task.optimizer")
        return opt
    if make_groups is None:
        return build_optimizer(cfg.optim, model)
    groups = _groups(make_groups(model, cfg), name)
    _check_covered(model, [p for g in groups for p in g["params"]], name, "Task.param_groups")
    return build_optimizer(cfg.optim, model, groups)


def _groups(raw: Any, name: str) -> list[dict]:
    """What torch takes as parameter groups: dicts with 'params' (a tensor or an iterable of them), or
    the parameters themselves (``model.parameters()``: one group)."""
    items = list(raw) if raw is not None and not isinstance(raw, (torch.Tensor, dict, str)) else None
    if items and all(isinstance(p, torch.Tensor) for p in items):
        return [{"params": items}]
    if not items or not all(isinstance(g, dict) and "params" in g for g in items):
        got = "nothing (a missing return?)" if raw is None else type(raw).__name__
        raise ConfigError(f"{name}: Task.param_groups returned {got}: it must return torch's parameter groups, a "
                          "non-empty list of dicts each with 'params' (or the parameters themselves)")
    groups = [dict(g) for g in items]
    for g in groups:
        g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
    return groups


def _check_covered(model: torch.nn.Module, given: list, name: str, hook: str) -> None:
    """Every trainable parameter in exactly one group: one left out would silently never train, and
    torch only refuses a duplicate."""
    ids = {id(p) for p in given}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{name}: {hook} leaves out trainable parameters {', '.join(missing[:3])}{more}: they would "
                          "never train (freeze them with requires_grad=False)")
    if len(ids) != len(given):
        raise ConfigError(f"{name}: {hook} puts a parameter in more than one group")


def task_scheduler(task: Any, cfg: Any, opt: torch.optim.Optimizer, total_steps: int, name: str,
                   quality: str, mode: str) -> Any:
    """The task's own LR scheduler, or the config's schedule. A ``ReduceLROnPlateau`` watches the task's
    quality metric, so its mode must be the metric's direction: one the other way round would cut the
    LR each time the model improved."""
    own = getattr(task, "scheduler", None)
    if own is None:
        return build_scheduler(cfg.optim, opt, total_steps)
    sched = own(opt, cfg, total_steps)
    if not (callable(getattr(sched, "step", None)) and callable(getattr(sched, "state_dict", None))):
        raise ConfigError(f"{name}: Task.scheduler returned {type(sched).__name__}, not a torch LR scheduler")
    if getattr(sched, "optimizer", opt) is not opt:  # it would schedule an optimizer that never steps
        raise ConfigError(f"{name}: Task.scheduler returned a scheduler of another optimizer than the one it was given")
    if is_plateau(sched) and sched.mode != mode:
        raise ConfigError(f"{name}: its ReduceLROnPlateau has mode='{sched.mode}', but it is stepped with {quality}, "
                          f"which is {'maximised' if mode == 'max' else 'minimised'}: use mode='{mode}'")
    return sched


def group_settings(opt: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings as the optimizer was built, before a scheduler wrote its own keys
    (``initial_lr``, OneCycleLR's ``max_lr``) or moved ``lr``: what :func:`fast_forward` rebuilds from."""
    import copy

    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]


def fast_forward(task: Any, cfg: Any, opt: torch.optim.Optimizer, total_steps: int, step: int,
                 built: list[dict]) -> Any:
    """The task's own scheduler for a run whose length changed on a resume: built for ``total_steps``
    and stepped ``step`` times, to where the run is. The checkpoint's state would keep the old length
    (OneCycleLR then fails past it; a cosine climbs back to its peak after it)."""
    import warnings

    # the groups as the optimizer was built (``built``: group_settings before any scheduler), not as the
    # checkpoint left them: a scheduler reading its peak from the group's lr (OneCycleLR's max_lr from
    # ``g["lr"]``) or keeping an old ``initial_lr`` would otherwise start from the LR a schedule reached
    for g, settings in zip(opt.param_groups, built):
        params = g["params"]
        g.clear()
        g.update(settings, params=params)
    sched = task.scheduler(opt, cfg, total_steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": no step is taken here
        for _ in range(step):
            sched.step()
    return sched


def apply_changed_settings(task: Any, cfg: Any, opt: torch.optim.Optimizer, sched: Any, built: list[dict],
                           saved: Optional[list[dict]], total_steps: int, step: int) -> tuple[Any, list[str]]:
    """A resume whose optimizer settings changed (``--resume --set optim.lr=...``): loading the checkpoint's
    optimizer state put back the settings the run was built with, so the change was said and tagged but not
    trained with. ``built``: :func:`group_settings` of the optimizer this config builds; ``saved``: the same, as
    the checkpoint's session built it (None: a checkpoint that did not record it, its groups left as they are).
    The groups take the new settings; a changed LR keeps the schedule's place: the config's schedule goes on from
    the new peak, a task's own is rebuilt from it and taken to ``step``, a ReduceLROnPlateau keeps its cuts. The
    config's schedule also gives this step's LR as configured now (another schedule, warmup or length). Returns
    the scheduler (rebuilt or not) and the changes, as ``key: old -> new``."""
    own = getattr(task, "scheduler", None) is not None
    known = saved is not None and len(saved) == len(built)  # else: the groups as the checkpoint left them
    changes: dict[str, str] = {}
    lr_changed = False
    for i, (g, now, was) in enumerate(zip(opt.param_groups, built, saved) if known else []):
        for key, value in now.items():
            old = was.get(key)
            if key not in was:  # another optimizer's own setting (adam -> sgd: momentum): as built, unsaid
                g[key] = value
                continue
            if key in IMPLEMENTATION_KEYS or _same(old, value):
                continue
            changes.setdefault(key if len(built) == 1 else f"group {i} {key}", f"{old!r} -> {value!r}")
            if key != "lr":
                g[key] = value
                continue
            lr_changed = True
            if is_plateau(sched):  # its cuts so far, applied to the new LR
                g["lr"] = g["lr"] * value / old if old else value
            elif not own:  # the config's LambdaLR: its base, and the factor at its step below
                sched.base_lrs[i] = g["initial_lr"] = value
    if not own and not is_plateau(sched):
        # the config's LambdaLR takes its factor from this config (schedule, warmup, the run's length), but the
        # loaded group holds the LR the checkpoint's session computed for this step: the first step would train
        # with it (a finished cosine extended: LR 0). The same formula as LambdaLR.step, so unchanged is exact.
        for i, g in enumerate(opt.param_groups):
            lr = sched.base_lrs[i] * sched.lr_lambdas[i](sched.last_epoch)
            if not lr_changed and lr != g["lr"]:
                changes.setdefault("lr at this step" if len(built) == 1 else f"group {i} lr at this step",
                                   f"{g['lr']!r} -> {lr!r} (the schedule as configured now)")
            g["lr"] = lr
    if lr_changed and own and not is_plateau(sched):
        sched = fast_forward(task, cfg, opt, total_steps, step, built)
    return sched, [f"{k}: {v}" for k, v in changes.items()]


def clip_grads(params, max_norm: Optional[float]) -> torch.Tensor:
    """``clip_grad_norm_`` (``max_norm`` None or 0: the norm only), also for sparse gradients
    (``nn.Embedding(sparse=True)``), which torch's fused norm has no kernel for: a sparse gradient's norm is
    that of its coalesced values. Returns the total norm before clipping."""
    params = [p for p in params if p.grad is not None]
    if not any(p.grad.is_sparse for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    norms = [torch.linalg.vector_norm((p.grad.coalesce().values() if p.grad.is_sparse else p.grad).float())
             for p in params]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm and float(total) > max_norm:
        coef = max_norm / (float(total) + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return total


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Group keys of how an optimizer steps (they follow the device), not of what it learns with."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def hooks_used(task: Any) -> dict[str, str]:
    """The task's own optimizer hooks, as the run's MLflow tags: its ``optim.*`` params then do not say all."""
    hooks = [h for h in ("param_groups", "optimizer", "scheduler") if getattr(task, h, None) is not None]
    return {"raysys.optimizer_hooks": ", ".join(f"Task.{h}" for h in hooks)} if hooks else {}


OPTIMIZER_FIELDS = ("name", "lr", "weight_decay", "betas", "momentum", "nesterov")
"""The ``optim`` fields the config's optimizer is built from, which ``Task.optimizer`` replaces."""
SCHEDULE_FIELDS = ("schedule", "warmup_steps", "min_lr_ratio", "restart_period", "restart_mult")
"""The ``optim`` fields of the config's schedule, which ``Task.scheduler`` replaces."""


def unread_optim(task: Any, cfg: Any, model: torch.nn.Module, name: str) -> list[str]:
    """The ``optim`` fields a task's own optimizer or scheduler replaces and never reads: a value given to one
    (``--set optim.lr=...``, a sweep's knob) changes nothing. Found by building them once, with ``cfg.optim``
    watched; a hook that fails here gives no verdict (an empty list)."""
    replaced = (OPTIMIZER_FIELDS if getattr(task, "optimizer", None) is not None else ()) + \
               (SCHEDULE_FIELDS if getattr(task, "scheduler", None) is not None else ())
    if not replaced:
        return []
    import copy
    import dataclasses

    reads: set[str] = set()
    section = cfg.optim

    class Watched(type(section)):
        def __getattribute__(self, key):
            if key == "__dict__":  # vars(cfg.optim): every field read
                reads.update(f.name for f in dataclasses.fields(section))
            elif not key.startswith("_"):
                reads.add(key)
            return super().__getattribute__(key)

    watched = copy.copy(section)
    watched.__class__ = Watched
    seen = copy.copy(cfg)
    object.__setattr__(seen, "optim", watched)  # not dataclasses.replace: a __post_init__ would read every field
    try:
        opt = task_optimizer(task, seen, model, name)
        if getattr(task, "scheduler", None) is not None:
            task.scheduler(opt, seen, 1000)
    except Exception:
        return []
    return [f for f in replaced if f not in reads]


def is_plateau(sched: Any) -> bool:
    """Stepped with a metric after each evaluation, not once per optimizer step."""
    return isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)


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
