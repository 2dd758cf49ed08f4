"""The AD transformer's source algorithm as a workload of its own (``ad_source``): PPO learning Darkroom
goals from scratch (source.py), so that its settings can be trained, tracked and swept before
``ad_transformer`` generates histories from them (``--set source.lr=...`` there takes the same keys).

    python -m raysys train ad_source --preset quick
    python -m raysys.tune --space tune_spaces/ad_source.yaml --vectorize 8

One run is one source setting learning ``train.goals`` at once (a ``vmap`` over goals). Quality
(``eval/quality``) is the fraction of the optimal return the learners reach, averaged over goals and
the last ``train.last_updates`` updates; throughput is env steps/s over all goals. A population
(``--vectorize K``, :func:`train_population`) stacks K settings of one shape on a member axis outside
the goal axis: each member has its own hyper-parameters (:data:`MEMBER_KNOBS`), params, Adam state,
envs and PRNG streams, and ends as it would alone (tests/test_ad_source.py).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from raysys.config import at_least, require
from raysys.train import pbt as pbt_rounds
from raysys.train.config import JaxLaunchConfig
from raysys.train.jax_host import enable_compilation_cache, to_host
from raysys.workload import Population, Workload
from raysys.workloads.ad_transformer.histories import SourceConfig, pin_jax_to_one_core

N_CELLS = 81


@dataclass
class TrainConfig:
    goals: tuple[int, ...] = (0, 10, 20, 30, 40, 50, 60, 70, 80)
    """Goal cells (0..80, row-major) learned at once, one learner each: the diagonal by default,
    from a corner through the centre to the far corner."""
    last_updates: int = 5
    """Updates at the end averaged into ``eval/quality``."""
    checkpoint_every_minutes: float = 10.0
    """Checkpoint when this much time has passed since the last one (and at the end)."""
    compilation_cache_dir: str = "~/.cache/raysys/jax"
    """Persistent JAX compilation cache ('' disables)."""
    population: Literal["auto", "vmap", "loop"] = "auto"
    """How ``--vectorize`` trains settings of this shape in one process: vmap (one batched program; pays
    on a GPU/TPU that one member leaves idle) or loop (this program, member after member: one compile,
    no speed probe; a CPU runs a batch no faster). auto: loop on CPU, else vmap."""

    def validate(self) -> None:
        require(len(self.goals) > 0 and all(0 <= g < N_CELLS for g in self.goals),
                f"train.goals must be cells 0..{N_CELLS - 1}, got {self.goals!r}")
        require(len(set(self.goals)) == len(self.goals), f"train.goals has repeats: {self.goals!r}")
        at_least(self, "train.", 1, "last_updates")
        require(self.checkpoint_every_minutes > 0, "train.checkpoint_every_minutes must be > 0")


@dataclass
class ADSourceConfig:
    source: SourceConfig = field(default_factory=SourceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: JaxLaunchConfig = field(default_factory=JaxLaunchConfig)

    def validate(self) -> None:
        require(self.source.updates >= 1, "source.steps_per_goal must cover one update")


def default() -> ADSourceConfig:
    """The original's stable-baselines3 PPO (100 streams, 100k env steps a goal) on 9 goals."""
    return ADSourceConfig()


def learn() -> ADSourceConfig:
    """The histories ``ad_transformer``'s ``learn`` preset distils: 10 streams, 100 episodes a stream."""
    cfg = default()
    cfg.source.streams, cfg.source.steps_per_goal = 10, 10 * 20 * 100
    return cfg


def quick() -> ADSourceConfig:
    """Seconds: 10 streams, 30 episodes a stream, 4 goals, a 5-update window."""
    cfg = learn()
    cfg.source.steps_per_goal, cfg.source.updates_per_call = 10 * 20 * 30, 5
    cfg.train.goals = (0, 20, 60, 80)
    return cfg


PRESETS = {"default": default, "learn": learn, "quick": quick}

# Shape-free: these may differ between the members of one population (one compiled program).
MEMBER_KNOBS = ("source.lr", "source.max_grad_norm", "source.gamma", "source.gae_lambda", "source.clip_eps",
                "source.vf_coef", "source.ent_coef", "source.seed", "source.steps_per_goal",
                "train.last_updates", "train.checkpoint_every_minutes", "train.compilation_cache_dir")
# What PBT may perturb (--scheduler pbt): the update's hyper-parameters, not the seed or the budgets.
EXPLORE_KNOBS = ("source.lr", "source.max_grad_norm", "source.gamma", "source.gae_lambda", "source.clip_eps",
                 "source.vf_coef", "source.ent_coef")


def _setup(cfg: ADSourceConfig):
    """Compilation cache, and on a CPU one core (histories.py: the multi-threaded runtime can wedge on
    the vmapped program) unless JAX already runs in this process."""
    if "jax" not in sys.modules:
        pin_jax_to_one_core()
    enable_compilation_cache(cfg.train.compilation_cache_dir)


def _steps_per_update(cfg: ADSourceConfig) -> int:
    return len(cfg.train.goals) * cfg.source.streams * cfg.source.n_steps


def _start(cfg: ADSourceConfig, session, goals):
    """-> (learners [G], learning curve so far [U, G]): fresh, or the whole state from the session's
    last checkpoint (a resumed run continues bit-exact)."""
    import jax
    import numpy as np

    from raysys.workloads.ad_transformer import source

    learners = source.init_learners(cfg.source, goals)
    ckpt = session.restore()
    if ckpt is None:
        return learners, np.zeros((0, len(goals)), np.float32)
    leaves, tree = jax.tree.flatten(learners)
    saved = ckpt["learners"]
    if [tuple(t.shape) for t in saved] != [tuple(x.shape) for x in leaves]:
        from raysys.config import ConfigError

        raise ConfigError("the checkpoint's learners have other shapes than this config's (streams, goals or "
                          "hidden changed); start a new run")
    learners = jax.tree.unflatten(tree, [jax.numpy.asarray(np.asarray(t).astype(x.dtype)) for t, x in zip(saved, leaves)])
    curve = np.asarray(ckpt["curve"])
    session.message(f"resumed at update {len(curve)}")
    return learners, curve


def _save(session, learners, curve, steps_per_update: int) -> None:
    import jax
    import numpy as np

    state = {"learners": [np.array(x) for x in jax.tree.leaves(to_host(learners))],
             "curve": np.array(curve, np.float32)}
    session.checkpoint(state, len(curve) * steps_per_update)


def _metrics(returns, optimal, steps_per_s: float, compile_s: float) -> dict:
    """returns: float[n, G] of one chunk's updates -> the logged metrics (of its last update)."""
    last = returns[-1]
    return {"charts/episode_return": float(last.mean()), "charts/return_fraction": float((last / optimal).mean()),
            "charts/worst_goal_fraction": float((last / optimal).min()),
            "perf/env_steps_per_s": steps_per_s, "perf/compile_s": compile_s}


def _final(curve, optimal, last: int) -> dict:
    """curve: float[U, G], every update's mean returns -> the run's quality."""
    tail = curve[-last:]
    return {"eval/quality": float((tail / optimal).mean()), "eval/episode_return": float(tail.mean()),
            "eval/optimal_return": float(optimal.mean())}


def _progress(m: dict) -> str:
    return f"return {m['charts/episode_return']:.2f} ({m['charts/return_fraction']:.0%} of optimal)"


def train(cfg: ADSourceConfig, session) -> dict:
    """One setting, every goal's learner at once, ``source.updates_per_call`` updates per jitted chunk."""
    _setup(cfg)
    import jax
    import numpy as np

    from raysys.envs import darkroom as dr
    from raysys.workloads.ad_transformer import source

    goals, optimal = np.asarray(cfg.train.goals, np.int32), dr.optimal_return(cfg.train.goals)
    learners, curve = _start(cfg, session, goals)
    hp, k, per_update, total = source.hparams_of(cfg.source), cfg.source.updates_per_call, _steps_per_update(cfg), cfg.source.updates
    t0 = time.perf_counter()
    step = source.make_chunk(cfg.source).lower(learners, goals, hp, np.int32(k)).compile()
    compile_s = time.perf_counter() - t0
    session.message(f"{len(goals)} goals x {cfg.source.streams} streams on {jax.devices()[0].platform}; compiled "
                    f"in {compile_s:.1f}s; {total} updates of {per_update} env steps")
    final, last_ckpt, t_train = {"perf/compile_s": compile_s}, time.perf_counter(), 0.0
    while len(curve) < total:
        n = min(k, total - len(curve))
        t = time.perf_counter()
        learners, returns = step(learners, goals, hp, np.int32(n))
        returns = np.asarray(returns)[:n]  # the one host sync per chunk
        dt = time.perf_counter() - t
        t_train += dt
        curve = np.concatenate([curve, returns])
        final |= _metrics(returns, optimal, n * per_update / dt, compile_s)
        session.log(final, len(curve) * per_update, progress=_progress(final), bar=(len(curve), total), unit="update")
        stop = session.should_stop()
        if stop or time.perf_counter() - last_ckpt >= 60 * cfg.train.checkpoint_every_minutes:
            _save(session, learners, curve, per_update)
            last_ckpt = time.perf_counter()
        if stop:
            session.message(f"stopped at update {len(curve)}/{total}; checkpoint saved")
            return final
    _save(session, learners, curve, per_update)
    return final | _final(curve, optimal, cfg.train.last_updates) | {"perf/train_seconds": t_train}


def train_population(cfgs: list[ADSourceConfig], sessions: list) -> list[dict]:
    """K settings of one shape in one process. Each member starts (or resumes) from its own session as
    ``train`` would, logs the same metrics at the same env steps and saves a checkpoint ``train`` can
    resume alone; it stops once it has done its updates or its session was halted. The members ride
    in one ``vmap``ped program (:func:`_batched`) or in turn through ``train``'s own (:func:`_in_turn`),
    as ``train.population`` says (raysys/train/population.py: why, and ``auto``)."""
    _setup(cfgs[0])
    import jax
    import numpy as np

    from raysys.envs import darkroom as dr
    from raysys.train.population import population_mode

    lead, K = cfgs[0], len(cfgs)
    goals, optimal = np.asarray(lead.train.goals, np.int32), dr.optimal_return(lead.train.goals)
    starts = [_start(c, s, goals) for c, s in zip(cfgs, sessions)]
    curves = [c for _, c in starts]
    pbt = pbt_rounds.of(sessions)
    cfgs = pbt.resume(cfgs) if pbt is not None else list(cfgs)  # a member's knobs where PBT had left them
    carrier = _in_turn if population_mode(lead.train.population) == "loop" else _batched
    program = carrier(cfgs, [lr for lr, _ in starts], goals)
    k, per_update, totals = lead.source.updates_per_call, _steps_per_update(lead), [c.source.updates for c in cfgs]
    sessions[0].message(f"population of {K}: {len(goals)} goals x {lead.source.streams} streams each on "
                        f"{jax.devices()[0].platform}, {program.what}; compiled in {program.compile_s:.1f}s")
    finals = [{"perf/compile_s": program.compile_s} for _ in cfgs]
    last_ckpt, t_train, done, wall = time.perf_counter(), np.zeros(K), 0, 0.0

    def save(members):
        for i in members:
            _save(sessions[i], program.state(i), curves[i], per_update)

    def todo():
        return np.array([0 if sessions[i].halted else min(k, totals[i] - len(curves[i])) for i in range(K)], np.int32)

    while (n := todo()).any():
        t = time.perf_counter()
        chunk = program.step(n)
        wall += time.perf_counter() - t
        live = np.flatnonzero(n)
        done += int(n.sum()) * per_update
        for i in live:
            returns, seconds = chunk[i]
            t_train[i] += seconds
            curves[i] = np.concatenate([curves[i], returns])
            finals[i] |= _metrics(returns, optimal, program.rate(n[i] * per_update, seconds), program.compile_s)
            sessions[i].log(finals[i], len(curves[i]) * per_update, bar=(len(curves[i]), totals[i]), unit="update",
                            progress=_progress(finals[i]) + f" (member 1 of {len(live)} live)" if i == live[0] else None)
        if pbt is not None:  # the other member's params and Adam state; envs and PRNG streams stay its own
            pbt.after_chunk(program, cfgs, [i for i in live if len(curves[i]) < totals[i]],
                            inherit=lambda mine, theirs: mine._replace(params=theirs.params, opt_state=theirs.opt_state))
        stop = sessions[0].should_stop()
        if stop or time.perf_counter() - last_ckpt >= 60 * lead.train.checkpoint_every_minutes:
            save(range(K))
            last_ckpt = time.perf_counter()
        if stop:
            sessions[0].message("stopped; every member's checkpoint saved")
            return finals
    save(range(K))
    sessions[0].message(f"population of {K}: {done / max(wall, 1e-9):.0f} env-steps/s together{program.alone_note}")
    return [f | _final(c, optimal, cfg.train.last_updates) | {"perf/train_seconds": float(t)}
            for f, c, cfg, t in zip(finals, curves, cfgs, t_train)]


def _batched(cfgs: list, learners: list, goals):
    """Every member in ``source.make_population_chunk``; the probe compiles beside it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from raysys.train.population import Batched
    from raysys.workloads.ad_transformer import source

    lead = cfgs[0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *learners)
    hps = [source.stack_hparams([c.source for c in cfgs])]  # a box: PBT's retune replaces it
    with ThreadPoolExecutor(1) as pool:  # XLA compiles without the GIL: the probe's program alongside
        probe = pool.submit(_probe, lead, goals)
        t0 = time.perf_counter()
        full = np.full(len(cfgs), lead.source.updates_per_call, np.int32)
        step = source.make_population_chunk(lead.source).lower(stacked, goals, hps[0], full).compile()
        compile_s = time.perf_counter() - t0
        alone = probe.result()

    def run(learners, n):
        learners, returns = step(learners, goals, hps[0], n)
        returns = np.asarray(returns)  # [k, K, G]
        return learners, {i: returns[: n[i], i] for i in np.flatnonzero(n)}

    def retune(cfgs):
        hps[0] = source.stack_hparams([c.source for c in cfgs])

    return Batched(stacked, run, compile_s, alone, retune)


def _in_turn(cfgs: list, learners: list, goals):
    """``train``'s compiled chunk, each live member in turn."""
    import numpy as np

    from raysys.train.population import InTurn
    from raysys.workloads.ad_transformer import source

    hps = [source.hparams_of(c.source) for c in cfgs]
    t0 = time.perf_counter()
    k = np.int32(cfgs[0].source.updates_per_call)
    step = source.make_chunk(cfgs[0].source).lower(learners[0], goals, hps[0], k).compile()
    compile_s = time.perf_counter() - t0

    def run(i, learners, n):
        learners, returns = step(learners, goals, hps[i], np.int32(n))
        return learners, np.asarray(returns)[:n]

    def retune(cfgs):
        hps[:] = [source.hparams_of(c.source) for c in cfgs]

    return InTurn(learners, run, compile_s, retune)


def _probe(cfg: ADSourceConfig, goals) -> float:
    """env-steps/s of ``train``'s program for one throwaway member of ``cfg``'s shape (compile excluded)."""
    import numpy as np

    from raysys.train.population import time_alone
    from raysys.workloads.ad_transformer import source

    learners, hp, k = source.init_learners(cfg.source, goals), source.hparams_of(cfg.source), cfg.source.updates_per_call
    step = source.make_chunk(cfg.source).lower(learners, goals, hp, np.int32(k)).compile()
    return time_alone(step, learners, goals, hp, np.int32(k), work=k * _steps_per_update(cfg), chunks=1)


def _bench(quick: bool = False) -> dict:
    from raysys.workloads.ad_transformer.source_bench import run_bench

    return run_bench(quick=quick)


WORKLOAD = Workload(
    name="ad_source",
    description="The AD transformer's source PPO on Darkroom, every goal's learner in one JAX program",
    config_cls=ADSourceConfig,
    presets=PRESETS,
    bench=_bench,
    train_fn=train,
    population=Population(train_population, MEMBER_KNOBS, EXPLORE_KNOBS, rank_metric="charts/return_fraction"),
    throughput_metric="perf/env_steps_per_s",
    # a checkpoint belongs to one source setting (its shapes and hyper-parameters); one process, local devices
    extra={"identity_sections": ("source",)},
)
