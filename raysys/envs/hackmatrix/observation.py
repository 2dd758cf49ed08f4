"""The 1545-float observation (RULES §9), every value clipped into [0, 1]."""
import jax
import jax.numpy as jnp
import numpy as np

from .board import BIG, CELLS, SLOTS, cell_of
from .constants import (CRYPTOG, GRID, LAST_STAGE, MAX_HP, N_CELLS, N_ENEMY_TYPES, N_PROGRAMS,
                        PROGRAM_BLOCK, QUESTION_BLOCK)
from .state import Game


def player_features(g: Game):
    f = lambda x: jnp.asarray(x, jnp.float32)   # noqa: E731
    return jnp.stack([
        f(g.row) / (GRID - 1), f(g.col) / (GRID - 1), f(g.hp) / MAX_HP,
        jnp.minimum(f(g.credits) / 50, 1), jnp.minimum(f(g.energy) / 50, 1),
        jnp.minimum(f(g.stage - 1) / (LAST_STAGE - 1), 1),      # the port showed 8/7 once won
        jnp.minimum(f(g.siphons) / 10, 1),                      # the port did not cap this
        f(g.attack - 1) / 2, f(g.show), f(g.calm)])


def _units_by_scatter(e_cell, kind, visible, t_cell, turns):
    """(kinds bool[36, 4], top visible slot int32[36] or -1, soonest countdown int32[36] or BIG) by
    scatters: O(slots), the fastest on a CPU."""
    kinds = jnp.zeros((N_CELLS, N_ENEMY_TYPES), bool).at[e_cell, kind].max(visible)
    top = jnp.full(N_CELLS, -1).at[e_cell].max(jnp.where(visible, SLOTS, -1))
    return kinds, top, jnp.full(N_CELLS, BIG).at[t_cell].min(turns)


def _units_by_compare(e_cell, kind, visible, t_cell, turns):
    """The same by [slots, cells] compares: O(slots x cells), but on a GPU it fuses into its
    neighbours, where each scatter is a kernel of its own plus one to fill its output."""
    here = (e_cell[:, None] == CELLS) & visible[:, None]
    kinds = (here[:, :, None] & (kind[:, None, None] == np.arange(N_ENEMY_TYPES))).any(0)
    top = jnp.where(here, SLOTS[:, None], -1).max(0)
    return kinds, top, jnp.where(t_cell[:, None] == CELLS, turns[:, None], BIG).min(0)


def grid_features(g: Game):
    """float32[36, 42] in (cell, channel) order."""
    e, t, b = g.enemies, g.trans, g.board
    f = lambda x: jnp.asarray(x, jnp.float32)   # noqa: E731
    # Cryptogs are hidden unless in the player's row or column or SHOW is on.
    visible = e.active & ((e.kind != CRYPTOG) | g.show | (e.row == g.row) | (e.col == g.col))
    # Stacked enemies OR their type bits; hp / stun / from_siphon come from the highest visible
    # slot. A transmission shows only its countdown; stacked ones show the first to hatch.
    kinds, top, soonest = jax.lax.platform_dependent(
        cell_of(e.row, e.col), e.kind, visible, cell_of(t.row, t.col), jnp.where(t.active, t.turns, BIG),
        cpu=_units_by_scatter, default=_units_by_compare)
    top_stats = jnp.where(top[None, :] >= 0, e.data[:, jnp.maximum(top, 0)], 0)   # [fields, cells]
    has_program = (b.block == PROGRAM_BLOCK) | (b.block == QUESTION_BLOCK)

    columns = [
        f(kinds),                                                                # 0-3
        f(top_stats[e.FIELDS.index("hp")])[:, None] / MAX_HP,                    # 4
        f(top_stats[e.FIELDS.index("stunned")])[:, None],                        # 5
        f(top_stats[e.FIELDS.index("from_siphon")])[:, None],                    # 6
        f(b.block[:, None] == jnp.arange(1, 4)),                                 # 7-9 data, program, question
        f(b.points)[:, None] / 9,                                                # 10
        f(b.siphoned & (b.block != 0))[:, None],                                 # 11
        f(has_program[:, None] & (b.program[:, None] == jnp.arange(N_PROGRAMS))),   # 12-34
        jnp.minimum(f(b.spawn) / 9, 1)[:, None],                                 # 35
        jnp.where(soonest < BIG, jnp.minimum(f(soonest) / 4, 1), 0)[:, None],    # 36
        jnp.minimum(f(b.credits) / 3, 1)[:, None],                               # 37
        jnp.minimum(f(b.energy) / 3, 1)[:, None],                                # 38
        f(b.pickup)[:, None], f(CELLS == g.exit_cell)[:, None], f(b.centre)[:, None],   # 39-41
    ]
    return jnp.concatenate(columns, axis=1)


def features(g: Game):
    """float32[1545]: player (10), owned programs (23), grid raveled (row, col, channel)."""
    return jnp.concatenate([player_features(g), g.owned.astype(jnp.float32), grid_features(g).reshape(-1)])
