"""Deep-GPCM naive vs optimized: training-step throughput on the same batch, prediction parity on
the same weights, and quality after the same training, all in one process."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from raysys.bench_generic import sync, top_ops
from raysys.config import apply_overrides
from raysys.tracking import sqlite_uri
from raysys.train.optim import fused_kwargs


def _train_step(model, opt, batch) -> None:
    from raysys.workloads.deep_gpcm.model import masked_loss

    opt.zero_grad(set_to_none=True)
    loss = masked_loss(model(batch["questions"], batch["responses"]), batch["responses"], batch["mask"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def step_throughput(batch: dict, n_questions: int, n_cats: int, repeats: int, device: torch.device | str = "cpu",
                    variants: dict | None = None) -> dict:
    """Median seconds per training step (forward + backward + Adam) of each path (interleaved on a
    CPU, in a row on a GPU); plus prediction parity on shared weights.
    ``variants`` maps a name to DeepGPCM keyword arguments (default: the two paths)."""
    from raysys.train.data import to_device
    from raysys.workloads.deep_gpcm.model import DeepGPCM

    device = torch.device(device)
    variants = variants or {"naive": {"path": "naive"}, "optimized": {"path": "optimized"}}
    batch = to_device(batch, device)
    torch.manual_seed(0)
    models = {k: DeepGPCM(n_questions, n_cats, **kw).to(device) for k, kw in variants.items()}
    ref = next(iter(models.values()))
    for m in models.values():
        m.load_state_dict(ref.state_dict())
    with torch.no_grad():
        logits = {k: m(batch["questions"], batch["responses"]) for k, m in models.items()}
    base = logits.get("naive", logits[next(iter(logits))])
    diffs = {k: float((base - v)[batch["mask"]].abs().max()) for k, v in logits.items()}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3, **fused_kwargs(m.parameters())) for k, m in models.items()}
    times = {k: [] for k in models}
    for k in models:  # warm-up (allocator, lazy init, kernel compiles and tuning)
        _train_step(models[k], opts[k], batch)
    sync(device)
    # On a CPU the paths take turns, so that drift on a shared machine hits both alike. On a GPU each
    # path runs its steps in a row, as a training run does: a step right after another path's
    # finds the caching allocator holding that path's block sizes, and measured up to 5 ms slower.
    order = [list(models)] * repeats if device.type == "cpu" else [[k] * repeats for k in models]
    for keys in order:
        for k in keys:
            t0 = time.perf_counter()
            _train_step(models[k], opts[k], batch)
            sync(device)
            times[k].append(time.perf_counter() - t0)
    B, n_valid = batch["questions"].shape[0], int(batch["mask"].sum())
    out = {"max_abs_logit_diff": max(diffs.values())}
    for k, ts in times.items():
        med = statistics.median(ts)
        # throughput in responses/s: the unit of a run's perf/tokens_per_s and its progress line
        out[k] = {"step_s": med, "throughput": n_valid / med, "responses_per_s": n_valid / med,
                  "sequences_per_s": B / med, "steps_timed": len(ts),
                  "max_abs_logit_diff_vs_naive": diffs[k]}
    return out


def batch_sizes(task, cfg, sizes, repeats: int, device) -> dict:
    """Step times at each batch size (the longest sequences of the training split, so T is the data's
    longest): the naive path, the optimized path, and the optimized path with its recurrence as a
    torch loop (``model.recurrence=loop``) next to whatever ``auto`` picks on this device."""
    seqs = task._data(cfg)
    variants = {"naive": {"path": "naive"}, "optimized": {"path": "optimized"},
                "optimized_loop": {"path": "optimized", "recurrence": "loop"}}
    if torch.device(device).type == "cuda":  # the kernels' chunk: checkpoint memory against recompute
        variants |= {f"optimized_chunk{c}": {"path": "optimized", "chunk": c} for c in (4, 16)}
    out = {}
    for bs in sizes:
        big = longest_batch(task, cfg, bs)
        out[f"B={bs} T={big['questions'].shape[1]}"] = step_throughput(
            big, seqs.n_questions, seqs.n_cats, repeats=repeats, device=device, variants=variants)
    return out


def longest_batch(task, cfg, batch_size: int) -> dict:
    """A batch of the training split's ``batch_size`` longest sequences: T is the data's longest."""
    train_ds, _ = task.datasets(cfg)
    by_length = sorted(range(len(train_ds)), key=lambda i: -len(train_ds[i][0]))
    return task.collate([train_ds[i] for i in by_length[:batch_size]])


def step_profile(task, cfg, batch_size: int, device) -> list[dict]:
    """The optimized path's training step on the longest ``batch_size`` sequences, by operator or
    kernel (``top_ops``): what to speed up next where the step misses its time."""
    from raysys.train.data import to_device
    from raysys.workloads.deep_gpcm.model import DeepGPCM

    seqs = task._data(cfg)
    batch = to_device(longest_batch(task, cfg, batch_size), torch.device(device))
    torch.manual_seed(0)
    model = DeepGPCM(seqs.n_questions, seqs.n_cats, path="optimized").to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **fused_kwargs(model.parameters()))
    rows = top_ops(lambda: _train_step(model, opt, batch), torch.device(device))  # on CUDA: host rows too
    for r in rows:
        print(f"[bench] B={batch_size} optimized step: {r['ms_per_step']:8.3f} ms/step {r['share']:5.1%} "
              f"x{r['calls_per_step']:g} {r['name']}", flush=True)
    return rows


def run_bench(quick: bool = False, overrides: Optional[dict] = None) -> dict:
    """Both paths on the parity preset (or it with ``overrides``: your data, your model's size)."""
    from raysys.train.launcher import run_training
    from raysys.workloads.deep_gpcm.model import triton_available
    from raysys.workloads.deep_gpcm.workload import DeepGPCMTask, parity

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = DeepGPCMTask()
    cfg = task.prepare(apply_overrides(parity(), overrides or {}))
    train_ds, _ = task.datasets(cfg)
    seqs = task._data(cfg)
    batch = task.collate([train_ds[i] for i in range(min(cfg.train.batch_size, len(train_ds)))])
    speed = step_throughput(batch, seqs.n_questions, seqs.n_cats, repeats=3 if quick else 8, device=device)
    extra = {"max |logit diff| naive vs optimized (shared weights)": f"{speed['max_abs_logit_diff']:.2e}",
             "quality run": "" if quick else f"{cfg.train.epochs} epochs each, fold 0"}
    gpu_batches = {}
    if device.type == "cuda":
        gpu_batches = batch_sizes(task, cfg, (cfg.train.batch_size, 256), repeats=5 if quick else 10, device=device)
        for name, r in gpu_batches.items():
            extra[f"{name} step ms: naive / optimized / optimized loop"] = " / ".join(
                f"{r[k]['step_s'] * 1e3:.2f}" for k in ("naive", "optimized", "optimized_loop")) + (
                f" ({r['naive']['step_s'] / r['optimized']['step_s']:.0f}x; logits |diff| "
                f"{r['optimized']['max_abs_logit_diff_vs_naive']:.1e})")
        extra["recurrence on CUDA"] = "triton (fused kernels)" if triton_available() else "loop (triton missing)"
        for name, r in gpu_batches.items():
            chunks = sorted(k for k in r if k.startswith("optimized_chunk"))
            if chunks:
                extra[f"{name} optimized step ms by chunk"] = ", ".join(
                    f"{k.removeprefix('optimized_chunk')}: {r[k]['step_s'] * 1e3:.2f}" for k in chunks) + (
                    f", 8 (default): {r['optimized']['step_s'] * 1e3:.2f}")
        if triton_available():
            from raysys.workloads.deep_gpcm.memory_kernel import tuning_report

            for i, line in enumerate(tuning_report()):
                extra[f"kernel tuning {i}"] = line
        profile = step_profile(task, cfg, 256, device)
        extra["optimized step at B=256, GPU time by kernel (ms/step)"] = ", ".join(
            f"{r['name']} {r['ms_per_step']:.2f}" for r in profile if not r.get("host"))
        extra["optimized step at B=256, host time by operator (ms/step)"] = ", ".join(
            f"{r['name']} {r['ms_per_step']:.2f} x{r['calls_per_step']:g}" for r in profile if r.get("host"))

    # Quality: each path trained the same way from the same seed, through the shared loop in-process.
    quality = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("naive", "optimized"):
            overrides = {"model.path": path, "launch.workers": 0, "launch.storage_path": tmp,
                         "launch.tracking_uri": sqlite_uri(Path(tmp) / "bench.db"), "launch.name": f"bench-{path}",
                         "train.log_every_steps": 10, "launch.gpus_per_worker": 1 if device.type == "cuda" else 0}
            if quick:  # 12 steps, over as many epochs as that takes on a small data set
                overrides |= {"train.max_steps": 12, "train.epochs": 12}
            t0 = time.perf_counter()
            result = run_training("deep_gpcm", apply_overrides(cfg, overrides))
            quality[path] = {k.split("/")[-1]: v for k, v in result.metrics.items() if k.startswith("eval/")}
            quality[path]["train_seconds"] = time.perf_counter() - t0
            if quick:  # what it trained, said as it was
                extra["quality run"] = f"{int(result.metrics.get('step', 0))} steps each (quick)"

    res = {"workload": "deep_gpcm", "throughput_unit": "responses/s, one train step", "quality_metric": "qwk",
           "batch": {"size": int(batch["questions"].shape[0]), "max_len": int(batch["questions"].shape[1]),
                     "valid_responses": int(batch["mask"].sum())},
           "speedup": speed["naive"]["step_s"] / speed["optimized"]["step_s"], "extra": extra}
    if gpu_batches:
        res["gpu_batches"], res["profile_b256"] = gpu_batches, profile
    for path in ("naive", "optimized"):
        res[path] = {**speed[path], "quality": quality[path].get("qwk"), "eval": quality[path]}
    res["max_abs_logit_diff"] = speed["max_abs_logit_diff"]
    # speed never at the cost of learning: the same function on the same weights, and alike after training
    problems = []
    if not speed["max_abs_logit_diff"] <= LOGIT_PARITY:
        problems.append(f"the paths compute different functions: on shared weights their logits differ by "
                        f"{speed['max_abs_logit_diff']:.2e} (more than {LOGIT_PARITY:g})")
    qn, qo = res["naive"]["quality"], res["optimized"]["quality"]
    if qn is not None and qo is not None and not abs(qn - qo) <= QWK_PARITY:
        problems.append(f"the paths learn differently: trained alike from the same seed, the naive path's qwk is "
                        f"{qn:.4f} and the optimized path's {qo:.4f} (more than {QWK_PARITY:g} apart)")
    if problems:
        res["problems"] = problems
    return res


LOGIT_PARITY = 1e-4
"""The most the paths' logits may differ on shared weights: the fused recurrence sums in another order (3.6e-7
measured, docs/benchmarks.md); another function differs by far more."""

QWK_PARITY = 0.05
"""The most the two paths' QWK may differ after the same training from the same seed: the same function trains
alike, up to a response or two changing category at a rounding."""


if __name__ == "__main__":  # python -m raysys.workloads.deep_gpcm.bench --batch 256: the step table alone
    import argparse
    import json

    from raysys.workloads.deep_gpcm.model import triton_available
    from raysys.workloads.deep_gpcm.workload import DeepGPCMTask, parity

    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.deep_gpcm.bench",
                                 description="training-step times of every path at the data's longest T, then the "
                                             "optimized step's profile (the GPU figures of issue #14, alone)")
    ap.add_argument("--batch", type=int, nargs="+", default=[256], help="batch sizes")
    ap.add_argument("--repeats", type=int, default=10, help="timed training steps of each path; the median is reported")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    task = DeepGPCMTask()
    cfg = task.prepare(parity())
    table = batch_sizes(task, cfg, tuple(a.batch), repeats=a.repeats, device=dev)
    print(json.dumps({b: {k: v["step_s"] * 1e3 if isinstance(v, dict) else v for k, v in r.items()}
                      for b, r in table.items()}))
    if dev == "cuda" and triton_available():
        from raysys.workloads.deep_gpcm.memory_kernel import tuning_report

        print(*tuning_report(), sep="\n")
    step_profile(task, cfg, a.batch[-1], dev)
