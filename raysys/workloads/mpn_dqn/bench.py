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

import functools
import tempfile
from pathlib import Path

from raysys import console
from raysys.bench_generic import GRAD_PARITY
from raysys.config import apply_overrides
from raysys.tracking import sqlite_uri


def _run(preset: str, overrides: dict, tmp: str) -> dict:
    from raysys import workload as registry
    from raysys.session import run_custom

    wl = registry.get("mpn_dqn")
    cfg = apply_overrides(wl.config(preset), {
        "launch.storage_path": tmp, "launch.name": f"bench-{preset}",
        "launch.tracking_uri": sqlite_uri(Path(tmp) / "bench.db"), **overrides})
    m = run_custom(wl, cfg).metrics
    keys = ("perf/env_steps_per_s", "perf/updates_per_s", "perf/env_steps", "perf/train_seconds", "charts/episodes",
            "charts/final_avg_reward", "eval/reward_per_trial", "eval/random_reward_per_trial", "eval/correct_rate")
    return {k.split("/")[1]: m.get(k) for k in keys}


LOSS_PARITY = 1e-4
"""The most the two paths' TD losses on the same weights and batch may differ (measured: ~1e-7)."""

UPDATE_KINDS = ("eager", "compile", "reduce-overhead", "cuda_graph")


def update_times(batch_sizes=(64, 1024), repeats: int = 50, device: str = "cuda", kinds=UPDATE_KINDS) -> dict:
    """Milliseconds per whole optimized update (TD loss, backward, clip, Adam step) at each batch
    size: eager, the loss through ``torch.compile`` (the ``compile`` knob), the same with
    ``mode="reduce-overhead"`` (CUDA graphs of the loss's forward and backward, inside compile), and
    the whole update as one CUDA graph (the ``cuda_graph`` knob); median of ``repeats`` after a
    warm-up, on the same weights and batch."""
    import statistics
    import time

    import torch

    from raysys.bench_generic import sync
    from raysys.workloads.mpn_dqn.loss import _setup, td_loss_optimized

    out = {}
    for B in batch_sizes:
        row = {}
        for kind in kinds:
            online, target, batch = _setup(B, 10, 128, 7, 3, device, 0)
            params = list(online.parameters())
            opt = torch.optim.Adam(params, lr=2.5e-4, capturable=kind == "cuda_graph")
            if kind == "cuda_graph":
                from raysys.workloads.mpn_dqn.graphed import GraphedUpdate

                step = functools.partial(GraphedUpdate(online, target, opt, 0.99, 10.0, None), batch)
            else:
                def step(compile={"eager": False, "compile": True}.get(kind, kind)):
                    opt.zero_grad(set_to_none=True)
                    loss = td_loss_optimized(online, target, batch, compile=compile)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, 10.0)
                    opt.step()
            for _ in range(5):  # warm-up, compile, capture
                step()
            sync(torch.device(device))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                sync(torch.device(device))
                times.append(time.perf_counter() - t0)
            row[kind] = statistics.median(times) * 1e3
        out[f"B={B}"] = row
        print(f"[bench] update at B={B}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    return out


def parity_problems(td: dict) -> list[str]:
    """Speed never at the cost of learning: the batched unroll must be the per-sequence TD loss, on the same
    weights and batch (``compare_td_loss``), and give its gradients."""
    problems = []
    if not td["loss_abs_diff"] <= LOSS_PARITY:
        problems.append(f"the paths compute different TD losses: on the same weights and batch they differ by "
                        f"{td['loss_abs_diff']:.2e} (more than {LOSS_PARITY:g})")
    if not td["grad_rel_diff"] <= GRAD_PARITY:
        problems.append(f"the paths train differently: on the same weights and batch the optimized TD loss's "
                        f"gradients differ from the naive one's by {td['grad_rel_diff']:.2e} of their norm "
                        f"(more than {GRAD_PARITY:g})")
    return problems


def run_bench(quick: bool = False) -> dict:
    import torch

    from raysys.workloads.mpn_dqn.loss import compare_td_loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    td = compare_td_loss(rounds=6 if quick else 15, device=device)
    print(f"[bench] TD-loss step: naive {td['naive_s'] * 1e3:.1f} ms, optimized {td['optimized_s'] * 1e3:.2f} ms "
          f"-> {td['speedup']:.1f}x", flush=True)
    # quick: the two ends (torch.compile's variants cost a minute of compiling; the full bench has them)
    kinds = ("eager", "cuda_graph") if quick else UPDATE_KINDS
    updates = update_times(repeats=20 if quick else 50, kinds=kinds) if device == "cuda" else None
    # Same episodes for both commands; the old one stops at its time budget.
    # On a GPU the quick bench runs inside a short device lease: 30 s gives the old config's rate too.
    episodes, budget = (40, 90.0 if device == "cpu" else 30.0) if quick else (100, 900.0)
    with tempfile.TemporaryDirectory() as tmp:
        fast = _run("default", {"num_episodes": episodes, "eval_trials": 100}, tmp)
        old = _run("original", {"num_episodes": episodes, "max_seconds": budget, "eval_trials": 100}, tmp)
        graphed = _run("default", {"num_episodes": episodes, "eval_trials": 100, "cuda_graph": True,
                                   "launch.name": "bench-graphed"}, tmp) if device == "cuda" else None
    ratio = fast["env_steps_per_s"] / old["env_steps_per_s"]
    try:  # RLlib is an optional comparison (a machine with Ray but no RLlib skips it)
        with console.held_stderr():  # RLlib's deprecation and Ray core-worker lines: -v shows them
            rllib = rollout_vs_rllib(rounds=6 if quick else 12)
    except ImportError as e:
        print(f"[bench] rollout pool vs RLlib skipped: {e}", flush=True)
        rllib = None
    # The whole-training rows below are not a parity check (the old command stops at its budget)
    problems = parity_problems(td)
    return {
        **({"problems": problems} if problems else {}),
        "throughput_unit": "env-steps/s (whole training)",
        "quality_metric": "eval reward/trial",
        "naive": {"throughput": old["env_steps_per_s"], "quality": old["reward_per_trial"], **old,
                  "command": "original preset: path=naive sequence_batch_size=32 train_freq=1",
                  "time_budget_s": budget},
        "optimized": {"throughput": fast["env_steps_per_s"], "quality": fast["reward_per_trial"], **fast,
                      "command": "default preset (the seed's fast command): sequence_batch_size=64 train_freq=4"},
        "speedup": ratio,
        "notes": ["rows: the seed's old command (path=naive, sequence_batch_size=32, train_freq=1) and its fast one "
                  "(path=optimized, 64, train_freq=4), whole training: the ratio is of the configuration, mostly "
                  "train_freq; the code path alone is the TD-loss step below",
                  f"quality: each after its own episodes (the old command stops at its {budget:.0f} s budget), "
                  "not a parity check; the paths' parity is their TD loss and gradients on the same weights and "
                  f"batch (judged: loss within {LOSS_PARITY:g}, gradients within {GRAD_PARITY:g} of their norm)"],
        "td_loss": td,
        **({"update_ms": updates, "cuda_graph_training": graphed} if updates else {}),
        **({"rollout_vs_rllib": rllib} if rllib else {}),
        "extra": {
            "TD-loss step speedup (B=64 L=10 H=128)": f"{td['speedup']:.1f}x "
                                                      f"(naive {td['naive_s'] * 1e3:.1f} ms, optimized {td['optimized_s'] * 1e3:.2f} ms)",
            "TD loss / gradients, naive vs optimized (same weights and batch)": f"{td['loss_abs_diff']:.1e} apart / "
                                                                               f"{td['grad_rel_diff']:.1e} of their norm",
            "whole-training speedup (fast command vs old config)": f"{ratio:.1f}x",
            "old config": f"{old['episodes']:.0f} of {episodes} episodes in its {budget:.0f}s budget, "
                          f"final avg reward {old['final_avg_reward']:.2f}",
            "fast command": f"{fast['episodes']:.0f} episodes in {fast['train_seconds']:.0f}s, "
                            f"final avg reward {fast['final_avg_reward']:.2f}",
            "random policy reward/trial": f"{fast['random_reward_per_trial']:.3f}",
            **({f"update ms at {b}: " + " / ".join(row): " / ".join(f"{v:.2f}" for v in row.values())
                for b, row in updates.items()} if updates else {}),
            **({"fast command with cuda_graph": f"{graphed['env_steps_per_s']:.0f} env-steps/s, final avg reward "
                                                f"{graphed['final_avg_reward']:.2f}"} if graphed else {}),
            **({"rollout pool vs RLlib EnvRunners (2 actors x 8 envs)": f"{rllib['ratio']:.2f}x "
                                                                       f"({rllib['raysys_env_steps_per_s']:.0f} vs "
                                                                       f"{rllib['rllib_env_steps_per_s']:.0f} env-steps/s)"}
               if rllib else {}),
        },
    }


def rollout_vs_rllib(num_actors: int = 2, envs_per_actor: int = 8, steps_per_call: int = 256, rounds: int = 12) -> dict:
    """raysys's rollout pool vs RLlib's own EnvRunner sampling on ContextDecisionMaking, same
    actors x envs, steps per call and CPUs per actor, interleaved in this process."""
    from raysys import workload as registry
    from raysys.rl.rollout import compare_with_rllib
    from raysys.train.runtime import init_ray
    from raysys.workloads.mpn_dqn.train import env_factory, policy_factory

    init_ray(None)
    cfg = registry.get("mpn_dqn").config()
    res = compare_with_rllib(env_factory(cfg), policy_factory(cfg), num_actors=num_actors, envs_per_actor=envs_per_actor,
                             steps_per_call=steps_per_call, rounds=rounds)
    print(f"[bench] rollout pool {res['raysys_env_steps_per_s']:.0f} vs RLlib {res['rllib_env_steps_per_s']:.0f} "
          f"env-steps/s -> {res['ratio']:.2f}x", flush=True)
    return res


if __name__ == "__main__":  # python -m raysys.workloads.mpn_dqn.bench: the RLlib comparison alone
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.mpn_dqn.bench",
                                 description="raysys rollout actors vs RLlib EnvRunners on ContextDecisionMaking-v0")
    ap.add_argument("--actors", type=int, default=2, help="rollout actors (and RLlib EnvRunners), one CPU each")
    ap.add_argument("--envs", type=int, default=8, help="envs per actor")
    ap.add_argument("--steps", type=int, default=256, help="vector steps per sample call")
    ap.add_argument("--rounds", type=int, default=12, help="timed sample calls of each, interleaved (after one warm-up each)")
    a = ap.parse_args()
    print(json.dumps(rollout_vs_rllib(a.actors, a.envs, a.steps, a.rounds), indent=1))
