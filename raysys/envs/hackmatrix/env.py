"""HackMatrix as pure functions over an explicit EnvState (gymnax / PureJaxRL style).

    obs, state = reset(key, params)
    obs, state, reward, done, info = step(key, state, action, params)   # auto-resets

Everything is jittable and vmappable; there is no Python control flow on
traced values. `step` enforces the action mask: an invalid action changes
nothing but the step counters and pays `params.invalid_action_penalty`.
"""
import jax
import jax.numpy as jnp

from .actions import N_SIPHON_UNIFORMS, base_mask, line_of_sight, move, siphon, with_forced_wait
from .board import cell_of, materialize, walls
from .constants import (LAST_STAGE, MAX_HP, MAX_UNITS, N_ACTIONS, N_CELLS, PROGRAM_BASE,
                        PROGRAM_CREDITS, RESET, SIPHON, SPAWN_INTERVAL, UNDO, WAIT, WARP)
from .enemies import N_ENEMY_UNIFORMS, enemy_phase
from .generate import N_GEN_UNIFORMS, generate_stage
from .observation import features
from .programs import N_PROGRAM_UNIFORMS, run_program
from .rewards import REWARD_TERMS, bfs_distance, exit_distance, reward_terms
from .sampling import random_order, uniforms
from .state import Enemies, EnvParams, EnvState, Game, Obs, new_game, tree_where

# Layout of the uniforms drawn per step.
_ORDER = slice(0, N_CELLS)
_SIPHON = slice(_ORDER.stop, _ORDER.stop + N_SIPHON_UNIFORMS)
_PROGRAM = slice(_SIPHON.stop, _SIPHON.stop + N_PROGRAM_UNIFORMS)
_ENEMY = slice(_PROGRAM.stop, _PROGRAM.stop + N_ENEMY_UNIFORMS)
_GEN = slice(_ENEMY.stop, _ENEMY.stop + N_GEN_UNIFORMS)


def default_params() -> EnvParams:
    return EnvParams()


def state_from_game(game: Game) -> EnvState:
    """A fresh-turn EnvState around a game (also handy for hand-built test states)."""
    return EnvState(game=game, snapshot=game, undo_valid=jnp.asarray(False),
                    turn_reward=jnp.float32(0), exit_dist=exit_distance(game),
                    episode_return=jnp.float32(0), episode_length=jnp.int32(0))


def initial_game(key, params: EnvParams | None = None) -> Game:
    """Stage 1, generated like every other stage (the port left it empty)."""
    u = uniforms(key, N_CELLS + N_GEN_UNIFORMS)
    board, exit_cell, trans = generate_stage(u[N_CELLS:], random_order(u[:N_CELLS]), 0, 1)
    game = new_game(board, exit_cell, trans, params)
    # Always the empty table, but XLA cannot tell: otherwise it constant-folds the
    # first observation's unit scans over the whole batch, slowly, at compile time.
    return game._replace(enemies=type(game.enemies)(jnp.where(u[0] >= 0, game.enemies.data, 1)))


def action_mask(state: EnvState):
    """bool[28]: the legal actions. Never all False (see `with_forced_wait`)."""
    g = state.game
    return with_forced_wait(base_mask(g, state.undo_valid, line_of_sight(g)))


def observe(state: EnvState) -> Obs:
    return Obs(features=features(state.game), action_mask=action_mask(state))


def reset(key, params: EnvParams | None = None):
    state = state_from_game(initial_game(key, params))
    return observe(state), state


def _stage_change(g: Game, board, exit_cell, trans) -> Game:
    """RULES §3 on the player's corner; SHOW, CALM, STEP, ATK+ uses and the spawn
    schedule restart with the stage (the port carried CALM and the schedule over)."""
    return g.set(stage=g.stage + 1, hp=jnp.minimum(g.hp + 1, MAX_HP), exit_cell=exit_cell,
                 board=board, enemies=Enemies.make(MAX_UNITS), trans=trans, atk_uses=0,
                 show=False, calm=False, step_active=False, next_spawn=g.turn + SPAWN_INTERVAL)


def _transition(key, state: EnvState, action, params: EnvParams):
    """One step without the auto-reset. Returns (terminal, fresh, reward, done, info)."""
    u = materialize(uniforms(key, _GEN.stop))
    order = materialize(random_order(u[_ORDER]))   # shared by siphon and generation
    g, snap = state.game, state.snapshot
    in_range = (jnp.asarray(action) >= 0) & (jnp.asarray(action) < N_ACTIONS)
    action = jnp.clip(jnp.asarray(action, jnp.int32), 0, N_ACTIONS - 1)

    sight = materialize(line_of_sight(g))
    base = materialize(base_mask(g, state.undo_valid, sight))
    valid = in_range & with_forced_wait(base)[action]
    is_move, is_siphon, is_prog = action < SIPHON, action == SIPHON, action >= PROGRAM_BASE
    prog = jnp.clip(action - PROGRAM_BASE, 0, None)
    forced_wait = (prog == WAIT) & ~base[action]

    # Every branch is computed and the chosen one selected (vmap would do so anyway).
    undone = snap.set(credits=snap.credits - PROGRAM_CREDITS[UNDO])
    acted = run_program(u[_PROGRAM], g, prog, forced_wait)
    acted = tree_where(prog == UNDO, undone, acted)
    acted = tree_where(is_siphon, siphon(u[_SIPHON], order, g), acted)
    acted = tree_where(is_move, move(g, jnp.minimum(action, 3), sight), acted)
    acted = tree_where(valid, acted, g)

    ends_turn = valid & (is_move | is_siphon | (is_prog & (prog == WAIT)))
    is_undo = valid & is_prog & (prog == UNDO)
    acted = materialize(acted.set(turn=acted.turn + ends_turn))
    phased = materialize(tree_where(ends_turn, enemy_phase(u[_ENEMY], acted), acted))

    died = phased.hp <= 0
    on_exit = cell_of(phased.row, phased.col) == phased.exit_cell
    completed = valid & (is_move | (is_prog & (prog == WARP))) & on_exit & ~died & (g.stage <= LAST_STAGE)
    won = completed & (g.stage == LAST_STAGE)
    length = state.episode_length + 1
    truncated = ~died & ~won & (params.max_steps_in_episode > 0) & (length >= params.max_steps_in_episode)
    done = died | won | truncated

    # One generation serves both a stage change and the auto-reset (stage 1 on (0,0)).
    board, exit_cell, trans = generate_stage(
        u[_GEN], order, jnp.where(done, 0, cell_of(phased.row, phased.col)), jnp.where(done, 1, g.stage + 1))
    end = materialize(tree_where(completed, _stage_change(phased, board, exit_cell, trans), phased))
    fresh_game = new_game(board, exit_cell, trans, params)
    # Distance on the board the next step starts from (the fresh one if done).
    dist = bfs_distance(jnp.where(done, walls(board), walls(end.board)),
                        jnp.where(done, 0, cell_of(end.row, end.col)), jnp.where(done, exit_cell, end.exit_cell))

    terms = reward_terms(
        params, before=g, acted=acted, phased=phased, end=end, valid=valid, completed=completed,
        died=died, won=won, is_undo=is_undo,
        wasted_reset=valid & is_prog & (prog == RESET) & (g.hp == MAX_HP - 1),
        dist_before=state.exit_dist, dist_after=dist, turn_reward=state.turn_reward)
    reward = terms.sum()

    # UNDO bookkeeping: a new turn, a stage change or an UNDO itself re-takes the
    # snapshot; any other program makes an UNDO worth having.
    new_turn = ends_turn | completed | is_undo
    earned = reward - terms[REWARD_TERMS.index("step_penalty")]
    turn_reward = jnp.where(new_turn, 0.0, jnp.where(valid & is_prog, state.turn_reward + earned, state.turn_reward))
    episode_return = state.episode_return + reward
    terminal = EnvState(
        game=end, snapshot=tree_where(new_turn, end, snap),
        undo_valid=jnp.where(new_turn, False, state.undo_valid | (valid & is_prog)),
        turn_reward=turn_reward.astype(jnp.float32), exit_dist=jnp.where(done, 0, dist),
        episode_return=episode_return, episode_length=length)
    fresh = EnvState(game=fresh_game, snapshot=fresh_game, undo_valid=jnp.asarray(False),
                     turn_reward=jnp.float32(0), exit_dist=dist, episode_return=jnp.float32(0),
                     episode_length=jnp.int32(0))
    info = dict(
        episode_return=jnp.where(done, episode_return, 0.0), episode_length=jnp.where(done, length, 0),
        terminated=died | won, truncated=truncated, won=won, stage=end.stage,
        invalid_action=~valid, reward_terms=terms)
    return terminal, fresh, reward, done, info


def step(key, state: EnvState, action, params: EnvParams | None = None):
    """Advance one env; when done the returned obs/state are a fresh episode's.

    info: episode_return / episode_length (of the episode that ended this step,
    0 otherwise), terminated, truncated, won, stage (reached), invalid_action,
    reward_terms (float32[16], named by REWARD_TERMS, summing to reward).
    """
    params = EnvParams() if params is None else params
    terminal, fresh, reward, done, info = _transition(key, state, action, params)
    state = materialize(tree_where(done, fresh, terminal))
    return observe(state), state, reward, done, info


def step_no_reset(key, state: EnvState, action, params: EnvParams | None = None):
    """Like `step` but returns the terminal obs/state; call `reset` after done."""
    params = EnvParams() if params is None else params
    terminal, _, reward, done, info = _transition(key, state, action, params)
    return observe(terminal), terminal, reward, done, info


def step_with_final_obs(key, state: EnvState, action, params: EnvParams | None = None):
    """`step` plus the terminal observation (for same-step auto-reset vector envs)."""
    params = EnvParams() if params is None else params
    terminal, fresh, reward, done, info = _transition(key, state, action, params)
    state = materialize(tree_where(done, fresh, terminal))
    return observe(state), state, reward, done, info, observe(terminal)


def random_masked_action(key, mask):
    """A uniform legal action (mask: bool[..., 28]; batch dims allowed)."""
    return jax.random.categorical(key, jnp.where(mask, 0.0, -1e9), axis=-1).astype(jnp.int32)


def random_rollout(key, num_envs: int, num_steps: int, params: EnvParams | None = None, trace_fn=None):
    """Run `num_steps` random masked steps in `num_envs` envs (vmapped, in lax.scan).

    Jit it with num_envs, num_steps and trace_fn static. trace_fn(state, action,
    obs, next_state, reward, done, info) -> pytree (per env; it is vmapped) is
    stacked over time into `traces` [num_steps, num_envs, ...].
    Returns (final_state, summary, traces); summary sums, over the whole run,
    rewards, finished episodes, their returns and lengths, and wins.
    """
    params = EnvParams() if params is None else params
    k_reset, k_run = jax.random.split(key)
    obs, state = jax.vmap(reset, in_axes=(0, None))(jax.random.split(k_reset, num_envs), params)
    vstep = jax.vmap(step, in_axes=(0, 0, 0, None))

    def body(carry, k):
        obs, state = carry
        k_act, k_env = jax.random.split(k)
        action = random_masked_action(k_act, obs.action_mask)
        next_obs, next_state, reward, done, info = vstep(jax.random.split(k_env, num_envs), state, action, params)
        out = dict(reward=reward.sum(), episodes=done.sum(), returns=info["episode_return"].sum(),
                   lengths=info["episode_length"].sum(), wins=info["won"].sum())
        trace = None if trace_fn is None else jax.vmap(trace_fn)(
            state, action, next_obs, next_state, reward, done, info)
        return (next_obs, next_state), (out, trace)

    (obs, state), (outs, traces) = jax.lax.scan(body, (obs, state), jax.random.split(k_run, num_steps))
    summary = jax.tree.map(lambda x: x.sum(), outs)
    return state, summary, traces
