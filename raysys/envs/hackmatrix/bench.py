"""Throughput of the jitted, vmapped env step under random masked actions.

    python -m raysys.envs.hackmatrix.bench --num-envs 256 2048 --steps 200 --repeats 3
    python -m raysys.envs.hackmatrix.bench --kernels --num-envs 8192     # what one step compiles to

Each measurement runs `random_rollout` (reset + lax.scan of vmapped steps with
random legal actions) and reports env-steps per second of wall time (best of
the repeats, compilation excluded) and the process CPU time per env-step.
"""
import argparse
import json
import time

import jax

from .env import random_rollout
from .state import EnvParams


def measure(num_envs: int, num_steps: int = 200, repeats: int = 3, seed: int = 0, params: EnvParams | None = None):
    params = EnvParams() if params is None else params
    run = jax.jit(random_rollout, static_argnums=(1, 2))
    t0 = time.perf_counter()
    jax.block_until_ready(run(jax.random.PRNGKey(seed), num_envs, num_steps, params))
    compile_s = time.perf_counter() - t0
    best_wall, best_cpu = float("inf"), float("inf")
    for r in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        _, summary, _ = jax.block_until_ready(run(jax.random.PRNGKey(seed + 1 + r), num_envs, num_steps, params))
        best_wall, best_cpu = min(best_wall, time.perf_counter() - w), min(best_cpu, time.process_time() - c)
    steps = num_envs * num_steps
    return {"num_envs": num_envs, "num_steps": num_steps, "compile_plus_first_run_s": round(compile_s, 1),
            "env_steps_per_s": round(steps / best_wall), "cpu_us_per_env_step": round(best_cpu / steps * 1e6, 2),
            "episodes_in_last_run": int(summary["episodes"])}


def kernel_census(num_envs: int = 256, params: EnvParams | None = None) -> dict:
    """What one vmapped env step compiles to on this backend: its top-level XLA operations, most of
    them one kernel launch each on a GPU (fusions, sorts, scatters, copies). A step of a few hundred
    small kernels is bound by launches, not by the batch: its time stays flat as num_envs grows."""
    import collections
    import re

    import jax.numpy as jnp

    from .env import reset, step

    params = EnvParams() if params is None else params
    _, state = jax.vmap(reset, in_axes=(0, None))(jax.random.split(jax.random.PRNGKey(0), num_envs), params)
    keys, actions = jax.random.split(jax.random.PRNGKey(1), num_envs), jnp.zeros(num_envs, jnp.int32)
    text = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None))).lower(keys, state, actions, params).compile().as_text()
    entry = re.search(r"^ENTRY [^\n]*\{\n(.*?)\n\}", text, re.S | re.M)
    # an op's shape is one token or, for a multi-output op, a parenthesised tuple with spaces
    ops = collections.Counter(m.group(1) for m in re.finditer(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(",
                                                              entry.group(1) if entry else ""))
    free = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier"}  # no kernel of their own
    return {"backend": jax.default_backend(), "kernels": sum(v for k, v in ops.items() if k not in free),
            "by_op": dict(ops.most_common())}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m raysys.envs.hackmatrix.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--num-envs", type=int, nargs="+", default=[256, 2048], help="vmapped envs; one measurement per value")
    ap.add_argument("--steps", type=int, default=200, help="env steps of random legal actions per timed rollout")
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts after the compile; the fastest is reported")
    ap.add_argument("--kernels", action="store_true", help="instead: what one vmapped step compiles to (kernel_census)")
    args = ap.parse_args(argv)
    if args.kernels:
        print(json.dumps(kernel_census(args.num_envs[0])), flush=True)
        return
    for n in args.num_envs:
        print(json.dumps(measure(n, args.steps, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
