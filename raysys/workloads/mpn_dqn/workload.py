"""The recurrent MPN-DQN on NeuroGym (seed 000) as a raysys workload: config, presets, registration.

The config is flat, like CleanRL's ``Args`` and like the seed's command line, so its commands
translate one to one (``--sequence-batch-size 64`` -> ``--set sequence_batch_size=64``); see
``docs/mpn_dqn.md`` for the table. ``path=naive`` is the seed's *before* (one sequence at a time,
one forward per transition); ``path=optimized`` is its *after* (all sequences in one batch, a loop
over time only), with ``precision`` and ``compile`` on top.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from raysys.config import ConfigError, at_least, require
from raysys.train.config import LaunchConfig
from raysys.workload import Workload
from raysys.workloads.mpn_dqn.env import NEUROGYM_TASK


@dataclass
class MPNDQNConfig:
    # ---- environment
    task: str = NEUROGYM_TASK
    """NeuroGym task id (or any gymnasium id with a flat Box observation and Discrete actions)."""
    task_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the task's constructor, e.g. ``--set task_kwargs.dt=20`` or
    ``--set 'task_kwargs={dt: 20, timing: {stimulus: 500}}'`` (values read as YAML). Part of the run's identity."""
    max_episode_steps: int = 200
    """TimeLimit of an episode (NeuroGym tasks never end by themselves). Seed: --max-episode-steps."""
    num_episodes: int = 100
    """Episodes to train for, counted over all envs. Seed: --num-episodes. Envs are stepped ``steps_per_call`` steps
    at a time, so the last collection may finish more: each env ends the episode it is in, and where episodes are
    shorter than ``steps_per_call`` up to ``steps_per_call x num_envs`` episodes in all."""
    max_seconds: Optional[float] = None
    """Also stop after this many seconds of training (a time budget); None = no limit."""
    # ---- model
    hidden: int = 128
    """MPN hidden units H."""
    eta: float = 0.1
    """Hebbian learning rate of the synaptic modulation M."""
    lam: float = 0.95
    """Decay of M per step."""
    freeze_plasticity: bool = False
    """Keep M at 0 (the MPN becomes a plain tanh layer): the original's ablation."""
    # ---- the seed's speed knobs
    path: Literal["naive", "optimized"] = "optimized"
    """TD loss: naive = one sequence at a time, one forward per transition (the seed's before);
    optimized = all sequences as one [B, L, D] batch, loop over time only (its after)."""
    sequence_length: int = 10
    """Steps per replayed sequence L. Seed: --sequence-length."""
    sequence_batch_size: int = 64
    """Sequences per update B. Seed: --sequence-batch-size (32 before, 64 after)."""
    train_freq: int = 4
    """Environment transitions per gradient update (per learner when launch.workers > 1). Seed: --train-freq (1 before)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast of the unrolls: bf16 (CPU or GPU), fp16 (CUDA only, with loss scaling)."""
    compile: bool = False
    """torch.compile the optimized TD loss (falls back to eager if compilation fails)."""
    cuda_graph: bool = False
    """Capture the whole optimized update (TD loss, backward, clip, Adam) as one CUDA graph and
    replay it per update: the seed's small batches are launch-bound on a GPU (graphed.py). CUDA
    learner, fp32 or bf16, one learner."""
    learner_threads: int = 0
    """torch intra-op threads of the learner; 0 keeps torch's default (all cores)."""
    device: str = "auto"
    """Learner device: auto (cuda if available), cpu, cuda, cuda:1... Seed: --device."""
    # ---- DQN
    gamma: float = 0.99
    """Discount."""
    lr: float = 2.5e-4
    """Adam learning rate."""
    max_grad_norm: float = 10.0
    """Global gradient-norm clip."""
    buffer_capacity: int = 50_000
    """Replay capacity in transitions."""
    learning_starts: int = 1_000
    """Transitions collected before the first update."""
    epsilon_start: float = 1.0
    """ε-greedy exploration at the start."""
    epsilon_end: float = 0.01
    """ε after the decay."""
    epsilon_fraction: float = 0.3
    """Fraction of num_episodes over which ε decays linearly."""
    target_sync_every: int = 0
    """Updates between target-network syncs; 0 = scale with the run (about 50 syncs per run of episodes that last
    max_episode_steps, as NeuroGym's do; set it for a task that ends them sooner). The original's fixed 10,000
    never fired in the seed's 100-episode runs."""
    target_tau: float = 1.0
    """Target update at each sync: 1.0 = hard copy, < 1 = Polyak average with this weight."""
    burn_in: int = 0
    """R2D2 burn-in steps before each sequence (needs stored_state to be useful)."""
    stored_state: bool = False
    """R2D2: start each sequence from the recurrent state stored in replay instead of zeros."""
    seed: int = 0
    """Seeds torch, replay sampling and the environments."""
    # ---- collection
    num_actors: int = 0
    """Ray rollout actors; 0 steps the envs in the learner's process (no Ray actors)."""
    envs_per_actor: int = 1
    """Vectorized envs per actor (or in-process when num_actors=0)."""
    vector_mode: Literal["sync", "async"] = "sync"
    """gymnasium vector env: sync (one process) or async (a subprocess per env)."""
    steps_per_call: int = 16
    """Vector steps per sample call; the learner then does the updates those transitions pay for."""
    # ---- reporting
    print_freq: int = 5
    """Log and print every this many episodes. Seed: --print-freq."""
    checkpoint_freq: int = 25
    """Checkpoint every this many episodes (and at the end). Seed: --checkpoint-freq."""
    avg_window: int = 10
    """Episodes in the windowed average reward (the seed's final average uses the last 10)."""
    eval_trials: int = 200
    """Greedy-policy trials at the end (eval/reward_per_trial, eval/quality); 0 skips them, and eval/quality
    is then the training reward per episode (charts/final_avg_reward), another unit: compare like with like."""
    launch: LaunchConfig = field(default_factory=lambda: LaunchConfig(workers=0))

    def validate(self) -> None:
        for name in ("max_episode_steps", "num_episodes", "hidden", "sequence_length", "sequence_batch_size",
                     "train_freq", "envs_per_actor", "steps_per_call", "print_freq", "checkpoint_freq", "avg_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_actors < 0 or self.burn_in < 0 or self.eval_trials < 0:
            raise ConfigError("num_actors, burn_in and eval_trials must be >= 0")
        if not 0.0 < self.target_tau <= 1.0:
            raise ConfigError(f"target_tau must be in (0, 1], got {self.target_tau}")
        require(0 < self.gamma <= 1, f"gamma must be in (0, 1], got {self.gamma}")
        # M is lam x M + eta x (its Hebbian term): outside [0, 1] it grows without bound over an episode
        require(0 <= self.lam <= 1, f"lam, the plastic memory's decay, must be in [0, 1], got {self.lam}")
        require(self.max_seconds is None or self.max_seconds > 0,
                f"max_seconds must be > 0 (or None: no time budget), got {self.max_seconds}")
        require(self.lr > 0 and self.max_grad_norm > 0, "lr and max_grad_norm must be > 0")
        require(all(0 <= e <= 1 for e in (self.epsilon_start, self.epsilon_end, self.epsilon_fraction)),
                "epsilon_start, epsilon_end and epsilon_fraction must be in [0, 1]")
        require(self.burn_in < self.sequence_length, f"burn_in ({self.burn_in}) must be < sequence_length "
                f"({self.sequence_length})")
        at_least(self, "", 0, "learning_starts", "target_sync_every")
        if self.buffer_capacity < self.num_envs:
            raise ConfigError(f"buffer_capacity ({self.buffer_capacity}) must hold one step of all {self.num_envs} envs")
        window = self.burn_in + self.sequence_length
        require(self.buffer_capacity // self.num_envs >= window,
                f"buffer_capacity ({self.buffer_capacity}) holds {self.buffer_capacity // self.num_envs} steps per env, "
                f"less than one sampled window (burn_in + sequence_length = {window}); raise it to at least "
                f"{window * self.num_envs}")
        held = (self.buffer_capacity // self.num_envs) * self.num_envs  # what the replay ever holds (whole env steps)
        require(self.learning_starts <= held, f"learning_starts ({self.learning_starts}) is more than buffer_capacity "
                f"({self.buffer_capacity}) ever holds ({held} transitions of {self.num_envs} envs): no update would "
                "run; lower it or raise buffer_capacity")
        most = (self.num_episodes + self.num_envs) * self.max_episode_steps  # a last collection ends its episodes
        require(most >= self.learning_starts + self.train_freq, f"{self.num_episodes} episodes of at most "
                f"{self.max_episode_steps} steps give at most {most} transitions, fewer than learning_starts "
                f"({self.learning_starts}) + train_freq ({self.train_freq}): no update would run")
        if self.path == "naive" and (self.precision != "fp32" or self.compile or self.cuda_graph):
            raise ConfigError("precision, compile and cuda_graph apply to path=optimized only (naive is the seed's "
                              "fp32 eager code)")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.cuda_graph:
            require(not self.device.startswith("cpu"), "cuda_graph needs a CUDA learner (device is cpu)")
            require(self.precision != "fp16", "cuda_graph: fp16's loss scaling skips steps on the host; use bf16")
            require(not self.compile, "cuda_graph and compile are two ways to cut launches: pick one")
            require(self.launch.workers <= 1, "cuda_graph: gradient averaging across learners is not captured; "
                    "use launch.workers <= 1")
        # last: the config's own limits first; then, the learner running in this process (--workers 0),
        # what this machine lacks is said now, not after the run exists
        if self.launch.workers == 0:
            from raysys.train.runtime import local_gpus

            here = "cuda" if local_gpus() else "cpu"
            dev = here if self.device == "auto" else self.device.split(":")[0]
            require(dev == "cpu" or here == "cuda", f"device={self.device}, but this machine has no CUDA device")
            require(self.precision != "fp16" or dev == "cuda", "precision=fp16 needs a CUDA device (use bf16 on CPU)")
            require(not self.cuda_graph or dev == "cuda", "cuda_graph needs a CUDA learner; this one would be on cpu")

    @property
    def num_envs(self) -> int:
        return max(self.num_actors, 1) * self.envs_per_actor


# ---------------------------------------------------------------- presets (derive from each other)


def default() -> MPNDQNConfig:
    """The seed's recommended fast command: L=10, B=64, train-freq 4, 100 episodes of 200 steps."""
    return MPNDQNConfig()


def original() -> MPNDQNConfig:
    """The seed's old configuration: the per-sequence loss, B=32, an update every step."""
    return dataclasses.replace(default(), path="naive", sequence_batch_size=32, train_freq=1)


def quality() -> MPNDQNConfig:
    """The seed's 'high quality' command: B=32, train-freq 1, 200 episodes (optimized loss)."""
    return dataclasses.replace(default(), sequence_batch_size=32, train_freq=1, num_episodes=200, print_freq=10,
                               checkpoint_freq=50)


def fast() -> MPNDQNConfig:
    """The seed's 'maximum speed' command: B=128, train-freq 8."""
    return dataclasses.replace(default(), sequence_batch_size=128, train_freq=8)


def learn() -> MPNDQNConfig:
    """The documented learning preset (docs/benchmarks.md): enough episodes on this CPU for the
    greedy policy's reward per trial to rise clearly above a random policy's."""
    return dataclasses.replace(default(), num_episodes=40, eval_trials=500)


def actors() -> MPNDQNConfig:
    """Collection on 2 Ray rollout actors x 4 envs, sampling overlapped with learning."""
    return dataclasses.replace(default(), num_actors=2, envs_per_actor=4, num_episodes=160)


def quick() -> MPNDQNConfig:
    """A smoke run of about a minute: short episodes, few of them."""
    return dataclasses.replace(default(), num_episodes=8, max_episode_steps=100, learning_starts=200, print_freq=2,
                               checkpoint_freq=4, eval_trials=20)


PRESETS = {"default": default, "original": original, "quality": quality, "fast": fast, "learn": learn,
           "actors": actors, "quick": quick}


def _train(cfg, session):
    from raysys.workloads.mpn_dqn.train import train

    return train(cfg, session)


def _prepare(cfg):
    """Before a run folder exists: the task must be a vector-observation, discrete-action env."""
    from raysys.workloads.mpn_dqn.env import env_spaces

    env_spaces(cfg.task, **cfg.task_kwargs)
    return cfg


def _bench(quick: bool = False) -> dict:
    from raysys.workloads.mpn_dqn.bench import run_bench

    return run_bench(quick=quick)


WORKLOAD = Workload(
    name="mpn_dqn",
    description="Recurrent plastic (MPN) DQN on NeuroGym ContextDecisionMaking with sequence replay",
    config_cls=MPNDQNConfig,
    presets=PRESETS,
    bench=_bench,
    path_key="path",
    train_fn=_train,
    throughput_metric="perf/env_steps_per_s",
    # launch.workers > 0: the learner runs data-parallel on that many Ray Train workers
    extra={"identity_sections": ("task", "task_kwargs", "hidden", "eta", "lam", "freeze_plasticity"), "distributed": "torch",
           "prepare": _prepare},
)
