"""Invariants over thousands of random masked rollouts (vmapped, jitted, lax.scan),
plus the jit/vmap/shape contract of the pure API."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raysys.envs import hackmatrix as hm
from raysys.envs.hackmatrix import constants as C
from raysys.envs.hackmatrix.gym_env import jit_vreset
from raysys.envs.hackmatrix.rewards import exit_distance

NUM_ENVS, NUM_STEPS = 256, 150
RICH = hm.EnvParams(start_credits=40, start_energy=40, start_siphons=3, start_programs=C.ALL_PROGRAMS)


def invariants(state, action, obs, nxt, reward, done, info):
    """Named bools that must hold after every step (per env)."""
    g, e, t, b = nxt.game, nxt.game.enemies, nxt.game.trans, nxt.game.board
    on_board = lambda r, c: (r >= 0) & (r < C.GRID) & (c >= 0) & (c < C.GRID)   # noqa: E731
    player = C.GRID * g.row + g.col
    m = obs.action_mask
    forced_wait = m[C.PROGRAM_BASE + C.WAIT] & (m.sum() == 1)
    affordable = g.owned & (g.credits >= C.PROGRAM_CREDITS) & (g.energy >= C.PROGRAM_ENERGY)
    is_wait = jnp.arange(C.N_PROGRAMS) == C.WAIT
    hp_max = jnp.asarray(C.ENEMY_HP)[e.kind]
    pairs = zip(jax.tree.leaves(nxt.snapshot), jax.tree.leaves(g))
    same_snapshot = jnp.stack([(a == b2).all() for a, b2 in pairs]).all()
    return dict(
        hp=(g.hp >= 1) & (g.hp <= C.MAX_HP),
        position=on_board(g.row, g.col),
        counts=(g.credits >= 0) & (g.energy >= 0) & (g.score >= 0) & (g.siphons >= 0),
        attack=(g.attack >= 1) & (g.attack <= C.MAX_ATTACK) & (g.atk_uses >= 0) & (g.atk_uses <= 2),
        stage=(g.stage >= 1) & (g.stage <= C.LAST_STAGE),
        exit=jnp.isin(g.exit_cell, C.CORNERS) & (g.exit_cell != player),
        enemies=(~e.active | ((e.kind >= 0) & (e.kind < 4) & (e.hp >= 1) & (e.hp <= hp_max)
                              & on_board(e.row, e.col) & (C.GRID * e.row + e.col != player))).all(),
        transmissions=(~t.active | ((t.turns >= 1) & (t.kind >= 0) & (t.kind < 4) & on_board(t.row, t.col)
                                    & (C.GRID * t.row + t.col != player))).all(),
        board=(((b.block >= 0) & (b.block <= 2) & (b.points >= 0) & (b.points <= 9) & (b.spawn >= 0)
                & (b.spawn <= 9) & (b.credits >= 0) & (b.credits <= 3) & (b.energy >= 0) & (b.energy <= 3)
                & (~b.siphoned | (b.block != 0)) & (~b.pickup | jnp.asarray(C.IS_CORNER))).all()),
        mask_matches_state=(m == hm.action_mask(nxt)).all(),
        mask_costs=(~m[C.PROGRAM_BASE:] | affordable | (forced_wait & is_wait)).all(),
        mask_siphon=m[C.SIPHON] == (g.siphons > 0),
        mask_nonempty=m.any(),
        obs=(obs.features.shape == (C.OBS_SIZE,)) & (obs.features >= 0).all() & (obs.features <= 1).all(),
        no_invalid_action=~info["invalid_action"],
        reward=jnp.isfinite(reward) & (jnp.abs(reward - info["reward_terms"].sum()) < 1e-3),
        auto_reset=~done | ((nxt.episode_length == 0) & (info["episode_length"] > 0) & (g.stage == 1) & (g.turn == 0)),
        snapshot=nxt.undo_valid | same_snapshot,
        exit_dist=nxt.exit_dist == exit_distance(g),
    ), dict(program=action >= C.PROGRAM_BASE, undo=action == C.PROGRAM_BASE + C.UNDO,
            stage_up=~done & (g.stage > state.game.stage))


@pytest.fixture(scope="module")
def rollout():
    return jax.jit(hm.random_rollout, static_argnums=(1, 2, 4))


# the default game is slow-only (~25 s): RICH holds every program and rule the default one has
@pytest.mark.parametrize("params", [pytest.param(hm.EnvParams(), marks=pytest.mark.slow), RICH], ids=["default", "all_programs"])
def test_random_rollouts_keep_invariants(rollout, params):
    state, summary, (checks, usage) = rollout(jax.random.PRNGKey(7), NUM_ENVS, NUM_STEPS, params, invariants)
    checks, usage, summary = jax.device_get((checks, usage, summary))
    broken = {k: int((~v).sum()) for k, v in checks.items() if not v.all()}
    assert not broken, f"invariants broken (count of env-steps): {broken}"
    # ~1,900 finished episodes in the default run and ~500 longer ones in the rich run
    assert summary["episodes"] >= (1000 if params is not RICH else 300), summary
    assert usage["stage_up"].sum() > 0
    if params is RICH:
        assert usage["program"].sum() > NUM_ENVS * NUM_STEPS // 4 and usage["undo"].sum() > 100


def test_jit_vmap_shapes():
    n = 16                                                  # the gym vector-env test compiles this size
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    obs, state = jit_vreset(keys, hm.EnvParams())          # jax.jit(jax.vmap(reset)), shared with the gym tests
    assert obs.features.shape == (n, 1545) and obs.features.dtype == jnp.float32
    assert obs.action_mask.shape == (n, 28) and obs.action_mask.dtype == jnp.bool_
    action = jax.jit(hm.random_masked_action)(jax.random.PRNGKey(1), obs.action_mask)
    assert action.shape == (n,) and np.asarray(obs.action_mask)[np.arange(n), np.asarray(action)].all()
    # the named views also read (and .set writes) batched states on the host
    g = state.game
    assert g.hp.shape == (n,) and g.board.block.shape == (n, 36) and g.enemies.row.shape == (n, 20)
    assert g.owned.shape == (n, 23) and (np.asarray(g.stage) == 1).all()
    g2 = g.set(hp=1, board=g.board.set(pickup=False))
    assert (np.asarray(g2.hp) == 1).all() and not np.asarray(g2.board.pickup).any()
    assert (np.asarray(g2.credits) == np.asarray(g.credits)).all()


def test_the_gpu_forms_of_the_step_give_the_cpus_results(monkeypatch):
    """Where a GPU gets other code than a CPU (`lax.platform_dependent`: compares instead of
    scatters, reductions instead of matmuls), those forms run here too and every step's obs,
    rewards and state match the CPU forms' bit for bit."""
    trace = lambda s, a, obs, nxt, r, d, info: (obs, nxt, r, info["reward_terms"])  # noqa: E731
    # a fresh function each time: jit's cache would otherwise reuse the first trace
    run = lambda: jax.device_get(jax.jit(lambda key: hm.random_rollout(key, 64, 120, RICH, trace))(  # noqa: E731
        jax.random.PRNGKey(11)))
    on_cpu = run()
    chosen = []
    monkeypatch.setattr(jax.lax, "platform_dependent",
                        lambda *args, default, **_: chosen.append(default.__name__) or default(*args))
    elsewhere = run()
    assert {"_units_by_compare", "_prefix_by_reduce"} <= set(chosen), chosen
    for a, b in zip(jax.tree.leaves(on_cpu), jax.tree.leaves(elsewhere)):
        np.testing.assert_array_equal(a, b)
