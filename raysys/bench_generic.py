"""The bench a workload gets without writing one: its training step, timed in this process.

For a ``TorchTask``: the same items are collated and put through forward, backward and the
optimizer step of the configured path, warm-up first, then timed repeats (median). Where the
workload names its ``path_key`` both paths run, interleaved so that drift on a shared machine hits
both alike, from the same initial weights; their losses on the same weights and batch are compared
(the fast path must compute the same function) and each path's quality is its evaluation after the
same timed steps. Each pass of those steps trains on the same batches: the first pass's loss against
the last's says whether a path learns, and one whose loss falls far less than the other's fails the bench. A workload with its own bench (``Workload.bench``) is measured by that instead.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Optional

import torch

from raysys import workload as registry
from raysys.config import ConfigError, apply_overrides
from raysys.train.code_checks import map_style


LOSS_PARITY = 1e-4
"""The most the two paths' losses on the same weights and batch may differ, relative to the loss: fp32
sums in another order differ by about 1e-7 of it (TF32 is off for that check); a path that computes
another function differs by far more."""

GRAD_PARITY = 1e-3
"""The most the two paths' gradients on the same weights and batch may differ, as a norm relative to the naive
path's: one function summed in another order differs by about 1e-6; a path that stops gradients (trains only
its last layer) or scales its output differs by far more, while its loss at the start may still agree."""

LEARN_PARITY = 0.25
"""The least share of one path's fall in loss over the timed steps the other path's fall must reach: one
function on both paths falls alike (dropout draws apart); a path that learns nothing falls by far less."""


def _grad_gap(task, a: torch.nn.Module, b: torch.nn.Module, batch, name: str) -> tuple[float, list[str]]:
    """|g_a - g_b| / |g_a| of the two models' loss gradients on one batch (their weights alike, eval mode), and
    the parameters that differ most: the same function must also train alike. A parameter one path leaves
    without a gradient counts as zero there."""
    from raysys.train.loop import checked_loss

    grads = []
    for m in (a, b):
        m.zero_grad(set_to_none=True)
        with _no_tf32():
            checked_loss(task, m, batch, name)[0].backward()
        grads.append({n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                      for n, p in m.named_parameters()})
        m.zero_grad(set_to_none=True)
    ga, gb = grads
    gap = {n: float((ga[n] - gb[n]).norm()) for n in ga if n in gb}
    total = sum(v * v for v in gap.values()) ** 0.5
    scale = sum(float(g.norm()) ** 2 for g in ga.values()) ** 0.5
    # named: parameters whose own gradients part beyond the tolerance, not float noise (a bias 1e-8 apart)
    own = {n: v / max(float(ga[n].norm()), 1e-12) for n, v in gap.items()}
    worst = [n for n, v in sorted(gap.items(), key=lambda kv: -kv[1])[:3] if own[n] > GRAD_PARITY]
    return total / max(scale, 1e-12), worst


def _has_batch_statistics(*models: torch.nn.Module) -> bool:
    """A module whose training forward normalises by the batch's own statistics (BatchNorm): eval mode, which
    normalises by the running ones, would hide a path that trains on other statistics (a per-sample loop)."""
    return any(isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) for m in models for mod in m.modules())


@contextlib.contextmanager
def _batch_statistics(*models: torch.nn.Module):
    """Train mode without dropout (the same function, BatchNorm on the batch's statistics), the models'
    running statistics put back after."""
    kept = [{n: b.clone() for n, b in m.named_buffers()} for m in models]
    try:
        for m in models:
            m.train()
            for mod in m.modules():
                if isinstance(mod, torch.nn.modules.dropout._DropoutNd):
                    mod.eval()
        yield
    finally:
        for m, buffers in zip(models, kept):
            with torch.no_grad():
                for n, b in m.named_buffers():
                    b.copy_(buffers[n])
            m.eval()


class _no_tf32:
    """fp32 matmuls and convolutions in full precision while the paths' losses are compared: TF32 (cuDNN's
    convolutions use it by default on Ampere and later) alone moves a loss by about 1e-3 of it."""

    def __enter__(self):
        self.was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.was


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU): before reading a timer."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def top_ops(step, device: torch.device, steps: int = 3, top: int = 8) -> list[dict]:
    """Where a training step's time goes, from PyTorch's profiler: the ``top`` operators or kernels
    by self time on ``device`` (GPU kernels on CUDA), in ms per step, over ``steps`` calls of
    ``step()`` after one warm-up. What a bench prints next to a step time that misses its target.
    On CUDA the same trace also gives the ``top`` operators by self time on the host (rows marked
    ``host``), which is what bounds a GPU step made of many small kernels."""
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch's Kineto prints two lines per trace otherwise
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = prof.key_averages()

    def on_device(e) -> float:  # microseconds, on the device the step runs on
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    def rows(own, extra: dict) -> list[dict]:
        timed = [e for e in events if own(e) > 0]
        total = sum(own(e) for e in timed) or 1.0
        return [{"name": e.key[:90], "ms_per_step": own(e) / 1e3 / steps, "calls_per_step": e.count / steps,
                 "share": own(e) / total} | extra for e in sorted(timed, key=own, reverse=True)[:top]]

    return rows(on_device, {}) + (rows(lambda e: e.self_cpu_time_total, {"host": True}) if cuda else [])


def bench_preset(wl: registry.Workload, quick: bool, preset: Optional[str]) -> str:
    """The preset a bench measures: the one asked for, else ``quick`` for --quick where the workload has one."""
    return preset or ("quick" if quick and "quick" in wl.presets else "default")


def generic_bench(wl: registry.Workload, quick: bool = False, preset: Optional[str] = None,
                  overrides: Optional[dict] = None) -> dict:
    from raysys.train.data import to_device
    from raysys.train.loop import _number, checked_loss, shape_lazy_modules
    from raysys.train.runtime import set_threads
    from raysys.train.optim import clip_grads, task_optimizer

    if wl.task is None:
        raise ConfigError(f"{wl.name} trains with its own loop (train_fn) and has no bench: give "
                          "Workload(bench=...) a function that measures it")
    task = wl.task
    preset = bench_preset(wl, quick, preset)
    cfg = apply_overrides(wl.config(preset), overrides or {})
    cfg = (task.prepare(cfg) or cfg) if getattr(task, "prepare", None) is not None else cfg
    launch = apply_overrides(cfg, {"launch.workers": 0}).launch
    set_threads(launch)
    device = _device()
    paths = ["naive", "optimized"] if wl.path_key else [None]
    cfgs = {p: apply_overrides(cfg, {wl.path_key: p}) if p else cfg for p in paths}
    label = {p: p or "configured" for p in paths}

    train_ds, eval_ds = map_style(wl.name, task.datasets(cfg))
    collate = registry.collate_of(task)
    if len(train_ds) == 0:
        raise ConfigError(f"{wl.name}: its training set is empty (Task.datasets gave 0 items): nothing to time")
    bs = cfg.train.batch_size
    n_batches = max(1, min(len(train_ds) // bs, 4 if quick else 8))
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(train_ds), generator=g).tolist()
    items = [[train_ds[i] for i in order[b * bs:(b + 1) * bs]] for b in range(n_batches)]
    eval_batches = [to_device(collate([eval_ds[i] for i in range(s, min(s + bs, len(eval_ds)))]), device)
                    for s in range(0, min(len(eval_ds), bs * (2 if quick else 8)), bs)]

    models, opts = {}, {}
    for p in paths:
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every path
        models[p] = task.build_model(cfgs[p]).to(device)
        shape_lazy_modules(task, models[p], train_ds, collate, bs, device)  # as the loop does, before the optimizer
        opts[p] = task_optimizer(task, cfgs[p], models[p], wl.name)  # the task's own, as its runs train
    parity, grad_gap = None, None
    if len(paths) == 2:
        a, b = models["naive"], models["optimized"]
        try:
            b.load_state_dict(a.state_dict())
        except RuntimeError as e:
            raise ConfigError(f"{wl.name}: the naive and optimized models differ in parameters, so the paths "
                              f"cannot be compared on the same weights: {str(e).splitlines()[0]}") from None
        batch = to_device(collate(items[0]), device)
        a.eval(), b.eval()  # no dropout: the same function must give the same loss
        with torch.no_grad(), _no_tf32():
            # the naive path twice: a loss that draws randomness even in eval mode cannot be compared
            la, again, lb = (float(checked_loss(task, m, batch, wl.name)[0]) for m in (a, a, b))
        deterministic = abs(la - again) <= LOSS_PARITY * max(abs(la), 1e-3)
        grad_gap = (*_grad_gap(task, a, b, batch, wl.name), "eval mode") if deterministic else None
        if deterministic and _has_batch_statistics(a, b):  # BatchNorm: also as training normalises
            try:
                with _batch_statistics(a, b):
                    trained = _grad_gap(task, a, b, batch, wl.name)
            except Exception:  # noqa: BLE001 - a path that cannot run so (BatchNorm on one value): its training says
                trained = (0.0, [])
            if trained[0] > grad_gap[0]:
                grad_gap = (*trained, "train mode without dropout: BatchNorm on the batch's statistics")
        a.train(), b.train()
        parity = abs(la - lb)

    losses = {p: [] for p in paths}  # read once the timing is over: a read is a device sync

    def step(p: str, batch_items: list) -> tuple[int, int]:
        batch = to_device(collate(batch_items), device)
        opts[p].zero_grad(set_to_none=True)
        loss, stats = checked_loss(task, models[p], batch, wl.name, bs)
        losses[p].append(loss.detach())
        loss.backward()
        clip = cfg.optim.clip_grad_norm
        if clip:
            clip_grads(models[p].parameters(), clip)
        opts[p].step()
        return int(stats.get("samples", 0)), int(stats.get("tokens", 0))

    for p in paths:  # warm-up: allocator, lazy init, kernels
        step(p, items[0])
    repeats = 3 if quick else 7
    times = {p: [] for p in paths}
    counts = {p: (0, 0) for p in paths}
    for _ in range(repeats):
        for p in paths:
            sync(device)
            t0 = time.perf_counter()
            samples = tokens = 0
            for it in items:
                s, t = step(p, it)
                samples, tokens = samples + s, tokens + t
            sync(device)
            times[p].append(time.perf_counter() - t0)
            counts[p] = (samples, tokens)

    res: dict = {"workload": wl.name, "preset": preset, "device": None,
                 "throughput_unit": "samples/s (collate + forward + backward + optimizer, same batches)",
                 "quality_metric": f"{task.quality_metric} after {1 + repeats * n_batches} steps",
                 "quality_mode": getattr(task, "quality_mode", "max"),
                 "paths": [label[p] for p in paths],
                 "params": sum(t.numel() for t in models[paths[0]].parameters()),
                 # the size used: a training set smaller than train.batch_size is one batch of all of it
                 "batch": {"size": len(items[0]), "batches": n_batches, "repeats": repeats}}
    for p in paths:
        models[p].eval()
        with torch.no_grad():
            ev = task.evaluate(models[p], eval_batches) if eval_batches else {}
        ev = {k: _number(v, k, wl.name) for k, v in ev.items()}  # a tensor of one element as the number it holds
        med = statistics.median(times[p])
        samples, tokens = counts[p]
        res[label[p]] = {"step_s": med / n_batches, "throughput": samples / med, "tokens_per_s": tokens / med,
                         "quality": ev.get(task.quality_metric), "eval": ev}
    # a speed of a step that learns nothing, or of a model that cannot be judged, is no result: said, exit 1
    problems = []
    for p in paths:
        bad = sum(not torch.isfinite(x).all() for x in losses[p])
        if bad:
            problems.append(f"{label[p]}: {bad} of {len(losses[p])} timed losses are not finite")
        if eval_batches and res[label[p]]["quality"] is None:
            problems.append(f"{label[p]}: evaluate() returned no {task.quality_metric} (Task.quality_metric); "
                            f"it returned {', '.join(map(str, res[label[p]]['eval'])) or 'nothing'}")
    # learning: each pass of the timed steps trains on the same batches, so its first pass's loss against
    # its last pass's shows whether the path learns, and the two paths from the same weights learn alike
    passes = {p: (float(torch.stack(losses[p][1:1 + n_batches]).float().mean()),
                  float(torch.stack(losses[p][-n_batches:]).float().mean())) for p in paths}
    fell = {p: a - b for p, (a, b) in passes.items()}
    if len(paths) == 2 and deterministic and parity > LOSS_PARITY * max(abs(la), abs(lb), 1e-3):
        problems.append(f"the paths compute different functions: on the same weights and batch (eval mode) the naive "
                        f"path's loss is {la:.6g} and the optimized path's {lb:.6g} (|diff| {parity:.2e}, more than "
                        f"{LOSS_PARITY:g} of the loss)")
    if grad_gap is not None and grad_gap[0] > GRAD_PARITY:
        problems.append(f"the paths train differently: on the same weights and batch ({grad_gap[2]}) the optimized path's "
                        f"gradients differ from the naive path's by {grad_gap[0]:.2e} of their norm (more than "
                        f"{GRAD_PARITY:g})" + (f"; most in {', '.join(grad_gap[1])}" if grad_gap[1] else ""))
    if len(paths) == 2:
        more, less = sorted(paths, key=lambda p: -fell[p])
        if fell[more] > 0.01 * abs(passes[more][0]) and fell[less] < LEARN_PARITY * fell[more]:
            problems.append(f"{less}: its loss on the same batches did not fall as the other path's did over the "
                            f"timed steps ({passes[less][0]:.4g} -> {passes[less][1]:.4g}; {more}: "
                            f"{passes[more][0]:.4g} -> {passes[more][1]:.4g})")
    if problems:
        res["problems"] = problems
    ignored = sorted(k for k in (overrides or {}) if k in ("train.max_steps", "train.epochs"))
    if ignored:  # the bench trains its own fixed steps, the same for both paths
        res["notes"] = [f"{', '.join(ignored)}: not used here; the bench times and judges {1 + repeats * n_batches} "
                        "steps of its own"]
    loop_only = sorted(k for k in (overrides or {}) if k in ("train.precision", "train.compile", "train.grad_accum"))
    if loop_only:  # the paths' code is compared, in fp32, eager, one batch a step: these knobs are the loop's
        res.setdefault("notes", []).append(
            f"{', '.join(loop_only)}: not used here; the bench compares the paths' code in fp32, eagerly, one batch "
            "a step: time the training loop's knobs with `python -m raysys train` (perf/ metrics) or a sweep")
    res["learning"] = {label[p]: {"first_pass_loss": a, "last_pass_loss": b} for p, (a, b) in passes.items()}
    res["extra"] = {f"learning: loss on the same {n_batches} batches, first pass -> pass {repeats}":
                    ", ".join(f"{label[p]} {a:.4g} -> {b:.4g}" for p, (a, b) in passes.items())}
    if len(paths) == 2:
        res["speedup"] = res["naive"]["step_s"] / res["optimized"]["step_s"]
        res["loss_abs_diff_same_weights"] = parity
        if grad_gap is not None:
            res["grad_rel_diff_same_weights"] = grad_gap[0]
        res["extra"]["|loss naive - loss optimized| on the same weights and batch"] = (
            f"{parity:.2e}" if deterministic else f"{parity:.2e} (not judged: the loss differs between two "
                                                  "evaluations of one path in eval mode)")
    return res
