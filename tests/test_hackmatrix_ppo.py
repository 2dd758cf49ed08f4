"""hackmatrix_ppo: GAE, masking, the CLI run, bf16, resume with another batch, compile cache, 4 devices."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raysys.checkpoint import read_state
from raysys.config import ConfigError
from raysys.cli import main
from raysys.workloads.hackmatrix_ppo import ppo


def _final(workdir, name: str) -> dict:
    return json.loads((workdir / "raysys_runs" / name / "final_metrics.json").read_text())


def test_gae_matches_a_hand_loop():
    rng = np.random.default_rng(0)
    T, N, gamma, lam = 7, 3, 0.9, 0.8
    r, v, d = rng.normal(size=(T, N)), rng.normal(size=(T, N)), (rng.random((T, N)) < 0.3).astype(np.float32)
    last = rng.normal(size=N)
    adv_ref, nxt_adv, nxt_v = np.zeros((T, N)), np.zeros(N), last
    for t in reversed(range(T)):
        delta = r[t] + gamma * nxt_v * (1 - d[t]) - v[t]
        nxt_adv = delta + gamma * lam * (1 - d[t]) * nxt_adv
        adv_ref[t], nxt_v = nxt_adv, v[t]
    adv, ret = ppo.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(d), jnp.asarray(last), gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), adv_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), adv_ref + v, rtol=1e-5, atol=1e-5)


def test_masked_actions_are_never_sampled():
    params = ppo.init_params(jax.random.PRNGKey(0), (32, 32))
    obs = jax.random.uniform(jax.random.PRNGKey(1), (512, 1545))
    mask = jax.random.uniform(jax.random.PRNGKey(2), (512, 28)) < 0.2
    mask = mask.at[:, 0].set(True)  # at least one legal action per row
    for dtype in (jnp.float32, jnp.bfloat16):
        logits, value = ppo.forward(params, obs, mask, dtype)
        assert logits.dtype == jnp.float32 and value.shape == (512,)
        a = jax.random.categorical(jax.random.PRNGKey(3), jnp.broadcast_to(logits, (20, 512, 28)))
        assert bool(jnp.take_along_axis(jnp.broadcast_to(mask, (20, 512, 28)), a[..., None], -1).all())


def test_minibatch_scaling_follows_the_seed():
    from raysys.workloads.hackmatrix_ppo.workload import default, seed_fast

    assert ppo.minibatch_plan(default()) == (4, 4)
    cfg = seed_fast()  # 2048 x 256 = 524,288 samples -> 64 minibatches of 8,192, epochs floored at 2
    assert ppo.minibatch_plan(cfg) == (64, 2)
    # where scaling leaves the count as it is, the epochs asked stay (1 became 2: audit AP F8)
    one = dataclasses.replace(default().train, minibatch_scaling=True, update_epochs=1)
    assert one.minibatch_plan() == (4, 1)
    # where it lowers a count asked for, the epochs rise in proportion: as many minibatch steps
    assert dataclasses.replace(cfg.train, num_minibatches=128).minibatch_plan() == (64, 8)
    # what the update runs is what the config checks: 200 x 128 rows do not split into the 3 it makes
    with pytest.raises(ConfigError, match=r"25600 rows\) must be divisible by train.num_minibatches \(minibatch_scaling"):
        dataclasses.replace(default().train, minibatch_scaling=True, num_minibatches=1, num_envs=200).validate()


@pytest.mark.slow  # ~50 s: two JAX compiles; test_ad_source resumes a JAX run bit-exact by default
@pytest.mark.timeout(300)
def test_quick_run_bf16_and_resume_with_other_num_envs(workdir, capsys):
    args = ["train", "hackmatrix_ppo", "--preset", "quick", "--name", "h", "--set", "train.precision=bf16",
            "--set", "train.compilation_cache_dir="]
    assert main([*args, "--set", "train.total_timesteps=10240"]) == 0
    first = _final(workdir, "h")
    assert first["perf/env_steps"] == 10240 and np.isfinite(first["losses/loss"])
    assert first["perf/env_steps_per_s"] > 0 and 0 < first["charts/entropy"] < np.log(28)
    ckpt = sorted((workdir / "raysys_runs" / "h" / "checkpoints").glob("step_*"))[-1]
    state = read_state(ckpt)
    assert all(t.dtype == np.float32 for t in state["params"])  # bf16 compute, fp32 params
    capsys.readouterr()
    # resume with twice the envs: params and Adam state continue, envs start fresh
    assert main([*args, "--set", "train.total_timesteps=20480", "--set", "train.num_envs=64", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed at 10240 env steps" in out and "the environments start afresh" in out
    second = _final(workdir, "h")
    assert second["perf/env_steps"] == 10240 + 64 * 32 * 5
    # the best return of the whole run, its first session's included (it used to restart at each resume)
    assert json.loads((ckpt / "meta.json").read_text())["last_metrics"]["charts/best_episode_return"] == \
        first["charts/best_episode_return"]
    assert second["charts/best_episode_return"] >= first["charts/best_episode_return"]


@pytest.mark.slow  # ~40 s: two cold JAX processes, the second one's cache hit
@pytest.mark.timeout(300)
def test_compilation_cache_skips_compilation_on_a_second_start(tmp_path):
    cache = tmp_path / "jax_cache"
    cmd = [sys.executable, "-m", "raysys", "train", "hackmatrix_ppo", "--preset", "quick",
           "--set", "train.total_timesteps=5120", "--set", f"train.compilation_cache_dir={cache}"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    compile_s = []
    for name in ("first", "second"):
        subprocess.run([*cmd, "--name", name, "--storage-path", str(tmp_path / "runs")], check=True, env=env,
                       cwd=tmp_path, capture_output=True, timeout=240)
        compile_s.append(json.loads((tmp_path / "runs" / name / "final_metrics.json").read_text())["perf/compile_s"])
    assert any(cache.iterdir())
    assert compile_s[1] < 0.5 * compile_s[0], compile_s


def test_the_compilation_cache_is_bounded(tmp_path):
    """Audit BH F3: every program shape a sweep tries added to the cache, and JAX evicts nothing unless given a
    size: 2 GiB by default, $RAYSYS_JAX_CACHE_MAX_MB otherwise (-1: no bound)."""
    code = ("import jax, sys; from raysys.train.jax_host import enable_compilation_cache; "
            "enable_compilation_cache(sys.argv[1]); print(jax.config.jax_compilation_cache_max_size)")
    sizes = []
    for limit in (None, "10", "-1"):
        env = {k: v for k, v in os.environ.items() if k != "RAYSYS_JAX_CACHE_MAX_MB"}
        env |= {"RAYSYS_JAX_CACHE_MAX_MB": limit} if limit else {}
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        sizes.append(int(out.stdout.split()[-1]))
    assert sizes == [2048 * 2**20, 10 * 2**20, -1]


FOUR_DEVICES = textwrap.dedent("""
    import dataclasses, jax, numpy as np
    from raysys.workloads.hackmatrix_ppo import ppo
    from raysys.workloads.hackmatrix_ppo.workload import quick
    assert jax.device_count() == 4
    cfg = quick()
    # one minibatch: the gradient is the mean over all envs however they are split
    cfg.train = dataclasses.replace(cfg.train, num_minibatches=1, update_epochs=2, updates_per_chunk=1)
    out = {}
    for n in (4, 1):
        mesh = ppo.make_mesh(jax.devices()[:n])
        runner = ppo.init_runner(cfg, jax.random.PRNGKey(0), mesh)
        shards = {s.device for s in jax.tree.leaves(runner.env_state)[0].addressable_shards}
        assert len(shards) == n, shards
        runner, stats = ppo.make_train_chunk(cfg, mesh)(runner, ppo.hparams_of(cfg))
        out[n] = [np.asarray(x) for x in jax.tree.leaves(runner.params)]
        assert len({s.device for s in runner.obs.features.addressable_shards}) == n
    err = max(float(np.abs(a - b).max()) for a, b in zip(out[4], out[1]))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(out[1], [np.asarray(x) for x in jax.tree.leaves(
        ppo.init_params(jax.random.split(jax.random.PRNGKey(0), 4)[0], tuple(cfg.model.hidden)))]))
    print("max diff 4 vs 1 device:", err, "moved:", moved)
    assert moved > 1e-4 and err < 1e-5 * max(1.0, moved) + 1e-6
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision, dtype, align", [pytest.param("fp32", jnp.float32, 1, marks=pytest.mark.slow),
                                                     ("bf16", jnp.bfloat16, 16)])
def test_the_rollout_stores_observations_in_the_compute_dtype_and_width(precision, dtype, align):
    """What the network reads: with bf16 the trajectory's largest array is half the bytes; with
    ``model.feature_align`` its rows are zero-padded to the matmul's width, and the loss and the
    params' gradients are those of the unpadded features."""
    import dataclasses

    from raysys.workloads.hackmatrix_ppo.workload import quick

    cfg = quick()
    cfg.train = dataclasses.replace(cfg.train, num_envs=4, num_steps=3, precision=precision)
    cfg.model = dataclasses.replace(cfg.model, feature_align=align)
    runner = ppo.init_runner(cfg, jax.random.PRNGKey(0), ppo.make_mesh(jax.devices()[:1]))
    (_, _, last, _), traj = jax.jit(ppo.make_rollout(cfg))(runner.params, runner.env_state, runner.obs, runner.env_keys)
    n = runner.obs.features.shape[-1]
    width = -(-n // align) * align
    assert traj.obs.dtype == dtype and traj.obs.shape == (3, 4, width)
    assert last.features.shape == runner.obs.features.shape and last.features.dtype == runner.obs.features.dtype
    assert np.array_equal(np.asarray(traj.obs[0, :, :n], np.float32),
                          np.asarray(runner.obs.features.astype(dtype), np.float32))
    assert not np.asarray(traj.obs[..., n:], np.float32).any()
    flat = jax.tree.map(lambda x: x.reshape((12,) + x.shape[2:]), traj)
    adv, targets = jnp.linspace(-1.0, 1.0, 12), jnp.linspace(0.0, 0.5, 12)
    grad = jax.jit(jax.grad(lambda p, mb: ppo.ppo_loss(p, mb, adv, targets, cfg, dtype)[0]))
    padded, unpadded = grad(runner.params, flat), grad(runner.params, flat._replace(obs=flat.obs[:, :n]))
    assert jax.tree.map(np.shape, padded) == jax.tree.map(np.shape, runner.params)
    for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(unpadded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=1e-5)


@pytest.mark.slow  # compiles the whole step (~30 s here), for a diagnostic
def test_the_env_step_census_counts_its_kernels():
    """``python -m raysys.envs.hackmatrix.bench --kernels``: the compiled vmapped step's top-level
    operations (hundreds of fusions: on a GPU, a launch-bound step)."""
    from raysys.envs.hackmatrix.bench import kernel_census

    census = kernel_census(8)
    assert census["backend"] == "cpu" and census["by_op"]["fusion"] > 50
    assert census["kernels"] >= census["by_op"]["fusion"]


@pytest.mark.slow  # ~45 s (a subprocess compiling both programs); docs/hackmatrix.md cites it
def test_four_device_sharding_matches_one_device():
    """XLA_FLAGS forces 4 host devices: the env batch is split over them, gradients are averaged
    across them, and one update gives the same params as on one device (up to float rounding)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", FOUR_DEVICES], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "max diff 4 vs 1 device" in out.stdout


@pytest.mark.timeout(300)
def test_python_loop_path_reaches_the_fused_params():
    """The bench's slow path (Python loop, host round-trips) and the fused lax.scan path run the
    same PPO: same keys, permutation and loss, so two updates give the same params (what the bench judges)."""
    from raysys.workloads.hackmatrix_ppo import bench

    p = bench.path_parity()
    assert p["moved"] > 1e-4 and p["max_param_diff"] < 1e-5 < bench.PARAM_PARITY * p["moved"], p
    assert p["env_steps"] == (2 * 16 * 16,) * 2
    assert bench.parity_problems(p) == []


@pytest.mark.slow  # ~25 s; the parity itself is checked by default above
def test_the_bench_fails_a_slow_path_that_does_not_train_as_the_fused_one(monkeypatch):
    from raysys.workloads.hackmatrix_ppo import bench

    monkeypatch.setattr(bench, "python_loop_update", lambda cfg: lambda runner: (runner, None))  # no update at all
    (problem,) = bench.parity_problems(bench.path_parity())
    assert "the paths train differently" in problem and "1 of how far the fused path moved them" in problem, problem


@pytest.mark.slow  # ~2 min: a learning run; the default suite checks the PPO step itself
@pytest.mark.timeout(600)
def test_default_ppo_learns_above_a_random_masked_policy(workdir):
    """The default PPO (256 envs x 128 steps, the original's hyper-parameters) for ~1M env steps:
    the mean episode return of its last chunk must clear a random masked policy's by a margin far
    beyond noise. Each figure averages over 10,000 episodes (standard error ~0.01); measured here:
    -2.343 against -2.532. docs/benchmarks.md has the longer curve."""
    from raysys.envs import hackmatrix as hm

    _, summary, _ = jax.jit(hm.random_rollout, static_argnums=(1, 2))(jax.random.PRNGKey(1), 256, 200)
    random_return = float(summary["returns"]) / float(summary["episodes"])
    steps = 3 * 10 * 256 * 128  # three chunks of the default preset
    assert main(["train", "hackmatrix_ppo", "--name", "learn", "--set", f"train.total_timesteps={steps}",
                 "--set", "train.compilation_cache_dir="]) == 0
    final = _final(workdir, "learn")
    assert final["perf/env_steps"] == steps
    assert final["charts/episode_return"] > random_return + 0.1, (final["charts/episode_return"], random_return)


def test_a_sweeps_driver_prepares_without_starting_jax():
    """The sweep's driver prepares the base config once and trains nothing: it must not start JAX's backend,
    which on a GPU takes most of the device's memory from the trials (and made every later process Ray
    started warn that os.fork() may deadlock). The device split is checked by each trial, in its process."""
    probe = ("import sys\n"
             "from raysys import workload as registry\n"
             "from raysys.tune import space as spaces\n"
             "from raysys.tune.runner import _prepare\n"
             "sp = spaces.load('tune_spaces/hackmatrix_ppo_members.yaml', preset='quick', overrides={})\n"
             "_prepare(registry.get(sp.workload), sp.base_config())\n"
             "from jax._src import xla_bridge\n"
             "print('backends started:', xla_bridge.backends_are_initialized())\n"
             "from raysys.workloads.hackmatrix_ppo.workload import _check_here\n"
             "_check_here(sp.base_config())  # train's own check, outside a sweep's driver, does start it\n"
             "print('after train check:', xla_bridge.backends_are_initialized())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.split("\n")[:2] == ["backends started: False", "after train check: True"], out.stdout + out.stderr


TINY = ["train", "hackmatrix_ppo", "--preset", "quick", "--set", "train.num_envs=1", "--set", "train.num_steps=4",
        "--set", "train.num_minibatches=1", "--set", "train.updates_per_chunk=1", "--set", "train.compilation_cache_dir="]


def _history(workdir, name: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-hackmatrix_ppo").experiment_id],
                                filter_string=f"tags.mlflow.runName = '{name}'")
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.slow  # ~30 s of training
@pytest.mark.timeout(300)
def test_the_lr_anneals_to_the_runs_real_end_and_the_quality_is_of_finished_episodes(workdir, capsys):
    """The LR anneals to 0 at the end the run really has (total_timesteps rounded up to whole chunks; it
    reached 0 before, and the updates past it learned nothing), and the quality is the last return of finished
    episodes (a last chunk that finished none gave NaN) (audit AP)."""
    assert main([*TINY, "--name", "a", "--set", "train.total_timesteps=57"]) == 0
    assert "total_timesteps 57 rounds up to 60" in capsys.readouterr().out
    lr = _history(workdir, "a", "charts/learning_rate")
    assert lr[-1] == (60, pytest.approx(2.5e-4 * 4 / 60))  # the last update, at 56 of 60 env steps
    returns = [v for _, v in _history(workdir, "a", "charts/episode_return")]
    assert np.isnan(returns[-1]) and not np.isnan(returns).all()  # the last chunk finished no episode
    assert _final(workdir, "a")["eval/quality"] == pytest.approx([v for v in returns if not np.isnan(v)][-1])


@pytest.mark.slow  # ~1 min: four JAX runs
@pytest.mark.timeout(600)
def test_a_resume_with_another_seed_draws_from_it(workdir, capsys):
    """A --resume with another train.seed was announced and then ignored: the checkpoint's random streams went
    on, bit for bit (audit AP). Two runs alike, each resumed, one with a new seed: only its updates differ."""
    for name in ("a", "b"):
        assert main([*TINY, "--name", name, "--set", "train.total_timesteps=60"]) == 0
    first = _final(workdir, "a")["perf/train_seconds"]
    assert main([*TINY, "--name", "a", "--set", "train.total_timesteps=80", "--resume"]) == 0
    # the whole run's seconds and rate, not the last session's (audit AP F10)
    whole = _final(workdir, "a")
    assert whole["perf/train_seconds"] > first
    assert whole["perf/env_steps_per_s_overall"] == pytest.approx(80 / whole["perf/train_seconds"])
    capsys.readouterr()
    assert main([*TINY, "--name", "b", "--set", "train.total_timesteps=80", "--set", "train.seed=5", "--resume"]) == 0
    assert "train.seed 0 -> 5: the envs' and the minibatches' random streams start from the new seed" in \
        capsys.readouterr().out
    (a0, a1), (b0, b1) = ([[v for s, v in _history(workdir, n, "losses/loss") if (s > 60) == late] for late in (0, 1)]
                          for n in "ab")
    assert a0 == b0 and len(a1) == len(b1) == 5 and a1 != b1
