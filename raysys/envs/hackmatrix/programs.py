"""Programs 0-22 (RULES §5) as one masked combination.

Under vmap a `lax.switch` on a per-env index runs every branch anyway, and
each branch would return a whole Game to select from. Instead each program
contributes a small masked update to the few fields it touches (damage,
stun, positions, counters), so the cost is one pass over the unit slots.
UNDO is handled in env.py because it needs the snapshot.
"""
import jax.numpy as jnp

from .board import BIG, SLOTS, cell_of, first_min, nth_true, walls
from .constants import (ANTI_V, ATK_PLUS, CALM, COL, CRASH, DAEMON, DEBUG, DELAY, D_BOM,
                        ENEMY_HP, EXCH, GRID, HACK, LAST_STAGE, MAX_HP, MAX_UNITS, N_ENEMY_TYPES,
                        POLY, PROGRAM_CREDITS, PROGRAM_ENERGY, PULL, PUSH, REDUC, RESET, ROW, SCORE,
                        SHOW, SIPH_PLUS, STEP, VIRUS, WARP)
from .sampling import uniform_int
from .state import Game

N_PROGRAM_UNIFORMS = 1 + MAX_UNITS   # WARP's pick, then POLY's new types
MAX_TURNS = 99                       # DELAY's cap: countdowns are stored as int8


def run_program(u, g: Game, p, free=False) -> Game:
    """Pay program p's cost (nothing if `free`, the forced WAIT) and apply its effect."""
    p = jnp.asarray(p)
    on = lambda i: p == i   # noqa: E731
    e, t, b = g.enemies, g.trans, g.board
    paid = ~jnp.asarray(free)
    credits = g.credits - jnp.where(paid, jnp.asarray(PROGRAM_CREDITS)[p], 0)
    energy = g.energy - jnp.where(paid, jnp.asarray(PROGRAM_ENERGY)[p], 0)

    # PUSH / PULL: one step away from / toward the player on each axis (diagonal allowed).
    dr, dc = jnp.sign(e.row - g.row), jnp.sign(e.col - g.col)
    push_r, push_c = jnp.clip(e.row + dr, 0, GRID - 1), jnp.clip(e.col + dc, 0, GRID - 1)
    pull_r, pull_c = e.row - dr, e.col - dc
    onto_player = (pull_r == g.row) & (pull_c == g.col)      # fixed: the port let it land there
    pull_r, pull_c = jnp.where(onto_player, e.row, pull_r), jnp.where(onto_player, e.col, pull_c)
    row = jnp.where(on(PUSH), push_r, jnp.where(on(PULL), pull_r, e.row))
    col = jnp.where(on(PUSH), push_c, jnp.where(on(PULL), pull_c, e.col))

    # Damage programs (fixed amounts; attack_damage does not apply).
    e_cell = cell_of(e.row, e.col)
    on_block = b.block[e_cell] != 0
    on_siphoned = on_block & b.siphoned[e_cell]
    daemon = e.active & (e.kind == DAEMON)
    bomb = first_min(jnp.where(daemon, abs(e.row - g.row) + abs(e.col - g.col), BIG))
    bombed = on(D_BOM) & daemon & (SLOTS == bomb)
    blast = on(D_BOM) & ~bombed & (jnp.maximum(abs(e.row - e.row[bomb]), abs(e.col - e.col[bomb])) == 1)
    debug = on(DEBUG) & on_block
    antivirus = on(ANTI_V) & (e.kind == VIRUS)
    damage = (on(CRASH).astype(jnp.int32) + debug + (on(ROW) & (e.row == g.row)) + (on(COL) & (e.col == g.col))
              + antivirus + 2 * (on(HACK) & on_siphoned) + blast)
    stun = debug | antivirus | blast

    # WARP: a uniform pick over enemies (slot order) then transmissions; the player
    # lands there and everything on that cell is destroyed (the port removed only
    # the target, leaving stacked units under the player; docs/hackmatrix.md).
    units = jnp.concatenate([e.active, t.active])
    target = jnp.minimum(nth_true(units, uniform_int(u[0], units.sum())), len(units) - 1)
    land_r = jnp.concatenate([e.row, t.row])[target]
    land_c = jnp.concatenate([e.col, t.col])[target]
    warp = on(WARP)
    warped_e = warp & (e.row == land_r) & (e.col == land_c)
    warped_t = warp & (t.row == land_r) & (t.col == land_c)

    # POLY: a different random type at full HP.
    poly = on(POLY)
    kind = jnp.where(poly, (e.kind + 1 + uniform_int(u[1:1 + MAX_UNITS], N_ENEMY_TYPES - 1)) % N_ENEMY_TYPES, e.kind)
    hp = jnp.where(poly, jnp.asarray(ENEMY_HP)[kind], e.hp - damage)

    dead = e.active & ((hp <= 0) | bombed | warped_e)
    enemies = e.set(active=e.active & ~dead, kind=kind, row=row, col=col, hp=hp,
                    stunned=e.stunned | (stun & ~dead))
    trans = t.set(active=t.active & ~warped_t,
                  turns=jnp.where(on(DELAY) & t.active, jnp.minimum(t.turns + 3, MAX_TURNS), t.turns))
    board = b.set(spawn=jnp.where(on(REDUC) & walls(b), jnp.maximum(b.spawn - 1, 0), b.spawn))

    return g.set(
        row=jnp.where(warp, land_r, g.row), col=jnp.where(warp, land_c, g.col),
        credits=credits, energy=energy + 4 * on(EXCH),
        hp=jnp.where(on(RESET), MAX_HP, g.hp),
        siphons=g.siphons + on(SIPH_PLUS),
        score=g.score + jnp.where(on(SCORE), LAST_STAGE - g.stage, 0),
        attack=g.attack + on(ATK_PLUS), atk_uses=g.atk_uses + on(ATK_PLUS),
        show=g.show | on(SHOW), calm=g.calm | on(CALM), step_active=g.step_active | on(STEP),
        board=board, enemies=enemies, trans=trans)
