"""Learning-history generation, raysys vs the original's tool, in one command:

    python -m raysys.workloads.ad_transformer.sb3_compare [--goals 4] [--steps-per-goal 100000]

Both sides run the original's source algorithm on the same goals and the same number of env steps:
stable-baselines3 PPO (MlpPolicy, 100 DummyVecEnv streams, n_steps 20, batch 50, 20 epochs, lr 3e-4),
one run per goal as the original did (one process here; the original used 8 processes for 81 goals),
and raysys's population PPO (source.py), every goal in one jitted program. It prints env-steps/s of
each (raysys with and without its one-off compile), their ratio, and each side's final return per
goal against the optimum, so "faster" is only claimed for learners that learn.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from raysys.envs import darkroom as dr
from raysys.workloads.ad_transformer.histories import pin_jax_to_one_core


def sb3_run(goal: int, c) -> dict:
    """One stable-baselines3 PPO run on one goal, the original's settings; -> timing and returns."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

    torch.set_num_threads(1)  # as each of the original's worker processes
    env = VecMonitor(DummyVecEnv([lambda: dr.DarkroomEnv(goal=goal)] * c.streams))
    model = PPO("MlpPolicy", env, n_steps=c.n_steps, batch_size=c.minibatch, n_epochs=c.epochs, learning_rate=c.lr,
                gamma=c.gamma, gae_lambda=c.gae_lambda, clip_range=c.clip_eps, ent_coef=c.ent_coef,
                vf_coef=c.vf_coef, max_grad_norm=c.max_grad_norm, seed=c.seed + goal, device="cpu", verbose=0)
    t0 = time.perf_counter()
    model.learn(total_timesteps=c.steps_per_goal)
    wall = time.perf_counter() - t0
    last = [ep["r"] for ep in list(model.ep_info_buffer)]  # the last 100 episodes
    return {"goal": goal, "wall_s": wall, "final_return": float(np.mean(last)), "env_steps": model.num_timesteps}


def compare(goals: list[int], c, raysys_goals: list[int] | None = None) -> dict:
    """SB3 on ``goals``; raysys on ``raysys_goals`` (default: the same goals). Learning is reported on
    ``goals`` for both."""
    from raysys.workloads.ad_transformer import source

    runs = [sb3_run(g, c) for g in goals]
    sb3_steps, sb3_wall = sum(r["env_steps"] for r in runs), sum(r["wall_s"] for r in runs)
    raysys_goals = goals if raysys_goals is None else raysys_goals
    # raysys twice: the first call includes the compile, the second is the steady state
    _, first = source.timed_generate(c, raysys_goals)
    h, steady = source.timed_generate(c, raysys_goals)
    final = source.final_return(h, last_updates=1)[[raysys_goals.index(g) for g in goals]]
    opt = dr.optimal_return(goals)
    return {
        "goals": goals, "raysys_goals": raysys_goals, "steps_per_goal": c.steps_per_goal,
        "sb3": {"env_steps": sb3_steps, "wall_s": sb3_wall, "env_steps_per_s": sb3_steps / sb3_wall,
                "final_return": [r["final_return"] for r in runs]},
        "raysys": {"env_steps": steady["env_steps"], "wall_s": steady["wall_s"], "wall_s_with_compile": first["wall_s"],
                   "env_steps_per_s": steady["env_steps_per_s"],
                   "env_steps_per_s_with_compile": first["env_steps_per_s"], "final_return": final.tolist()},
        "optimal_return": opt.tolist(),
        "speedup": steady["env_steps_per_s"] / (sb3_steps / sb3_wall),
        "speedup_with_compile": first["env_steps_per_s"] / (sb3_steps / sb3_wall),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.ad_transformer.sb3_compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--goals", type=int, default=4, help="how many goals both sides learn (spread over the grid)")
    ap.add_argument("--steps-per-goal", type=int, default=100_000, help="env steps per goal (the original: 100k)")
    ap.add_argument("--raysys-all-goals", action="store_true",
                    help="raysys learns all 81 goals (the dataset it really generates) while sb3 learns --goals")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args(argv)
    # the same single core for both sides (before JAX starts; see histories.py for why JAX needs it here)
    pinned = pin_jax_to_one_core()
    from raysys.workloads.ad_transformer import source

    c = source.SourceConfig(steps_per_goal=a.steps_per_goal)
    goals = np.linspace(0, dr.SIZE * dr.SIZE - 1, a.goals).round().astype(int).tolist()
    if pinned:
        print("(CPU: both sides on one core, as each of the original's 8 worker processes)")
    r = compare(goals, c, list(range(dr.SIZE * dr.SIZE)) if a.raysys_all_goals else None)
    print(f"goals {goals} ({'raysys: all 81' if a.raysys_all_goals else 'both'}), {c.steps_per_goal} env steps each")
    print(f"stable-baselines3 PPO  {r['sb3']['env_steps_per_s']:>10,.0f} env-steps/s  ({r['sb3']['wall_s']:.1f} s)")
    print(f"raysys population PPO  {r['raysys']['env_steps_per_s']:>10,.0f} env-steps/s  ({r['raysys']['wall_s']:.1f} s; "
          f"{r['raysys']['wall_s_with_compile']:.1f} s with the compile)")
    print(f"speedup {r['speedup']:.1f}x ({r['speedup_with_compile']:.1f}x with the compile)")
    print("final return per goal (optimum / sb3 / raysys):")
    for g, o, s, x in zip(goals, r["optimal_return"], r["sb3"]["final_return"], r["raysys"]["final_return"]):
        print(f"  goal {g:2d}: {o:5.1f} / {s:5.1f} / {x:5.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
