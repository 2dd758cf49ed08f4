"""Each of the 23 programs on a hand-built state where it applies: its mask
(owned, credits, energy, extra condition) and its effect."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raysys.envs import hackmatrix as hm
from raysys.envs.hackmatrix import constants as C
from raysys.envs.hackmatrix.gym_env import jit_action_mask, jit_step_no_reset
from raysys.envs.hackmatrix.scenario import build_state

P = hm.EnvParams()


def act(state, action, key=0):
    obs, s, r, done, info = jit_step_no_reset(jax.random.PRNGKey(key), state, jnp.int32(action), P)
    info = jax.device_get(info)
    return s, float(r), dict(zip(hm.REWARD_TERMS, info["reward_terms"].tolist())), info


def at(table, i):
    return int(table.row[i]), int(table.col[i])


# Each case: the state (player at (2,2) unless given), an optional state where only
# the extra condition fails, and a check(before_game, after_game, terms).
CASES = {
    "PUSH": dict(state=dict(enemies=[("virus", 3, 3), ("daemon", 0, 2), ("glitch", 2, 3)]),
                 not_applicable=dict(),
                 check=lambda g0, g, t: [at(g.enemies, i) for i in range(3)] == [(4, 4), (0, 2), (2, 4)]),
    "PULL": dict(state=dict(enemies=[("virus", 4, 4), ("daemon", 3, 3), ("glitch", 2, 5)]),
                 not_applicable=dict(),
                 check=lambda g0, g, t: [at(g.enemies, i) for i in range(3)] == [(3, 3), (3, 3), (2, 4)]),
    "CRASH": dict(state=dict(blocks={(3, 3): ("data", 2)}, transmissions=[("virus", 5, 5, 3)],
                             enemies=[("daemon", 0, 5), {"kind": "glitch", "row": 5, "col": 0, "hp": 1}]),
                  not_applicable=dict(blocks={(4, 4): ("data", 2)}, enemies=[("daemon", 0, 5)]),
                  check=lambda g0, g, t: (int(g.enemies.hp[0]) == 2 and not bool(g.enemies.active[1])
                                          and bool(g.trans.active[0]) and int(g.board.block[21]) == 1
                                          and t["kills"] == pytest.approx(0.3))),
    "WARP": dict(state=dict(enemies=[("daemon", 4, 1)], transmissions=[("virus", 4, 1, 3)],
                            resources={(4, 1): (2, 0)}),
                 not_applicable=dict(),
                 check=lambda g0, g, t: ((int(g.row), int(g.col)) == (4, 1) and not np.asarray(g.enemies.active).any()
                                         and not np.asarray(g.trans.active).any()
                                         and int(g.board.credits[25]) == 2       # no pickup on landing
                                         and t["kills"] == pytest.approx(0.3))),
    "POLY": dict(state=dict(enemies=[{"kind": "virus", "row": 5, "col": 5, "hp": 1}, ("daemon", 0, 5)]),
                 not_applicable=dict(transmissions=[("virus", 5, 5, 3)]),
                 check=lambda g0, g, t: all(int(g.enemies.kind[i]) != int(g0.enemies.kind[i])
                                            and int(g.enemies.hp[i]) == C.ENEMY_HP[int(g.enemies.kind[i])]
                                            for i in range(2))),
    "WAIT": dict(state=dict(transmissions=[("virus", 5, 5, 3)]),
                 check=lambda g0, g, t: int(g.turn) == 1 and int(g.trans.turns[0]) == 2),
    "DEBUG": dict(state=dict(blocks={(3, 3): ("data", 2), (4, 4): ("data", 2)}, siphoned=[(4, 4)],
                             enemies=[("glitch", 3, 3), ("daemon", 4, 4), ("daemon", 0, 5)]),
                  not_applicable=dict(blocks={(3, 3): ("data", 2)}, enemies=[("daemon", 0, 5)]),
                  check=lambda g0, g, t: ([int(h) for h in g.enemies.hp[:3]] == [1, 2, 3]
                                          and [bool(s) for s in g.enemies.stunned[:3]] == [True, True, False])),
    "ROW": dict(state=dict(enemies=[("daemon", 2, 5), ("daemon", 3, 5)]),
                not_applicable=dict(enemies=[("daemon", 3, 5)]),
                check=lambda g0, g, t: ([int(h) for h in g.enemies.hp[:2]] == [2, 3]
                                        and not np.asarray(g.enemies.stunned).any())),
    "COL": dict(state=dict(enemies=[("daemon", 5, 2), ("daemon", 3, 5)]),
                not_applicable=dict(enemies=[("daemon", 3, 5)]),
                check=lambda g0, g, t: [int(h) for h in g.enemies.hp[:2]] == [2, 3]),
    # UNDO needs something to undo: SIPH+ runs first (see test_program).
    "UNDO": dict(state=dict(owned=["SIPH+"], credits=C.PROGRAM_CREDITS[C.SIPH_PLUS]), before="SIPH+",
                 check=lambda g0, g, t: int(g.siphons) == 0 and t["undo_rewind"] < 0),
    "STEP": dict(state=dict(), check=lambda g0, g, t: bool(g.step_active)),
    "SIPH+": dict(state=dict(), check=lambda g0, g, t: int(g.siphons) == 1 and t["data_siphon"] == 1.0),
    "EXCH": dict(state=dict(), check=lambda g0, g, t: int(g.energy) == int(g0.energy) + 4),
    "SHOW": dict(state=dict(), not_applicable=dict(show=True), check=lambda g0, g, t: bool(g.show)),
    "RESET": dict(state=dict(hp=1), not_applicable=dict(hp=3),
                  check=lambda g0, g, t: int(g.hp) == 3 and t["program_waste"] == 0.0),
    "CALM": dict(state=dict(), not_applicable=dict(calm=True), check=lambda g0, g, t: bool(g.calm)),
    "D_BOM": dict(state=dict(enemies=[("daemon", 0, 5), ("daemon", 4, 4), ("virus", 5, 5), ("virus", 4, 2)]),
                  not_applicable=dict(enemies=[("virus", 5, 5)]),
                  check=lambda g0, g, t: ([bool(a) for a in g.enemies.active[:4]] == [True, False, True, True]
                                          and int(g.enemies.hp[2]) == 1 and bool(g.enemies.stunned[2])
                                          and int(g.enemies.hp[3]) == 2 and int(g.enemies.hp[0]) == 3)),
    "DELAY": dict(state=dict(transmissions=[("virus", 5, 5, 1), ("glitch", 0, 5, 2)]),
                  not_applicable=dict(enemies=[("virus", 5, 5)]),
                  check=lambda g0, g, t: [int(x) for x in g.trans.turns[:2]] == [4, 5]),
    "ANTI-V": dict(state=dict(enemies=[("virus", 5, 5), ("daemon", 0, 5)]),
                   not_applicable=dict(enemies=[("daemon", 0, 5)]),
                   check=lambda g0, g, t: (int(g.enemies.hp[0]) == 1 and bool(g.enemies.stunned[0])
                                           and int(g.enemies.hp[1]) == 3)),
    "SCORE": dict(state=dict(stage=3), not_applicable=dict(stage=8),
                  check=lambda g0, g, t: int(g.score) == 5 and t["score_gain"] == pytest.approx(2.5)),
    "REDUC": dict(state=dict(blocks={(3, 3): ("data", 4), (4, 4): ("data", 4), (5, 1): ("program", 0, 0)},
                             siphoned=[(4, 4)]),
                  not_applicable=dict(blocks={(3, 3): ("data", 4, 0), (4, 4): ("data", 4)}, siphoned=[(4, 4)]),
                  check=lambda g0, g, t: ([int(g.board.spawn[c]) for c in (21, 28, 31)] == [3, 4, 0])),
    "ATK+": dict(state=dict(atk_uses=1), not_applicable=dict(atk_uses=2),
                 check=lambda g0, g, t: int(g.attack) == 2 and int(g.atk_uses) == 2),
    "HACK": dict(state=dict(blocks={(3, 3): ("data", 2), (4, 4): ("data", 2)}, siphoned=[(4, 4)],
                            enemies=[("glitch", 3, 3), ("daemon", 4, 4)]),
                 not_applicable=dict(blocks={(3, 3): ("data", 2)}, enemies=[("glitch", 3, 3)]),
                 check=lambda g0, g, t: [int(h) for h in g.enemies.hp[:2]] == [2, 1]
                 and not np.asarray(g.enemies.stunned).any()),
}


def test_every_program_has_a_case():
    assert set(CASES) == set(C.PROGRAM_NAMES)


@pytest.mark.parametrize("name", C.PROGRAM_NAMES)
def test_program(name):
    i = C.PROGRAM_NAMES.index(name)
    action = C.PROGRAM_BASE + i
    cost_c, cost_e = int(C.PROGRAM_CREDITS[i]), int(C.PROGRAM_ENERGY[i])
    case = CASES[name]
    base = dict(player=(2, 2), calm=name != "CALM", credits=cost_c + 3, energy=cost_e + 3)
    kw = {**base, **case["state"], "owned": [name] + list(case["state"].get("owned", []))}
    if "credits" in case["state"]:
        kw["credits"] = case["state"]["credits"] + cost_c + 3
    s = build_state(**kw)
    if "before" in case:
        s = act(s, C.PROGRAM_BASE + C.PROGRAM_NAMES.index(case["before"]))[0]

    m = np.asarray(jit_action_mask(s))
    assert m[action], f"{name} should be legal here"
    if "before" not in case:
        assert not np.asarray(jit_action_mask(build_state(**{**kw, "owned": []})))[action]
        if cost_c:
            assert not np.asarray(jit_action_mask(build_state(**{**kw, "credits": cost_c - 1})))[action]
        if cost_e:
            assert not np.asarray(jit_action_mask(build_state(**{**kw, "energy": cost_e - 1})))[action]
    if "not_applicable" in case:
        other = {**base, **case["not_applicable"], "owned": [name]}
        if "enemies" not in case["not_applicable"] and name not in ("SCORE", "ATK+", "RESET", "SHOW", "CALM"):
            other.setdefault("enemies", [])
        assert not np.asarray(jit_action_mask(build_state(**other)))[action], f"{name} should not apply"

    g0 = s.game
    s2, r, t, info = act(s, action)
    g = s2.game
    assert not bool(info["invalid_action"])
    assert case["check"](g0, g, t), f"{name}: unexpected effect"
    if name == "UNDO":
        return
    expect_energy = int(g0.energy) - cost_e + (4 if name == "EXCH" else 0)
    assert int(g.credits) == int(g0.credits) - cost_c
    assert int(g.energy) == expect_energy
    assert int(g.turn) == int(g0.turn) + (name == "WAIT")          # only WAIT ends the turn
    assert r == pytest.approx(sum(t.values()))


def test_reset_at_two_hp_is_wasteful():
    s = build_state(player=(2, 2), hp=2, energy=4, owned=["RESET"], calm=True)
    s2, r, t, _ = act(s, C.PROGRAM_BASE + C.RESET)
    assert int(s2.game.hp) == 3 and t["program_waste"] == pytest.approx(-0.3)


def test_warp_picks_uniformly_over_units():
    s = build_state(player=(2, 2), enemies=[("daemon", 0, 5)], transmissions=[("virus", 5, 0, 3)],
                    credits=2, energy=2, owned=["WARP"], calm=True)
    landed = {(int(act(s, C.PROGRAM_BASE + C.WARP, key=k)[0].game.row),
               int(act(s, C.PROGRAM_BASE + C.WARP, key=k)[0].game.col)) for k in range(12)}
    assert landed == {(0, 5), (5, 0)}
