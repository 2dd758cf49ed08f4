"""HackMatrix PPO, measured in one process (``python -m raysys.bench hackmatrix_ppo``).

* optimized: full PPO training (env steps + GAE + epochs of minibatch updates) as jitted
  ``lax.scan`` chunks, env-steps/s after compilation, at 256 x 128 and at 2048 x 128;
* naive: the same PPO the seed's slow way (``python_loop_update``): a Python loop that calls a jitted
  policy+env step per time step and a jitted update per minibatch, with the host in between (256 x 128);
  same keys and loss, so it reaches the same params;
* RLlib: RLlib's PPO on the same game through the gymnasium adapter (``rllib_compare.py``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np


FEATURE_ALIGN = 1  # model.feature_align of every bench config (--feature-align)


def _cfg(num_envs: int, num_steps: int, updates_per_chunk: int, precision: str = "fp32"):
    from raysys.workloads.hackmatrix_ppo.workload import default

    cfg = default()
    cfg.model = dataclasses.replace(cfg.model, feature_align=FEATURE_ALIGN)
    cfg.train = dataclasses.replace(cfg.train, num_envs=num_envs, num_steps=num_steps, updates_per_chunk=updates_per_chunk,
                                    total_timesteps=10**9, precision=precision)
    return cfg


def fused_throughput(num_envs: int, num_steps: int = 128, chunks: int = 3, updates_per_chunk: int = 2,
                     precision: str = "fp32") -> dict:
    """env-steps/s of whole PPO updates in jitted chunks (compile excluded, reported apart)."""
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, updates_per_chunk, precision)
    mesh = ppo.make_mesh()
    runner = ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh)
    t0 = time.perf_counter()
    hp = ppo.replicate(ppo.hparams_of(cfg), mesh)
    compiled = ppo.make_train_chunk(cfg, mesh).lower(runner, hp).compile()
    fn = lambda r: compiled(r, hp)  # noqa: E731
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


def python_loop_update(cfg):
    """-> ``update(runner) -> runner``: one PPO update the seed's slow way. A jitted policy+env
    step is called from Python per time step and its transition copied to the host; GAE runs
    once, then a jitted Adam step per minibatch. It uses the same PRNG streams, permutation, LR
    schedule and loss (``ppo.ppo_loss``) as ``ppo.make_update``, so on one device both paths give
    the same params (tests/test_hackmatrix_ppo.py): the speed-up costs no learning."""
    import jax
    import jax.numpy as jnp
    import optax

    from raysys.envs import hackmatrix as hm
    from raysys.workloads.hackmatrix_ppo import ppo

    tc = cfg.train
    dtype = jnp.bfloat16 if tc.precision == "bf16" else jnp.float32
    env_params = ppo.env_params_of(cfg)
    optimizer = ppo.make_optimizer(cfg)
    nmb, epochs = ppo.minibatch_plan(cfg)
    n = tc.num_envs * tc.num_steps

    @jax.jit
    def act_step(params, env_state, obs, env_keys):
        ks = jax.vmap(lambda k: jax.random.split(k, 3))(env_keys)
        env_keys, k_act, k_env = ks[:, 0], ks[:, 1], ks[:, 2]
        logits, value = ppo.forward(params, obs.features, obs.action_mask, dtype)
        action = jax.vmap(jax.random.categorical)(k_act, logits)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
        next_obs, env_state, reward, done, info = jax.vmap(hm.step, in_axes=(0, 0, 0, None))(k_env, env_state, action, env_params)
        return next_obs, env_state, env_keys, ppo.Transition(obs.features, obs.action_mask, action, logp, value, reward,
                                                             done.astype(jnp.float32), info["episode_return"], info["episode_length"])

    @jax.jit
    def advantages(params, obs, traj):
        _, last_value = ppo.forward(params, obs.features, obs.action_mask, dtype)
        return ppo.gae(traj.reward, traj.value, traj.done, last_value, cfg.ppo.gamma, cfg.ppo.gae_lambda)

    @jax.jit
    def minibatch_update(params, opt_state, mb, adv, targets):
        mean = adv.mean()
        adv = (adv - mean) / (jnp.sqrt(((adv - mean) ** 2).mean()) + 1e-8)
        grads, _ = jax.grad(ppo.ppo_loss, has_aux=True)(params, mb, adv, targets, cfg, dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def update(runner):
        params, opt_state, env_state, obs, env_keys = runner.params, runner.opt_state, runner.env_state, runner.obs, runner.env_keys
        frac = 1.0 - float(runner.env_steps) / ppo.run_end(cfg)
        opt_state[1].hyperparams["learning_rate"] = jnp.float32(
            cfg.optim.lr * min(max(frac, 0.0), 1.0) if cfg.optim.anneal_lr else cfg.optim.lr)
        steps = []
        for _ in range(tc.num_steps):
            obs, env_state, env_keys, t = act_step(params, env_state, obs, env_keys)
            steps.append(jax.device_get(t))  # the slow path's host round-trip, every step
        traj = jax.tree.map(lambda *xs: np.stack(xs), *steps)
        adv, targets = jax.device_get(advantages(params, obs, traj))
        key, k_epochs = jax.random.split(runner.key)
        for k in jax.random.split(k_epochs, epochs):
            perm = np.asarray(jax.random.permutation(k, n))
            flat = jax.tree.map(lambda x: np.asarray(x).reshape((n,) + x.shape[2:])[perm], (traj, adv, targets))
            for i in range(nmb):
                mb = jax.tree.map(lambda x: x[i * n // nmb:(i + 1) * n // nmb], flat)
                params, opt_state = minibatch_update(params, opt_state, *mb)
        return ppo.Runner(params, opt_state, env_state, obs, env_keys, key, runner.env_steps + n), traj

    return update


def python_loop_throughput(num_envs: int = 256, num_steps: int = 128, updates: int = 1) -> dict:
    """env-steps/s of the slow path (``python_loop_update``), compile excluded."""
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, 1)
    update = python_loop_update(cfg)
    runner = ppo.init_runner(cfg, jax.random.PRNGKey(0), ppo.make_mesh(jax.devices()[:1]))
    runner, _ = update(runner)  # compile
    rets, times = [], []
    for _ in range(updates):  # each update timed: the median, as the fused path's, so one slow moment decides nothing
        t = time.perf_counter()
        runner, traj = update(runner)
        jax.block_until_ready(runner.params)
        times.append(time.perf_counter() - t)
        finished = traj.done.astype(bool)
        if finished.any():
            rets.append(float(traj.ep_return[finished].mean()))
    return {"env_steps_per_s": num_envs * num_steps / float(np.median(times)), "num_envs": num_envs,
            "num_steps": num_steps, "updates_timed": updates, "mean_return": float(np.mean(rets)) if rets else None}


PARAM_PARITY = 1e-2
"""The most the two paths' params may differ after the same updates from one init, as a share of how far the
fused path moved them (measured on a CPU: ~1e-5 of it; a path that skips or changes the update: ~1)."""


def path_parity(num_envs: int = 16, num_steps: int = 16, updates: int = 2) -> dict:
    """The Python-loop path and the fused path from one init and key, ``updates`` PPO updates each (two
    minibatches, two epochs): the largest param difference and how far the fused path moved the params (an
    update that does nothing would agree too). Small shapes: the paths' code, not their speed, is judged."""
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, updates)
    cfg.train = dataclasses.replace(cfg.train, num_minibatches=2, update_epochs=2)
    mesh = ppo.make_mesh(jax.devices()[:1])
    # full fp32 matmuls (a GPU's default TF32 rounds each program its own way, and Adam magnifies it)
    with jax.default_matmul_precision("highest"):
        fused, _ = ppo.make_train_chunk(cfg, mesh)(ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh),
                                                   ppo.hparams_of(cfg))
        slow = ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh)
        update = python_loop_update(cfg)
        for _ in range(updates):
            slow, _ = update(slow)

    def gap(a, b):
        return max(float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max())
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    start = ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh).params
    return {"max_param_diff": gap(fused.params, slow.params), "moved": gap(fused.params, start),
            "env_steps": (int(fused.env_steps), int(slow.env_steps)), "shape": f"{num_envs} envs x {num_steps} steps"}


def parity_problems(parity: dict) -> list[str]:
    """What ``path_parity`` shows wrong: params apart by more than ``PARAM_PARITY`` of their move, or unequal
    env steps."""
    share = parity["max_param_diff"] / parity["moved"] if parity["moved"] > 0 else float("inf")
    if share <= PARAM_PARITY and len(set(parity["env_steps"])) == 1:
        return []
    return [f"the paths train differently: after the same updates from one init ({parity['shape']}) their params "
            f"differ by {parity['max_param_diff']:.2e}, {share:.2g} of how far the fused path moved them "
            f"({parity['moved']:.2e}; at most {PARAM_PARITY:g}); env steps {parity['env_steps']}"]


def _median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` (a JAX computation, waited for) over ``repeats``, after one
    untimed call (compile, warm-up)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def profile_split(num_envs: int, num_steps: int = 128, repeats: int = 3, precision: str = "fp32") -> dict:
    """Where one PPO update's time goes, on one device: the env step alone (random legal actions,
    ``raysys.envs.hackmatrix.bench``), the rollout (policy network + sampling + env step,
    ``ppo.make_rollout``), and the whole update (rollout + GAE + epochs of minibatch SGD). Each is
    its own jitted program, timed after compilation (median of ``repeats``); the split is the
    differences: env | policy in the rollout | learning."""
    import jax

    from raysys.envs.hackmatrix.bench import kernel_census, measure
    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, 1, precision)
    env = measure(num_envs, num_steps, repeats, params=ppo.env_params_of(cfg))
    t_env = num_envs * num_steps / env["env_steps_per_s"]
    kernels = kernel_census(num_envs, ppo.env_params_of(cfg))["kernels"]
    mesh = ppo.make_mesh(jax.devices()[:1])
    runner = ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh)
    rollout = jax.jit(ppo.make_rollout(cfg))
    args = (runner.params, runner.env_state, runner.obs, runner.env_keys)
    t_rollout = _median_seconds(lambda: rollout(*args), repeats)
    full = fused_throughput(num_envs, num_steps, chunks=repeats, updates_per_chunk=1, precision=precision)
    t_update = num_envs * num_steps / full["env_steps_per_s"]
    parts = {"env step": t_env, "policy network + sampling": max(t_rollout - t_env, 0.0),
             "learning (GAE + SGD epochs)": max(t_update - t_rollout, 0.0)}
    return {"num_envs": num_envs, "num_steps": num_steps, "precision": precision, "device": str(jax.devices()[0].platform),
            "update_s": t_update, "rollout_s": t_rollout, "env_s": t_env, "env_step_kernels": kernels,
            "env_step_us_per_kernel": t_env / num_steps / max(kernels, 1) * 1e6,
            "share": {k: v / t_update for k, v in parts.items()}, "env_steps_per_s": full["env_steps_per_s"]}


def population_vs_alone(k: int, num_envs: int = 256, num_steps: int = 128, chunks: int = 3,
                        precision: str = "fp32") -> dict:
    """Aggregate env-steps/s of K members of one shape trained as one population program (what
    ``--vectorize K`` runs) vs one member's program alone (what each separate trial runs), on this
    machine's devices, compiles excluded (reported apart). Members differ in seed and learning rate;
    both sides train at ``precision`` (``train.precision``, a shape knob: one program per value)."""
    import dataclasses

    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    cfg = _cfg(num_envs, num_steps, 1, precision)
    alone = fused_throughput(num_envs, num_steps, chunks=chunks, updates_per_chunk=1, precision=precision)
    cfgs = [dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr * (0.5 + i / k)),
                                train=dataclasses.replace(cfg.train, seed=i)) for i in range(k)]
    mesh = ppo.make_mesh()
    runners = ppo.init_population(cfg, [jax.random.PRNGKey(c.train.seed) for c in cfgs], mesh)
    hps = ppo.replicate(ppo.stack_hparams(cfgs), mesh)
    active = ppo.replicate(np.ones(k, bool), mesh)
    t0 = time.perf_counter()
    step = ppo.make_population_chunk(cfg, mesh).lower(runners, hps, active).compile()
    compile_s = time.perf_counter() - t0
    state = [runners]

    def chunk():
        state[0], stats = step(state[0], hps, active)  # donated: each chunk continues the last
        return stats

    together = k * num_envs * num_steps / _median_seconds(chunk, chunks)
    return {"k": k, "num_envs": num_envs, "num_steps": num_steps, "precision": precision,
            "population_env_steps_per_s": together,
            "alone_env_steps_per_s": alone["env_steps_per_s"], "ratio": together / alone["env_steps_per_s"],
            "population_compile_s": compile_s, "alone_compile_s": alone["compile_s"]}


def _print_split(p: dict) -> None:
    print(f"[bench] one update at {p['num_envs']} envs x {p['num_steps']} steps ({p['precision']}): {p['update_s'] * 1e3:.1f} ms "
          f"({p['env_steps_per_s']:.0f} env-steps/s): " + ", ".join(f"{k} {v:.0%}" for k, v in p["share"].items())
          + f"; one env step is {p['env_step_kernels']} kernels, {p['env_step_us_per_kernel']:.1f} us each", flush=True)


def _width_key(num_envs: int, precision: str) -> str:
    """The result's key of a wide run: ``envs_8192`` (fp32, as before bf16 was measured), ``envs_8192_bf16``."""
    return f"envs_{num_envs}" + ("" if precision == "fp32" else f"_{precision}")


def run_bench(quick: bool = False) -> dict:
    from raysys.envs import hackmatrix as hm

    chunks = 2 if quick else 4
    small = fused_throughput(256, 128, chunks=chunks)
    print(f"[bench] fused PPO 256x128: {small['env_steps_per_s']:.0f} env-steps/s (compile {small['compile_s']:.1f}s)", flush=True)
    big = fused_throughput(2048, 128, chunks=chunks, updates_per_chunk=1)
    print(f"[bench] fused PPO 2048x128: {big['env_steps_per_s']:.0f} env-steps/s", flush=True)
    slow = python_loop_throughput(256, 128, updates=3)
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
    if jax.default_backend() != "cpu":  # a GPU/TPU: the large env batches it is for, and where time goes
        for n in (8192,) if quick else (8192, 32768):  # quick: the issue's width only (a short device lease)
            for prec in ("fp32", "bf16"):  # train.precision: bf16 matmuls, and a rollout half the bytes
                r = fused_throughput(n, 128, chunks=chunks, updates_per_chunk=1, precision=prec)
                res[_width_key(n, prec)] = r
                extra[f"fused PPO env-steps/s at {n} envs x 128 steps, {prec}"] = (
                    f"{r['env_steps_per_s']:.0f} (mean return {r['mean_return']})")
                print(f"[bench] fused PPO {n}x128 {prec}: {r['env_steps_per_s']:.0f} env-steps/s", flush=True)
        best = max(("fp32", "bf16"), key=lambda p: res[_width_key(8192, p)]["env_steps_per_s"])
        res["profile_8192"] = split = profile_split(8192, 128, repeats=3, precision=best)
        _print_split(split)
        extra[f"one update at 8192 envs, {best}: time shares"] = ", ".join(f"{k} {v:.0%}" for k, v in split["share"].items())
        # quick: fp32 only; else bf16 too where it ran the wide batch faster (train.precision is a shape
        # knob, so a sweep over it is one program per value)
        for prec in dict.fromkeys(("fp32",) if quick else ("fp32", best)):
            pop = population_vs_alone(32, 256, 128, chunks=chunks, precision=prec)
            res["population_32" + ("" if prec == "fp32" else f"_{prec}")] = pop
            line = f"{pop['population_env_steps_per_s']:.0f} vs {pop['alone_env_steps_per_s']:.0f}: {pop['ratio']:.1f}x"
            extra[f"population of 32 x 256 envs vs one member alone, {prec} (aggregate env-steps/s)"] = line
            print(f"[bench] population of 32 x 256 envs vs one member alone, {prec}: {line}", flush=True)
    try:
        from raysys.workloads.hackmatrix_ppo.rllib_compare import measure_rllib_ppo

        from raysys import console

        with console.held_stderr():  # RLlib's deprecation and Ray core-worker lines: -v shows them
            rl = measure_rllib_ppo(seconds=45 if quick else 120)
        res["rllib"] = rl
        res["rllib_ratio"] = small["env_steps_per_s"] / rl["env_steps_per_s"]
        extra["RLlib PPO (gymnasium adapter) env-steps/s"] = f"{rl['env_steps_per_s']:.0f} -> raysys {res['rllib_ratio']:.1f}x"
    except ImportError:
        pass
    # speed never at the cost of learning: the quality column is each path's own training returns (unequal
    # updates, near a random policy's in --quick); parity is judged on the params the two paths reach
    parity = path_parity()
    res["parity"] = parity
    extra["params after 2 updates from one init, naive vs optimized"] = (
        f"{parity['max_param_diff']:.1e} apart, moved {parity['moved']:.1e} ({parity['shape']})")
    if parity_problems(parity):
        res["problems"] = parity_problems(parity)
    res["notes"] = ["quality: the mean return of each path's own training rollouts (the naive path's timed updates, "
                    "the optimized path's timed chunks), not a parity check; parity: the params both reach from one "
                    "init (judged)"]
    res["extra"] = extra
    return res


if __name__ == "__main__":  # python -m raysys.workloads.hackmatrix_ppo.bench --profile 256 2048 [--precision fp32 bf16] | --population 32
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.hackmatrix_ppo.bench",
                                 description="where one PPO update's time goes: env step, policy, learning")
    ap.add_argument("--profile", type=int, nargs="+", default=[256], metavar="NUM_ENVS",
                    help="split one update's time (env step | policy | learning) at each of these env counts")
    ap.add_argument("--steps", type=int, default=128, help="env steps per update")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls of each jitted program; the median is reported")
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"], help="train.precision(s)")
    ap.add_argument("--population", type=int, metavar="K", help="instead: K members at 256 envs as one program vs "
                                                                  "one member alone (aggregate env-steps/s)")
    ap.add_argument("--gpu-barriers", choices=["on", "off"], default="on",
                    help="the env's optimization barriers on a GPU (raysys.envs.hackmatrix.board.GPU_BARRIERS)")
    ap.add_argument("--feature-align", type=int, default=1,
                    help="model.feature_align: pad the network's input features to a multiple of this (16 on a GPU)")
    a = ap.parse_args()
    from raysys.envs.hackmatrix import board

    board.GPU_BARRIERS = a.gpu_barriers == "on"
    FEATURE_ALIGN = a.feature_align
    if a.population:
        for prec in a.precision:
            print(json.dumps(population_vs_alone(a.population, 256, a.steps, a.repeats, precision=prec)))
    else:
        for n in a.profile:
            for prec in a.precision:
                split = profile_split(n, a.steps, a.repeats, precision=prec)
                _print_split(split)
                print(json.dumps(split))
