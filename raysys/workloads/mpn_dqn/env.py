"""Environment factory: NeuroGym tasks (or any registered gymnasium id) behind a TimeLimit.

NeuroGym tasks never set ``terminated``: a task is an endless stream of trials, so an episode
exists only because ``TimeLimit`` truncates it. The MPN state therefore carries across trials
inside an episode, which is what lets it learn the task's context.
"""

from __future__ import annotations

import difflib
import functools
import json
import warnings
from typing import Any, Optional

import gymnasium as gym
import numpy as np

from raysys.config import ConfigError

NEUROGYM_TASK = "ContextDecisionMaking-v0"


@functools.cache
def _neurogym_ids() -> frozenset[str]:
    # Importing neurogym registers all its tasks with gymnasium's registry (~50 ids, ~3 s the
    # first time), so import it only when an id is not already known.
    before = set(gym.envs.registry)
    import neurogym  # noqa: F401

    return frozenset(set(gym.envs.registry) - before)


class NeurogymSeeding(gym.Wrapper):
    """Make ``reset(seed=s)`` seed a NeuroGym task. NeuroGym draws trials from its own
    ``np.random.RandomState`` (``env.unwrapped.rng``), which gymnasium's reset seed never
    touches; without this, two "seeded" copies of a task would still diverge."""

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        if seed is not None:
            self.env.unwrapped.seed(seed)
        return self.env.reset(seed=seed, options=options)


def make_env(task: str = NEUROGYM_TASK, max_episode_steps: int = 200, **task_kwargs: Any) -> gym.Env:
    """Build ``task`` with ``TimeLimit(max_episode_steps)``.

    For ContextDecisionMaking the explicit-context variant is the default (7-dim observation:
    fixation, 2 stimuli x 2 modalities, 2 context cues; actions: fixate, choice 1, choice 2).
    """
    if task not in gym.envs.registry:
        _neurogym_ids()
    entry = gym.envs.registry[task].entry_point  # "module:Class", or the callable itself
    is_neurogym = (entry if isinstance(entry, str) else f"{getattr(entry, '__module__', '')}:").startswith("neurogym.")
    if task == NEUROGYM_TASK:
        task_kwargs.setdefault("use_expl_context", True)
    # The env checker only adds per-step overhead, and NeuroGym's unbounded Box obs trip its
    # warnings; TimeLimit is added explicitly below (not via gym.make) to be sure it is outermost.
    with warnings.catch_warnings():
        # NeuroGym's metadata has no render_modes; gymnasium warns on every make()
        warnings.filterwarnings("ignore", message=".*render_modes.*")
        # a registered limit of its own (CartPole's 500) would cut a longer max_episode_steps unsaid: it is replaced
        own = {"max_episode_steps": max_episode_steps} if gym.envs.registry[task].max_episode_steps else {}
        env = gym.make(task, disable_env_checker=True, **own, **task_kwargs)
    if is_neurogym:
        env = NeurogymSeeding(env)
    return gym.wrappers.TimeLimit(env, max_episode_steps=max_episode_steps)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def env_spaces(task: str = NEUROGYM_TASK, **task_kwargs: Any) -> tuple[int, int]:
    """(obs_dim, n_actions) of a task with a flat Box observation and a Discrete action space; a
    ConfigError naming the problem for an unknown id, one that cannot be made, or other spaces."""
    # cached by value: the kwargs may hold lists or mappings (a task's timing), which are not hashable
    return _env_spaces(task, json.dumps(task_kwargs, sort_keys=True, default=repr))


@functools.cache
def _env_spaces(task: str, kwargs_json: str) -> tuple[int, int]:
    task_kwargs = json.loads(kwargs_json)
    if task not in gym.envs.registry:
        _neurogym_ids()
    if task not in gym.envs.registry:
        near = difflib.get_close_matches(task, list(gym.envs.registry), n=3, cutoff=0.6)
        raise ConfigError(f"task {task!r} is not a gymnasium or NeuroGym id"
                          + (f"; did you mean {', '.join(near)}?" if near else ""))
    try:
        env = make_env(task, **task_kwargs)
    except Exception as e:  # a missing extra (box2d, mujoco), bad kwargs: say which, in one line
        given = f" with task_kwargs {task_kwargs}" if task_kwargs else ""
        raise ConfigError(f"task {task!r} cannot be made{given}: {type(e).__name__}: "
                          f"{_first_line(e)}") from None
    obs, act = env.observation_space, env.action_space
    try:
        if not (isinstance(obs, gym.spaces.Box) and len(obs.shape) == 1):
            raise ConfigError(f"task {task!r}: the MPN reads a flat Box observation (a vector); this task's is {obs}")
        if not isinstance(act, gym.spaces.Discrete):
            raise ConfigError(f"task {task!r}: DQN picks one of n actions (Discrete); this task's actions are {act}")
        if int(act.start) != 0:  # the Q-network's outputs are actions 0..n-1
            raise ConfigError(f"task {task!r}: its actions are {act}, numbered from {int(act.start)}; DQN's are 0..n-1 "
                              "(wrap it with gymnasium's TransformAction, or register it with Discrete(n))")
        # what it returns, not only what it declares: an env that says (1,) and returns a bare number
        # would fail its run's first batch, after the run exists
        try:
            first = np.asarray(env.reset(seed=0)[0])
        except Exception as e:
            raise ConfigError(f"task {task!r} cannot be reset: {type(e).__name__}: "
                              f"{_first_line(e)}") from None
        if first.shape != obs.shape:
            raise ConfigError(f"task {task!r}: its observation space says shape {obs.shape}, but reset() returned "
                              f"shape {first.shape} ({first.dtype}): the MPN needs what the space says")
    finally:
        env.close()
    return int(obs.shape[0]), int(act.n)
