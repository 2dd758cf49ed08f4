"""K HackMatrix PPO configurations of one shape in one process (``python -m raysys.tune --vectorize K``).

Each member starts (or resumes) from its own session exactly as ``train`` would, logs the same
metrics at the same env steps, and saves a checkpoint ``train`` can resume alone. A member stops
(its state kept) once it reached its ``total_timesteps`` or its session was halted (unstable); the
others go on. Two carriers (raysys/train/population.py) can take the members, as
``train.population`` says, under one loop:

* ``vmap``: ``ppo.make_population_chunk``, every member in one batched program. It pays where one
  member leaves the device idle (a GPU at 256 envs). A member's ``perf/env_steps_per_s`` is what its
  configuration does alone: a probe, ``train``'s program for one member of the same shape, is
  compiled beside the population's and timed over a few chunks (members share shapes: one probe).
* ``loop``: ``train``'s own compiled chunk, member after member. The same arithmetic with one
  compile and no probe: each member's chunks are timed as a lone run's are. On a CPU a batch of
  members runs no faster than one member (docs/benchmarks.md), so there the batched program's own
  compile and its probe are all cost.

``auto`` (the default) is ``loop`` on a CPU and ``vmap`` on a GPU or TPU.

In a PBT sweep (``--scheduler pbt``, raysys/train/pbt.py) a member that exploits another takes its
params and Adam state (:func:`_inherit`); its envs, observations and PRNG streams stay its own.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from raysys.metrics import Throughput
from raysys.train import pbt as pbt_rounds
from raysys.train.jax_host import enable_compilation_cache, to_host
from raysys.train.population import Batched, InTurn, population_mode, time_alone
from raysys.workloads.hackmatrix_ppo import workload as lone


def train_population(cfgs: list, sessions: list) -> list[dict]:
    """``Population.train_fn``: train ``cfgs`` (one shape) together, each through its own session."""
    enable_compilation_cache(cfgs[0].train.compilation_cache_dir)
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    lead, k = cfgs[0], len(cfgs)
    mesh = ppo.make_mesh()
    starts = _starts(cfgs, sessions, mesh)
    pbt = pbt_rounds.of(sessions)
    cfgs = pbt.resume(cfgs) if pbt is not None else list(cfgs)  # a member's knobs where PBT had left them
    carrier = _in_turn if population_mode(lead.train.population) == "loop" else _batched
    program = carrier(cfgs, [r for r, _, _ in starts], mesh)
    env_steps = np.array([e for _, e, _ in starts])
    updates = np.array([u for _, _, u in starts])
    totals = np.array([c.train.total_timesteps for c in cfgs])
    per_chunk = lead.train.updates_per_chunk * lead.train.num_envs * lead.train.num_steps
    sessions[0].message(f"population of {k} on {mesh.size} device(s) ({jax.devices()[0].platform}), "
                        f"{program.what}; compiled in {program.compile_s:.1f}s")
    finals = [{"perf/compile_s": program.compile_s} for _ in cfgs]
    best = np.array([s.last_metrics.get(lone.BEST, -np.inf) for s in sessions])  # a resume's, as run alone
    recent = np.array([s.last_metrics.get("charts/episode_return", np.nan) for s in sessions])  # as lone's quality
    last_ckpt, done, wall = time.perf_counter(), 0, 0.0
    so_far = [lone.seconds_so_far(s, int(e)) for s, e in zip(sessions, env_steps)]  # as lone's: the whole run's
    t_train, counted_from = np.array([t for t, _ in so_far]), np.array([c for _, c in so_far])
    saved_at = env_steps.copy()
    speeds = [Throughput(window=lone.SPEED_WINDOW) for _ in cfgs]  # each member's, over its last chunks, as lone's

    def save(members):
        for i in members:
            if env_steps[i] != saved_at[i] or sessions[i].store.latest() is None:  # only members that moved
                lone._save(sessions[i], program.state(i), int(env_steps[i]), int(updates[i]), cfgs[i].train.seed)
                saved_at[i] = env_steps[i]

    while True:
        live = np.array([env_steps[i] < totals[i] and not sessions[i].halted for i in range(k)])
        if not live.any():
            break
        t = time.perf_counter()
        chunk = program.step(live)
        wall += time.perf_counter() - t
        done += per_chunk * live.sum()
        members = np.flatnonzero(live)
        for i in members:
            stats, seconds = chunk[i]
            env_steps[i] += per_chunk
            updates[i] += lead.train.updates_per_chunk
            t_train[i] += seconds
            speeds[i].update(seconds, per_chunk, 0)
            m = lone._chunk_metrics(stats, program.rate(*speeds[i].window_sums()), program.compile_s) | \
                {lone.TRAIN_SECONDS: float(t_train[i])}
            if m["charts/episodes"]:
                best[i] = m[lone.BEST] = max(best[i], m["charts/episode_return"])
                recent[i] = m["charts/episode_return"]
            finals[i] |= m
            progress = lone._progress(m) + f" (member 1 of {len(members)} live)" if i == members[0] else None
            sessions[i].log(m, int(env_steps[i]), progress=progress, bar=(int(env_steps[i]), int(totals[i])),
                            unit="env-step")
        if pbt is not None:
            pbt.after_chunk(program, cfgs, [i for i in members if env_steps[i] < totals[i]], inherit=_inherit)
        if time.perf_counter() - last_ckpt >= 60 * lead.train.checkpoint_every_minutes:
            save(range(k))
            last_ckpt = time.perf_counter()
        if sessions[0].should_stop():  # SIGINT/SIGTERM: every member saves and the program stops
            save(range(k))
            sessions[0].message(f"stopped at {env_steps.min()}..{env_steps.max()} env steps; checkpoints saved")
            return finals
    save(range(k))
    sessions[0].message(f"population of {k}: {done / max(wall, 1e-9):.0f} env-steps/s together{program.alone_note}")
    for i in range(k):
        trained = int(env_steps[i] - starts[i][1])
        if trained == 0:  # restored at its end (a resumed sweep): what it ended with, not a chunk it never ran
            last = sessions[i].last_metrics
            finals[i] = {"eval/quality": last.get("eval/quality", last.get("charts/episode_return", float("nan")))}
            continue
        finals[i] |= {"eval/quality": float(recent[i]),
                      lone.BEST: float(best[i]), "perf/train_seconds": float(t_train[i]),
                      "perf/env_steps": int(env_steps[i]),
                      "perf/env_steps_per_s_overall": program.rate(int(env_steps[i] - counted_from[i]), t_train[i])}
    return finals


def _starts(cfgs: list, sessions: list, mesh) -> list[tuple]:
    """-> [(runner, env_steps, updates)]: each member from its checkpoint (a resumed sweep), or fresh
    from one build program shared by all (the seed an argument of it, so compiled once)."""
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    fresh = [i for i, s in enumerate(sessions) if s.store.latest() is None]
    built = dict(zip(fresh, ppo.init_runners(cfgs[0], [jax.random.PRNGKey(cfgs[i].train.seed) for i in fresh], mesh)))
    return [(built[i], 0, 0) if i in built else lone._start(c, s, mesh) for i, (c, s) in enumerate(zip(cfgs, sessions))]


def _batched(cfgs: list, runners: list, mesh) -> Batched:
    """Every member in ``ppo.make_population_chunk``; the probe compiles beside it."""
    from raysys.workloads.hackmatrix_ppo import ppo

    lead = cfgs[0]
    stacked = ppo.stack_runners(runners, mesh)
    hps = [ppo.replicate(ppo.stack_hparams(cfgs), mesh)]  # a box: PBT's retune replaces it
    with ThreadPoolExecutor(1) as pool:  # XLA compiles without the GIL: the probe's program alongside
        probe = pool.submit(_probe_program, lead, mesh)
        t0 = time.perf_counter()
        active = ppo.replicate(np.ones(len(cfgs), bool), mesh)
        step = ppo.make_population_chunk(lead, mesh).lower(stacked, hps[0], active).compile()
        compile_s = time.perf_counter() - t0
        runner, hp, alone_step = probe.result()  # one member of this shape alone: its env-steps/s
        alone = time_alone(alone_step, runner, hp,
                           work=lead.train.updates_per_chunk * lead.train.num_envs * lead.train.num_steps)

    def run(runners, live):
        runners, stats = step(runners, hps[0], ppo.replicate(live, mesh))
        stats = {key: np.asarray(v, np.float64) for key, v in to_host(stats).items()}
        return runners, {i: {key: float(v[i]) for key, v in stats.items()} for i in np.flatnonzero(live)}

    def retune(cfgs):
        hps[0] = ppo.replicate(ppo.stack_hparams(cfgs), mesh)

    return Batched(stacked, run, compile_s, alone, retune)


def _in_turn(cfgs: list, runners: list, mesh) -> InTurn:
    """``train``'s compiled chunk, each live member in turn."""
    from raysys.workloads.hackmatrix_ppo import ppo

    hps = [ppo.replicate(ppo.hparams_of(c), mesh) for c in cfgs]
    t0 = time.perf_counter()
    step = ppo.make_train_chunk(cfgs[0], mesh).lower(runners[0], hps[0]).compile()
    compile_s = time.perf_counter() - t0

    def run(i, runner, _):
        runner, stats = step(runner, hps[i])
        return runner, {key: float(v) for key, v in to_host(stats).items()}

    def retune(cfgs):
        hps[:] = [ppo.replicate(ppo.hparams_of(c), mesh) for c in cfgs]

    return InTurn(runners, run, compile_s, retune)


def _inherit(mine, theirs):
    """PBT's exploit: the other member's params and Adam state; envs and PRNG streams stay this member's."""
    return mine._replace(params=theirs.params, opt_state=theirs.opt_state)


def _probe_program(cfg, mesh):
    """A throwaway single-member runner of this shape and its compiled chunk (``train``'s program)."""
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    runner = ppo.init_runner(cfg, jax.random.PRNGKey(cfg.train.seed), mesh)
    hp = ppo.replicate(ppo.hparams_of(cfg), mesh)
    return runner, hp, ppo.make_train_chunk(cfg, mesh).lower(runner, hp).compile()

