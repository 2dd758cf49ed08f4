"""Deep-GPCM naive vs optimized: training-step throughput on the same batch, prediction parity on
the same weights, and quality after the same training, all in one process."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from raysys.config import apply_overrides


def _train_step(model, opt, batch) -> None:
    from raysys.workloads.deep_gpcm.model import masked_loss

    opt.zero_grad(set_to_none=True)
    loss = masked_loss(model(batch["questions"], batch["responses"]), batch["responses"], batch["mask"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def step_throughput(batch: dict, n_questions: int, n_cats: int, repeats: int) -> dict:
    """Median seconds per training step (forward + backward + Adam) of each path, interleaved so
    that drift on a shared machine hits both alike; plus prediction parity on shared weights."""
    from raysys.workloads.deep_gpcm.model import DeepGPCM

    torch.manual_seed(0)
    models = {"naive": DeepGPCM(n_questions, n_cats, path="naive")}
    models["optimized"] = DeepGPCM(n_questions, n_cats, path="optimized")
    models["optimized"].load_state_dict(models["naive"].state_dict())
    with torch.no_grad():
        a = models["naive"](batch["questions"], batch["responses"])
        b = models["optimized"](batch["questions"], batch["responses"])
        max_diff = float((a - b)[batch["mask"]].abs().max())
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    times = {k: [] for k in models}
    for k in models:  # warm-up (allocator, lazy init)
        _train_step(models[k], opts[k], batch)
    for _ in range(repeats):
        for k in models:
            t0 = time.perf_counter()
            _train_step(models[k], opts[k], batch)
            times[k].append(time.perf_counter() - t0)
    B, n_valid = batch["questions"].shape[0], int(batch["mask"].sum())
    out = {"max_abs_logit_diff": max_diff}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = {"step_s": med, "throughput": B / med, "responses_per_s": n_valid / med, "steps_timed": len(ts)}
    return out


def run_bench(quick: bool = False) -> dict:
    from raysys.train.launcher import run_training
    from raysys.workloads.deep_gpcm.workload import DeepGPCMTask, parity

    task = DeepGPCMTask()
    cfg = task.prepare(parity())
    train_ds, _ = task.datasets(cfg)
    seqs = task._data(cfg)
    batch = task.collate([train_ds[i] for i in range(cfg.train.batch_size)])
    speed = step_throughput(batch, seqs.n_questions, seqs.n_cats, repeats=3 if quick else 8)

    # Quality: each path trained the same way from the same seed, through the shared loop in-process.
    quality = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("naive", "optimized"):
            overrides = {"model.path": path, "launch.workers": 0, "launch.storage_path": tmp,
                         "launch.tracking_uri": f"sqlite:///{Path(tmp) / 'bench.db'}", "launch.name": f"bench-{path}",
                         "train.log_every_steps": 10}
            if quick:
                overrides |= {"train.max_steps": 12, "train.epochs": 1}
            t0 = time.perf_counter()
            result = run_training("deep_gpcm", apply_overrides(cfg, overrides))
            quality[path] = {k.split("/")[-1]: v for k, v in result.metrics.items() if k.startswith("eval/")}
            quality[path]["train_seconds"] = time.perf_counter() - t0

    res = {"workload": "deep_gpcm", "throughput_unit": "samples/s (train step, same batch)", "quality_metric": "qwk",
           "batch": {"size": int(batch["questions"].shape[0]), "max_len": int(batch["questions"].shape[1]),
                     "valid_responses": int(batch["mask"].sum())},
           "speedup": speed["naive"]["step_s"] / speed["optimized"]["step_s"],
           "extra": {"max |logit diff| naive vs optimized (shared weights)": f"{speed['max_abs_logit_diff']:.2e}",
                     "quality run": "12 steps each (quick)" if quick else f"{cfg.train.epochs} epochs each, fold 0"}}
    for path in ("naive", "optimized"):
        res[path] = {**speed[path], "quality": quality[path].get("qwk"), "eval": quality[path]}
    res["max_abs_logit_diff"] = speed["max_abs_logit_diff"]
    return res
