"""Stage generation (RULES §3), also used for stage 1 (the port left it empty)."""
import jax.numpy as jnp
import numpy as np

from .board import CELLS, first_true
from .constants import (BLOCKS_MAX, BLOCKS_MIN, CORNERS, DATA_BLOCK, GRID, IS_CORNER,
                        MAX_STAGE_TRANSMISSIONS, MAX_UNITS, N_CELLS, N_ENEMY_TYPES, N_PROGRAMS,
                        NO_BLOCK, PROGRAM_BLOCK)
from .sampling import Order, rank_within, uniform_int
from .state import Board, Transmissions

N_GEN_UNIFORMS = 3 * N_CELLS   # content, resource, misc (the cell order comes separately)

# For a player on a corner, the three other corners (rows for other cells are unused).
_OTHER_CORNERS = np.array([[c for c in CORNERS if c != p] if p in CORNERS else [0, 0, 0]
                           for p in range(N_CELLS)], np.int32)


def generate_stage(u, order: Order, player_cell, stage):
    """Board, exit cell and transmissions of a new stage; the player is on a corner.

    u: N_GEN_UNIFORMS uniforms; order: a random cell order (sampling.random_order).
    """
    content, resource, misc = u.reshape(3, N_CELLS)   # misc: 8 transmission types, exit, count

    exit_cell = jnp.asarray(_OTHER_CORNERS)[player_cell, uniform_int(misc[8], 3)]

    # In one random order of the 32 non-corner cells, the first n are blocks (a
    # uniform n-subset, n in 5..11) and the next min(stage, 8) get transmissions
    # (a uniform subset of the rest); the player is on a corner, so never hit.
    n_blocks = BLOCKS_MIN + uniform_int(misc[9], BLOCKS_MAX - BLOCKS_MIN + 1)
    rank = rank_within(order, ~IS_CORNER)
    is_block = rank < n_blocks
    # One uniform feeds two independent choices: its half picks data vs program,
    # its position inside the half picks the points (1..9) or the program (0..22).
    is_data = content < 0.5
    points = jnp.where(is_block & is_data, 1 + uniform_int(content * 2, 9), 0)
    program = jnp.where(is_block & ~is_data, uniform_int(content * 2 - 1, N_PROGRAMS), 0)
    block = jnp.where(is_block, jnp.where(is_data, DATA_BLOCK, PROGRAM_BLOCK), NO_BLOCK)
    spawn = jnp.where(is_block, jnp.where(is_data, points, 2), 0)

    # Resources on every free non-corner cell: 1/2/3 (p .45/.45/.10) credits or energy.
    has_res = ~IS_CORNER & ~is_block
    part = jnp.mod(resource * 2, 1.0)
    amount = 1 + (part >= 0.45).astype(jnp.int32) + (part >= 0.9).astype(jnp.int32)

    board = Board.make(
        N_CELLS, block=block, points=points, program=program, spawn=spawn,
        credits=jnp.where(has_res & (resource < 0.5), amount, 0),
        energy=jnp.where(has_res & (resource >= 0.5), amount, 0),
        pickup=IS_CORNER & (CELLS != player_cell) & (CELLS != exit_cell))

    # Transmissions hatch next turn; slot k < min(stage, 8) takes the cell ranked n_blocks + k.
    k = jnp.arange(MAX_STAGE_TRANSMISSIONS)
    active = k < jnp.minimum(stage, MAX_STAGE_TRANSMISSIONS)
    cell = first_true(rank[None, :] == (n_blocks + k)[:, None], axis=1)
    pad = lambda x: jnp.concatenate([jnp.where(active, x, 0), jnp.zeros(MAX_UNITS - len(k), x.dtype)])  # noqa: E731
    trans = Transmissions.make(MAX_UNITS, active=pad(active), kind=pad(uniform_int(misc[:len(k)], N_ENEMY_TYPES)),
                               row=pad(cell // GRID), col=pad(cell % GRID), turns=pad(jnp.ones_like(k)))
    return board, exit_cell, trans

