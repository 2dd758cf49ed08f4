"""Darkroom (the algorithm-distillation benchmark): pure JAX functions, gymnax style, and a gymnasium adapter.

A 9x9 grid; the agent starts at the centre and sees only its own cell (row, col), never the goal.
Actions: 0 row+1, 1 row-1, 2 col+1, 3 col-1, 4 stay (moves into a wall stay put). Reward 1 on every
step that ends on the goal cell; an episode is ``horizon`` (20) steps. The goal is a parameter, so
one program can ``vmap`` over goals and over streams of the same goal.

Goals are numbered ``row * size + col``. :func:`goal_split` is the fixed 73 / 8 split of training
and held-out goals.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
from gymnasium import spaces

SIZE = 9
HORIZON = 20
N_ACTIONS = 5
MOVES = np.array([[1, 0], [-1, 0], [0, 1], [0, -1], [0, 0]], np.int32)
ENV_ID = "raysys/Darkroom-v0"


class EnvParams(NamedTuple):
    goal: Any  # int32[2] (row, col); batch it to vmap over goals
    size: int = SIZE
    horizon: int = HORIZON


class EnvState(NamedTuple):
    pos: jax.Array  # int32[2]
    t: jax.Array  # int32: steps taken in this episode
    episode_return: jax.Array  # float32


def params_for(goal_index, size: int = SIZE, horizon: int = HORIZON) -> EnvParams:
    """EnvParams of goal number ``row * size + col`` (an int or an int array: a batch of goals)."""
    g = jnp.asarray(goal_index, jnp.int32)
    return EnvParams(jnp.stack([g // size, g % size], -1), size, horizon)


def reset(key, params: EnvParams):
    """-> (obs int32[2], state). Deterministic: every episode starts at the centre (the key is unused,
    kept for the gymnax signature)."""
    del key
    c = params.size // 2
    state = EnvState(jnp.array([c, c], jnp.int32), jnp.int32(0), jnp.float32(0))
    return state.pos, state


def step_no_reset(key, state: EnvState, action, params: EnvParams):
    """-> (obs, state, reward, done, info) of one step; after done, call :func:`reset`."""
    del key
    pos = jnp.clip(state.pos + jnp.asarray(MOVES)[action], 0, params.size - 1)
    reward = jnp.all(pos == jnp.asarray(params.goal)).astype(jnp.float32)
    t = state.t + 1
    done = t >= params.horizon
    ret = state.episode_return + reward
    info = {"episode_return": jnp.where(done, ret, 0.0), "episode_length": jnp.where(done, t, 0)}
    return pos, EnvState(pos, t, ret), reward, done, info


def step(key, state: EnvState, action, params: EnvParams):
    """Like :func:`step_no_reset`, but a finished episode restarts at once: the returned obs and state
    are the new episode's; ``info['next_obs']`` is the cell the step really ended on."""
    obs, nxt, reward, done, info = step_no_reset(key, state, action, params)
    fresh_obs, fresh = reset(key, params)
    state = jax.tree.map(lambda f, n: jnp.where(done, f, n), fresh, nxt)
    return jnp.where(done, fresh_obs, obs), state, reward, done, {**info, "next_obs": obs}


def move(pos: np.ndarray, action, size: int = SIZE) -> np.ndarray:
    """The move rule in numpy, for any batch of cells [..., 2] and actions [...]: walls hold."""
    return np.clip(pos + MOVES[action], 0, size - 1)


def optimal_return(goal_index, size: int = SIZE, horizon: int = HORIZON) -> np.ndarray:
    """The best episode return for each goal: walk the Manhattan distance d, then stay (``horizon - d
    + 1`` rewarded steps; ``horizon`` at the centre)."""
    g = np.asarray(goal_index)
    c = size // 2
    d = np.abs(g // size - c) + np.abs(g % size - c)
    return np.where(d == 0, horizon, np.maximum(horizon - d + 1, 0)).astype(np.float32)


def goal_split(size: int = SIZE, train_fraction: float = 0.9, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(training goals, held-out goals): a fixed seeded shuffle of all cells; 73 / 8 on the 9x9 grid."""
    order = np.random.default_rng(seed).permutation(size * size)
    n_train = round(size * size * train_fraction)
    return np.sort(order[:n_train]), np.sort(order[n_train:])


# ---- gymnasium ------------------------------------------------------------------------------------

class DarkroomEnv(gym.Env):
    """One Darkroom episode per reset. ``goal`` is a cell number (None: drawn from the training goals
    by ``reset(seed=...)``'s generator; ``reset(options={"goal": g})`` picks one).

    The rules are the pure functions' (a test steps both alike), written again in numpy: a jitted call
    per step would cost more than the step, and baselines such as stable-baselines3 step one env at a
    time."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, goal: Optional[int] = None, size: int = SIZE, horizon: int = HORIZON,
                 render_mode: Optional[str] = None):
        self.size, self.horizon, self.fixed_goal = size, horizon, goal
        self.observation_space = spaces.Box(0, size - 1, (2,), np.int32)
        self.action_space = spaces.Discrete(N_ACTIONS)
        self.render_mode = render_mode
        self.goal: Optional[np.ndarray] = None
        self.pos: Optional[np.ndarray] = None
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        goal = (options or {}).get("goal", self.fixed_goal)
        if goal is None:
            goal = int(self.np_random.choice(goal_split(self.size)[0]))
        self.goal = np.array(divmod(int(goal), self.size), np.int32)
        self.pos, self.t = np.full(2, self.size // 2, np.int32), 0
        return self.pos.copy(), {"goal": int(goal)}

    def step(self, action):
        if self.pos is None or self.t >= self.horizon:
            raise gym.error.ResetNeeded("call reset() before step() (the episode has ended)")
        self.pos = move(self.pos, int(action), self.size).astype(np.int32)
        self.t += 1
        reward = float(np.array_equal(self.pos, self.goal))
        # a fixed horizon is a time limit: truncated, not terminated
        return self.pos.copy(), reward, False, self.t >= self.horizon, {}

    def render(self):
        if self.render_mode != "ansi" or self.pos is None:
            return None
        grid = [["." for _ in range(self.size)] for _ in range(self.size)]
        grid[self.goal[0]][self.goal[1]] = "G"
        grid[self.pos[0]][self.pos[1]] = "A"
        return "\n".join("".join(row) for row in grid)


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=DarkroomEnv)
