"""``python -m raysys.bench ad_source``: K source-PPO settings trained one after another (each its own
program, as K separate trials would) vs as one population program (``--vectorize K``), in one process.

Both paths train the same K settings (learning rate, entropy bonus, clip range, seed differ) on the
same goals for the same updates; throughput is env steps/s over all K, with each path's compiles
counted (a sweep pays them) and, apart, without. The cache is fresh and persistent: the settings after
the first load the lone program from it, as the trials of a sweep do. The quality columns are the mean
``eval/quality``.

The population is the same computation, but ``vmap`` over members turns each matmul into a batched
one, whose float rounding can differ in the last bit. RL amplifies that: the curves are identical
until one sampled action flips, after which the two runs of a setting are different (equally good)
learners. ``identical_updates`` says, per setting, for how many updates the curves were identical
(tests/test_ad_source.py checks the states' equality to 1e-5 over a short run).
"""

from __future__ import annotations

import dataclasses
import time

SETTINGS = [dict(lr=lr, ent_coef=ent, clip_eps=clip, seed=seed)
            for lr, ent, clip, seed in [(3e-4, 0.0, 0.2, 0), (1e-3, 0.0, 0.2, 1), (3e-3, 0.0, 0.1, 2),
                                        (3e-4, 0.01, 0.3, 3), (1e-3, 0.01, 0.2, 4), (3e-3, 0.01, 0.3, 5),
                                        (6e-4, 0.05, 0.2, 6), (2e-3, 0.05, 0.1, 7)]]


def _curves_one_by_one(cfgs, goals):
    import jax
    import numpy as np

    from raysys.workloads.ad_transformer import source

    curves, compile_s = [], 0.0
    for cfg in cfgs:
        c, k = cfg.source, cfg.source.updates_per_call
        learners, hp = source.init_learners(c, goals), source.hparams_of(c)
        t = time.perf_counter()
        step = source.make_chunk(c).lower(learners, goals, hp, np.int32(k)).compile()
        compile_s += time.perf_counter() - t
        out, done = [], 0
        while done < c.updates:
            n = min(k, c.updates - done)
            learners, ret = step(learners, goals, hp, np.int32(n))
            out.append(np.asarray(ret)[:n])
            done += n
        jax.block_until_ready(learners)
        curves.append(np.concatenate(out))
    return curves, compile_s


def _curves_population(cfgs, goals):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from raysys.workloads.ad_transformer import source

    c, k, K = cfgs[0].source, cfgs[0].source.updates_per_call, len(cfgs)
    learners = jax.tree.map(lambda *xs: jnp.stack(xs), *[source.init_learners(x.source, goals) for x in cfgs])
    hps = source.stack_hparams([x.source for x in cfgs])
    t = time.perf_counter()
    step = source.make_population_chunk(c).lower(learners, goals, hps, np.full(K, k, np.int32)).compile()
    compile_s = time.perf_counter() - t
    out, done = [], 0
    while done < c.updates:
        n = min(k, c.updates - done)
        learners, ret = step(learners, goals, hps, np.full(K, n, np.int32))
        out.append(np.asarray(ret)[:n])
        done += n
    curve = np.concatenate(out)  # [U, K, G]
    return [curve[:, i] for i in range(K)], compile_s


def run_bench(quick: bool = False) -> dict:
    import tempfile

    # a fresh compilation cache, as a first sweep has: the first lone program compiles, the other
    # settings (same shapes; hyper-parameters and seeds are arguments) load it, as separate trials do;
    # removed when the bench ends
    with tempfile.TemporaryDirectory(prefix="raysys-ad-source-bench-") as cache:
        return _run_bench(quick, cache)


def _run_bench(quick: bool, cache: str) -> dict:
    from raysys.workloads.ad_transformer.source_workload import _final, _setup, _steps_per_update, learn
    from raysys.workloads.ad_transformer.source_workload import quick as quick_preset

    base = quick_preset() if quick else learn()
    base.train.compilation_cache_dir = cache
    _setup(base)
    import numpy as np

    from raysys.envs import darkroom as dr

    cfgs = []
    for s in SETTINGS:
        cfg = dataclasses.replace(base)
        cfg.source = dataclasses.replace(base.source, **s)
        cfgs.append(cfg)
    goals, optimal = np.asarray(base.train.goals, np.int32), dr.optimal_return(base.train.goals)
    steps = len(cfgs) * base.source.updates * _steps_per_update(base)
    res = {}
    for path, fn in (("naive", _curves_one_by_one), ("optimized", _curves_population)):
        t = time.perf_counter()
        curves, compile_s = fn(cfgs, goals)
        wall = time.perf_counter() - t
        quality = [_final(c, optimal, base.train.last_updates)["eval/quality"] for c in curves]
        res[path] = {"throughput": steps / wall, "throughput_without_compile": steps / (wall - compile_s),
                     "wall_s": wall, "compile_s": compile_s, "quality": float(np.mean(quality)),
                     "quality_per_setting": quality, "curves": curves}
    same = [int(np.argmax(np.append(np.abs(a - b).max(1) > 1e-4, True)))
            for a, b in zip(res["naive"].pop("curves"), res["optimized"].pop("curves"))]
    import jax

    return {"device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})",
            "throughput_unit": "env-steps/s", "quality_metric": "eval/quality",
            "naive": res["naive"], "optimized": res["optimized"],
            "speedup": res["optimized"]["throughput"] / res["naive"]["throughput"],
            "extra": {"settings": len(cfgs), "goals": len(goals), "env_steps": steps,
                      "naive": "one setting at a time, each its own compiled program",
                      "optimized": f"all {len(cfgs)} as one population program",
                      "speedup without compiles": round(res["optimized"]["throughput_without_compile"]
                                                        / res["naive"]["throughput_without_compile"], 2),
                      "compile_s (naive / optimized)": f"{res['naive']['compile_s']:.1f} / {res['optimized']['compile_s']:.1f}",
                      "updates": base.source.updates, "identical_updates": same}}
