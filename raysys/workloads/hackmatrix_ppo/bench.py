"""HackMatrix PPO, measured in one process (``python -m raysys.bench hackmatrix_ppo``).

* optimized: full PPO training (env steps + GAE + epochs of minibatch updates) as jitted
  ``lax.scan`` chunks, env-steps/s after compilation, at 256 x 128 and at 2048 x 128;
* naive: the same PPO the seed's slow way, a Python loop that calls a jitted policy+env step
  per time step and a jitted update per minibatch, with the host in between (256 x 128);
* RLlib: RLlib's PPO on the same game through the gymnasium adapter (``rllib_compare.py``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np


def _cfg(num_envs: int, num_steps: int, updates_per_chunk: int):
    from raysys.workloads.hackmatrix_ppo.workload import default

    cfg = default()
    cfg.train = dataclasses.replace(cfg.train, num_envs=num_envs, num_steps=num_steps, updates_per_chunk=updates_per_chunk,
                                    total_timesteps=10**9)
    return cfg


def fused_throughput(num_envs: int, num_steps: int = 128, chunks: int = 3, updates_per_chunk: int = 2) -> dict:
    """env-steps/s of whole PPO updates in jitted chunks (compile excluded, reported apart)."""
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, updates_per_chunk)
    mesh = ppo.make_mesh()
    runner = ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh)
    t0 = time.perf_counter()
    fn = ppo.make_train_chunk(cfg, mesh).lower(runner).compile()
    compile_s = time.perf_counter() - t0
    runner, stats = fn(runner)  # warm-up chunk
    jax.block_until_ready(stats)
    times, returns = [], []
    for _ in range(chunks):
        t = time.perf_counter()
        runner, stats = fn(runner)
        stats = jax.device_get(stats)  # blocks: the chunk is done
        times.append(time.perf_counter() - t)
        if stats["episodes"]:
            returns.append(float(stats["return_sum"] / stats["episodes"]))
    steps = updates_per_chunk * num_envs * num_steps
    return {"env_steps_per_s": steps / float(np.median(times)), "compile_s": compile_s, "num_envs": num_envs,
            "num_steps": num_steps, "mean_return": float(np.mean(returns)) if returns else None}


def python_loop_throughput(num_envs: int = 256, num_steps: int = 128, updates: int = 1) -> dict:
    """The slow way: per-step jitted calls from Python, then per-minibatch jitted updates."""
    import jax
    import jax.numpy as jnp
    import optax

    from raysys.envs import hackmatrix as hm
    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, 1)
    key = jax.random.PRNGKey(0)
    params = ppo.init_params(key)
    optimizer = ppo.make_optimizer(cfg)
    opt_state = optimizer.init(params)
    obs, env_state = jax.jit(jax.vmap(hm.reset, in_axes=(0, None)))(jax.random.split(key, num_envs), ppo.env_params_of(cfg))

    @jax.jit
    def act_step(params, env_state, obs, key):
        k_act, k_env = jax.random.split(key)
        logits, value = ppo.forward(params, obs.features, obs.action_mask)
        action = jax.random.categorical(k_act, logits)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
        next_obs, env_state, reward, done, info = jax.vmap(hm.step, in_axes=(0, 0, 0, None))(
            jax.random.split(k_env, num_envs), env_state, action, ppo.env_params_of(cfg))
        return next_obs, env_state, (obs.features, obs.action_mask, action, logp, value, reward, done, info["episode_return"])

    @jax.jit
    def minibatch_update(params, opt_state, obs, mask, action, logp_old, value_old, adv, targets):
        def loss_fn(p):
            logits, value = ppo.forward(p, obs, mask)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
            ratio = jnp.exp(logp - logp_old)
            a = (adv - adv.mean()) / (adv.std() + 1e-8)
            pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a).mean()
            return pg + 0.5 * ((value - targets) ** 2).mean()

        grads = jax.grad(loss_fn)(params)
        upd, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    nmb, epochs = ppo.minibatch_plan(cfg)
    rng = np.random.default_rng(0)

    def one_update(params, opt_state, env_state, obs, key):
        traj = []
        for _ in range(num_steps):
            key, k = jax.random.split(key)
            obs, env_state, tr = act_step(params, env_state, obs, k)
            traj.append(jax.device_get(tr))  # the host round-trip of the slow path
        o, m, a, lp, v, r, d, ret = (np.stack([t[i] for t in traj]) for i in range(8))
        _, last_v = ppo.forward(params, obs.features, obs.action_mask)
        adv, targets = ppo.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(d, jnp.float32), last_v, 0.99, 0.95)
        flat = [x.reshape((-1,) + x.shape[2:]) for x in (o, m, a, lp, v, np.asarray(adv), np.asarray(targets))]
        n = flat[0].shape[0]
        for _ in range(epochs):
            perm = rng.permutation(n)
            for idx in np.array_split(perm, nmb):
                params, opt_state = minibatch_update(params, opt_state, *(x[idx] for x in flat))
        finished = d.astype(bool)
        return params, opt_state, env_state, obs, key, (ret[finished].mean() if finished.any() else None)

    params, opt_state, env_state, obs, key, _ = one_update(params, opt_state, env_state, obs, key)  # compile
    t = time.perf_counter()
    rets = []
    for _ in range(updates):
        params, opt_state, env_state, obs, key, ret = one_update(params, opt_state, env_state, obs, key)
        rets.append(ret)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t
    rets = [r for r in rets if r is not None]
    return {"env_steps_per_s": updates * num_envs * num_steps / dt, "num_envs": num_envs, "num_steps": num_steps,
            "mean_return": float(np.mean(rets)) if rets else None}


def run_bench(quick: bool = False) -> dict:
    from raysys.envs import hackmatrix as hm

    chunks = 2 if quick else 4
    small = fused_throughput(256, 128, chunks=chunks)
    print(f"[bench] fused PPO 256x128: {small['env_steps_per_s']:.0f} env-steps/s (compile {small['compile_s']:.1f}s)", flush=True)
    big = fused_throughput(2048, 128, chunks=chunks, updates_per_chunk=1)
    print(f"[bench] fused PPO 2048x128: {big['env_steps_per_s']:.0f} env-steps/s", flush=True)
    slow = python_loop_throughput(256, 128, updates=1 if quick else 2)
    print(f"[bench] Python-loop PPO 256x128: {slow['env_steps_per_s']:.0f} env-steps/s", flush=True)
    import jax

    _, summary, _ = jax.jit(hm.random_rollout, static_argnums=(1, 2))(jax.random.PRNGKey(1), 256, 200)
    random_return = float(summary["returns"] / max(float(summary["episodes"]), 1.0))
    extra = {
        "fused PPO env-steps/s at 256 envs x 128 steps": f"{small['env_steps_per_s']:.0f} (seed's TPU v4-8 baseline: 1,800)",
        "fused PPO env-steps/s at 2048 envs x 128 steps": f"{big['env_steps_per_s']:.0f}",
        "2048 vs 256 envs": f"{big['env_steps_per_s'] / small['env_steps_per_s']:.2f}x",
        "compile time (256x128 chunk)": f"{small['compile_s']:.1f}s",
        "random masked policy mean episode return": f"{random_return:.3f}",
    }
    res = {
        "throughput_unit": "env-steps/s (full PPO training)",
        "quality_metric": "mean episode return",
        "naive": {"throughput": slow["env_steps_per_s"], "quality": slow["mean_return"], **slow},
        "optimized": {"throughput": small["env_steps_per_s"], "quality": small["mean_return"], **small},
        "speedup": small["env_steps_per_s"] / slow["env_steps_per_s"],
        "envs_2048": big,
        "ratio_2048_vs_256": big["env_steps_per_s"] / small["env_steps_per_s"],
        "random_policy_return": random_return,
    }
    try:
        from raysys.workloads.hackmatrix_ppo.rllib_compare import measure_rllib_ppo

        rl = measure_rllib_ppo(seconds=45 if quick else 120)
        res["rllib"] = rl
        res["rllib_ratio"] = small["env_steps_per_s"] / rl["env_steps_per_s"]
        extra["RLlib PPO (gymnasium adapter) env-steps/s"] = f"{rl['env_steps_per_s']:.0f} -> raysys {res['rllib_ratio']:.1f}x"
    except ImportError:
        pass
    res["extra"] = extra
    return res
