"""Gymnasium adapters: one env (`HackMatrixGymEnv`) and a JAX-backed vector env.

Observations are dicts {"observations": float32[1545], "action_mask":
float32[28] of 0/1} (RLlib's action-masking convention). Actions are
Discrete(28). Illegal actions are legal to send: they change nothing and pay
`EnvParams.invalid_action_penalty` (info["invalid_action"] is True).
"""
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from . import env as E
from .constants import N_ACTIONS, OBS_SIZE
from .render import render_text
from .rewards import REWARD_TERMS
from .state import EnvParams

ENV_ID = "raysys/HackMatrix-v0"

# Module-level jits: every env instance (and the tests) share one compilation.
jit_reset = jax.jit(E.reset)
jit_step_no_reset = jax.jit(E.step_no_reset)
jit_vreset = jax.jit(jax.vmap(E.reset, in_axes=(0, None)))
jit_vstep_no_reset = jax.jit(jax.vmap(E.step_no_reset, in_axes=(0, 0, 0, None)))
jit_action_mask = jax.jit(E.action_mask)


def single_observation_space() -> spaces.Dict:
    return spaces.Dict({
        "observations": spaces.Box(0.0, 1.0, (OBS_SIZE,), np.float32),
        "action_mask": spaces.Box(0.0, 1.0, (N_ACTIONS,), np.float32),
    })


def _obs_np(obs) -> dict:
    return {"observations": np.asarray(obs.features, np.float32),
            "action_mask": np.asarray(obs.action_mask, np.float32)}


def _info_np(info, mask) -> dict:
    """Plain-Python info of one env."""
    terms = np.asarray(info["reward_terms"])
    return {"action_mask": np.asarray(mask, bool), "stage": int(info["stage"]), "won": bool(info["won"]),
            "invalid_action": bool(info["invalid_action"]),
            "reward_terms": {k: float(v) for k, v in zip(REWARD_TERMS, terms)}}


def _key_from(rng: np.random.Generator):
    return jax.random.PRNGKey(int(rng.integers(0, 2**31 - 1)))


class HackMatrixGymEnv(gym.Env):
    """One HackMatrix env; jitted JAX underneath, numpy at the interface."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, params: EnvParams | None = None, render_mode: str | None = None):
        self.params = EnvParams() if params is None else params
        self.observation_space = single_observation_space()
        self.action_space = spaces.Discrete(N_ACTIONS)
        self.render_mode = render_mode
        self.state = None
        self._key = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        # The JAX key comes from np_random, so reset(seed=s) is reproducible and
        # later seedless resets continue the same stream.
        self._key = _key_from(self.np_random)
        self._key, k = jax.random.split(self._key)
        obs, self.state = jit_reset(k, self.params)
        return _obs_np(obs), {"action_mask": np.asarray(obs.action_mask, bool)}

    def step(self, action):
        if self.state is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        self._key, k = jax.random.split(self._key)
        obs, self.state, reward, _, info = jit_step_no_reset(k, self.state, jnp.int32(action), self.params)
        info = jax.device_get(info)
        return (_obs_np(obs), float(reward), bool(info["terminated"]), bool(info["truncated"]),
                _info_np(info, obs.action_mask))

    def action_masks(self) -> np.ndarray:
        """bool[28] of the current state (the sb3-contrib MaskablePPO hook)."""
        return np.asarray(jit_action_mask(self.state), bool)

    def render(self):
        if self.render_mode == "ansi" and self.state is not None:
            return render_text(self.state.game)
        return None


def _rows_where(mask, a, b):
    """Per-env select of two batched pytrees (mask: bool[num_envs])."""
    return jax.tree.map(lambda x, y: jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, y), a, b)


jit_rows_where = jax.jit(_rows_where)


class HackMatrixVectorEnv(VectorEnv):
    """`num_envs` HackMatrix envs stepped by one jitted, vmapped call.

    autoreset_mode NEXT_STEP (gymnasium's default, what RLlib's env runner
    expects): a finished env returns its terminal obs, and its next step only
    reveals the new episode (that action is ignored, reward 0). SAME_STEP: a finished env returns the
    new episode's first obs; the terminal one is in info["final_obs"] (object
    array of obs dicts, None elsewhere) with the mask info["_final_obs"].
    Other info keys are arrays over envs: episode_return / episode_length (a
    finished episode's totals, 0 elsewhere), won, stage, invalid_action and
    reward_terms (float32[num_envs, 16], named by REWARD_TERMS).
    """

    def __init__(self, num_envs: int = 1, params: EnvParams | None = None,
                 autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP, render_mode=None, **kwargs):
        del kwargs   # e.g. max_episode_steps from gym.make_vec; the params hold the limit
        self.num_envs = num_envs
        self.params = EnvParams() if params is None else params
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.metadata = {"autoreset_mode": self.autoreset_mode, "render_modes": []}
        self.render_mode = render_mode
        self.single_observation_space = single_observation_space()
        self.single_action_space = spaces.Discrete(N_ACTIONS)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.state = None
        self._key = None
        self._needs_reset = np.zeros(num_envs, bool)
        self._current_obs = None   # obs of self.state (a fresh episode's for envs awaiting reset)

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self._np_random, self._np_random_seed = gym.utils.seeding.np_random(
                seed if isinstance(seed, int) else int(seed[0]))
        if isinstance(seed, (list, tuple)):   # one seed per env
            keys = jnp.stack([jax.random.PRNGKey(int(s)) for s in seed])
            self._key = _key_from(self.np_random)
        else:
            self._key, k = jax.random.split(_key_from(self.np_random))
            keys = jax.random.split(k, self.num_envs)
        obs, self.state = jit_vreset(keys, self.params)
        self._needs_reset[:] = False
        self._current_obs = _obs_np(obs)
        return self._current_obs, {}

    def step(self, actions):
        if self.state is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        self._key, k_step, k_reset = jax.random.split(self._key, 3)
        actions = jnp.asarray(np.asarray(actions), jnp.int32).reshape(self.num_envs)
        obs, state, reward, done, info = jit_vstep_no_reset(
            jax.random.split(k_step, self.num_envs), self.state, actions, self.params)
        info, reward, done = jax.device_get((info, reward, done))
        obs = _obs_np(obs)
        skip = self._needs_reset                       # NEXT_STEP: these only reveal their reset
        if skip.any():
            state = jit_rows_where(jnp.asarray(skip), self.state, state)
            obs = {k: np.where(skip[:, None], self._current_obs[k], v) for k, v in obs.items()}
            reward, done = np.where(skip, 0.0, reward), np.where(skip, False, done)
            info = {k: np.where(skip.reshape(skip.shape + (1,) * (np.ndim(v) - 1)), np.zeros_like(v), v)
                    for k, v in info.items()}
            info["stage"] = np.where(skip, 1, info["stage"])
        done = np.asarray(done, bool)
        current = obs
        if done.any():                                 # reset the finished envs now
            fresh_obs, fresh = jit_vreset(jax.random.split(k_reset, self.num_envs), self.params)
            state = jit_rows_where(jnp.asarray(done), fresh, state)
            current = {k: np.where(done[:, None], v, obs[k]) for k, v in _obs_np(fresh_obs).items()}
        self.state, self._current_obs = state, current
        infos = {k: np.asarray(v) for k, v in info.items() if k not in ("terminated", "truncated")}
        terminated, truncated = np.asarray(info["terminated"], bool), np.asarray(info["truncated"], bool)
        reward = np.asarray(reward, np.float32)
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            if done.any():
                finals = np.full(self.num_envs, None, dtype=object)
                for i in np.flatnonzero(done):
                    finals[i] = {k: v[i] for k, v in obs.items()}
                infos["final_obs"], infos["_final_obs"] = finals, done
            return current, reward, terminated, truncated, infos
        self._needs_reset = done
        return obs, reward, terminated, truncated, infos

    def action_masks(self) -> np.ndarray:
        """bool[num_envs, 28] of the current states."""
        return self._current_obs["action_mask"].astype(bool)


def make_vector_env(num_envs: int, params: EnvParams | None = None, **kwargs) -> HackMatrixVectorEnv:
    return HackMatrixVectorEnv(num_envs=num_envs, params=params, **kwargs)


def register_envs() -> str:
    """Register `raysys/HackMatrix-v0` (single and vector entry points); idempotent."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point=f"{__name__}:HackMatrixGymEnv",
                     vector_entry_point=f"{__name__}:HackMatrixVectorEnv")
    return ENV_ID
