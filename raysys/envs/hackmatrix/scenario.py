"""Build a Game by hand (tests, debugging, docs); host-side, not jittable."""
import jax
import jax.numpy as jnp
import numpy as np

from .constants import (DATA_BLOCK, ENEMY_HP, GRID, MAX_UNITS, N_CELLS, N_PROGRAMS, PROGRAM_BLOCK,
                        PROGRAM_NAMES, SPAWN_INTERVAL)
from .env import state_from_game
from .state import STATS, Board, Enemies, EnvState, Game, Transmissions

ENEMY_KINDS = {"virus": 0, "daemon": 1, "glitch": 2, "cryptog": 3}


def _cell(rc):
    return GRID * rc[0] + rc[1]


def _program(p):
    return PROGRAM_NAMES.index(p) if isinstance(p, str) else int(p)


def build_game(*, player=(0, 0), exit=(5, 5), hp=3, credits=0, energy=0, score=0, siphons=0,
               attack=1, owned=(), stage=1, turn=0, next_spawn=SPAWN_INTERVAL, atk_uses=0,
               show=False, calm=False, step_active=False, blocks=None, siphoned=(),
               resources=None, pickups=(), enemies=(), transmissions=()) -> Game:
    """A Game from readable pieces; positions are (row, col), row 0 at the bottom.

    blocks: {(r, c): ("data", points[, spawn]) | ("program", index_or_name[, spawn])}
    siphoned: cells whose block is siphoned. resources: {(r, c): (credits, energy)}.
    enemies: [(kind, r, c)] or dicts with kind, row, col and optional hp,
    stunned, from_siphon (kind is an int or "virus"/"daemon"/"glitch"/"cryptog").
    transmissions: [(kind, r, c, turns)] or dicts (optional from_siphon).
    owned: program indices or names.
    """
    layers = {name: np.zeros(N_CELLS, np.int32) for name in Board.FIELDS}
    for rc, spec in (blocks or {}).items():
        i = _cell(rc)
        if spec[0] == "data":
            layers["block"][i], layers["points"][i] = DATA_BLOCK, spec[1]
            layers["spawn"][i] = spec[2] if len(spec) > 2 else spec[1]
        else:
            layers["block"][i], layers["program"][i] = PROGRAM_BLOCK, _program(spec[1])
            layers["spawn"][i] = spec[2] if len(spec) > 2 else 2
    for rc in siphoned:
        layers["siphoned"][_cell(rc)] = 1
    for rc, (c, e) in (resources or {}).items():
        layers["credits"][_cell(rc)], layers["energy"][_cell(rc)] = c, e
    for rc in pickups:
        layers["pickup"][_cell(rc)] = 1

    def table(cls, rows, defaults):
        cols = {name: np.zeros(MAX_UNITS, np.int32) for name in cls.FIELDS}
        for slot, row in enumerate(rows):
            row = dict(zip(("kind", "row", "col", "turns"), row)) if not isinstance(row, dict) else dict(row)
            row["kind"] = ENEMY_KINDS.get(row["kind"], row["kind"])
            row = {**defaults(row), **row, "active": 1}
            for name, value in row.items():
                cols[name][slot] = int(value)
        return cls(jnp.asarray(np.stack([cols[n] for n in cls.FIELDS]), cls.DTYPE))

    stats = dict(row=player[0], col=player[1], hp=hp, credits=credits, energy=energy, score=score,
                 siphons=siphons, attack=attack, stage=stage, turn=turn, next_spawn=next_spawn,
                 atk_uses=atk_uses, show=show, calm=calm, step_active=step_active, exit_cell=_cell(exit))
    own = np.zeros(N_PROGRAMS, np.int32)
    for p in owned:
        own[_program(p)] = 1
    return Game(
        stats=jnp.asarray(np.concatenate([np.array([int(stats[n]) for n in STATS], np.int32), own])),
        board=Board(jnp.asarray(np.stack([layers[n] for n in Board.FIELDS]), Board.DTYPE)),
        enemies=table(Enemies, enemies, lambda r: {"hp": ENEMY_HP[r["kind"]]}),
        trans=table(Transmissions, transmissions, lambda r: {}))


_jit_state_from_game = None


def build_state(**kwargs) -> EnvState:
    """`build_game(**kwargs)` wrapped as a fresh-turn EnvState (jitted, compiled once)."""
    global _jit_state_from_game
    if _jit_state_from_game is None:
        _jit_state_from_game = jax.jit(state_from_game)
    return _jit_state_from_game(build_game(**kwargs))
