"""HackMatrix rules on hand-built states: moves, line of sight, siphon, enemy phase,
stage completion, death, victory, UNDO, the mask and the observation encoding.

All single-env steps go through the adapter's module-level jits, so this file,
the program tests and the gymnasium tests share one compilation.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raysys.envs import hackmatrix as hm
from raysys.envs.hackmatrix import constants as C
from raysys.envs.hackmatrix.gym_env import jit_action_mask, jit_step_no_reset
from raysys.envs.hackmatrix.scenario import build_state

P = hm.EnvParams()
UP, DOWN, LEFT, RIGHT, SIPHON = range(5)
WAIT = C.PROGRAM_BASE + C.WAIT


def act(state, action, key=0, params=P):
    """One step without auto-reset: (obs, state, reward, done, info, terms)."""
    obs, s, r, done, info = jit_step_no_reset(jax.random.PRNGKey(key), state, jnp.int32(action), params)
    info = jax.device_get(info)
    return obs, s, float(r), bool(done), info, dict(zip(hm.REWARD_TERMS, info["reward_terms"].tolist()))


observe = jax.jit(hm.observe)


def mask(state):
    return np.asarray(jit_action_mask(state))


def pos(state):
    return int(state.game.row), int(state.game.col)


def units_at(table, rc):
    a = np.asarray(table.active)
    return [i for i in np.flatnonzero(a) if (int(table.row[i]), int(table.col[i])) == rc]


# ---- movement -------------------------------------------------------------------

def test_move_collects_credits_energy_and_pickup():
    s = build_state(player=(2, 2), resources={(3, 2): (2, 1)}, pickups=[(3, 2)])
    _, s2, r, done, info, t = act(s, UP)
    g = s2.game
    assert pos(s2) == (3, 2) and not done
    assert (int(g.credits), int(g.energy), int(g.siphons), int(g.turn)) == (2, 1, 1, 1)
    assert int(g.board.credits[20]) == 0 and int(g.board.energy[20]) == 0 and not bool(g.board.pickup[20])
    assert t["resource_gain"] == pytest.approx(0.15) and t["data_siphon"] == pytest.approx(1.0)
    assert t["distance_shaping"] == pytest.approx(0.05)      # BFS 6 -> 5
    assert r == pytest.approx(sum(t.values()))


def test_edges_and_blocks_mask_moves():
    s = build_state(player=(0, 0), blocks={(1, 0): ("data", 3)})
    m = mask(s)
    assert not m[UP] and not m[DOWN] and not m[LEFT] and m[RIGHT]
    # a siphoned block can be walked on
    s = build_state(player=(0, 0), blocks={(1, 0): ("data", 3)}, siphoned=[(1, 0)])
    assert mask(s)[UP]
    assert pos(act(s, UP)[1]) == (1, 0)


def test_invalid_action_is_a_noop_with_penalty():
    s = build_state(player=(0, 0))
    _, s2, r, done, info, t = act(s, DOWN)
    assert bool(info["invalid_action"]) and not done
    for a, b in zip(jax.tree.leaves(s.game), jax.tree.leaves(s2.game)):
        np.testing.assert_array_equal(a, b)
    assert int(s2.episode_length) == 1
    assert r == pytest.approx(P.step_penalty + P.invalid_action_penalty)
    # a program that is not owned is invalid too and costs nothing
    s = build_state(player=(0, 0), energy=5)
    _, s2, _, _, info, _ = act(s, WAIT)
    assert bool(info["invalid_action"]) and int(s2.game.energy) == 5 and int(s2.game.turn) == 0


# ---- line of sight ---------------------------------------------------------------

def test_attack_through_block_at_range():
    s = build_state(player=(2, 2), blocks={(3, 2): ("data", 3)}, enemies=[("virus", 5, 2)], calm=True)
    assert mask(s)[UP]                                       # blocked cell, but a target in line
    _, s2, *_ = act(s, UP)
    assert pos(s2) == (2, 2)
    assert int(s2.game.enemies.hp[0]) == 1                   # 2 - attack 1; the phase then moves it


def test_attack_kills_and_pays_kill_reward():
    s = build_state(player=(2, 2), attack=2, enemies=[("virus", 2, 5)], calm=True)
    _, s2, r, _, _, t = act(s, RIGHT)
    assert not bool(s2.game.enemies.active[0]) and t["kills"] == pytest.approx(0.3)


def test_enemy_beats_transmission_on_same_cell_and_nearest_first():
    s = build_state(player=(0, 0), transmissions=[("virus", 0, 3, 5)], enemies=[("daemon", 0, 3)],
                    calm=True)
    _, s2, *_ = act(s, RIGHT)
    assert int(s2.game.enemies.hp[0]) == 2 and bool(s2.game.trans.active[0])
    # a nearer transmission is hit first and dies in one hit
    s = build_state(player=(0, 0), transmissions=[("virus", 0, 2, 5)], enemies=[("daemon", 0, 4)],
                    step_active=True, calm=True)
    _, s2, *_ = act(s, RIGHT)
    assert not bool(s2.game.trans.active[0]) and int(s2.game.enemies.hp[0]) == 3


def test_lowest_slot_wins_among_stacked_enemies():
    s = build_state(player=(0, 0), enemies=[("daemon", 3, 0), ("daemon", 3, 0)], step_active=True, calm=True)
    _, s2, *_ = act(s, UP)
    assert [int(h) for h in s2.game.enemies.hp[:2]] == [2, 3]


# ---- siphon ----------------------------------------------------------------------

def test_siphon_prefers_program_and_releases_spread_transmissions():
    s = build_state(player=(2, 2), siphons=1, blocks={(3, 2): ("data", 9), (2, 3): ("program", "WARP", 4)},
                    calm=True)
    assert mask(s)[SIPHON]
    _, s2, r, _, _, t = act(s, SIPHON)
    g = s2.game
    assert bool(g.owned[C.WARP]) and int(g.score) == 0
    assert bool(g.board.siphoned[C.GRID * 2 + 3]) and not bool(g.board.siphoned[C.GRID * 3 + 2])
    assert bool(g.board.centre[C.GRID * 2 + 2])
    assert int(g.siphons) == 0 and int(g.next_spawn) == 12 + C.SIPHON_DELAY and int(g.turn) == 1
    active = np.flatnonzero(np.asarray(g.trans.active))
    assert len(active) == 4                                  # spawn 4
    cells = {(int(g.trans.row[i]), int(g.trans.col[i])) for i in active}
    assert len(cells) == 4 and (2, 2) not in cells and (3, 2) not in cells   # distinct, free cells
    assert all(int(g.trans.turns[i]) == 2 and bool(g.trans.from_siphon[i]) for i in active)   # 3, ticked once
    assert t["data_siphon"] == 0.0 and int(g.credits) == 0


def test_siphon_data_scores_and_ties_go_up_first():
    s = build_state(player=(2, 2), siphons=2, blocks={(3, 2): ("data", 5, 0), (2, 3): ("data", 5, 0)}, calm=True)
    _, s2, r, _, _, t = act(s, SIPHON)
    assert bool(s2.game.board.siphoned[C.GRID * 3 + 2]) and not bool(s2.game.board.siphoned[C.GRID * 2 + 3])
    assert int(s2.game.score) == 5 and t["score_gain"] == pytest.approx(2.5)
    assert not np.asarray(s2.game.trans.active).any()       # spawn 0 -> nothing released


def test_siphon_without_candidate_only_spends_the_siphon():
    s = build_state(player=(2, 2), siphons=1, calm=True)
    assert mask(s)[SIPHON]
    _, s2, *_ = act(s, SIPHON)
    assert int(s2.game.siphons) == 0 and int(s2.game.next_spawn) == 12 and int(s2.game.turn) == 1
    assert not mask(build_state(player=(2, 2), siphons=0))[SIPHON]


# ---- enemy phase -----------------------------------------------------------------

def test_enemy_movement_speeds_and_attack():
    s = build_state(player=(0, 0), enemies=[("virus", 5, 0), ("daemon", 0, 5), ("glitch", 1, 0)], calm=True,
                    energy=1, owned=["WAIT"])
    _, s2, r, _, _, t = act(s, WAIT)
    e = s2.game.enemies
    assert (int(e.row[0]), int(e.col[0])) == (3, 0)          # virus: 2 steps
    assert (int(e.row[1]), int(e.col[1])) == (0, 4)          # daemon: 1 step
    assert (int(e.row[2]), int(e.col[2])) == (1, 0)          # adjacent: stays and attacks
    assert int(s2.game.hp) == 2 and t["damage_penalty"] == -1.0


def test_blocked_enemy_tries_other_axis_glitch_walks_through():
    blocks = {(3, 3): ("data", 1)}
    s = build_state(player=(1, 1), blocks=blocks, enemies=[("daemon", 4, 3), ("glitch", 4, 3)],
                    calm=True, energy=1, owned=["WAIT"])
    _, s2, *_ = act(s, WAIT)
    e = s2.game.enemies
    assert (int(e.row[0]), int(e.col[0])) == (4, 2)          # rows first is blocked -> column step
    assert (int(e.row[1]), int(e.col[1])) == (3, 3)          # glitch ignores blocks
    # both axes blocked -> stays (never diagonal, never onto the block)
    blocks = {(3, 3): ("data", 1), (4, 2): ("data", 1)}
    s = build_state(player=(1, 1), blocks=blocks, enemies=[("daemon", 4, 3)], calm=True, energy=1, owned=["WAIT"])
    e = act(s, WAIT)[1].game.enemies
    assert (int(e.row[0]), int(e.col[0])) == (4, 3)


def test_stunned_enemy_skips_phase_and_step_skips_movement_only():
    s = build_state(player=(0, 0), enemies=[{"kind": "daemon", "row": 0, "col": 1, "stunned": 1}],
                    calm=True, energy=1, owned=["WAIT"])
    _, s2, *_ = act(s, WAIT)
    assert int(s2.game.hp) == 3 and not bool(s2.game.enemies.stunned[0])
    s = build_state(player=(0, 0), enemies=[("daemon", 0, 1), ("daemon", 3, 3)], step_active=True,
                    calm=True, energy=1, owned=["WAIT"])
    _, s2, *_ = act(s, WAIT)
    assert int(s2.game.hp) == 2                              # adjacent one still attacks
    assert (int(s2.game.enemies.row[1]), int(s2.game.enemies.col[1])) == (3, 3)
    assert not bool(s2.game.step_active)


def test_transmission_hatches_and_moves_at_once():
    s = build_state(player=(0, 0), transmissions=[("daemon", 3, 0, 1), ("virus", 5, 5, 2)], calm=True,
                    energy=1, owned=["WAIT"])
    _, s2, *_ = act(s, WAIT)
    g = s2.game
    assert not bool(g.trans.active[0]) and bool(g.enemies.active[0]) and int(g.enemies.kind[0]) == C.DAEMON
    assert (int(g.enemies.row[0]), int(g.enemies.col[0])) == (2, 0) and int(g.enemies.hp[0]) == 3
    assert int(g.trans.turns[1]) == 1


def test_scheduled_spawn_and_calm():
    kw = dict(player=(0, 0), turn=11, next_spawn=12, energy=1, owned=["WAIT"])
    _, s2, *_ = act(build_state(**kw), WAIT)
    t = s2.game.trans
    assert np.asarray(t.active).sum() == 1 and int(t.turns[0]) == 1 and int(s2.game.next_spawn) == 24
    assert (int(t.row[0]), int(t.col[0])) != (0, 0)
    _, s3, *_ = act(build_state(calm=True, **kw), WAIT)
    assert not np.asarray(s3.game.trans.active).any()


# ---- stages, death, victory --------------------------------------------------------

def test_stage_completion_generates_next_stage():
    s = build_state(player=(5, 4), exit=(5, 5), hp=2, credits=3, energy=4, stage=1,
                    enemies=[("daemon", 0, 0)], owned=["CALM"], calm=True, turn=7)
    _, s2, r, done, info, t = act(s, RIGHT)
    g = s2.game
    assert not done and int(g.stage) == 2 and int(info["stage"]) == 2 and int(g.hp) == 3
    assert pos(s2) == (5, 5) and int(g.exit_cell) in (0, 5, 30)
    assert not np.asarray(g.enemies.active).any() and np.asarray(g.trans.active).sum() == 2
    n_blocks = int((np.asarray(g.board.block) != 0).sum())
    assert 5 <= n_blocks <= 11 and not (np.asarray(g.board.block)[C.CORNERS] != 0).any()
    pickups = set(np.flatnonzero(np.asarray(g.board.pickup)).tolist())
    assert pickups == set(C.CORNERS.tolist()) - {35, int(g.exit_cell)}
    assert not bool(g.calm) and int(g.next_spawn) == 8 + 12 and bool(g.owned[C.CALM])
    assert t["stage_completion"] == 1.0 and t["kills"] == 0.0           # no stage-wipe kills
    assert t["distance_shaping"] == pytest.approx(0.05)                # the last step pays
    assert t["hp_recovery"] == 1.0 and t["resource_holding"] == pytest.approx(0.07)


def test_warp_onto_exit_completes_stage():
    s = build_state(player=(0, 0), exit=(5, 5), transmissions=[("virus", 5, 5, 3)], credits=2, energy=2,
                    owned=["WARP"], calm=True)
    _, s2, r, _, info, t = act(s, C.PROGRAM_BASE + C.WARP)
    assert int(s2.game.stage) == 2 and t["stage_completion"] == 1.0


def test_death_penalties():
    s = build_state(player=(2, 2), hp=1, stage=3, enemies=[{"kind": "daemon", "row": 2, "col": 3, "from_siphon": 1}],
                    energy=1, owned=["WAIT"], calm=True)
    _, s2, r, done, info, t = act(s, WAIT)
    assert done and bool(info["terminated"]) and not bool(info["won"]) and int(s2.game.hp) == 0
    assert t["death_penalty"] == pytest.approx(-1.5)                   # -0.5 * (1 + 2)
    assert t["siphon_death_penalty"] == -10.0 and t["damage_penalty"] == -1.0
    assert float(info["episode_return"]) == pytest.approx(r) and int(info["episode_length"]) == 1


def test_death_beats_completion_on_the_exit():
    # Two enemies next to the exit finish the player on the step onto it.
    s = build_state(player=(5, 4), hp=1, exit=(5, 5), enemies=[("daemon", 4, 5), ("daemon", 3, 4)], calm=True)
    _, s2, r, done, info, t = act(s, RIGHT)
    assert done and int(s2.game.stage) == 1 and t["stage_completion"] == 0.0


def test_victory_on_stage_8():
    s = build_state(player=(0, 1), exit=(0, 0), stage=8, score=3, calm=True)
    _, s2, r, done, info, t = act(s, LEFT)
    assert done and bool(info["won"]) and bool(info["terminated"]) and int(info["stage"]) == 9
    assert t["stage_completion"] == 100.0 and t["victory"] == pytest.approx(500 + 300)


def test_truncation():
    params = P._replace(max_steps_in_episode=2)
    s = build_state(player=(0, 0), calm=True)
    _, s, _, done, info, _ = act(s, UP, params=params)
    assert not done
    _, s, _, done, info, _ = act(s, DOWN, params=params)
    assert done and bool(info["truncated"]) and not bool(info["terminated"])


# ---- UNDO, forced WAIT -------------------------------------------------------------

def test_undo_restores_turn_start_and_rewinds_reward():
    s = build_state(player=(2, 2), credits=7, owned=["SIPH+", "UNDO"], calm=True)
    assert not mask(s)[C.PROGRAM_BASE + C.UNDO]
    _, s1, r1, *_ = act(s, C.PROGRAM_BASE + C.SIPH_PLUS)
    assert int(s1.game.siphons) == 1 and int(s1.game.credits) == 2 and mask(s1)[C.PROGRAM_BASE + C.UNDO]
    _, s2, r2, _, _, t = act(s1, C.PROGRAM_BASE + C.UNDO)
    assert int(s2.game.siphons) == 0 and int(s2.game.credits) == 6   # refunded, minus UNDO's 1
    assert t["undo_rewind"] == pytest.approx(-(r1 - P.step_penalty))
    assert r1 + r2 == pytest.approx(2 * P.step_penalty - P.resource_coef)
    assert not mask(s2)[C.PROGRAM_BASE + C.UNDO]
    # a turn-ending action takes a new snapshot: nothing left to undo
    _, s3, *_ = act(s1, UP)
    assert not mask(s3)[C.PROGRAM_BASE + C.UNDO]


def test_walled_in_player_gets_a_free_wait():
    s = build_state(player=(0, 0), blocks={(1, 0): ("data", 1), (0, 1): ("data", 1)}, calm=True)
    m = mask(s)
    assert m.sum() == 1 and m[WAIT]
    _, s2, _, _, info, _ = act(s, WAIT)
    assert not bool(info["invalid_action"]) and int(s2.game.turn) == 1 and int(s2.game.energy) == 0


# ---- observation ---------------------------------------------------------------------

def idx(r, c, ch):
    return C.N_PLAYER + C.N_PROGRAMS + (C.GRID * r + c) * C.N_CHANNELS + ch


def test_observation_encoding():
    s = build_state(player=(1, 2), hp=2, credits=100, siphons=30, stage=3, attack=2, owned=["WAIT"],
                    enemies=[("daemon", 4, 2), ("cryptog", 4, 4), ("cryptog", 1, 5)],
                    transmissions=[("virus", 3, 0, 2)], blocks={(2, 2): ("program", "HACK"), (0, 3): ("data", 7)},
                    siphoned=[(0, 3)], resources={(5, 0): (3, 0)}, pickups=[(0, 5)], exit=(5, 5))
    f = np.asarray(observe(s).features)
    assert f.shape == (C.OBS_SIZE,) == (1545,) and f.min() >= 0 and f.max() <= 1
    np.testing.assert_allclose(f[:10], [0.2, 0.4, 2 / 3, 1, 0, 2 / 7, 1, 0.5, 0, 0], rtol=1e-6)
    assert f[10 + C.WAIT] == 1 and f[10:33].sum() == 1
    assert f[idx(4, 2, 1)] == 1 and f[idx(4, 2, 4)] == 1            # daemon, hp 3/3
    assert f[idx(4, 4, 3)] == 0                                        # cryptog hidden
    assert f[idx(1, 5, 3)] == 1                                        # cryptog in the player's row
    assert f[idx(3, 0, 36)] == pytest.approx(0.5)                      # transmission, 2 turns
    assert f[idx(2, 2, 8)] == 1 and f[idx(2, 2, 12 + C.HACK)] == 1 and f[idx(2, 2, 35)] == pytest.approx(2 / 9)
    assert f[idx(0, 3, 7)] == 1 and f[idx(0, 3, 10)] == pytest.approx(7 / 9) and f[idx(0, 3, 11)] == 1
    assert f[idx(5, 0, 37)] == 1 and f[idx(0, 5, 39)] == 1 and f[idx(5, 5, 40)] == 1
    shown = build_state(**{**dict(player=(1, 2), enemies=[("cryptog", 4, 4)]), "show": True})
    assert np.asarray(observe(shown).features)[idx(4, 4, 3)] == 1
