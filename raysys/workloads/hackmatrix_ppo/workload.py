"""HackMatrix PPO in JAX (seed 001) as a raysys workload: config, presets, the chunked train loop.

``train`` runs jitted chunks of PPO updates (raysys/workloads/hackmatrix_ppo/ppo.py) and, between
chunks, logs and checkpoints through the Session. The env batch is sharded over every device
JAX sees (all chips of all hosts under ``jax.distributed``). ``naive`` in the bench is the seed's
slow way: a Python loop of jitted env steps and jitted minibatch updates with host round-trips.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal

from raysys import lifecycle
from raysys.config import ConfigError, at_least, require
from raysys.metrics import Throughput
from raysys.train.config import JaxLaunchConfig
from raysys.train.jax_host import enable_compilation_cache, to_host
from raysys.workload import Population, Workload


@dataclass
class EnvConfig:
    max_steps_in_episode: int = 1000
    """Episode truncation of the HackMatrix env (episodes last ~20 steps in practice)."""

    def validate(self) -> None:
        at_least(self, "env.", 1, "max_steps_in_episode")


@dataclass
class ModelConfig:
    hidden: tuple[int, ...] = (256, 256)
    """Shared MLP trunk widths (ReLU), then a 28-logit actor head and a value head."""
    feature_align: int = 1
    """Zero-pad the network's input features to a multiple of this (16: 1,545 -> 1,552) in the
    rollout's stored observations and the first layer's weights, so a row starts on a 32-byte
    boundary for a GPU's matrix units. The same network and params (the padded rows are zeros, not
    trained); sums may round differently. 1: no padding."""

    def validate(self) -> None:
        at_least(self, "model.", 1, "hidden", "feature_align")


@dataclass
class TrainConfig:
    total_timesteps: int = 5_000_000
    """Env steps to train for (all envs, all devices), rounded up to whole chunks of updates_per_chunk x
    num_envs x num_steps (one compiled program each)."""
    num_envs: int = 256
    """Parallel envs (split over every device). Seed: 256 before, 2048 after."""
    num_steps: int = 128
    """Steps per env per update (rollout length). Seed: 128 before, 256 after."""
    num_minibatches: int = 4
    """Minibatches per epoch."""
    update_epochs: int = 4
    """Passes over each rollout."""
    minibatch_scaling: bool = False
    """The seed's large-batch remedy: ~8,192 samples per minibatch (<= 64 of them), and, where that changes the
    count, update_epochs scaled to keep about as many minibatch steps (>= 2, unless 1 was asked). The plan in use
    is said when the run starts."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: network compute in bfloat16; params and Adam state stay fp32."""
    updates_per_chunk: int = 10
    """Updates per jitted chunk; Python logs and checkpoints between chunks."""
    checkpoint_every_minutes: float = 10.0
    """Checkpoint when this much time has passed since the last one (and at the end)."""
    seed: int = 0
    """PRNG seed of params, envs and shuffling."""
    compilation_cache_dir: str = "~/.cache/raysys/jax"
    """Persistent JAX compilation cache ('' disables): a second start skips compilation."""
    population: Literal["auto", "vmap", "loop"] = "auto"
    """How ``--vectorize`` trains configurations of this shape in one process: vmap (one batched
    program; pays on a GPU/TPU that one member leaves idle) or loop (this program, member after
    member: one compile, no speed probe; a CPU runs a batch no faster). auto: loop on CPU, else vmap."""

    def validate(self) -> None:
        for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "updates_per_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        nmb, _ = self.minibatch_plan()
        if (self.num_envs * self.num_steps) % nmb:
            scaled = f" (minibatch_scaling makes them {nmb})" if nmb != self.num_minibatches else ""
            raise ConfigError(f"train.num_envs * train.num_steps ({self.num_envs * self.num_steps} rows) must be "
                              f"divisible by train.num_minibatches{scaled}")
        require(self.checkpoint_every_minutes > 0,
                f"train.checkpoint_every_minutes must be > 0, got {self.checkpoint_every_minutes}")

    def minibatch_plan(self) -> tuple[int, int]:
        """(num_minibatches, update_epochs) the update runs. With ``minibatch_scaling`` the original's large-batch
        remedy: about 8,192 samples per minibatch (at most 64 minibatches); where that changes the count, the
        epochs in proportion (at least 2, unless 1 was asked), so that about as many minibatch steps are taken."""
        nmb, epochs = self.num_minibatches, self.update_epochs
        if self.minibatch_scaling:
            scaled = int(min(64, max(nmb, self.num_envs * self.num_steps // 8192)))
            if scaled != nmb:
                epochs, nmb = max(min(2, epochs), round(epochs * nmb / scaled)), scaled
        return nmb, epochs


@dataclass
class OptimConfig:
    lr: float = 2.5e-4
    """Adam learning rate (the original's)."""
    anneal_lr: bool = True
    """Linear decay to 0 over total_timesteps rounded up to whole chunks (by env steps, so it survives a changed
    batch on resume)."""
    max_grad_norm: float = 0.5
    """Global-norm gradient clip."""

    def validate(self) -> None:
        require(self.lr > 0 and self.max_grad_norm > 0, "optim.lr and optim.max_grad_norm must be > 0")


@dataclass
class PPOConfig:
    gamma: float = 0.99
    """Discount."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    clip_eps: float = 0.2
    """Policy (and value) clip range."""
    ent_coef: float = 0.1
    """Entropy bonus (the original's 0.1: HackMatrix needs a lot of exploration)."""
    vf_coef: float = 0.5
    """Value-loss weight."""

    def validate(self) -> None:
        require(0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1, "ppo.gamma must be in (0, 1], ppo.gae_lambda in [0, 1]")
        require(self.clip_eps > 0, f"ppo.clip_eps must be > 0, got {self.clip_eps}")
        at_least(self, "ppo.", 0, "ent_coef", "vf_coef")


@dataclass
class HackMatrixPPOConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    launch: JaxLaunchConfig = field(default_factory=JaxLaunchConfig)

    def validate(self) -> None:
        """Sizes this machine's memory cannot hold, refused before the run exists: XLA's allocation error came
        after a run, its MLflow run and a compile, as a traceback. A lower bound (the rollout's observations and
        the params with their gradients and Adam's two moments, fp32); said where the run is this machine's CPU
        alone (a GPU's or a cluster's memory is not this process's to measure before JAX starts)."""
        from raysys.train.code_checks import physical_memory
        from raysys.train.runtime import local_gpus

        if self.launch.workers or self.launch.jax_platforms not in ("", "cpu") or local_gpus():
            return
        obs = -(-1545 // self.model.feature_align) * self.model.feature_align  # envs.hackmatrix OBS_SIZE, padded
        widths = (obs, *self.model.hidden)
        params = sum(a * b + b for a, b in zip(widths, widths[1:])) + (self.model.hidden[-1] + 1) * 29  # + heads
        rollout = self.train.num_envs * self.train.num_steps * (obs * 4 + 28 + 5 * 4)  # obs, mask, 5 scalars
        need, have = rollout + 4 * 4 * params, physical_memory()
        gib = 2 ** 30
        require(have is None or need <= have,
                f"train.num_envs={self.train.num_envs} x train.num_steps={self.train.num_steps} and model.hidden="
                f"{list(self.model.hidden)} need at least {need / gib:,.0f} GiB ({rollout / gib:,.1f} GiB of rollout, "
                f"{params:,} parameters with their gradients and Adam's moments), more than this machine's "
                f"{have / gib:.1f} GiB of memory")


# ---------------------------------------------------------------- presets (derive from each other)


def default() -> HackMatrixPPOConfig:
    """The original's PPO at 256 envs x 128 steps."""
    return HackMatrixPPOConfig()


def seed_fast() -> HackMatrixPPOConfig:
    """The seed's speed change: 2048 envs x 256 steps, with its minibatch-scaling remedy."""
    cfg = default()
    cfg.train = dataclasses.replace(cfg.train, num_envs=2048, num_steps=256, minibatch_scaling=True, updates_per_chunk=2)
    return cfg


def learn() -> HackMatrixPPOConfig:
    """The documented learning preset (docs/benchmarks.md): 2M env steps, minutes on a CPU."""
    cfg = default()
    cfg.train = dataclasses.replace(cfg.train, total_timesteps=2_000_000)
    return cfg


def quick() -> HackMatrixPPOConfig:
    """A smoke run of well under a minute: 32 envs x 32 steps, 20 updates."""
    cfg = default()
    cfg.model = ModelConfig(hidden=(64, 64))
    cfg.train = dataclasses.replace(cfg.train, total_timesteps=32 * 32 * 20, num_envs=32, num_steps=32,
                                    num_minibatches=2, update_epochs=2, updates_per_chunk=5)
    return cfg


PRESETS = {"default": default, "seed_fast": seed_fast, "learn": learn, "quick": quick}


# ---------------------------------------------------------------- training


def check_devices(cfg, n_devices: int, what: str = "devices") -> None:
    """What splitting the envs over ``n_devices`` needs, said in one line: whole envs per device, and
    per-device rows that the minibatches divide (each device shuffles its own share)."""
    tc = cfg.train
    if tc.num_envs % n_devices:
        raise ConfigError(f"train.num_envs={tc.num_envs} must be a multiple of the {n_devices} {what}")
    nmb, _ = cfg.train.minibatch_plan()
    rows = tc.num_envs // n_devices * tc.num_steps
    if rows % nmb:
        raise ConfigError(f"each of the {n_devices} {what.split(' (')[0].replace('devices', 'device(s)')} splits its "
                          f"{rows} rows (train.num_envs / {n_devices} x train.num_steps) into {nmb} minibatches: "
                          "choose sizes that divide evenly")


def _check_here(cfg: HackMatrixPPOConfig) -> None:
    """Trained in this process (--workers 0): the split over this machine's devices is checked before the
    run exists (Ray Train workers check their own devices, a sweep's trials theirs: its driver, which
    trains nothing, neither checks nor starts JAX)."""
    from raysys.workload import on_sweep_driver

    if on_sweep_driver():
        return
    if cfg.launch.workers == 0:
        import jax

        check_devices(cfg, jax.device_count())
    else:  # each worker has one device or more: what its first worker would refuse, said before the run exists
        check_devices(cfg, cfg.launch.workers, "Ray Train workers (one device each, at least)")



def _start(cfg: HackMatrixPPOConfig, session, mesh):
    """-> (runner, env_steps, updates): fresh, or from the session's last checkpoint."""
    import jax
    import numpy as np

    from raysys.workloads.hackmatrix_ppo import ppo

    key = jax.random.PRNGKey(cfg.train.seed)
    ckpt = session.restore()
    if ckpt is None:
        return ppo.init_runner(cfg, key, mesh), 0, 0

    # params and Adam state come back; envs start fresh, so num_envs/num_steps may differ
    def fresh():
        params = ppo.init_params(key, tuple(cfg.model.hidden))
        return params, ppo.make_optimizer(cfg).init(params)

    shapes = jax.eval_shape(fresh)  # the tree structures only; nothing is computed
    params, opt_state = (jax.tree.unflatten(jax.tree.structure(tree), [np.asarray(t) for t in leaves])
                         for tree, leaves in zip(shapes, (ckpt["params"], ckpt["opt_state"])))
    env_steps, updates = int(ckpt["env_steps"]), int(ckpt["updates"])
    runner = ppo.init_runner(cfg, jax.random.fold_in(key, updates), mesh, params, opt_state, env_steps)
    saved = ckpt.get("runner")
    leaves, tree = jax.tree.flatten(runner)
    if saved is not None and [tuple(t.shape) for t in saved] == [tuple(x.shape) for x in leaves]:
        # the whole state came back (envs, observations, PRNG streams): the run continues bit-exact
        fresh_keys = runner
        runner = jax.tree.unflatten(tree, [jax.device_put(np.asarray(t).astype(x.dtype), x.sharding)
                                           for t, x in zip(saved, leaves)])
        was = ckpt.get("seed")  # checkpoints of before it was kept: the seed they ran with is not known
        if was is not None and int(was) != cfg.train.seed:  # a new seed would otherwise change nothing
            runner = runner._replace(env_keys=fresh_keys.env_keys, key=fresh_keys.key)
            session.message(f"train.seed {int(was)} -> {cfg.train.seed}: the envs' and the minibatches' random "
                            "streams start from the new seed here; params, Adam state and the envs' states go on")
    elif saved is not None:  # another num_envs or num_steps: the saved envs do not fit this program
        session.message("the environments start afresh: the checkpoint's env states have another shape "
                        "(train.num_envs or train.num_steps changed); params and Adam state go on")
    session.message(f"resumed at {env_steps} env steps ({updates} updates)")
    return runner, env_steps, updates


def _save(session, runner, env_steps: int, updates: int, seed: int) -> None:
    import jax
    import numpy as np

    if not session.is_main:  # only rank 0 writes; the host copy involves no collective
        return
    host = to_host((runner.params, runner.opt_state))
    state = {"params": [np.array(x) for x in jax.tree.leaves(host[0])],
             "opt_state": [np.array(x) for x in jax.tree.leaves(host[1])],
             "env_steps": env_steps, "updates": updates, "seed": seed}
    if jax.process_count() == 1:  # all of it, so that a resume with the same num_envs is bit-exact
        state["runner"] = [np.array(x) for x in jax.tree.leaves(runner)]
    session.checkpoint(state, env_steps)


BEST = "charts/best_episode_return"
TRAIN_SECONDS = "perf/train_seconds"


def seconds_so_far(session, env_steps: int) -> tuple[float, int]:
    """(training seconds so far, the env step they count from). They are logged with each chunk, so that a
    resumed run's overall rate is the whole run's; a checkpoint of before lacks them: this session's alone."""
    prior = session.last_metrics.get(TRAIN_SECONDS)
    return (float(prior), 0) if prior is not None else (0.0, env_steps)


SPEED_WINDOW = 10
"""perf/env_steps_per_s is the rate over the last chunks (at most this many), as a task's loop's is over its
last steps: a sweep judges a trial by its last report, and one chunk's time is noisy."""


def _chunk_metrics(stats: dict, env_steps_per_s: float, compile_s: float) -> dict:
    eps = max(stats["episodes"], 1.0)
    return {
        "charts/episode_return": stats["return_sum"] / eps if stats["episodes"] else float("nan"),
        "charts/episode_length": stats["length_sum"] / eps if stats["episodes"] else float("nan"),
        "charts/episodes": stats["episodes"],
        "charts/entropy": stats["entropy"],
        "charts/approx_kl": stats["approx_kl"],
        "charts/clipfrac": stats["clipfrac"],
        "charts/learning_rate": stats["lr_last"],
        "losses/policy_loss": stats["policy_loss"],
        "losses/value_loss": stats["value_loss"],
        "losses/loss": stats["loss"],
        "losses/grad_norm": stats["grad_norm"],
        "perf/env_steps_per_s": env_steps_per_s,
        "perf/compile_s": compile_s,
    }


def _progress(m: dict) -> str:
    return (f"return {m['charts/episode_return']:.3f} | entropy {m['charts/entropy']:.2f} | "
            f"kl {m['charts/approx_kl']:.4f} | {m['perf/env_steps_per_s']:.0f} env-steps/s")


def train(cfg: HackMatrixPPOConfig, session) -> dict:
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    import jax

    from raysys.workloads.hackmatrix_ppo import ppo

    mesh = ppo.make_mesh()
    runner, env_steps, updates = _start(cfg, session, mesh)
    chunk_fn = ppo.make_train_chunk(cfg, mesh)
    hp = ppo.replicate(ppo.hparams_of(cfg), mesh)
    t0 = time.perf_counter()
    step = chunk_fn.lower(runner, hp).compile()  # AOT: compile time measured apart from training
    compile_s = time.perf_counter() - t0
    per_chunk = cfg.train.updates_per_chunk * cfg.train.num_envs * cfg.train.num_steps
    n_chunks = max(0, -(-(cfg.train.total_timesteps - env_steps) // per_chunk))
    end = env_steps + n_chunks * per_chunk  # a chunk is one compiled program: the run ends on a whole one
    rounded = f" (total_timesteps {cfg.train.total_timesteps} rounds up to {end})" if end > cfg.train.total_timesteps else ""
    nmb, epochs = cfg.train.minibatch_plan()
    plan = f"; minibatch_scaling: {nmb} minibatches x {epochs} epochs" if cfg.train.minibatch_scaling else ""
    session.message(f"{mesh.size} device(s) ({jax.devices()[0].platform}), {jax.process_count()} process(es); "
                    f"compiled in {compile_s:.1f}s; {n_chunks} chunks of {per_chunk} env steps{rounded}{plan}")
    # the best so far is logged with each chunk, so a checkpoint keeps it (Session.last_metrics) for a resume
    last_ckpt, best = time.perf_counter(), session.last_metrics.get(BEST, -float("inf"))
    t_train, counted_from = seconds_so_far(session, env_steps)
    # the quality is the last chunk's return that finished episodes: a short last chunk may finish none
    recent = session.last_metrics.get("charts/episode_return", float("nan"))
    final: dict = {"perf/compile_s": compile_s}
    last_dt, speed = None, Throughput(window=SPEED_WINDOW)
    for _ in range(n_chunks):
        t = time.perf_counter()
        with lifecycle.uncut(last_dt):  # one compiled program: a second signal waits for its end (and says so)
            runner, stats = step(runner, hp)
            stats = {k: float(v) for k, v in to_host(stats).items()}  # the one host sync per chunk
        dt = last_dt = time.perf_counter() - t
        t_train += dt
        env_steps += per_chunk
        updates += cfg.train.updates_per_chunk
        speed.update(dt, per_chunk, 0)
        steps_in, seconds_in = speed.window_sums()
        m = _chunk_metrics(stats, steps_in / seconds_in, compile_s) | {TRAIN_SECONDS: t_train}
        if stats["episodes"]:
            best = m[BEST] = max(best, m["charts/episode_return"])
            recent = m["charts/episode_return"]
        final |= m
        session.log(m, env_steps, progress=_progress(m), bar=(env_steps, max(end, env_steps)), unit="env-step")
        if time.perf_counter() - last_ckpt >= 60 * cfg.train.checkpoint_every_minutes:
            _save(session, runner, env_steps, updates, cfg.train.seed)
            last_ckpt = time.perf_counter()
        if jax.process_count() == 1 and session.should_stop():  # SIGINT/SIGTERM: save below and stop
            _save(session, runner, env_steps, updates, cfg.train.seed)
            session.message(f"stopped at {env_steps}/{cfg.train.total_timesteps} env steps; checkpoint saved")
            return final
    if jax.process_count() > 1:
        # before the final checkpoint: a worker group restarted after a mismatch must not resume
        # from (and so inherit) rank 0's params, which would hide the divergence
        _check_in_hosts(runner, session)
    _save(session, runner, env_steps, updates, cfg.train.seed)
    final |= {"eval/quality": recent, BEST: best,
              TRAIN_SECONDS: t_train, "perf/env_steps": env_steps,
              "perf/env_steps_per_s_overall": (env_steps - counted_from) / t_train if t_train else 0.0}
    return final


# Changing none of the program's shapes, these may differ between the members of one population.
MEMBER_KNOBS = ("optim.lr", "optim.anneal_lr", "optim.max_grad_norm", "ppo.gamma", "ppo.gae_lambda", "ppo.clip_eps",
                "ppo.ent_coef", "ppo.vf_coef", "train.seed", "train.total_timesteps",
                "train.checkpoint_every_minutes", "train.compilation_cache_dir")
# What PBT may perturb (--scheduler pbt): the update's hyper-parameters, not the seed, budget or schedule switch.
EXPLORE_KNOBS = ("optim.lr", "optim.max_grad_norm", "ppo.gamma", "ppo.gae_lambda", "ppo.clip_eps", "ppo.ent_coef",
                 "ppo.vf_coef")


def train_population(cfgs: list[HackMatrixPPOConfig], sessions: list) -> list[dict]:
    """K configurations of one shape in one process: see population.py."""
    from raysys.workloads.hackmatrix_ppo.population import train_population as run

    return run(cfgs, sessions)


def _check_in_hosts(runner, session) -> None:
    """All JAX processes must end with the same params (one model, trained together on disjoint
    envs): each records what it held under hosts/ in the run folder, and a mismatch fails the run."""
    import hashlib
    import json

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    sha = lambda arrays: hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()  # noqa: E731
    params = to_host(runner.params)
    local_keys = [np.asarray(s.data) for s in runner.env_keys.addressable_shards]
    record = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "devices": jax.device_count(), "local_devices": jax.local_device_count(),
              "local_envs": int(sum(len(k) for k in local_keys)),
              "params_sha256": sha(jax.tree.leaves(params)), "env_keys_sha256": sha(local_keys)}
    folder = session.run_dir / "hosts"
    folder.mkdir(exist_ok=True)
    (folder / f"process{jax.process_index()}.json").write_text(json.dumps(record, indent=1))
    multihost_utils.assert_equal(params, "JAX processes ended with different params")


def _bench(quick: bool = False) -> dict:
    from raysys.workloads.hackmatrix_ppo.bench import run_bench

    return run_bench(quick=quick)


WORKLOAD = Workload(
    name="hackmatrix_ppo",
    description="PPO on HackMatrix in pure JAX: one jitted lax.scan per chunk of updates, envs sharded over devices",
    config_cls=HackMatrixPPOConfig,
    presets=PRESETS,
    bench=_bench,
    train_fn=train,
    population=Population(train_population, MEMBER_KNOBS, EXPLORE_KNOBS, rank_metric="charts/episode_return"),
    throughput_metric="perf/env_steps_per_s",
    # resume only needs the same network: num_envs / num_steps may change
    extra={"identity_sections": ("model",), "runner": "jax", "prepare": _check_here},
)
