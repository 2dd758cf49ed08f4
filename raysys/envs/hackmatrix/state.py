"""Pytree containers of HackMatrix.

Each record stores its fields packed in ONE array (int8 rows for the board and
the unit tables, an int32 vector for the game's scalars) behind named read-only
properties, and `.set(**fields)` returns an updated copy. Why packed: under
vmap every pytree leaf costs at least one XLA kernel per select/copy, and a
step selects whole states several times; ~60 small leaves made kernel launches
the dominant cost. Bool fields are stored as 0/1 and read back as bool.

Unit tables hold MAX_UNITS slots with an `active` flag; new units take the
lowest free slots (`insert`).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .board import first_true, prefix_count
from .constants import MAX_UNITS, N_PROGRAMS, SPAWN_INTERVAL, STAGE_REWARDS

Array = jax.Array


def _packed(fields, bools, dtype=jnp.int8):
    """Class decorator: named row views over `self.data` plus `set` and `make`.

    Rows are stored as int8 (every board and unit value is small; 4x less
    memory to move per step) and read back as int32 or bool, so arithmetic
    never happens in int8.
    """
    index = {name: i for i, name in enumerate(fields)}

    def deco(cls):
        # `...` indexing: the views also work on batched states ([n_envs, fields, width]).
        for name, i in index.items():
            if name in bools:
                setattr(cls, name, property(lambda self, i=i: self.data[..., i, :] != 0))
            else:
                setattr(cls, name, property(lambda self, i=i: self.data[..., i, :].astype(jnp.int32)))

        def set(self, **changes):
            shape = self.data.shape[:-2] + self.data.shape[-1:]
            rows = [jnp.broadcast_to(jnp.asarray(changes.pop(n)).astype(dtype), shape)
                    if n in changes else self.data[..., i, :] for n, i in index.items()]
            assert not changes, f"unknown fields {sorted(changes)}"
            return cls(jnp.stack(rows, axis=-2))

        @classmethod
        def make(klass, width, **values):
            """All fields from keyword arguments (missing ones are 0), each [width]."""
            rows = [jnp.broadcast_to(jnp.asarray(values.pop(n, 0)).astype(dtype), (width,)) for n in fields]
            assert not values, f"unknown fields {sorted(values)}"
            return klass(jnp.stack(rows))

        cls.set, cls.make, cls.FIELDS, cls.DTYPE = set, make, tuple(fields), dtype
        return cls
    return deco


@_packed(("block", "points", "program", "spawn", "siphoned", "centre", "credits", "energy", "pickup"),
         bools=("siphoned", "centre", "pickup"))
class Board(NamedTuple):
    """Cell layers: data int8[9, N_CELLS], flat cells (cell = 6*row + col).

    block 0 none / 1 data / 2 program / 3 question; points (data blocks, 1..9);
    program (program blocks); spawn (transmissions released when siphoned);
    siphoned (walkable block); centre (player stood here to siphon); credits,
    energy (collected by walking onto the cell); pickup (+1 data siphon).
    """
    data: Array


@_packed(("active", "kind", "row", "col", "hp", "stunned", "from_siphon"),
         bools=("active", "stunned", "from_siphon"))
class Enemies(NamedTuple):
    """data int8[7, MAX_UNITS]; kind 0 virus, 1 daemon, 2 glitch, 3 cryptog;
    stunned: skips the next enemy phase (move and attack)."""
    data: Array


@_packed(("active", "kind", "row", "col", "turns", "from_siphon"),
         bools=("active", "from_siphon"))
class Transmissions(NamedTuple):
    """data int8[6, MAX_UNITS]: countdowns (turns left) that hatch into enemies of `kind`."""
    data: Array


STATS = ("row", "col", "hp", "credits", "energy", "score", "siphons", "attack", "stage", "turn",
         "next_spawn", "atk_uses", "show", "calm", "step_active", "exit_cell")
_STAT = {name: i for i, name in enumerate(STATS)}
_BOOL_STATS = ("show", "calm", "step_active")
_OWNED = slice(len(STATS), len(STATS) + N_PROGRAMS)
_RECORDS = ("board", "enemies", "trans")


class Game(NamedTuple):
    """Everything the rules act on.

    stats int32[16 + 23]: the scalars in STATS order, then the owned-program
    flags. siphons = data siphons held; stage 1..8 (9 once won); turn +1 per
    turn-ending action, never reset; next_spawn = turn of the next scheduled
    transmission; atk_uses = ATK+ uses this stage; show / calm / step_active =
    SHOW, CALM (both this stage) and STEP (skip the next enemy move);
    exit_cell = flat index of the exit.
    """
    stats: Array
    board: Board
    enemies: Enemies
    trans: Transmissions

    @property
    def owned(self):
        return self.stats[..., _OWNED] != 0

    def set(self, **changes):
        records = {k: changes.pop(k) for k in _RECORDS if k in changes}
        if changes:
            batch = self.stats.shape[:-1]
            owned = changes.pop("owned", None)
            scalars = jnp.stack([jnp.broadcast_to(jnp.asarray(changes.pop(n), jnp.int32), batch)
                                 if n in changes else self.stats[..., i] for n, i in _STAT.items()], axis=-1)
            assert not changes, f"unknown fields {sorted(changes)}"
            owned = self.stats[..., _OWNED] if owned is None else jnp.asarray(owned, jnp.int32)
            records["stats"] = jnp.concatenate([scalars, jnp.broadcast_to(owned, batch + (N_PROGRAMS,))], axis=-1)
        return self._replace(**records)


for _name, _i in _STAT.items():   # views work on batched states too
    setattr(Game, _name, property(lambda self, i=_i: self.stats[..., i] != 0) if _name in _BOOL_STATS
            else property(lambda self, i=_i: self.stats[..., i]))


class EnvState(NamedTuple):
    game: Game
    snapshot: Game          # the game at the start of the current turn, for UNDO
    undo_valid: Array       # bool: a program ran since the snapshot
    turn_reward: Array      # float32: reward earned since the snapshot (UNDO rewinds it)
    exit_dist: Array        # int32: BFS distance to the exit, for reward shaping
    episode_return: Array   # float32
    episode_length: Array   # int32


class Obs(NamedTuple):
    features: Array         # float32[1545], every value in [0, 1]
    action_mask: Array      # bool[28]


class EnvParams(NamedTuple):
    """Episode limit, starting kit and reward coefficients (a pytree: may be traced,
    so different values reuse one compilation)."""
    max_steps_in_episode: int = 1000   # truncation; <= 0 disables it
    # Starting kit of every episode (the port starts empty; Swift gives a small
    # bonus). Handy for curricula and for tests that need programs in play.
    start_credits: int = 0
    start_energy: int = 0
    start_siphons: int = 0
    start_programs: int = 0            # bitmask: bit i set = program i owned
    invalid_action_penalty: float = -0.1
    step_penalty: float = -0.01
    score_coef: float = 0.5
    kill_reward: float = 0.3
    siphon_reward: float = 1.0
    shaping_coef: float = 0.05
    hp_coef: float = 1.0
    victory_reward: float = 500.0
    victory_score_coef: float = 100.0
    death_coef: float = 0.5
    siphon_death_penalty: float = -10.0
    resource_coef: float = 0.05
    holding_coef: float = 0.01
    waste_penalty: float = -0.3
    stage_rewards: tuple = tuple(float(x) for x in STAGE_REWARDS)


def new_game(board: Board, exit_cell, trans: Transmissions, params: EnvParams | None = None) -> Game:
    """Start of an episode (RULES §2): player at (0,0), 3 HP, attack 1, plus the
    params' starting kit (empty by default)."""
    params = EnvParams() if params is None else params
    start = dict(hp=3, attack=1, stage=1, next_spawn=SPAWN_INTERVAL, exit_cell=exit_cell,
                 credits=params.start_credits, energy=params.start_energy, siphons=params.start_siphons)
    owned = (jnp.asarray(params.start_programs, jnp.int32) >> jnp.arange(N_PROGRAMS)) & 1
    stats = jnp.concatenate([jnp.stack([jnp.asarray(start.get(n, 0), jnp.int32) for n in STATS]), owned])
    return Game(stats, board, Enemies.make(MAX_UNITS), trans)


def tree_where(pred, a, b):
    """Per-leaf select of two pytrees of the same structure (pred is a scalar)."""
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def insert(table, new):
    """Put the active rows of `new` ([K] slots) into the lowest free slots of `table`.

    Rows keep their order; rows that find no free slot are dropped (RULES §1).
    Free slot s takes the new row whose rank among active rows equals the rank
    of s among free slots: one [slots, K] match, then one gather.
    """
    free = ~table.active
    free_rank = prefix_count(free) - 1
    new_rank = prefix_count(new.active) - 1
    match = new.active[None, :] & (new_rank[None, :] == free_rank[:, None])   # [slots, K]
    src = jnp.minimum(first_true(match, axis=1), match.shape[1] - 1)
    taken = free & (free_rank < new.active.sum())
    return type(table)(jnp.where(taken[None, :], new.data[:, src], table.data))
