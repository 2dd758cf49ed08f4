"""PPO on HackMatrix, PureJaxRL style: the whole update is one jitted function of ``lax.scan``s.

One update = ``num_steps`` vmapped env steps (auto-reset) -> GAE -> ``update_epochs`` x
``num_minibatches`` Adam steps. ``make_train_chunk`` scans ``updates_per_chunk`` updates inside
one jit, so Python only runs between chunks (logging, checkpoints).

Data parallel: the env batch is split over a 1-D device mesh (axis ``envs``) with ``shard_map``.
Every device rolls out and shuffles its own envs; gradients and advantage statistics are
averaged over the axis (``pmean``), so the replicated params stay identical everywhere. The same
code runs on one CPU, on 4 forced host devices, or on every chip of a multi-host TPU slice under
``jax.distributed`` (the mesh is built from the global ``jax.devices()``).

Each env carries its own PRNG key, so a trajectory does not depend on how envs are sharded.
The stored transition holds the observation the action was taken on (the original stored the
next one).

Population: every hyper-parameter that changes no array shape (:class:`HParams`) is an input of
the compiled update, not a constant baked into it. ``make_population_chunk`` ``vmap``s that same
update over a leading member axis of runners and hyper-parameters, so K configurations of one
shape train as one program (one compile), each with its own params, Adam state, envs and PRNG
streams; a member left out of ``active`` keeps its state unchanged.
"""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from raysys.envs import hackmatrix as hm
from raysys.workloads.hackmatrix_ppo.workload import check_devices  # noqa: F401  (pure: the driver checks too)

AXIS = "envs"


# --------------------------------------------------------------------------- network


def init_params(key, hidden: tuple[int, ...] = (256, 256), obs_dim: int = hm.OBS_SIZE, n_actions: int = hm.N_ACTIONS):
    """Shared MLP trunk, actor head (28 logits) and critic head; orthogonal init as in PureJaxRL."""
    sizes = (obs_dim, *hidden)
    keys = jax.random.split(key, len(hidden) + 2)
    ortho = jax.nn.initializers.orthogonal
    trunk = [{"w": ortho(math.sqrt(2))(k, (a, b)), "b": jnp.zeros(b)} for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
    actor = {"w": ortho(0.01)(keys[-2], (sizes[-1], n_actions)), "b": jnp.zeros(n_actions)}
    critic = {"w": ortho(1.0)(keys[-1], (sizes[-1], 1)), "b": jnp.zeros(1)}
    return {"trunk": trunk, "actor": actor, "critic": critic}


def forward(params, obs, mask, compute_dtype=jnp.float32):
    """-> (masked logits f32 [..., A], value f32 [...]). bf16 compute keeps fp32 params outside.
    Features zero-padded past the first layer's inputs (``model.feature_align``) meet zero rows."""
    x = obs.astype(compute_dtype)
    for i, layer in enumerate(params["trunk"]):
        w = layer["w"].astype(compute_dtype)
        if i == 0 and x.shape[-1] > w.shape[0]:
            w = jnp.pad(w, ((0, x.shape[-1] - w.shape[0]), (0, 0)))
        x = jax.nn.relu(x @ w + layer["b"].astype(compute_dtype))
    logits = (x @ params["actor"]["w"].astype(compute_dtype) + params["actor"]["b"].astype(compute_dtype)).astype(jnp.float32)
    value = (x @ params["critic"]["w"].astype(compute_dtype) + params["critic"]["b"].astype(compute_dtype))[..., 0]
    return jnp.where(mask, logits, -1e9), value.astype(jnp.float32)


# --------------------------------------------------------------------------- state


class Runner(NamedTuple):
    params: Any
    opt_state: Any
    env_state: Any  # [num_envs, ...] (sharded over the mesh)
    obs: Any  # hm.Obs with [num_envs, ...] leaves
    env_keys: jax.Array  # [num_envs, 2]: one PRNG stream per env
    key: jax.Array  # minibatch shuffling
    env_steps: jax.Array  # global env steps so far (for the LR schedule)


class Transition(NamedTuple):
    obs: jax.Array
    mask: jax.Array
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array
    ep_return: jax.Array
    ep_length: jax.Array


class HParams(NamedTuple):
    """The hyper-parameters that change no array shape, as f32 scalars (or [K] over a population)."""

    lr: jax.Array
    anneal_lr: jax.Array  # 1.0: linear decay to 0 over total_timesteps (rounded up to whole chunks: run_end)
    total_timesteps: jax.Array
    max_grad_norm: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_eps: jax.Array
    ent_coef: jax.Array
    vf_coef: jax.Array


def run_end(cfg) -> int:
    """The env steps a run trains: ``total_timesteps`` rounded up to whole chunks (a chunk is one compiled
    program). The LR anneals to 0 here, not at ``total_timesteps``: the updates past it would learn nothing."""
    per_chunk = cfg.train.updates_per_chunk * cfg.train.num_envs * cfg.train.num_steps
    return -(-cfg.train.total_timesteps // per_chunk) * per_chunk


def hparams_of(cfg) -> HParams:
    o, p = cfg.optim, cfg.ppo
    values = (o.lr, float(o.anneal_lr), run_end(cfg), o.max_grad_norm, p.gamma, p.gae_lambda,
              p.clip_eps, p.ent_coef, p.vf_coef)
    return HParams(*(np.float32(v) for v in values))


def stack_hparams(cfgs) -> HParams:
    return jax.tree.map(lambda *xs: np.stack(xs), *(hparams_of(c) for c in cfgs))


def _optimizer(lr, max_grad_norm):
    # the LR is injected per update (linear anneal by env steps), so a resumed run with another
    # num_envs/num_steps keeps the same schedule
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.inject_hyperparams(optax.adam)(learning_rate=lr, eps=1e-5))


def make_optimizer(cfg):
    return _optimizer(cfg.optim.lr, cfg.optim.max_grad_norm)


def make_mesh(devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (AXIS,))


def runner_specs() -> Runner:
    env = P(AXIS)
    return Runner(params=P(), opt_state=P(), env_state=env, obs=env, env_keys=env, key=P(), env_steps=P())


def runner_shardings(mesh: Mesh) -> Runner:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), runner_specs(), is_leaf=lambda x: isinstance(x, P))


def _build(cfg, key, params=None, opt_state=None, env_steps=0) -> Runner:
    """One runner from ``key``: fresh envs, PRNG streams and (unless given) params and Adam state."""
    n = cfg.train.num_envs
    k_params, k_envs, k_reset, k_run = jax.random.split(key, 4)
    if params is None:
        params = init_params(k_params, tuple(cfg.model.hidden))
        opt_state = make_optimizer(cfg).init(params)
    obs, env_state = jax.vmap(hm.reset, in_axes=(0, None))(jax.random.split(k_reset, n), env_params_of(cfg))
    return Runner(params, opt_state, env_state, obs, jax.random.split(k_envs, n), k_run, jnp.int32(env_steps))


def init_runner(cfg, key, mesh: Mesh, params=None, opt_state=None, env_steps: int = 0) -> Runner:
    """Fresh envs (and fresh params/optimizer unless given). Built inside one jit with sharded
    outputs, so every process of a multi-host run computes its own shard of the same arrays."""
    check_devices(cfg, mesh.size)
    out_shardings = runner_shardings(mesh)
    if params is None:  # the key an argument, not a constant: every seed runs one program (compiled once, cached)
        return jax.jit(lambda key: _build(cfg, key), out_shardings=out_shardings)(key)
    build = lambda params, opt_state: _build(cfg, key, params, opt_state, env_steps)  # noqa: E731
    return jax.jit(build, out_shardings=out_shardings)(*replicate((params, opt_state), mesh))


def replicate(tree, mesh: Mesh):
    """Host arrays -> replicated global arrays; works when the mesh spans several processes too."""
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), rep, lambda idx: np.asarray(x)[idx]), tree)


def env_params_of(cfg) -> hm.EnvParams:
    return hm.EnvParams(max_steps_in_episode=cfg.env.max_steps_in_episode)


# --------------------------------------------------------------------------- the update


def gae(rewards, values, dones, last_value, gamma: float, lam: float):
    """Generalized advantage estimates over time-major [T, N] arrays (``dones[t]``: the episode
    ended at step t, so step t does not bootstrap from t+1). Returns (advantages, returns)."""

    def body(carry, x):
        next_adv, next_value = carry
        r, v, d = x
        delta = r + gamma * next_value * (1.0 - d) - v
        adv = delta + gamma * lam * (1.0 - d) * next_adv
        return (adv, v), adv

    _, adv = jax.lax.scan(body, (jnp.zeros_like(last_value), last_value), (rewards, values, dones), reverse=True)
    return adv, adv + values


def minibatch_plan(cfg) -> tuple[int, int]:
    """(num_minibatches, update_epochs) of ``cfg``'s update (``TrainConfig.minibatch_plan``)."""
    return cfg.train.minibatch_plan()


def ppo_loss(params, mb: Transition, adv, targets, cfg, dtype=jnp.float32):
    """Clipped policy loss + clipped value loss - entropy bonus on one minibatch (advantages
    already normalised). -> (total, aux metrics). The fused update and the bench's Python loop
    both use it, so the two paths optimise the same objective."""
    pc = cfg.ppo
    logits, value = forward(params, mb.obs, mb.mask, dtype)
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, mb.action[:, None], axis=-1)[:, 0]
    # value loss clipped around the rollout's estimate, as in PureJaxRL/CleanRL
    v_clip = mb.value + jnp.clip(value - mb.value, -pc.clip_eps, pc.clip_eps)
    v_loss = 0.5 * jnp.maximum((value - targets) ** 2, (v_clip - targets) ** 2).mean()
    ratio = jnp.exp(logp - mb.logp)
    pg_loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - pc.clip_eps, 1 + pc.clip_eps) * adv).mean()
    probs = jnp.exp(logp_all)
    entropy = -jnp.sum(jnp.where(mb.mask, probs * logp_all, 0.0), axis=-1).mean()
    total = pg_loss + pc.vf_coef * v_loss - pc.ent_coef * entropy
    approx_kl = ((ratio - 1.0) - (logp - mb.logp)).mean()
    clipfrac = (jnp.abs(ratio - 1.0) > pc.clip_eps).mean()
    return total, dict(policy_loss=pg_loss, value_loss=v_loss, entropy=entropy, approx_kl=approx_kl, clipfrac=clipfrac)


def feature_width(cfg) -> int:
    """The network's input width: the observation's features, padded to ``model.feature_align``."""
    align = cfg.model.feature_align
    return -(-hm.OBS_SIZE // align) * align


def make_rollout(cfg):
    """``rollout(params, env_state, obs, env_keys) -> ((params, env_state, obs, env_keys), traj)``: the
    ``num_steps`` policy + env steps of one update as one ``lax.scan`` (the first half of
    ``make_update``'s update; the bench's profile times it alone)."""
    dtype = jnp.bfloat16 if cfg.train.precision == "bf16" else jnp.float32
    env_params = env_params_of(cfg)
    vstep = jax.vmap(hm.step, in_axes=(0, 0, 0, None))

    def env_step(carry, _):
        weights, env_state, obs, env_keys = carry
        ks = jax.vmap(lambda k: jax.random.split(k, 3))(env_keys)
        env_keys, k_act, k_env = ks[:, 0], ks[:, 1], ks[:, 2]
        logits, value = forward(weights, obs.features, obs.action_mask, dtype)
        action = jax.vmap(jax.random.categorical)(k_act, logits)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
        next_obs, env_state, reward, done, info = vstep(k_env, env_state, action, env_params)
        # The per-env numbers travel as one [envs, 7] float32 row: the scan writes each output
        # into its [num_steps, ...] stack with a kernel of its own, so seven stacks cost seven
        # kernels a step. Exact: actions and episode lengths are far below 2**24.
        numbers = jnp.stack([action.astype(jnp.float32), logp, value, reward, done.astype(jnp.float32),
                             info["episode_return"], info["episode_length"].astype(jnp.float32)], axis=-1)
        return (weights, env_state, in_dtype(next_obs), env_keys), (obs.features, obs.action_mask, numbers)

    # The network reads observations and weights only in the compute dtype, so the loop carries
    # them so: in bf16 the step writes its 1,545 features once, at half the bytes, and the rollout's
    # largest array (num_steps x num_envs x 1,545) and every epoch's shuffle of it move half the
    # bytes; the weights are cast once per rollout, not once per step. The loss is the same.
    # model.feature_align > 1 pads them here too, so the stored rows are already the matmul's width.
    width = feature_width(cfg)

    def in_dtype(obs):
        x = obs.features.astype(dtype)
        return obs._replace(features=jnp.pad(x, ((0, 0), (0, width - x.shape[-1]))) if width > x.shape[-1] else x)

    def rollout(params, env_state, obs, env_keys):
        weights = jax.tree.map(lambda w: w.astype(dtype), params)
        w0 = weights["trunk"][0]["w"]  # padded once here, not in every step's forward
        weights["trunk"][0]["w"] = jnp.pad(w0, ((0, width - w0.shape[0]), (0, 0)))
        (_, env_state, last, env_keys), (features, mask, numbers) = jax.lax.scan(
            env_step, (weights, env_state, in_dtype(obs), env_keys), None, cfg.train.num_steps)
        action, logp, value, reward, done, ep_return, ep_length = jnp.moveaxis(numbers, -1, 0)
        traj = Transition(features, mask, action.astype(jnp.int32), logp, value, reward, done, ep_return,
                          ep_length.astype(jnp.int32))
        # the runner keeps float32 features (exactly the compute dtype's values), unpadded
        last = last._replace(features=last.features[..., :obs.features.shape[-1]].astype(obs.features.dtype))
        return (params, env_state, last, env_keys), traj

    return rollout


def make_update(cfg, n_devices: int):
    """``update(runner, hp) -> (runner, stats)``: one PPO update on this device's envs (called inside
    shard_map over AXIS). ``cfg`` fixes the shapes; ``hp`` (:class:`HParams`) the rest."""
    tc = cfg.train
    dtype = jnp.bfloat16 if tc.precision == "bf16" else jnp.float32
    nmb, epochs = minibatch_plan(cfg)
    local_envs = tc.num_envs // n_devices
    steps_per_update = tc.num_envs * tc.num_steps
    rollout = make_rollout(cfg)

    def sgd_step(carry, rows):
        params, opt_state, hp, flat = carry
        # gather this minibatch's rows here: permuting the whole batch first wrote and read every
        # epoch an extra copy of it (3.2 GB of bf16 observations at 8,192 envs x 128 steps)
        mb, adv, targets = jax.tree.map(lambda x: x[rows], flat)
        loss_fn = partial(ppo_loss, cfg=SimpleNamespace(ppo=hp), dtype=dtype)
        optimizer = _optimizer(hp.lr, hp.max_grad_norm)
        # advantage normalisation with statistics over the whole minibatch across devices
        mean = jax.lax.pmean(adv.mean(), AXIS)
        std = jnp.sqrt(jax.lax.pmean(((adv - mean) ** 2).mean(), AXIS))
        adv = (adv - mean) / (std + 1e-8)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, adv, targets)
        grads = jax.lax.pmean(grads, AXIS)  # the data-parallel all-reduce
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        aux = dict(aux, loss=loss, grad_norm=optax.tree.norm(grads))
        return (params, opt_state, hp, flat), aux

    def epoch(carry, key):
        params, opt_state, hp, traj, adv, targets = carry
        n = tc.num_steps * local_envs
        flat = jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), (traj, adv, targets))
        rows = jax.random.permutation(key, n).reshape(nmb, n // nmb)
        (params, opt_state, hp, _), aux = jax.lax.scan(sgd_step, (params, opt_state, hp, flat), rows)
        return (params, opt_state, hp, traj, adv, targets), aux

    def update(runner: Runner, hp: HParams):
        frac = 1.0 - runner.env_steps.astype(jnp.float32) / hp.total_timesteps
        lr = jnp.where(hp.anneal_lr > 0, hp.lr * jnp.clip(frac, 0.0, 1.0), hp.lr)
        hp = hp._replace(lr=lr)
        opt_state = runner.opt_state
        opt_state[1].hyperparams["learning_rate"] = lr
        (params, env_state, obs, env_keys), traj = rollout(runner.params, runner.env_state, runner.obs, runner.env_keys)
        _, last_value = forward(params, obs.features, obs.action_mask, dtype)
        adv, targets = gae(traj.reward, traj.value, traj.done, last_value, hp.gamma, hp.gae_lambda)
        key, k_epochs = jax.random.split(runner.key)
        (params, opt_state, _, _, _, _), aux = jax.lax.scan(
            epoch, (params, opt_state, hp, traj, adv, targets), jax.random.split(k_epochs, epochs))
        episodes = jax.lax.psum(traj.done.sum(), AXIS)
        stats = {k: jax.lax.pmean(v.mean(), AXIS) for k, v in aux.items()}
        stats |= dict(
            episodes=episodes,
            return_sum=jax.lax.psum(traj.ep_return.sum(), AXIS),
            length_sum=jax.lax.psum(traj.ep_length.sum().astype(jnp.float32), AXIS),
            reward_mean=jax.lax.pmean(traj.reward.mean(), AXIS),
            lr=lr,
        )
        new = Runner(params, opt_state, env_state, obs, env_keys, key, runner.env_steps + steps_per_update)
        return new, stats

    return update


def _chunk_stats(stats) -> dict:
    """Per-update stats [U, ...] -> chunk means (episode stats: chunk totals)."""
    sums = {k: stats[k].sum(0) for k in ("episodes", "return_sum", "length_sum")}
    means = {k: v.mean(0) for k, v in stats.items() if k not in sums}
    return {**means, **sums, "lr_last": stats["lr"][-1]}


def make_train_chunk(cfg, mesh: Mesh):
    """jit((runner, hp) -> (runner, metrics)): ``updates_per_chunk`` PPO updates in one ``lax.scan``,
    the env batch split over ``mesh``. Metrics are chunk means (episode stats: chunk totals)."""
    update = make_update(cfg, mesh.size)

    def chunk(runner: Runner, hp: HParams):
        runner, stats = jax.lax.scan(lambda r, _: update(r, hp), runner, None, cfg.train.updates_per_chunk)
        return runner, _chunk_stats(stats)

    sharded = jax.shard_map(chunk, mesh=mesh, in_specs=(runner_specs(), P()), out_specs=(runner_specs(), P()),
                            check_vma=False)
    return jax.jit(sharded, donate_argnums=0)


def population_specs() -> Runner:
    """A population's runners: a leading member axis, envs still split over the mesh."""
    return jax.tree.map(lambda spec: P(None, *spec), runner_specs(), is_leaf=lambda x: isinstance(x, P))


def population_shardings(mesh: Mesh) -> Runner:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), population_specs(), is_leaf=lambda x: isinstance(x, P))


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def init_runners(cfg, keys, mesh: Mesh) -> list[Runner]:
    """Fresh runners of ``cfg``'s shape, one per key: ``init_runner``'s program, compiled once."""
    check_devices(cfg, mesh.size)
    one = jax.jit(lambda key: _build(cfg, key), out_shardings=runner_shardings(mesh))
    return [one(k) for k in keys]


def init_population(cfg, keys, mesh: Mesh) -> Runner:
    """Fresh runners for K members of ``cfg``'s shape, member i from ``keys[i]``, stacked. Not a
    vmap: a vmapped orthogonal init (batched QR) wedges this jaxlib's multi-threaded CPU runtime."""
    return stack_runners(init_runners(cfg, keys, mesh), mesh)


def stack_runners(runners: list[Runner], mesh: Mesh) -> Runner:
    return jax.jit(_stack, out_shardings=population_shardings(mesh))(runners)


def make_population_chunk(cfg, mesh: Mesh):
    """jit((runners, hps, active) -> (runners, metrics)): the same chunk as ``make_train_chunk`` for K
    members at once (leading axis K on runners, hps and every metric). ``cfg`` gives the shapes all
    members share; a member with ``active`` False keeps its state (masked, not stopped)."""
    update = jax.vmap(make_update(cfg, mesh.size))

    def chunk(runners: Runner, hps: HParams, active: jax.Array):
        def step(r, _):
            new, stats = update(r, hps)
            keep = lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)  # noqa: E731
            return jax.tree.map(keep, new, r), stats

        runners, stats = jax.lax.scan(step, runners, None, cfg.train.updates_per_chunk)
        return runners, _chunk_stats(stats)

    sharded = jax.shard_map(chunk, mesh=mesh, in_specs=(population_specs(), P(), P()),
                            out_specs=(population_specs(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=0)
