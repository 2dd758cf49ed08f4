"""Actions 0-4 (move/attack, siphon), line of sight and the action mask (RULES §4-5)."""
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .board import BIG, CELLS, SLOTS, cell_of, first_min, occupancy, on_board, walls
from .constants import (DAEMON, DATA_BLOCK, DIRECTIONS, GRID, LAST_STAGE, MAX_ATTACK, MAX_HP,
                        MAX_SIPHON_SPAWN, N_CELLS, N_ENEMY_TYPES, N_PROGRAMS, PROGRAM_CREDITS,
                        PROGRAM_ENERGY, PROGRAM_RANK, SIPHON_DELAY, SIPHON_SPAWN_TURNS, VIRUS,
                        WAIT)
from .sampling import Order, rank_within, uniform_int
from .state import Game, Transmissions, insert

N_SIPHON_UNIFORMS = N_CELLS   # one enemy type per cell


class Sight(NamedTuple):
    """What a move in each direction (up, down, left, right) would hit."""
    has_target: jnp.ndarray   # bool[4]
    hits_enemy: jnp.ndarray   # bool[4]: the target is an enemy (else a transmission)
    enemy_slot: jnp.ndarray   # int32[4]
    trans_slot: jnp.ndarray   # int32[4]


def line_of_sight(g: Game) -> Sight:
    """First unit on each ray from the player; blocks do not stop it.

    A unit is on ray d when its offset across d is 0 and along d is > 0; the
    nearest wins, an enemy beats a transmission on the same cell, and the
    lowest slot breaks ties.
    """
    dr, dc = DIRECTIONS[:, 0, None], DIRECTIONS[:, 1, None]

    def distance(units):
        drow, dcol = units.row[None] - g.row, units.col[None] - g.col
        along = drow * dr + dcol * dc
        across = drow * abs(dc) + dcol * abs(dr)
        return jnp.where(units.active[None] & (across == 0) & (along > 0), along, BIG)

    de, dt = distance(g.enemies), distance(g.trans)
    near_e, near_t = de.min(1), dt.min(1)
    return Sight(has_target=jnp.minimum(near_e, near_t) < BIG, hits_enemy=(near_e <= near_t) & (near_e < BIG),
                 enemy_slot=first_min(de), trans_slot=first_min(dt))


def neighbours(g: Game):
    """The 4 neighbour cells (up, down, left, right), clipped, and which are on the board."""
    nrow, ncol = g.row + DIRECTIONS[:, 0], g.col + DIRECTIONS[:, 1]
    return cell_of(jnp.clip(nrow, 0, GRID - 1), jnp.clip(ncol, 0, GRID - 1)), on_board(nrow, ncol)


def move(g: Game, direction, sight: Sight) -> Game:
    """Attack the first unit in line, or step into the adjacent cell and collect it."""
    has, hits_enemy = sight.has_target[direction], sight.hits_enemy[direction]
    e, t, b = g.enemies, g.trans, g.board

    hit = has & hits_enemy & (SLOTS == sight.enemy_slot[direction])
    hp = jnp.where(hit, e.hp - g.attack, e.hp)
    enemies = e.set(hp=hp, active=e.active & ~(hit & (hp <= 0)))
    trans = t.set(active=t.active & ~(has & ~hits_enemy & (SLOTS == sight.trans_slot[direction])))

    # The mask never allows an off-board step; the clip keeps a bad action harmless.
    step = jnp.asarray(DIRECTIONS)[direction]
    row = jnp.clip(g.row + step[0], 0, GRID - 1)
    col = jnp.clip(g.col + step[1], 0, GRID - 1)
    to = cell_of(row, col)
    walk = ~has
    here = walk & (CELLS == to)
    return g.set(
        row=jnp.where(walk, row, g.row), col=jnp.where(walk, col, g.col),
        siphons=g.siphons + (walk & b.pickup[to]),
        credits=g.credits + jnp.where(walk, b.credits[to], 0),
        energy=g.energy + jnp.where(walk, b.energy[to], 0),
        board=b.set(pickup=b.pickup & ~here, credits=jnp.where(here, 0, b.credits),
                    energy=jnp.where(here, 0, b.energy)),
        enemies=enemies, trans=trans)


def siphon(u, order: Order, g: Game) -> Game:
    """Siphon the best neighbouring unsiphoned block (program > most points; ties up, down, left, right).

    u: N_SIPHON_UNIFORMS uniforms (spawn types); order: a random cell order.
    The min(spawn, 9) released transmissions go to distinct random free cells
    (the port stacked them all on the block; docs/hackmatrix.md).
    """
    b = g.board
    ncell, on = neighbours(g)
    candidate = on & walls(b)[ncell]
    block = b.block[ncell]
    value = jnp.where(block == DATA_BLOCK, b.points[ncell], PROGRAM_RANK)
    best = first_min(-jnp.where(candidate, value, -1))
    found = candidate.any()
    best_cell = ncell[best]
    is_data = block[best] == DATA_BLOCK
    gained = found & ~is_data & (jnp.arange(N_PROGRAMS) == b.program[best_cell])
    player = CELLS == cell_of(g.row, g.col)
    board = b.set(siphoned=b.siphoned | (found & (CELLS == best_cell)), centre=b.centre | (found & player))

    count = jnp.where(found, jnp.minimum(b.spawn[best_cell], MAX_SIPHON_SPAWN), 0)
    free = ~walls(board) & ~player & ~occupancy(g.enemies) & ~occupancy(g.trans)
    chosen = rank_within(order, free) < count                     # one row per cell
    new = Transmissions.make(len(CELLS), active=chosen, kind=uniform_int(u, N_ENEMY_TYPES),
                             row=CELLS // GRID, col=CELLS % GRID, turns=SIPHON_SPAWN_TURNS,
                             from_siphon=True)
    return g.set(
        siphons=g.siphons - 1,
        score=g.score + jnp.where(found & is_data, b.points[best_cell], 0),
        owned=g.owned | gained,
        next_spawn=g.next_spawn + jnp.where(found, SIPHON_DELAY, 0),
        board=board, trans=insert(g.trans, new))


def base_mask(g: Game, undo_valid, sight: Sight):
    """bool[28] of the rules (before the forced-WAIT fallback of `with_forced_wait`)."""
    e, t, b = g.enemies, g.trans, g.board
    ncell, on = neighbours(g)
    moves = on & (~walls(b)[ncell] | sight.has_target)

    # All "is there a unit / cell such that ..." questions as two reductions
    # (one over unit slots, one over cells) instead of a dozen tiny kernels.
    around = lambda r, c: jnp.maximum(abs(r - g.row), abs(c - g.col)) == 1   # noqa: E731
    on_block = b.block[cell_of(e.row, e.col)] != 0
    units = jnp.stack([
        e.active, t.active, (e.active & around(e.row, e.col)) | (t.active & around(t.row, t.col)),
        e.active & on_block, e.active & (e.row == g.row), e.active & (e.col == g.col),
        e.active & (e.kind == DAEMON), e.active & (e.kind == VIRUS)]).any(1)
    any_enemy, any_trans, near_unit, enemy_on_block, in_row, in_col, daemon, virus = units
    cells = jnp.stack([
        around(CELLS // GRID, CELLS % GRID) & (b.block != 0), walls(b) & (b.spawn > 0),
        (b.block != 0) & b.siphoned]).any(1)
    block_near, spawning_block, siphoned_block = cells
    condition = jnp.stack([
        any_enemy,                                              # PUSH
        any_enemy,                                              # PULL
        block_near | near_unit,                                 # CRASH
        any_enemy | any_trans,                                  # WARP
        any_enemy,                                              # POLY
        True,                                                   # WAIT
        enemy_on_block,                                         # DEBUG
        in_row,                                                 # ROW
        in_col,                                                 # COL
        undo_valid,                                             # UNDO
        True,                                                   # STEP
        True,                                                   # SIPH+
        g.credits > 0,                                          # EXCH
        ~g.show,                                                # SHOW
        g.hp < MAX_HP,                                          # RESET
        ~g.calm,                                                # CALM
        daemon,                                                 # D_BOM
        any_trans,                                              # DELAY
        virus,                                                  # ANTI-V
        g.stage < LAST_STAGE,                                   # SCORE
        spawning_block,                                         # REDUC
        (g.atk_uses < 2) & (g.attack < MAX_ATTACK),             # ATK+
        siphoned_block,                                         # HACK
    ])
    programs = g.owned & (g.credits >= PROGRAM_CREDITS) & (g.energy >= PROGRAM_ENERGY) & condition
    return jnp.concatenate([moves, (g.siphons > 0)[None], programs])


def with_forced_wait(mask):
    """If nothing is legal (e.g. walled in at a stage start), WAIT is: a free pass."""
    # a select, not `.at[].set`: under vmap that is an update-slice plus a copy, two kernels on a GPU
    return mask | ((np.arange(mask.shape[-1]) == 5 + WAIT) & ~mask.any(-1, keepdims=True))
