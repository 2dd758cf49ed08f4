"""Reward terms (RULES §10, with the fixes listed in docs/hackmatrix.md) and the exit distance."""
import jax.numpy as jnp
import numpy as np

from .board import CELLS, cell_of, walls
from .constants import LAST_STAGE, N_CELLS, PROGRAM_CREDITS, UNDO
from .state import EnvParams, Game

REWARD_TERMS = (
    "step_penalty", "stage_completion", "score_gain", "kills", "data_siphon", "distance_shaping",
    "damage_penalty", "hp_recovery", "victory", "death_penalty", "siphon_death_penalty",
    "resource_gain", "resource_holding", "program_waste", "undo_rewind", "invalid_action")


# Bitboards: the 36 cells as two 18-bit words, rows 0-2 and rows 3-5, bit 6*(row % 3) + col.
_POW2 = np.concatenate([2.0 ** np.arange(18)] * 2).astype(np.float32).reshape(2, 18)
_FULL = (1 << 18) - 1
_NOT_COL0 = sum(1 << (6 * r + c) for r in range(3) for c in range(1, 6))
_NOT_COL5 = sum(1 << (6 * r + c) for r in range(3) for c in range(5))


def _pack(mask):
    """bool[36] -> int32[2] (exact: 18-bit sums in float32)."""
    return (mask.reshape(2, 18).astype(jnp.float32) * _POW2).sum(1).astype(jnp.int32)


def _grow(lo, hi):
    """The cells of (lo, hi) plus their 4-neighbours."""
    side_lo = ((lo << 1) & _NOT_COL0) | ((lo >> 1) & _NOT_COL5)
    side_hi = ((hi << 1) & _NOT_COL0) | ((hi >> 1) & _NOT_COL5)
    up_lo, up_hi = (lo << 6) & _FULL, ((hi << 6) & _FULL) | (lo >> 12)
    down_lo, down_hi = (lo >> 6) | ((hi & 63) << 12), hi >> 6
    return lo | side_lo | up_lo | down_lo, hi | side_hi | up_hi | down_hi


def exit_distance(g: Game):
    """4-neighbour BFS steps from the player to the exit, 0 if unreachable."""
    return bfs_distance(walls(g.board), cell_of(g.row, g.col), g.exit_cell)


def bfs_distance(wall, player_cell, exit_cell):
    """BFS steps between two cells around `wall` cells, 0 if unreachable.

    Walls are unsiphoned blocks only (the port also walled off siphoned blocks,
    which can be walked on). The wavefront grows from the exit a fixed 35
    times on bitboards, so there are no data-dependent loops and it is cheap.
    """
    player = CELLS == player_cell
    p_lo, p_hi = _pack(player)
    pass_lo, pass_hi = _pack(~wall | player)
    lo, hi = _pack(CELLS == exit_cell)
    steps = jnp.int32(0)
    for _ in range(N_CELLS - 1):          # no shortest path on 36 cells is longer
        steps += ((lo & p_lo) | (hi & p_hi)) == 0
        lo, hi = _grow(lo, hi)
        lo, hi = lo & pass_lo, hi & pass_hi
    return jnp.where(((lo & p_lo) | (hi & p_hi)) != 0, steps, 0)


def reward_terms(params: EnvParams, *, before: Game, acted: Game, phased: Game, end: Game,
                 valid, completed, died, won, is_undo, wasted_reset, dist_before, dist_after,
                 turn_reward):
    """float32[16]: the reward terms of one step, in REWARD_TERMS order.

    before: game at the start of the step; acted: after the action; phased: after
    the enemy phase; end: after any stage change (before auto-reset).
    """
    f32 = lambda x: jnp.asarray(x, jnp.float32)   # noqa: E731
    stage_rewards = jnp.asarray(params.stage_rewards, jnp.float32)
    stage_idx = jnp.clip(before.stage - 1, 0, LAST_STAGE - 1)
    below = jnp.where(jnp.arange(LAST_STAGE) < stage_idx, stage_rewards, 0).sum()
    # Kills: enemies the action removed; hatchings and the stage wipe do not count.
    kills = jnp.maximum(before.enemies.active.sum() - acted.enemies.active.sum(), 0)
    d_hp = end.hp - before.hp
    adjacent = abs(phased.enemies.row - phased.row) + abs(phased.enemies.col - phased.col) == 1
    siphon_adjacent = (phased.enemies.active & phased.enemies.from_siphon & adjacent).any()
    # Shaping: the step onto the exit pays its last step too; no shaping on death.
    shaping = jnp.where(completed, dist_before, jnp.where(died, 0, jnp.maximum(dist_before - dist_after, 0)))

    terms = jnp.stack([
        f32(params.step_penalty),                                                        # step_penalty
        jnp.where(completed, stage_rewards[stage_idx], 0.0),                             # stage_completion
        params.score_coef * f32(end.score - before.score),                               # score_gain
        params.kill_reward * f32(kills),                                                 # kills
        params.siphon_reward * f32(jnp.maximum(end.siphons - before.siphons, 0)),        # data_siphon
        params.shaping_coef * f32(shaping),                                              # distance_shaping
        -params.hp_coef * f32(jnp.maximum(-d_hp, 0)),                                    # damage_penalty
        params.hp_coef * f32(jnp.maximum(d_hp, 0)),                                      # hp_recovery
        jnp.where(won, params.victory_reward + params.victory_score_coef * f32(end.score), 0.0),   # victory
        jnp.where(died, -params.death_coef * below, 0.0),                                # death_penalty
        jnp.where(died & siphon_adjacent, f32(params.siphon_death_penalty), 0.0),        # siphon_death_penalty
        params.resource_coef * f32(end.credits + end.energy - before.credits - before.energy),   # resource_gain
        jnp.where(completed, params.holding_coef * f32(end.credits + end.energy), 0.0),  # resource_holding
        jnp.where(wasted_reset, f32(params.waste_penalty), 0.0),                         # program_waste
        f32(0.0),                                                                        # undo_rewind
        jnp.where(valid, 0.0, f32(params.invalid_action_penalty)),                       # invalid_action
    ]).astype(jnp.float32)
    # UNDO rewinds the game, so it rewinds the reward earned since the snapshot
    # instead of paying the raw differences (which would refund costs and make
    # SIPH+ or kills repeatable for profit); it still pays for its own credit.
    rewound = dict(step_penalty=f32(params.step_penalty), undo_rewind=-f32(turn_reward),
                   resource_gain=-params.resource_coef * f32(PROGRAM_CREDITS[UNDO]))
    undo = jnp.stack([rewound.get(name, f32(0.0)) for name in REWARD_TERMS])   # a stack, not a scatter: no kernel of its own
    return jnp.where(is_undo, undo, terms)
