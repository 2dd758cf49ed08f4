"""HackMatrix in JAX: a pure, jittable, vmappable environment plus gymnasium adapters.

    from raysys.envs import hackmatrix as hm
    obs, state = hm.reset(key, hm.EnvParams())
    obs, state, reward, done, info = hm.step(key, state, action, params)   # auto-resets
    # obs.features: float32[1545], obs.action_mask: bool[28]

See docs/hackmatrix.md for the rules as implemented and the differences from
the original port (charleseff/hack-matrix).
"""
from .constants import ACTION_NAMES, ALL_PROGRAMS, N_ACTIONS, OBS_SIZE, PROGRAM_NAMES
from .env import (action_mask, default_params, initial_game, observe, random_masked_action,
                  random_rollout, reset, state_from_game, step, step_no_reset, step_with_final_obs)
from .gym_env import ENV_ID, HackMatrixGymEnv, HackMatrixVectorEnv, make_vector_env, register_envs
from .render import render_text
from .scenario import build_game, build_state
from .rewards import REWARD_TERMS
from .state import Board, Enemies, EnvParams, EnvState, Game, Obs, Transmissions

register_envs()

__all__ = [
    "ACTION_NAMES", "ALL_PROGRAMS", "ENV_ID", "N_ACTIONS", "OBS_SIZE", "PROGRAM_NAMES", "REWARD_TERMS",
    "Board", "Enemies", "EnvParams", "EnvState", "Game", "Obs", "Transmissions",
    "HackMatrixGymEnv", "HackMatrixVectorEnv",
    "action_mask", "default_params", "initial_game", "make_vector_env", "observe",
    "build_game", "build_state", "random_masked_action", "random_rollout", "register_envs",
    "render_text", "reset",
    "state_from_game", "step", "step_no_reset", "step_with_final_obs",
]
