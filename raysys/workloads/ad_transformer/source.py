"""The source algorithm whose learning histories the transformer distils: PPO learning one Darkroom goal
from scratch, for every goal at once.

The original ran stable-baselines3 PPO once per goal (100 envs, n_steps 20, minibatch 50, 20 epochs,
lr 3e-4, 100k steps) in 8 processes. Here each goal is one member of a population: params, Adam state,
envs and PRNG stream are stacked on a leading goal axis, one update is ``vmap``ped over goals (and over
the streams inside it), and ``lax.scan`` runs updates back to back, so all 81 learners are one jitted
program. Goals are sharded over the devices (learners never talk to each other, so no collective is
needed). The PPO pieces (network, GAE, clipped loss) are hackmatrix_ppo's.

History layout (:class:`Histories`): ``[goal, stream, step]``, a stream's steps in the order it took
them across the whole run (1000 = 50 episodes at the defaults), with the real next cell of each step
(the original stored the next episode's first cell after the last step).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from raysys.envs import darkroom as dr
from raysys.workloads.ad_transformer.histories import Histories, SourceConfig
from raysys.workloads.hackmatrix_ppo.ppo import forward, gae, init_params, ppo_loss

N_FEATURES = 2 * dr.SIZE  # one-hot row and one-hot column


class Learner(NamedTuple):
    params: Any
    opt_state: Any
    env_state: Any  # dr.EnvState with [S] leaves
    obs: jax.Array  # int32[S, 2]
    key: jax.Array


def features(obs):
    """(row, col) -> one-hot row ++ one-hot column (float32[..., 18])."""
    return jnp.concatenate([jax.nn.one_hot(obs[..., 0], dr.SIZE), jax.nn.one_hot(obs[..., 1], dr.SIZE)], -1)


class HParams(NamedTuple):
    """The source PPO's shape-free hyper-parameters as arrays: an argument of the update, so the
    members of a population (``ad_source`` sweeps, ``--vectorize``) can each have their own."""

    lr: jax.Array
    max_grad_norm: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_eps: jax.Array
    vf_coef: jax.Array
    ent_coef: jax.Array


def hparams_of(c: SourceConfig) -> HParams:
    return HParams(*(np.float32(getattr(c, f)) for f in HParams._fields))


def stack_hparams(cs) -> HParams:
    return HParams(*(np.stack(xs) for xs in zip(*(hparams_of(c) for c in cs))))


def _optimizer(lr, max_grad_norm):
    # its state (Adam moments, step count) does not depend on either value, so one init serves all
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(lr, eps=1e-5))


def make_learner_fns(c: SourceConfig) -> tuple[Callable, Callable]:
    """(init(key, goal) -> Learner, update(learner, goal, hp) -> (learner, (record, mean_return))) of ONE
    goal's learner; the caller vmaps them over goals (and over a population's members). ``c`` gives
    the shapes (streams, n_steps, minibatch, epochs, hidden); ``hp`` (:class:`HParams`) the rest."""
    all_legal = jnp.ones(dr.N_ACTIONS, bool)
    n_mb = c.streams * c.n_steps // c.minibatch

    def env_params(goal):
        return dr.EnvParams(jnp.stack([goal // dr.SIZE, goal % dr.SIZE]))

    def init(key, goal):
        k_params, k_run = jax.random.split(key)
        params = init_params(k_params, c.hidden, N_FEATURES, dr.N_ACTIONS)
        obs, state = jax.vmap(lambda _: dr.reset(None, env_params(goal)))(jnp.arange(c.streams))
        return Learner(params, _optimizer(c.lr, c.max_grad_norm).init(params), state, obs, k_run)

    def update(learner: Learner, goal, hp: HParams):
        params_env = env_params(goal)
        optimizer = _optimizer(hp.lr, hp.max_grad_norm)
        loss_cfg = SimpleNamespace(ppo=SimpleNamespace(clip_eps=hp.clip_eps, vf_coef=hp.vf_coef, ent_coef=hp.ent_coef))
        vstep = jax.vmap(dr.step, in_axes=(None, 0, 0, None))

        def env_step(carry, _):
            env_state, obs, key = carry
            key, k_act = jax.random.split(key)
            logits, value = forward(learner.params, features(obs), all_legal)
            action = jax.random.categorical(k_act, logits)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
            next_obs, env_state, reward, done, info = vstep(None, env_state, action, params_env)
            out = dict(obs=obs, action=action, logp=logp, value=value, reward=reward, done=done.astype(jnp.float32),
                       next_obs=info["next_obs"], ep_return=info["episode_return"])
            return (env_state, next_obs, key), out

        (env_state, obs, key), t = jax.lax.scan(env_step, (learner.env_state, learner.obs, learner.key), None,
                                                c.n_steps)
        _, last_value = forward(learner.params, features(obs), all_legal)
        adv, targets = gae(t["reward"], t["value"], t["done"], last_value, hp.gamma, hp.gae_lambda)
        n = c.n_steps * c.streams
        flat = jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]),
                            dict(obs=features(t["obs"]), action=t["action"], logp=t["logp"], value=t["value"],
                                 adv=adv, targets=targets))

        def sgd_step(carry, mb):
            params, opt_state = carry
            a = (mb["adv"] - mb["adv"].mean()) / (mb["adv"].std() + 1e-8)  # per minibatch, as sb3
            batch = SimpleNamespace(obs=mb["obs"], mask=all_legal, action=mb["action"], logp=mb["logp"],
                                    value=mb["value"])
            grads = jax.grad(lambda p: ppo_loss(p, batch, a, mb["targets"], loss_cfg)[0])(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        def epoch(carry, k):
            # one gather per epoch, then minibatches are plain slices
            perm = jax.random.permutation(k, n)
            mbs = jax.tree.map(lambda x: x[perm].reshape((n_mb, c.minibatch) + x.shape[1:]), flat)
            return jax.lax.scan(sgd_step, carry, mbs)[0], None

        key, k_epochs = jax.random.split(key)
        (params, opt_state), _ = jax.lax.scan(epoch, (learner.params, learner.opt_state),
                                              jax.random.split(k_epochs, c.epochs))
        # [S, n_steps] in stream-major order, compact dtypes: this is what the dataset keeps
        record = dict(states=t["obs"].swapaxes(0, 1).astype(jnp.int8), actions=t["action"].T.astype(jnp.int8),
                      rewards=t["reward"].T.astype(jnp.int8), next_states=t["next_obs"].swapaxes(0, 1).astype(jnp.int8))
        mean_return = t["ep_return"].sum() / jnp.maximum(t["done"].sum(), 1.0)
        return Learner(params, opt_state, env_state, obs, key), (record, mean_return)

    return init, update


def goal_keys(seed: int, goals) -> jax.Array:
    """Each goal's own PRNG stream of ``seed``."""
    return jax.vmap(lambda g: jax.random.fold_in(jax.random.PRNGKey(seed), g))(jnp.asarray(goals, jnp.int32))


def init_learners(c: SourceConfig, goals, sharding=None) -> Learner:
    """One fresh learner per goal (leading axis G), from ``c.seed``."""
    init, _ = make_learner_fns(c)
    goals = jnp.asarray(goals, jnp.int32)
    return jax.jit(jax.vmap(init), out_shardings=sharding)(goal_keys(c.seed, goals), goals)


def _goal_updates(c: SourceConfig, k: int) -> Callable:
    """(learners [G], goals [G], hp) -> (learners, (records [k, G, ...], mean returns [k, G])): ``k``
    updates of every goal's learner, back to back."""
    _, update = make_learner_fns(c)
    per_goal = jax.vmap(update, in_axes=(0, 0, None))
    return lambda learners, goals, hp: jax.lax.scan(lambda lr, _: per_goal(lr, goals, hp), learners, None, k)


def _masked(n, new, old):
    """``new`` where ``n`` (a scalar, or one flag per leading-axis entry) is true, else ``old``."""
    return jax.tree.map(lambda x, y: jnp.where(jnp.reshape(n, jnp.shape(n) + (1,) * (x.ndim - jnp.ndim(n))), x, y),
                        new, old)


def _scan_chunk(c: SourceConfig, update: Callable) -> Callable:
    """jit((learners, goals, hp, n) -> (learners, returns [k, ...])): ``k = c.updates_per_call`` calls of
    the batched ``update``, of which only the first ``n`` (a scalar, or one per member) change the
    learners; one program serves a run's shorter last chunk and masked members."""

    def chunk(learners, goals, hp, n):
        def step(lr, j):
            new, (_, ret) = update(lr, goals, hp)
            return _masked(j < n, new, lr), ret

        return jax.lax.scan(step, learners, jnp.arange(c.updates_per_call))

    return jax.jit(chunk, donate_argnums=0)


def make_chunk(c: SourceConfig) -> Callable:
    """jit((learners [G], goals, hp, n) -> (learners, mean returns [k, G])): ``k = c.updates_per_call``
    updates of one setting, of which only the first ``n`` change the learners (the run's last chunk
    may need fewer; one program serves both). Histories are not kept."""
    _, update = make_learner_fns(c)
    return _scan_chunk(c, jax.vmap(update, in_axes=(0, 0, None)))


def make_population_chunk(c: SourceConfig) -> Callable:
    """jit((learners [K, G], goals, hps [K], n [K]) -> (learners, mean returns [k, K, G])): the same
    chunk for K settings of ``c``'s shapes at once, each with its own hyper-parameters (``vmap`` over
    members of the ``vmap`` over goals) and its own ``n``: a member with ``n == 0`` keeps its state
    (masked, not stopped)."""
    _, update = make_learner_fns(c)
    return _scan_chunk(c, jax.vmap(jax.vmap(update, in_axes=(0, 0, None)), in_axes=(0, None, 0)))


def generate(c: SourceConfig, goals, devices=None, progress: Optional[Callable[[int, int], None]] = None) -> Histories:
    """Run one PPO learner per goal, all at once; -> their learning histories. ``progress(done, total)``
    is called between jitted calls."""
    c.validate()
    goals = np.asarray(goals, np.int32)
    devices = jax.devices() if devices is None else devices
    # goals are sharded over the devices; pad to a multiple with copies, dropped at the end
    pad = (-len(goals)) % len(devices)
    padded = jnp.asarray(np.concatenate([goals, goals[:pad]]))
    shard = NamedSharding(Mesh(np.asarray(devices), ("goals",)), P("goals")) if len(devices) > 1 else None
    goals_dev = jax.device_put(padded, shard) if shard is not None else padded
    learners = init_learners(c, padded, shard)
    run = jax.jit(lambda lr, g, hp, k: _goal_updates(c, k)(lr, g, hp), static_argnums=3)
    hp = hparams_of(c)
    records, curves, done = [], [], 0
    while done < c.updates:
        k = min(c.updates_per_call, c.updates - done)
        learners, (rec, ret) = run(learners, goals_dev, hp, k)
        records.append(jax.device_get(rec))  # [k, G, S, n_steps, ...]
        curves.append(np.asarray(ret))
        done += k
        if progress:
            progress(done, c.updates)
    G = len(goals)

    def join(name):  # [U, G, S, n, ...] -> [G, S, U * n, ...]
        x = np.concatenate([r[name] for r in records])[:, :G]
        x = np.moveaxis(x, 0, 2)
        return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])

    return Histories(goals, join("states"), join("actions"), join("rewards"), join("next_states"),
                     np.concatenate(curves)[:, :G].T.astype(np.float32))


def final_return(h: Histories, last_updates: int = 5) -> np.ndarray:
    """Each goal's mean episode return over its last ``last_updates`` updates."""
    return h.returns[:, -last_updates:].mean(1)


def timed_generate(c: SourceConfig, goals, **kw) -> tuple[Histories, dict]:
    """generate() plus its timing: compile and run apart, env-steps/s of the run (compile included and not)."""
    t0 = time.perf_counter()
    h = generate(c, goals, **kw)
    wall = time.perf_counter() - t0
    steps = len(goals) * c.updates * c.streams * c.n_steps
    return h, {"env_steps": steps, "wall_s": wall, "env_steps_per_s": steps / wall}
