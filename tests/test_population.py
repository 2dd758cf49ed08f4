"""A population of PPO configurations as one program (``ppo.make_population_chunk``): every member
trains exactly as it would alone, and a masked member's state stays as it was."""

import dataclasses

import jax
import numpy as np
import pytest

from raysys.checkpoint import read_state
from raysys.workloads.hackmatrix_ppo import ppo
from raysys.workloads.hackmatrix_ppo.workload import WORKLOAD, quick


def _member(lr, ent, clip, gamma, lam, vf, grad, seed, anneal=True):
    cfg = quick()
    cfg.train = dataclasses.replace(cfg.train, num_envs=16, num_steps=16, updates_per_chunk=2, seed=seed,
                                    total_timesteps=16 * 16 * 6)
    cfg.optim = dataclasses.replace(cfg.optim, lr=lr, max_grad_norm=grad, anneal_lr=anneal)
    cfg.ppo = dataclasses.replace(cfg.ppo, ent_coef=ent, clip_eps=clip, gamma=gamma, gae_lambda=lam, vf_coef=vf)
    return cfg


@pytest.mark.timeout(600)
def test_each_member_ends_as_it_would_alone():
    """Members differ in every shape-free hyper-parameter and the seed; after two chunks (the third
    member masked in the second) each holds the params, and saw the returns, of its lone run."""
    cfgs = [_member(2.5e-4, 0.1, 0.2, 0.99, 0.95, 0.5, 0.5, 0),
            _member(1e-3, 0.0, 0.1, 0.95, 0.9, 1.0, 5.0, 7, anneal=False),
            _member(5e-4, 0.05, 0.3, 0.999, 1.0, 0.25, 0.1, 3)]
    assert len({WORKLOAD.population.program_key(c) for c in cfgs}) == 1  # one program
    mesh = ppo.make_mesh(jax.devices()[:1])
    runners = ppo.init_population(cfgs[0], [jax.random.PRNGKey(c.train.seed) for c in cfgs], mesh)
    start = [np.asarray(x)[2] for x in jax.tree.leaves(runners)]
    chunk = ppo.make_population_chunk(cfgs[0], mesh)
    hps = ppo.stack_hparams(cfgs)
    returns = []
    for active in ([True, True, True], [True, True, False]):
        runners, stats = chunk(runners, hps, np.array(active))
        returns.append(np.asarray(stats["return_sum"]))

    alone = ppo.make_train_chunk(cfgs[0], mesh)
    for i, cfg in enumerate(cfgs):
        runner = ppo.init_runner(cfg, jax.random.PRNGKey(cfg.train.seed), mesh)
        first = [np.asarray(x) for x in jax.tree.leaves(runner.params)]
        for c in range(2 if i < 2 else 1):
            runner, stats = alone(runner, ppo.hparams_of(cfg))
            assert float(stats["return_sum"]) == pytest.approx(float(returns[c][i]), rel=1e-5, abs=1e-4)
        mine = [np.asarray(x)[i] for x in jax.tree.leaves(runners.params)]
        lone = [np.asarray(x) for x in jax.tree.leaves(runner.params)]
        moved = max(float(np.abs(a - b).max()) for a, b in zip(lone, first))
        err = max(float(np.abs(a - b).max()) for a, b in zip(mine, lone))
        assert moved > 1e-3 and err < 1e-5, (i, moved, err)
    # the masked member's whole state (params, Adam, envs, PRNG streams, step count) is its first chunk's
    after_one = jax.tree.leaves(runners)
    runner = ppo.init_runner(cfgs[2], jax.random.PRNGKey(3), mesh)
    runner, _ = alone(runner, ppo.hparams_of(cfgs[2]))
    for a, b in zip(after_one, jax.tree.leaves(runner)):
        np.testing.assert_allclose(np.asarray(a)[2], np.asarray(b), rtol=1e-5, atol=1e-5)
    assert any(not np.array_equal(a, np.asarray(b)[2]) for a, b in zip(start, after_one))


def test_program_key_splits_on_shapes_only():
    pop = WORKLOAD.population
    a, b = quick(), quick()
    b.optim.lr, b.ppo.ent_coef, b.train.seed, b.launch.name = 1e-3, 0.0, 5, "other"
    assert pop.program_key(a) == pop.program_key(b)
    for section, field, value in (("train", "num_envs", 64), ("model", "hidden", (32, 32)), ("train", "precision", "bf16")):
        c = quick()
        setattr(getattr(c, section), field, value)
        assert pop.program_key(c) != pop.program_key(a), field


def _run_cfg(tmp_path, name, cfg, population):
    # one cache for the test: the lone runs load the programs the population compiled (loop: the same one)
    cfg.train.compilation_cache_dir, cfg.train.population = str(tmp_path / "jax-cache"), population
    cfg.launch.storage_path, cfg.launch.name = str(tmp_path / "runs"), name
    cfg.launch.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return cfg


def _params(tmp_path, name):
    last = sorted((tmp_path / "runs" / name / "checkpoints").glob("step_*"))[-1]
    return read_state(last)["params"]


@pytest.mark.timeout(600)
# vmap through the sessions is slow-only: test_each_member_ends_as_it_would_alone checks its program,
# tests/test_plugin_population.py runs a user's vmap population through its sessions
@pytest.mark.parametrize("population", ["loop", pytest.param("vmap", marks=pytest.mark.slow)])
def test_a_population_run_ends_each_member_as_its_lone_run(tmp_path, population):
    """Through the sessions (run folders, checkpoints, MLflow runs), both ways of carrying a
    population: each member ends with its lone run's params and return, with its own measured speed.
    The second member is reported unstable at its first chunk: it stops there, the others go on."""
    from raysys.session import run_custom, run_population

    settings = [dict(lr=2.5e-4, ent=0.1, clip=0.2, gamma=0.99, lam=0.95, vf=0.5, grad=0.5, seed=0),
                dict(lr=5e-3, ent=0.0, clip=0.1, gamma=0.95, lam=0.9, vf=1.0, grad=5.0, seed=7),
                dict(lr=1e-3, ent=0.05, clip=0.3, gamma=0.999, lam=1.0, vf=0.25, grad=0.1, seed=3, anneal=False)]
    seen = []

    def report(metrics):
        seen.append(metrics["step"])
        return "lr too high"  # the verdict of a stability rule, at this member's first report

    cfgs = [_run_cfg(tmp_path, f"pop-{i}", _member(**kw), population) for i, kw in enumerate(settings)]
    together = run_population(WORKLOAD, cfgs, reports=[None, report, None])
    assert seen == [16 * 16 * 2]  # halted at its first chunk: nothing more reported, nothing more trained
    assert together[1].metrics["perf/env_steps"] == 16 * 16 * 2
    for i in (0, 2):
        cfg = _member(**settings[i])
        alone = run_custom(WORKLOAD, _run_cfg(tmp_path, f"alone-{i}", cfg, population))
        mine, lone = _params(tmp_path, f"pop-{i}"), _params(tmp_path, f"alone-{i}")
        err = max(float(np.abs(a - b).max()) for a, b in zip(mine, lone))
        assert err < 1e-5, (i, err)
        if population == "loop":  # the same compiled program: bit-identical
            assert err == 0.0
        assert together[i].metrics["perf/env_steps"] == alone.metrics["perf/env_steps"] == 16 * 16 * 6
        ret = alone.metrics["charts/episode_return"]
        assert together[i].metrics["charts/episode_return"] == pytest.approx(ret, rel=1e-5, abs=1e-4)
        assert together[i].metrics["perf/env_steps_per_s"] > 0


@pytest.mark.slow  # ~20 s
@pytest.mark.timeout(600)
def test_a_member_restored_at_its_end_keeps_the_quality_it_ended_with(tmp_path):
    """A program interrupted after one member reached its (shorter) end and before the program's final
    metrics were written: resumed, that member trains nothing and ends with the return it had, not NaN."""
    from raysys.session import run_population

    settings = dict(ent=0.01, clip=0.2, gamma=0.99, lam=0.95, vf=0.5, grad=0.5)
    cfgs = [_run_cfg(tmp_path, f"end-{i}", _member(lr=lr, seed=i, **settings), "loop") for i, lr in enumerate((1e-3, 5e-4))]
    first = run_population(WORKLOAD, cfgs)
    ended = first[0].metrics["eval/quality"]
    for i in (0, 1):  # as if the program had stopped before writing them
        (tmp_path / "runs" / f"end-{i}" / "final_metrics.json").unlink()
    longer = [_run_cfg(tmp_path, f"end-{i}", _member(lr=lr, seed=i, **settings), "loop") for i, lr in enumerate((1e-3, 5e-4))]
    longer[1].train = dataclasses.replace(longer[1].train, total_timesteps=16 * 16 * 10)
    for c in longer:
        c.launch.resume = True
    again = run_population(WORKLOAD, longer)
    assert again[0].metrics["eval/quality"] == ended and np.isfinite(ended)
    assert again[1].metrics["perf/env_steps"] == 16 * 16 * 10
