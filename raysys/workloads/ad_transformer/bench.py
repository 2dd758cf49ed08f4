"""AD transformer naive vs optimized, in one process, on the same batches and weights:

* training throughput (samples/s): building the batch from the histories (the naive dataset's
  per-sample items and the seed's per-item collate; the optimized path's packed gather) + forward +
  backward + AdamW step, both paths on the same regions, interleaved so that drift on a shared machine
  hits both alike; on a GPU the optimized path runs in bf16 autocast (flash/memory-efficient SDPA);
* loss parity: both paths' loss on the same weights and batch (fp32, eval mode);
* learning parity: both paths trained from the same weights on the same batches (fp32, no dropout) for
  10 steps (quick) or 60: their loss curves, which must fall and stay together (the fast path learns
  what the slow one does, step for step; the in-context return of long runs is docs/benchmarks.md's);
* the optimized path at its own default batch, for scale.
"""

from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import torch

from raysys.train.data import to_device


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(quick: bool = False) -> dict:
    from raysys.train.optim import build_optimizer
    from raysys.workloads.ad_transformer.data import collate
    from raysys.workloads.ad_transformer.model import loss_fn
    from raysys.workloads.ad_transformer.workload import DistillationTask, default, quick as quick_preset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = default()
    cfg.source, cfg.data.data_dir = quick_preset().source, quick_preset().data.data_dir  # small, real histories
    task = DistillationTask()
    cfg = task.prepare(cfg)
    cfg.model.path = "optimized"
    packed, _ = task.datasets(cfg)
    cfg.model.path = "naive"
    per_item, _ = task.datasets(cfg)
    regions = 2 if quick else 4
    repeats = 2 if quick else 3
    order = np.random.default_rng(0).permutation(len(packed))
    batch_ids = order[:regions].tolist()

    torch.manual_seed(0)
    models = {p: task.build_model(cfg).to(device) for p in ("naive", "optimized")}
    models["optimized"].load_state_dict(models["naive"].state_dict())
    opts = {p: build_optimizer(cfg.optim, m) for p, m in models.items()}
    build = {"naive": lambda ids: collate([per_item[i] for i in ids]),
             "optimized": lambda ids: collate(packed.__getitems__(ids))}

    with torch.no_grad():  # the same function: the same loss on the same weights and batch
        for m in models.values():
            m.eval()
        losses = {p: float(loss_fn(models[p], to_device(build[p](batch_ids), device))[0]) for p in models}
        for m in models.values():
            m.train()

    def step(p: str, ids) -> int:
        b = to_device(build[p](ids), device)
        opts[p].zero_grad(set_to_none=True)
        # on a GPU the optimized path runs in bf16; the naive one, and everything on a CPU, in fp32
        with torch.autocast(device.type, torch.bfloat16, enabled=p == "optimized" and device.type == "cuda"):
            loss, stats = loss_fn(models[p], b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(models[p].parameters(), 1.0)
        opts[p].step()
        return stats["samples"]

    def timed(p: str, ids) -> tuple[int, float]:
        _sync(device)
        t0 = time.perf_counter()
        n = step(p, ids)
        _sync(device)
        return n, time.perf_counter() - t0

    print(f"[bench] step times: both paths on {regions} regions x {repeats} (the naive path takes seconds a step "
          "on a CPU)", flush=True)
    for p in models:  # warm-up
        step(p, batch_ids)
    times = {p: [] for p in models}
    samples = {}
    for _ in range(repeats):
        for p in models:  # interleaved: drift on a shared machine hits both paths alike
            samples[p], dt = timed(p, batch_ids)
            times[p].append(dt)

    big = order[regions:regions + cfg.train.batch_size].tolist()  # the optimized path at its default batch
    step("optimized", big)
    big_runs = [timed("optimized", big) for _ in range(repeats)]
    n_big = big_runs[0][0]
    big_t = [dt for _, dt in big_runs]

    steps = 10 if quick else 60  # quick: enough for the loss to fall and the paths' curves to be compared
    rate = {p: samples[p] * repeats / sum(times[p]) for p in models}
    print(f"[bench] step times: naive {rate['naive']:.1f}, optimized {rate['optimized']:.1f} samples/s; "
          f"learning check: {steps} steps of each path from the same weights", flush=True)
    curves = learning_curves(task, cfg, build, order, regions, steps, device)
    n_steps = len(curves["naive"])
    gap = max(abs(a - b) for a, b in zip(curves["naive"], curves["optimized"]))
    problems = [f"{p}: its loss did not fall in {n_steps} steps ({c[0]:.4f} -> {c[-1]:.4f})"
                for p, c in curves.items() if not c[-1] < c[0]]
    if gap > PARITY_TOL * curves["naive"][0]:
        problems.append(f"the paths' loss curves part: up to {gap:.2e} apart in {n_steps} steps on the same batches "
                        f"(tolerance {PARITY_TOL:.0e} x the first loss)")

    res = {"workload": "ad_transformer", "device": None,
           "throughput_unit": "samples/s (batch build + forward + backward + AdamW, same batch)",
           "quality_metric": f"loss after {n_steps} steps",
           "paths": ["naive", "optimized"],
           "batch": {"regions": regions, "samples": samples["naive"], "region": cfg.data.region, "repeats": repeats},
           "precision": {"naive": "fp32", "optimized": "bf16" if device.type == "cuda" else "fp32"}}
    for p in models:
        med = statistics.median(times[p])
        res[p] = {"step_s": med, "throughput": samples[p] / med, "quality": curves[p][-1],
                  "loss_same_weights": losses[p], "learning_curve": curves[p]}
    res["speedup"] = res["naive"]["step_s"] / res["optimized"]["step_s"]
    res["loss_abs_diff_same_weights"] = abs(losses["naive"] - losses["optimized"])
    big_rate = n_big / statistics.median(big_t)
    res["optimized_default_batch"] = {"regions": len(big), "samples": n_big, "throughput": big_rate}
    res["learning_parity"] = {"steps": n_steps, "max_abs_loss_diff": gap}
    if problems:
        res["problems"] = problems
    res["extra"] = {"|loss naive - loss optimized| on the same weights and batch":
                    f"{res['loss_abs_diff_same_weights']:.2e}",
                    f"learning: {n_steps} steps of each path from the same weights on the same batches (fp32, no "
                    "dropout)": f"loss {curves['naive'][0]:.4f} -> naive {curves['naive'][-1]:.4f}, optimized "
                                f"{curves['optimized'][-1]:.4f}; the curves at most {gap:.1e} apart",
                    f"optimized at its default batch ({len(big)} regions, {n_big} samples)": f"{big_rate:.0f} samples/s",
                    f"vs naive at {samples['naive']} samples": f"{big_rate / res['naive']['throughput']:.1f}x"}
    return res


PARITY_TOL = 1e-2
"""How far apart (x the first loss) the paths' loss curves may drift in the learning check: one function in
two float orders, so rounding grows a little over the steps; a real difference is far larger."""


def learning_curves(task, cfg, build, order, regions: int, steps: int, device) -> dict[str, list[float]]:
    """Each path's training loss, step by step, from the same weights on the same batches (fp32, dropout off:
    no randomness but the weights')."""
    from raysys.train.optim import build_optimizer
    from raysys.workloads.ad_transformer.model import loss_fn

    cfg = copy.deepcopy(cfg)
    cfg.model.dropout = 0.0
    torch.manual_seed(1)
    first = task.build_model(cfg).to(device)
    models = {"naive": first, "optimized": copy.deepcopy(first)}
    opts = {p: build_optimizer(cfg.optim, m) for p, m in models.items()}
    curves: dict[str, list[float]] = {p: [] for p in models}
    for k in range(steps):
        ids = [order[(k * regions + j) % len(order)] for j in range(regions)]
        for p, m in models.items():
            loss, _ = loss_fn(m, to_device(build[p](ids), device))
            opts[p].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[p].step()
            curves[p].append(loss.item())
    return curves
