"""The enemy phase (RULES §6-7): hatch, move, attack, scheduled spawn, clear."""
import jax.numpy as jnp

from .board import CELLS, SLOTS, cell_of, first_true, materialize, nth_true, occupancy, walls
from .constants import ENEMY_HP, GLITCH, GRID, N_ENEMY_TYPES, SPAWN_INTERVAL, VIRUS
from .sampling import uniform_int
from .state import Enemies, Game, insert

N_ENEMY_UNIFORMS = 2   # scheduled spawn: cell, type


def step_toward(e: Enemies, g: Game, blocked):
    """One step of every enemy toward the player.

    The longer axis goes first (rows on ties). If that cell is the player's the
    enemy stays (it is adjacent and will attack). If it is an unsiphoned block
    (glitches ignore blocks) the enemy tries the other axis, else stays. The port
    stepped diagonally, onto the block or onto the player instead (a bug).
    """
    dr, dc = jnp.sign(g.row - e.row), jnp.sign(g.col - e.col)
    rows_first = abs(g.row - e.row) >= abs(g.col - e.col)
    r1, c1 = e.row + jnp.where(rows_first, dr, 0), e.col + jnp.where(rows_first, 0, dc)
    r2, c2 = e.row + jnp.where(rows_first, 0, dr), e.col + jnp.where(rows_first, dc, 0)
    ignores_blocks = e.kind == GLITCH

    def free(r, c):
        moved = (r != e.row) | (c != e.col)
        player = (r == g.row) & (c == g.col)
        return moved & ~player & (ignores_blocks | ~blocked[cell_of(r, c)])

    first = free(r1, c1)
    second = free(r2, c2)   # never the player's cell: that needs both offsets 0
    return jnp.where(first, r1, jnp.where(second, r2, e.row)), jnp.where(first, c1, jnp.where(second, c2, e.col))


def enemy_phase(u, g: Game) -> Game:
    e, t = g.enemies, g.trans

    # a. Tick: transmissions at 0 hatch into enemies of their type (lowest free slots).
    turns = jnp.where(t.active, t.turns - 1, t.turns)
    hatch = t.active & (turns <= 0)
    e = insert(e, Enemies.make(len(SLOTS), active=hatch, kind=t.kind, row=t.row, col=t.col,
                               hp=jnp.asarray(ENEMY_HP)[t.kind], from_siphon=t.from_siphon))
    e, t = materialize((e, t.set(turns=turns, active=t.active & ~hatch)))

    # b. Move (skipped under STEP): stunned enemies stay; viruses step twice.
    blocked = walls(g.board)
    moving = e.active & ~e.stunned & ~g.step_active
    row, col = step_toward(e, g, blocked)
    e = e.set(row=jnp.where(moving, row, e.row), col=jnp.where(moving, col, e.col))
    row, col = step_toward(e, g, blocked)
    again = moving & (e.kind == VIRUS)
    e = materialize(e.set(row=jnp.where(again, row, e.row), col=jnp.where(again, col, e.col)))

    # c. Attack: each active, unstunned enemy orthogonally adjacent deals 1.
    adjacent = abs(e.row - g.row) + abs(e.col - g.col) == 1
    hp = jnp.maximum(g.hp - (e.active & ~e.stunned & adjacent).sum(), 0)

    # d. Scheduled spawn on a uniform empty cell; skipped when there is none
    #    (the port fell back to (0,0)). The schedule advances either way.
    due = ~g.calm & (g.turn >= g.next_spawn)
    empty = ~walls(g.board) & (CELLS != cell_of(g.row, g.col)) & ~occupancy(e) & ~occupancy(t)
    spawn_cell = nth_true(empty, uniform_int(u[0], empty.sum()))
    first_free = first_true(~t.active)
    put = due & empty.any() & ~t.active.all() & (SLOTS == first_free)
    spawned = t.make(len(SLOTS), active=True, kind=uniform_int(u[1], N_ENEMY_TYPES),
                     row=spawn_cell // GRID, col=spawn_cell % GRID, turns=1)
    t = type(t)(jnp.where(put[None, :], spawned.data, t.data))

    # e. Stuns and STEP last exactly one enemy phase.
    return g.set(hp=hp, next_spawn=jnp.where(due, g.turn + SPAWN_INTERVAL, g.next_spawn),
                 step_active=False, enemies=e.set(stunned=False), trans=t)
