"""MPN-DQN naive vs optimized, measured in one process (``python -m raysys.bench mpn_dqn``).

Two ratios, as the seed claimed them:
1. the TD-loss step alone (B=64, L=10, H=128, online + target unrolls, forward + backward):
   per-sequence batch-1 loops vs one batched unroll, interleaved on the same weights and batch;
2. whole training, env-steps/s: the seed's recommended fast command (optimized loss, B=64,
   train-freq 4) vs its old configuration (per-sequence loss, B=32, an update every step), each
   a real run (temporary run folder and MLflow store) with the rewards it reached. The old
   configuration is ~100x slower, so it runs under a time budget and reports how far it got.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from raysys.config import apply_overrides


def _run(preset: str, overrides: dict, tmp: str) -> dict:
    from raysys import workload as registry
    from raysys.session import run_custom

    wl = registry.get("mpn_dqn")
    cfg = apply_overrides(wl.config(preset), {
        "launch.storage_path": tmp, "launch.name": f"bench-{preset}",
        "launch.tracking_uri": f"sqlite:///{Path(tmp) / 'bench.db'}", **overrides})
    m = run_custom(wl, cfg).metrics
    keys = ("perf/env_steps_per_s", "perf/updates_per_s", "perf/env_steps", "perf/train_seconds", "charts/episodes",
            "charts/final_avg_reward", "eval/reward_per_trial", "eval/random_reward_per_trial", "eval/correct_rate")
    return {k.split("/")[1]: m.get(k) for k in keys}


def run_bench(quick: bool = False) -> dict:
    from raysys.workloads.mpn_dqn.loss import compare_td_loss

    td = compare_td_loss(rounds=6 if quick else 15)
    print(f"[bench] TD-loss step: naive {td['naive_s'] * 1e3:.1f} ms, optimized {td['optimized_s'] * 1e3:.2f} ms "
          f"-> {td['speedup']:.1f}x", flush=True)
    # Same episodes for both commands; the old one stops at its time budget.
    episodes, budget = (40, 90.0) if quick else (100, 900.0)
    with tempfile.TemporaryDirectory() as tmp:
        fast = _run("default", {"num_episodes": episodes, "eval_trials": 100}, tmp)
        old = _run("original", {"num_episodes": episodes, "max_seconds": budget, "eval_trials": 100}, tmp)
    ratio = fast["env_steps_per_s"] / old["env_steps_per_s"]
    return {
        "throughput_unit": "env-steps/s (whole training)",
        "quality_metric": "eval reward/trial",
        "naive": {"throughput": old["env_steps_per_s"], "quality": old["reward_per_trial"], **old,
                  "command": "original preset: path=naive sequence_batch_size=32 train_freq=1",
                  "time_budget_s": budget},
        "optimized": {"throughput": fast["env_steps_per_s"], "quality": fast["reward_per_trial"], **fast,
                      "command": "default preset (the seed's fast command): sequence_batch_size=64 train_freq=4"},
        "speedup": ratio,
        "td_loss": td,
        "extra": {
            "TD-loss step speedup (B=64 L=10 H=128)": f"{td['speedup']:.1f}x "
                                                      f"(naive {td['naive_s'] * 1e3:.1f} ms, optimized {td['optimized_s'] * 1e3:.2f} ms)",
            "whole-training speedup (fast command vs old config)": f"{ratio:.1f}x",
            "old config": f"{old['episodes']} of {episodes} episodes in its {budget:.0f}s budget, "
                          f"final avg reward {old['final_avg_reward']:.2f}",
            "fast command": f"{fast['episodes']} episodes in {fast['train_seconds']:.0f}s, "
                            f"final avg reward {fast['final_avg_reward']:.2f}",
            "random policy reward/trial": f"{fast['random_reward_per_trial']:.3f}",
        },
    }
