"""The AD transformer's source PPO as a workload (``ad_source``): a population of settings is one
program in which every member trains exactly as it would alone; a run learns and resumes bit-exact."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raysys.checkpoint import read_state
from raysys.session import run_custom, run_population
from raysys.workloads.ad_transformer import source
from raysys.workloads.ad_transformer.source_workload import WORKLOAD, quick

GOALS = np.array([0, 40, 71], np.int32)


def _member(lr, ent, clip, gamma, lam, vf, grad, seed):
    c = source.SourceConfig(streams=4, steps_per_goal=4 * 10 * 6, n_steps=10, minibatch=20, epochs=2,
                            hidden=(16, 16), updates_per_call=3)
    return dataclasses.replace(c, lr=lr, ent_coef=ent, clip_eps=clip, gamma=gamma, gae_lambda=lam, vf_coef=vf,
                               max_grad_norm=grad, seed=seed)


@pytest.mark.slow  # ~45 s; tests/test_population.py checks the same for hackmatrix_ppo's program by default
@pytest.mark.timeout(600)
def test_each_member_ends_as_it_would_alone():
    """Members differ in every shape-free hyper-parameter and the seed; over two chunks (the third
    member masked in the second, the second stopping after one update of it) each member holds the
    params, and saw the returns, of the same setting run alone."""
    cs = [_member(3e-4, 0.0, 0.2, 0.99, 0.95, 0.5, 0.5, 0), _member(3e-3, 0.05, 0.1, 0.9, 1.0, 1.0, 5.0, 7),
          _member(1e-3, 0.01, 0.3, 0.999, 0.9, 0.25, 0.1, 3)]
    wl_cfgs = []
    for c in cs:
        cfg = quick()
        cfg.source = c
        wl_cfgs.append(cfg)
    assert len({WORKLOAD.population.program_key(c) for c in wl_cfgs}) == 1  # one program
    learners = jax.tree.map(lambda *xs: jnp.stack(xs), *[source.init_learners(c, GOALS) for c in cs])
    pop = source.make_population_chunk(cs[0])
    hps = source.stack_hparams(cs)
    plan = [np.array([3, 3, 3], np.int32), np.array([3, 1, 0], np.int32)]
    returns = []
    for n in plan:
        learners, ret = pop(learners, GOALS, hps, n)
        returns.append(np.asarray(ret))  # [3 updates, K, G]

    alone = source.make_chunk(cs[0])
    for i, c in enumerate(cs):
        lone = source.init_learners(c, GOALS)
        first = jax.tree.leaves(lone.params)
        first = [np.asarray(x) for x in first]
        for chunk, n in enumerate(plan):
            if n[i] == 0:
                continue
            lone, ret = alone(lone, GOALS, source.hparams_of(c), np.int32(n[i]))
            np.testing.assert_allclose(np.asarray(ret)[: n[i]], returns[chunk][: n[i], i], rtol=1e-5, atol=1e-5)
        mine = [np.asarray(x)[i] for x in jax.tree.leaves(learners)]
        theirs = [np.asarray(x) for x in jax.tree.leaves(lone)]
        moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(lone.params), first))
        err = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(mine, theirs))
        assert moved > 1e-3 and err < 1e-5, (i, moved, err)


def _cfg(tmp_path, name, **source_over):
    cfg = quick()
    cfg.source = dataclasses.replace(cfg.source, **source_over)
    cfg.train.compilation_cache_dir = ""
    cfg.launch.storage_path, cfg.launch.name = str(tmp_path / "runs"), name
    cfg.launch.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return cfg


@pytest.mark.timeout(600)
# slow-only (~30-50 s each): tests/test_population.py and tests/test_plugin_population.py run populations
# through their sessions by default
@pytest.mark.slow
@pytest.mark.parametrize("population", ["vmap", "loop"])
def test_a_population_run_gives_each_member_its_lone_runs_result(tmp_path, population):
    """Through the sessions (run folders, checkpoints, MLflow runs): two members trained as one
    program, batched or in turn, end with the quality of the same settings trained one by one. (Short runs: over long
    ones a last-bit difference of the batched matmuls can flip one sampled action, and from there
    the two runs are different learners; source_bench.py reports for how long they stay equal.)"""
    pair = [dict(lr=3e-4, seed=1, steps_per_goal=10 * 20 * 8), dict(lr=2e-3, ent_coef=0.01, seed=2, steps_per_goal=10 * 20 * 10)]
    def cfg(name, **kw):
        c = _cfg(tmp_path, name, **kw)
        c.train.population = population
        return c

    together = run_population(WORKLOAD, [cfg(f"pop-{i}", **kw) for i, kw in enumerate(pair)])
    for i, kw in enumerate(pair):
        alone = run_custom(WORKLOAD, cfg(f"alone-{i}", **kw))
        assert together[i].metrics["eval/quality"] == pytest.approx(alone.metrics["eval/quality"], abs=1e-4)
        if population == "loop":  # the lone program itself: bit-identical
            assert together[i].metrics["eval/quality"] == alone.metrics["eval/quality"]
        assert together[i].metrics["perf/env_steps_per_s"] > 0
        assert (tmp_path / "runs" / f"pop-{i}" / "final_metrics.json").is_file()


@pytest.mark.timeout(600)
def test_resume_from_an_earlier_checkpoint_ends_bit_exact(tmp_path):
    """A run resumed from a checkpoint before its end (the last one removed, as if killed there)
    ends with the same learners, curve and quality as the run that was never interrupted."""
    import shutil

    def run(name, resume=False):
        cfg = _cfg(tmp_path, name)
        cfg.train.checkpoint_every_minutes, cfg.launch.resume = 1e-9, resume  # a checkpoint every chunk
        return run_custom(WORKLOAD, cfg)

    first = run("r")
    assert first.metrics["eval/quality"] > 0.4  # the quick preset's learners reach ~0.6 of optimal (random ~0.05)
    ckpts = sorted((tmp_path / "runs" / "r" / "checkpoints").glob("step_*"))
    final_state = read_state(ckpts[-1])
    assert (ckpts[-1] / "state.npz").is_file()  # numpy arrays: saved without torch
    shutil.rmtree(ckpts[-1])
    (tmp_path / "runs" / "r" / "final_metrics.json").unlink()
    again = run("r", resume=True)
    assert again.metrics["eval/quality"] == first.metrics["eval/quality"]
    resumed_state = read_state(ckpts[-1])
    for a, b in zip(final_state["learners"] + [final_state["curve"]], resumed_state["learners"] + [resumed_state["curve"]]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
