"""Rollout actors for RL workloads whose environments are Python (gymnasium / NeuroGym).

A :class:`RolloutPool` owns ``num_actors`` Ray actors. Each actor steps a gymnasium vector env
of ``envs_per_actor`` copies and a CPU copy of the policy, batching one policy call over all of
its envs per step. The learner talks to the pool with three calls:

    pool.set_weights(model.state_dict())          # one ray.put, every actor reads that object
    batches = pool.sample(steps_per_call, eps)    # one dict of [steps, envs, ...] arrays per actor
    wait = pool.sample_async(steps_per_call, eps) # ... or overlap sampling with learning: wait()
    pool.num_restarts                             # dead actors replaced so far

The policy is any ``torch.nn.Module`` (built in the actor by a picklable factory) with

    act(obs [N, D], state, episode_start [N] bool, epsilon, generator) -> (actions [N], state')
    init_state(N, device) -> state          # optional; stateless policies get state=None

which is what :class:`raysys.workloads.mpn_dqn.model.MPNDQN` provides. Envs and recurrent state
live in the actor between calls, so consecutive ``sample`` calls continue the same episodes.

Throughput choices (this file is the only place these workloads touch Ray):
* one remote call per actor per ``sample`` (all issued before any is awaited), each returning
  ``steps_per_call`` x ``envs_per_actor`` transitions as a few contiguous numpy arrays;
* per step only the unavoidable work: one batched policy call and one vector-env step writing
  into preallocated arrays (no per-step dicts or lists); per-env info dicts are dropped by a
  wrapper (``drop_info``) because gymnasium's vector env spends as long merging them as the
  NeuroGym step itself; final observations come from SAME_STEP autoreset;
* the recurrent state, when returned, is float16 by default (it is [H, D] per transition).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Literal, Optional, Protocol, Sequence

import gymnasium as gym
import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from raysys.rl import env_state

log = logging.getLogger(__name__)

EnvFactory = Callable[[], gym.Env]
PolicyFactory = Callable[[], torch.nn.Module]  # the module must implement RecurrentPolicy


class RecurrentPolicy(Protocol):
    """What a rollout policy module provides (``init_state(n, device)`` too, if recurrent)."""

    def act(
        self,
        obs: torch.Tensor,
        state: Any,
        episode_start: torch.Tensor,
        epsilon: float,
        generator: Optional[torch.Generator] = None,
    ) -> tuple[torch.Tensor, Any]: ...


# Episode ids are actor_uid * 2**32 + the actor's own episode counter: unique across actors and
# across replacement actors (each gets a fresh uid) without any coordination.
_EP_STRIDE = 1 << 32


class _DropInfo(gym.Wrapper):
    """Return empty info dicts; the rollout never reads them (final obs come from the vector
    env's SAME_STEP autoreset), and merging them costs ~10 us per env per step."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, reward, terminated, truncated, {}

    def reset(self, **kwargs):
        obs, _ = self.env.reset(**kwargs)
        return obs, {}


class _Stateful(gym.Wrapper):
    """``raysys_state``: the env's data (:mod:`raysys.rl.env_state`), read and written through the
    vector env's ``get_attr`` / ``set_attr``, so sync and async (subprocess) envs work alike."""

    @property
    def raysys_state(self) -> dict:
        return env_state.capture(self.env)

    @raysys_state.setter
    def raysys_state(self, state: dict) -> None:
        env_state.apply(self.env, state)


def _build_env(env_factory: EnvFactory, drop_info: bool) -> gym.Env:
    env = env_factory()
    return _Stateful(_DropInfo(env) if drop_info else env)


def _like_layout(x: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty [T, *x.shape] tensor whose memory order per step matches x's strides, so the
    per-step ``copy_`` is a straight (converting) memcpy. MPN states are [N, H, D] views of
    [N, D, H] memory; a [T, N, H, D]-contiguous buffer would make every step a transposing
    fp16 conversion (measured 17 us vs 8 us per step for 8 envs)."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost dim first
    buf = torch.empty((T, *(x.shape[d] for d in order)), dtype=dtype)
    inverse = [order.index(d) for d in range(x.dim())]
    return buf.permute(0, *(1 + i for i in inverse))


class RolloutWorker:
    """The actor body (plain class: also usable in-process for debugging and unit tests)."""

    def __init__(
        self,
        env_factory: EnvFactory,
        policy_factory: PolicyFactory,
        envs_per_actor: int = 8,
        vector_mode: Literal["sync", "async"] = "sync",
        state_dtype: Optional[str] = "float16",
        seed: int = 0,
        uid: int = 0,
        weights: Optional[dict] = None,
        weights_version: int = -1,
        torch_threads: int = 1,
        drop_info: bool = True,
    ):
        # Small per-step batches: extra intra-op threads only add sync cost, and actors share
        # the machine's cores with each other and the learner.
        torch.set_num_threads(torch_threads)
        self.uid, self.n = uid, envs_per_actor
        fns = [functools.partial(_build_env, env_factory, drop_info)] * envs_per_actor
        same_step = gym.vector.AutoresetMode.SAME_STEP
        if vector_mode == "sync":
            self.envs = gym.vector.SyncVectorEnv(fns, copy=False, autoreset_mode=same_step)
        elif vector_mode == "async":
            self.envs = gym.vector.AsyncVectorEnv(fns, copy=False, autoreset_mode=same_step)
        else:
            raise ValueError(f"vector_mode must be 'sync' or 'async', got {vector_mode!r}")
        # (pool seed, actor uid) -> independent env and exploration seeds; a replacement actor
        # has a new uid, so it never replays the dead actor's trials.
        env_seeds = np.random.SeedSequence((seed, uid)).generate_state(envs_per_actor + 1, np.uint32)
        self.obs, _ = self.envs.reset(seed=[int(s) for s in env_seeds[:-1]])
        self.obs = np.array(self.obs, dtype=np.float32)
        self.obs_dim = int(np.prod(self.obs.shape[1:]))  # flat Box observations

        self.policy = policy_factory().cpu().eval()
        self.weights_version = -1
        if weights is not None:
            self.set_weights(weights, weights_version)
        self.generator = torch.Generator().manual_seed(int(env_seeds[-1]))
        init = getattr(self.policy, "init_state", None)
        self.state = init(envs_per_actor, "cpu") if init is not None else None
        self.state_dtype = None if state_dtype is None or self.state is None else getattr(torch, state_dtype)

        self.episode_start = np.ones(envs_per_actor, bool)
        self.next_episode = envs_per_actor
        self.episode_id = uid * _EP_STRIDE + np.arange(envs_per_actor, dtype=np.int64)
        self.ep_return = np.zeros(envs_per_actor, np.float64)
        self.ep_len = np.zeros(envs_per_actor, np.int64)

    def set_weights(self, weights: dict, version: int = 0) -> int:
        # Ray hands over read-only numpy views of the shared object; load_state_dict copies them
        self.policy.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
        self.weights_version = version
        return version

    def ready(self) -> int:
        return self.uid

    def sample(self, steps: int, epsilon: float = 0.0) -> dict[str, Any]:
        T, N, D = steps, self.n, self.obs_dim
        obs = np.empty((T, N, D), np.float32)
        next_obs = np.empty((T, N, D), np.float32)
        action = np.empty((T, N), np.int64)
        reward = np.empty((T, N), np.float32)
        terminated = np.empty((T, N), bool)
        truncated = np.empty((T, N), bool)
        episode_id = np.empty((T, N), np.int64)
        state_out = None
        if self.state_dtype is not None:
            state_out = _like_layout(self.state, T, self.state_dtype)
        done_ids, done_returns, done_lengths = [], [], []

        policy, envs, gen = self.policy, self.envs, self.generator
        state, cur_obs, start = self.state, self.obs, self.episode_start
        with torch.inference_mode():
            for t in range(T):
                obs[t] = cur_obs.reshape(N, D)
                if state_out is not None:
                    # the state the policy acts from at step t (zero at an episode's first step)
                    state_out[t].copy_(state)
                    if start.any():
                        state_out[t, torch.from_numpy(start)] = 0
                # obs[t] (our float32 copy) rather than the env's buffer: fixed dtype for the policy
                acts, state = policy.act(torch.from_numpy(obs[t]), state, torch.from_numpy(start), epsilon, gen)
                a = acts.numpy()
                cur_obs, r, term, trunc, info = envs.step(a)
                action[t], reward[t], terminated[t], truncated[t] = a, r, term, trunc
                episode_id[t] = self.episode_id
                next_obs[t] = cur_obs.reshape(N, D)
                self.ep_return += r
                self.ep_len += 1
                start = term | trunc
                if start.any():
                    for i in np.flatnonzero(start):
                        # SAME_STEP autoreset: cur_obs[i] is already the next episode's first obs
                        next_obs[t, i] = np.asarray(info["final_obs"][i]).reshape(D)
                        done_ids.append(self.episode_id[i])
                        done_returns.append(self.ep_return[i])
                        done_lengths.append(self.ep_len[i])
                        self.episode_id[i] = self.uid * _EP_STRIDE + self.next_episode
                        self.next_episode += 1
                    self.ep_return[start] = 0.0
                    self.ep_len[start] = 0
        self.state, self.obs, self.episode_start = state, cur_obs, start

        out = {
            "obs": obs, "action": action, "reward": reward, "next_obs": next_obs,
            "terminated": terminated, "truncated": truncated, "done": terminated | truncated,
            "episode_id": episode_id,
            "episode_returns": np.asarray(done_returns, np.float64),
            "episode_lengths": np.asarray(done_lengths, np.int64),
            "episode_ids_done": np.asarray(done_ids, np.int64),
            "actor_uid": self.uid,
            "weights_version": self.weights_version,
        }
        if state_out is not None:
            out["state"] = state_out.numpy()
        return out

    # What a checkpoint needs to continue these episodes exactly: the envs' data, the policy's
    # recurrent state, observations, episode bookkeeping and the exploration generator. Only
    # plain data (tensors, numbers, tagged tuples), so checkpoints load with weights_only=True.
    _ARRAYS = ("obs", "episode_start", "episode_id", "ep_return", "ep_len")

    def get_state(self) -> dict[str, Any]:
        return {"envs": list(self.envs.get_attr("raysys_state")),
                **{k: env_state.encode(getattr(self, k)) for k in self._ARRAYS},
                "state": self.state, "generator": self.generator.get_state(),
                "next_episode": self.next_episode, "uid": self.uid, "n": self.n}

    def set_state(self, st: dict[str, Any]) -> None:
        if st["n"] != self.n:
            raise env_state.EnvStateMismatch(f"saved {st['n']} envs per actor, this worker has {self.n}")
        self.envs.set_attr("raysys_state", st["envs"])
        for k in self._ARRAYS:
            setattr(self, k, env_state.decode(st[k]))
        self.state = st["state"]
        self.generator.set_state(st["generator"])
        self.next_episode, self.uid = st["next_episode"], st["uid"]

    def close(self) -> None:
        self.envs.close()


class RolloutPool:
    """``num_actors`` rollout actors; see the module docstring. Needs ``ray.init`` first."""

    def __init__(
        self,
        env_factory: EnvFactory,
        policy_factory: PolicyFactory,
        num_actors: int = 2,
        envs_per_actor: int = 8,
        vector_mode: Literal["sync", "async"] = "sync",
        steps_per_call: int = 64,
        num_cpus_per_actor: float = 0.5,
        state_dtype: Optional[str] = "float16",
        seed: int = 0,
        torch_threads: int = 1,
        drop_info: bool = True,
        max_restarts: int = 100,
    ):
        self.steps_per_call = steps_per_call
        self.num_restarts, self.max_restarts = 0, max_restarts
        self.weights_version = -1
        self._seed = seed
        self._weights_ref: Optional[ray.ObjectRef] = None
        self._next_uid = 0
        self._kw = dict(
            env_factory=env_factory, policy_factory=policy_factory, envs_per_actor=envs_per_actor,
            vector_mode=vector_mode, state_dtype=state_dtype, torch_threads=torch_threads, drop_info=drop_info,
        )
        # max_restarts=0: the pool replaces dead actors itself (fresh seeds, latest weights).
        self._cls = ray.remote(num_cpus=num_cpus_per_actor, max_restarts=0)(RolloutWorker)
        self.actors = [self._spawn() for _ in range(num_actors)]
        ray.get([a.ready.remote() for a in self.actors])

    # ------------------------------------------------------------------ actors

    def _spawn(self):
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        # Pass the ref itself (top-level argument): Ray hands the actor the stored object.
        return self._cls.remote(**self._kw, seed=self._seed, uid=uid, weights=self._weights_ref,
                                weights_version=self.weights_version)

    def _replace(self, i: int, err: BaseException) -> None:
        self.num_restarts += 1
        if self.num_restarts > self.max_restarts:
            raise RuntimeError(f"rollout actors died {self.num_restarts} times (max_restarts={self.max_restarts})") from err
        log.warning("rollout actor %d died (%s: %s); starting a replacement (restart %d)",
                    i, type(err).__name__, str(err).splitlines()[0] if str(err) else "", self.num_restarts)
        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:  # already gone
            pass
        self.actors[i] = self._spawn()

    def _call_all(self, method: str, *args) -> list:
        """Call ``method`` on every actor at once; replace and retry actors that died."""
        return self._collect([getattr(a, method).remote(*args) for a in self.actors], method, args)

    def _collect(self, refs: list, method: str, args: tuple) -> list:
        try:
            return ray.get(refs)  # fast path: one wait for all
        except RayActorError:
            pass
        out = []
        for i, ref in enumerate(refs):
            while True:
                try:
                    out.append(ray.get(ref))
                    break
                except RayActorError as e:
                    self._replace(i, e)
                    ref = getattr(self.actors[i], method).remote(*args)
        return out

    # ------------------------------------------------------------------ API

    def set_weights(self, state_dict: dict) -> int:
        """Broadcast weights: one ``ray.put``; every actor (and any later replacement) reads it."""
        self.weights_version += 1
        weights = {k: v.detach().cpu().numpy() for k, v in state_dict.items()}
        self._weights_ref = ray.put(weights)
        self._call_all("set_weights", self._weights_ref, self.weights_version)
        return self.weights_version

    def sample(self, steps: Optional[int] = None, epsilon: float = 0.0) -> list[dict[str, Any]]:
        """One call per actor, all in flight together. Returns one dict per actor of arrays
        shaped [steps, envs_per_actor, ...] (see RolloutWorker.sample)."""
        return self._call_all("sample", steps or self.steps_per_call, float(epsilon))

    def sample_async(self, steps: Optional[int] = None, epsilon: float = 0.0) -> Callable[[], list[dict[str, Any]]]:
        """Start ``sample`` on all actors and return a function that waits for the result, so the
        learner can train while the actors step their envs (same fault handling as ``sample``)."""
        args = (steps or self.steps_per_call, float(epsilon))
        refs = [a.sample.remote(*args) for a in self.actors]
        return functools.partial(self._collect, refs, "sample", args)

    def get_state(self) -> list[dict[str, Any]]:
        """Every actor's :meth:`RolloutWorker.get_state` (call while no sample is in flight)."""
        return self._call_all("get_state")

    def set_state(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.actors):
            raise env_state.EnvStateMismatch(f"saved {len(states)} rollout actors, this pool has {len(self.actors)}")
        ray.get([a.set_state.remote(st) for a, st in zip(self.actors, states)])
        self._next_uid = max(self._next_uid, 1 + max(st["uid"] for st in states))

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def concat_actor_batches(batches: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Join per-actor [T, N, ...] arrays along the env axis -> [T, sum N, ...] (one replay add)."""
    keys = [k for k, v in batches[0].items() if isinstance(v, np.ndarray) and v.ndim >= 2]
    out = {k: np.concatenate([b[k] for b in batches], axis=1) for k in keys}
    for k in ("episode_returns", "episode_lengths", "episode_ids_done"):
        out[k] = np.concatenate([b[k] for b in batches])
    return out


# ---------------------------------------------------------------------- throughput


class RLlibSampler:
    """RLlib's own sampling on the same env factory, for a like-for-like comparison: PPO on the
    new API stack (EnvRunner + RLModule + ConnectorV2), ``num_env_runners`` remote
    SingleAgentEnvRunners with ``num_envs_per_env_runner`` gymnasium sync-vector envs each.
    ``sample(steps)`` runs ``EnvRunner.sample(num_timesteps=steps * envs)`` on all runners at
    once (``EnvRunnerGroup.foreach_env_runner``, as ``synchronous_parallel_sample`` does inside
    ``PPO.training_step``) and returns the env steps collected (episodes come back to the driver)."""

    def __init__(
        self,
        env_factory: EnvFactory,
        num_env_runners: int = 2,
        num_envs_per_env_runner: int = 8,
        steps_per_call: int = 256,
        num_cpus_per_env_runner: float = 0.5,
        fcnet_hiddens: Sequence[int] = (128,),
    ):
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
        from ray.tune.registry import register_env

        name = f"raysys-rllib-bench-{id(self)}"
        register_env(name, lambda _cfg: env_factory())
        self.steps_per_call, self.num_envs = steps_per_call, num_envs_per_env_runner
        config = (
            PPOConfig()
            .environment(name)
            .env_runners(
                num_env_runners=num_env_runners,
                num_envs_per_env_runner=num_envs_per_env_runner,
                num_cpus_per_env_runner=num_cpus_per_env_runner,
                rollout_fragment_length=steps_per_call,
            )
            .learners(num_learners=0)
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=list(fcnet_hiddens)))
        )
        self.algo = config.build_algo()

    def sample(self, steps: Optional[int] = None) -> int:
        n = (steps or self.steps_per_call) * self.num_envs
        episodes = self.algo.env_runner_group.foreach_env_runner(
            lambda runner: runner.sample(num_timesteps=n), local_env_runner=False
        )
        return sum(e.env_steps() for eps in episodes for e in eps)

    def stop(self) -> None:
        self.algo.stop()


def compare_with_rllib(
    env_factory: EnvFactory,
    policy_factory: PolicyFactory,
    num_actors: int = 2,
    envs_per_actor: int = 8,
    steps_per_call: int = 256,
    rounds: int = 12,
    num_cpus_per_actor: float = 0.5,
    epsilon: float = 0.1,
    **pool_kw: Any,
) -> dict[str, Any]:
    """raysys pool vs RLlib EnvRunners on the same env factory, actors x envs and steps per call,
    in one process. Both sets of actors stay alive (idle ones cost no CPU); each round times one
    ``sample`` call of each, alternating which goes first, so load from other jobs on a shared
    machine hits both alike. Reports medians and the median of per-round ratios."""
    # RLlib's first: without RLlib (a device's kit) it fails before any of raysys's actors start
    sampler = RLlibSampler(env_factory, num_actors, envs_per_actor, steps_per_call, num_cpus_per_env_runner=num_cpus_per_actor)
    try:
        pool = RolloutPool(env_factory, policy_factory, num_actors, envs_per_actor, steps_per_call=steps_per_call,
                           num_cpus_per_actor=num_cpus_per_actor, **pool_kw)
    except BaseException:
        sampler.stop()
        raise

    def ours() -> float:
        t0 = time.perf_counter()
        n = sum(b["action"].size for b in pool.sample(steps_per_call, epsilon))
        return n / (time.perf_counter() - t0)

    def theirs() -> float:
        t0 = time.perf_counter()
        n = sampler.sample(steps_per_call)
        return n / (time.perf_counter() - t0)

    a, b = [], []
    try:
        ours(), theirs()  # warm-up: first calls pay for lazy imports and allocations
        for r in range(rounds):
            if r % 2 == 0:
                a.append(ours()), b.append(theirs())
            else:
                b.append(theirs()), a.append(ours())
    finally:
        pool.shutdown()
        sampler.stop()
    ratios = [x / y for x, y in zip(a, b)]
    return {
        "setup": dict(num_actors=num_actors, envs_per_actor=envs_per_actor, steps_per_call=steps_per_call,
                      num_cpus_per_actor=num_cpus_per_actor, rounds=rounds, epsilon=epsilon, **pool_kw),
        "raysys_env_steps_per_s": float(np.median(a)),
        "rllib_env_steps_per_s": float(np.median(b)),
        "ratio": float(np.median(ratios)),
        "ratio_iqr": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
    }
