"""AD transformer naive vs optimized, in one process, on the same batches and weights:

* training throughput (samples/s): building the batch from the histories (the naive dataset's
  per-sample items and the seed's per-item collate; the optimized path's packed gather) + forward +
  backward + AdamW step, both paths on the same regions, interleaved so that drift on a shared machine
  hits both alike; on a GPU the optimized path runs in bf16 autocast (flash/memory-efficient SDPA);
* loss parity: both paths' loss on the same weights and batch (fp32, eval mode);
* the optimized path at its own default batch, for scale.
"""

from __future__ import annotations

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

    res = {"workload": "ad_transformer", "device": None,
           "throughput_unit": "samples/s (batch build + forward + backward + AdamW, same batch)",
           "quality_metric": "loss on the same weights and batch",
           "paths": ["naive", "optimized"],
           "batch": {"regions": regions, "samples": samples["naive"], "region": cfg.data.region, "repeats": repeats},
           "precision": {"naive": "fp32", "optimized": "bf16" if device.type == "cuda" else "fp32"}}
    for p in models:
        med = statistics.median(times[p])
        res[p] = {"step_s": med, "throughput": samples[p] / med, "quality": losses[p]}
    res["speedup"] = res["naive"]["step_s"] / res["optimized"]["step_s"]
    res["loss_abs_diff_same_weights"] = abs(losses["naive"] - losses["optimized"])
    big_rate = n_big / statistics.median(big_t)
    res["optimized_default_batch"] = {"regions": len(big), "samples": n_big, "throughput": big_rate}
    res["extra"] = {"|loss naive - loss optimized| on the same weights and batch":
                    f"{res['loss_abs_diff_same_weights']:.2e}",
                    f"optimized at its default batch ({len(big)} regions, {n_big} samples)": f"{big_rate:.0f} samples/s",
                    f"vs naive at {samples['naive']} samples": f"{big_rate / res['naive']['throughput']:.1f}x"}
    return res
