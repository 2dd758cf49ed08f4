"""The algorithm-distillation transformer (seed 003) as a raysys workload: config, presets, the TorchTask.

Data: Darkroom learning histories of the source PPO (source.py), generated once per source setting
into ``data.data_dir`` (or your own folder, ``data.histories``). Training: the original's 80-step
region samples (data.py) of the 73 training goals. Evaluation: in-context RL on the 8 held-out goals
(icl.py), against a random policy and the source PPO at the same episode.

``model.path=naive`` is the seed's "before" (per-sample loops building tensors per timestep, per-item
pad/concatenate/stack collate); ``optimized`` computes the same loss on the same batch (a test checks
it) from regions packed by index arithmetic, attention through ``scaled_dot_product_attention``.
A batch is ``train.batch_size`` regions, each ``data.region + 1`` samples, on both paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Mapping, Optional

import numpy as np
import torch

from raysys.config import ConfigError, at_least, fingerprint, require
from raysys.train.config import LaunchConfig, LoaderConfig, OptimConfig, TrainConfig
from raysys.workload import Workload
from raysys.workloads.ad_transformer.histories import SourceConfig


@dataclass
class DataConfig:
    histories: Optional[str] = None
    """A folder of learning histories (``python -m raysys.workloads.ad_transformer.histories``). None
    generates them from the ``source`` settings into ``data_dir`` (once; reused by every run)."""
    data_dir: str = "raysys_data/ad_transformer"
    """Where generated histories are kept (a folder per distinct source setting)."""
    region: int = 80
    """Steps per region (the original: 80). A sample sees the previous region and the current prefix."""
    train_goals: Optional[int] = None
    """Train on k of the 73 training goals, drawn with ``split_seed`` (None: all). Drawn, not the first k:
    goals are numbered row by row, so the first 8 would all lie in the grid's top row."""
    streams: Optional[int] = None
    """Streams (learning histories) per goal used for training (None: all of them)."""
    split_seed: int = 0
    """Seed of the fixed 73 / 8 split of goals (darkroom.goal_split)."""
    prepared_dir: Optional[str] = None
    """Set by raysys: the histories folder this run uses, on this machine."""
    digest: Optional[str] = None
    """Set by raysys: the sha256 of ``histories`` (its manifest and shards), what the run learns from
    wherever the folder lies: a resume on other data is refused."""
    generated_digest: Optional[str] = None
    """Set by raysys: the same of the generated histories (named by their ``source`` settings): a resume on a
    folder replaced since (by hand, a copy from elsewhere) is refused."""

    def validate(self) -> None:
        at_least(self, "data.", 1, "region", "train_goals", "streams")
        at_least(self, "data.", 0, "split_seed")


@dataclass
class ModelConfig:
    path: Literal["naive", "optimized"] = "optimized"
    """naive: the seed's per-sample, per-timestep forward and per-item collate. optimized: the same
    function on regions packed by index arithmetic (see data.py, model.py)."""
    d_model: int = 64
    """Width (the original: 64)."""
    layers: int = 4
    """Encoder layers (the original: 4)."""
    heads: int = 4
    """Attention heads (the original: 4)."""
    ffn: int = 256
    """Feed-forward width (the original: 256)."""
    dropout: float = 0.1
    """Dropout of the encoder layers (torch's default, which the original kept)."""
    max_len: int = 328
    """Learned positions (the original: 328); must cover 2 x region + 4."""
    type_loss_weight: float = 0.1
    """Weight of the token-type loss next to the action loss."""

    def validate(self) -> None:
        at_least(self, "model.", 1, "d_model", "layers", "heads", "ffn", "max_len")
        require(self.d_model % self.heads == 0, f"model.d_model ({self.d_model}) must be a multiple of model.heads")
        require(0 <= self.dropout < 1, f"model.dropout must be in [0, 1), got {self.dropout}")
        require(self.type_loss_weight >= 0, "model.type_loss_weight must be >= 0")


@dataclass
class EvalConfig:
    episodes: int = 50
    """In-context episodes per held-out goal (the source's histories hold 50 per stream)."""
    streams: int = 4
    """Independent rollouts per held-out goal."""
    last_episodes: int = 5
    """The quality metric is the mean return of this many last in-context episodes."""
    seed: int = 0
    """Seed of the sampled actions."""

    def validate(self) -> None:
        at_least(self, "eval.", 1, "episodes", "streams", "last_episodes")
        require(self.last_episodes <= self.episodes, "eval.last_episodes must be <= eval.episodes")


@dataclass
class ADConfig:
    source: SourceConfig = field(default_factory=SourceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=1, batch_size=16, log_every_steps=20))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        name="adamw", lr=3e-4, betas=(0.9, 0.99), weight_decay=0.01, schedule="cosine", warmup_steps=1000,
        clip_grad_norm=1.0))
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def validate(self) -> None:
        require(self.model.max_len >= 2 * self.data.region + 4, f"model.max_len ({self.model.max_len}) must cover "
                f"2 x data.region + 4 = {2 * self.data.region + 4} positions")
        steps = self.source.updates * self.source.n_steps  # what the generator makes: whole PPO rollouts
        require(self.data.histories is not None or steps - 1 >= self.data.region, f"the source's streams are "
                f"{steps} steps long (source.steps_per_goal // (streams x n_steps) rollouts of n_steps); "
                f"data.region ({self.data.region}) must be shorter, with one step left for its query")
        require(self.data.histories is not None or (self.data.streams or 0) <= self.source.streams,
                f"data.streams ({self.data.streams}) must be <= source.streams ({self.source.streams}), the streams made")
        n_train = round(9 * 9 * 0.9)  # darkroom.goal_split's training goals on the 9x9 grid (not imported: JAX)
        require((self.data.train_goals or 0) <= n_train, f"data.train_goals ({self.data.train_goals}) must be <= "
                f"{n_train}, the training goals of the split")


# ---- presets ----------------------------------------------------------------------------------------

def default() -> ADConfig:
    """The original's model and optimizer on the optimized path: 16 regions (1,296 samples) a batch."""
    return ADConfig()


def original() -> ADConfig:
    """The seed's slow path: the naive forward and collate (same model, same batches)."""
    cfg = default()
    cfg.model.path = "naive"
    return cfg


def fast() -> ADConfig:
    """The seed's after and beyond, for a GPU: bf16, pinned memory, loader workers, 64 regions a batch."""
    cfg = default()
    cfg.train.batch_size, cfg.train.precision = 64, "bf16"
    cfg.loader.num_workers, cfg.loader.pin_memory, cfg.loader.prefetch_factor = 4, True, 2
    cfg.loader.persistent_workers = True
    return cfg


def learn() -> ADConfig:
    """The documented CPU run (docs/benchmarks.md), about half an hour on 2 cores: histories of all goals
    from PPO learners of 10 streams each, 100 episodes a stream (1 min, once), then 5,000 steps of 16
    regions without dropout at lr 6e-4, and in-context evaluation every epoch.

    Why 10 streams and not the original's 100: a learner's streams share its policy, so with 100 of
    them a stream's behaviour improves from what the other 99 found, which its own history cannot show.
    The transformer then learns to copy a drift it cannot cause and, acting alone, never improves (the
    100-stream histories gave a last-episode return at the random policy's level). With 10 streams a
    stream's own finds drive much more of its improvement; 100 episodes keep the learning part (about
    the first 30) a large share of the data. No dropout and the higher rate buy steps in the half hour."""
    cfg = default()
    cfg.source.streams, cfg.source.steps_per_goal = 10, 10 * 20 * 100
    cfg.model.dropout = 0.0
    cfg.train.epochs, cfg.train.max_steps = 20, 5000  # max_steps ends it (about 4.6 epochs)
    cfg.train.checkpoint_every_steps, cfg.train.log_every_steps = 500, 50
    cfg.optim.lr, cfg.optim.warmup_steps = 6e-4, 100
    cfg.eval.streams = 2
    return cfg


def long() -> ADConfig:
    """The longer CPU run reported against the seed's anchor (docs/benchmarks.md): ``learn``'s data and
    model, 16,000 steps instead of 5,000 (20.7M samples, 12 epochs; 62 minutes on one core). The
    anchor trained 102M samples on 4 GPUs; this preset measures how far the in-context return moves
    with 3.2x ``learn``'s training, on hardware a CPU session has (1.95 -> 7.98, anchor 10.77)."""
    cfg = learn()
    cfg.train.max_steps = 16000
    cfg.train.checkpoint_every_steps = 1000
    return cfg


def quick() -> ADConfig:
    """Seconds: a small source run (10 streams, 40 episodes), a few goals, short regions, one eval."""
    cfg = default()
    cfg.source.streams, cfg.source.steps_per_goal = 10, 10 * 20 * 40
    cfg.data.region, cfg.data.train_goals = 40, 8
    cfg.data.data_dir = "raysys_data/ad_transformer_quick"
    cfg.train.batch_size, cfg.train.max_steps, cfg.train.log_every_steps = 4, 6, 2
    cfg.optim.warmup_steps = 2
    cfg.eval.episodes, cfg.eval.streams, cfg.eval.last_episodes = 6, 1, 2
    return cfg


PRESETS = {"default": default, "original": original, "fast": fast, "learn": learn, "long": long, "quick": quick}


# ---- data -------------------------------------------------------------------------------------------

LOCAL_KEYS = ("data.histories", "data.data_dir", "data.prepared_dir")
"""Where the histories are on this machine, not what the run is: left out of the checkpoint's identity (the
``source`` settings, or ``data.digest``, stay in it), so a run resumes from another folder or machine."""


def histories_dir(cfg: ADConfig) -> Path:
    """The folder of ``cfg``'s histories: the user's, or the generated one of this source setting."""
    if cfg.data.histories:
        return Path(cfg.data.histories).expanduser().resolve()
    key = fingerprint(dataclasses.asdict(cfg.source))
    return (Path(cfg.data.data_dir) / f"histories-{key}").resolve()


def ensure_histories(cfg: ADConfig) -> Path:
    """Generate the histories of ``cfg.source`` unless they exist (one process at a time: a file lock)."""
    from filelock import FileLock

    out = histories_dir(cfg)
    if cfg.data.histories:  # a user's folder: checked by the task's prepare (histories.check)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "manifest.json").is_file():
            print(f"[ad_transformer] generating learning histories (source PPO, all 81 goals) into {out}", flush=True)
            # a process of its own: the generator pins itself to one core (histories.py), this one is not
            cmd = [sys.executable, "-m", "raysys.workloads.ad_transformer.histories", "--out", str(out),
                   "--config", json.dumps(dataclasses.asdict(cfg.source))]
            if subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode != 0:
                raise RuntimeError(f"generating histories into {out} failed (see above)")
    return out


class DistillationTask:
    quality_metric = "icl_return_last"
    token_name = "tokens"

    def __init__(self):
        self._cfg: Optional[ADConfig] = None
        self._baselines: Optional[dict] = None

    def prepare(self, cfg: ADConfig) -> ADConfig:
        from raysys.workloads.ad_transformer import histories

        folder = ensure_histories(cfg)
        train, held_out = self.goals(cfg)
        # what the run needs is there, said before anything is made: a user's folder, and a generated one a full
        # disk, an interrupted copy or a hand's edit damaged (the held-out goals too: the source's comparison)
        try:
            digest = histories.check(folder, train if cfg.data.histories else np.concatenate([train, held_out]),
                                     cfg.data.region, cfg.data.streams)
        except FileNotFoundError:
            what = ("is a file, not a folder of histories" if folder.is_file() else "does not exist"
                    if not folder.is_dir() else "holds no manifest.json")
            raise ConfigError(f"data.histories: {folder} {what} (make one with python -m "
                              "raysys.workloads.ad_transformer.histories --out DIR)") from None
        except ValueError as e:
            if cfg.data.histories:
                raise ConfigError(f"data.histories: {e}") from None
            raise ConfigError(f"the histories generated in {folder} are damaged ({e}): delete that folder, and the "
                              "next run generates them again") from None
        cfg.data.prepared_dir = str(folder)
        # generated ones too: a folder replaced (by hand, a copy, another jaxlib's generation) is other data. A key
        # of their own, which checkpoints of before it lack (not a difference): those resume as they did
        cfg.data.digest, cfg.data.generated_digest = (digest, None) if cfg.data.histories else (None, digest)
        return cfg

    def goals(self, cfg: ADConfig) -> tuple[np.ndarray, np.ndarray]:
        from raysys.envs import darkroom as dr

        train, held_out = dr.goal_split(seed=cfg.data.split_seed)
        if cfg.data.train_goals is not None:  # a spread-out subset: in-context RL needs goals all over the grid
            train = np.sort(np.random.default_rng(cfg.data.split_seed).permutation(train)[: cfg.data.train_goals])
        return train, held_out

    def datasets(self, cfg: ADConfig):
        from raysys.workloads.ad_transformer import histories
        from raysys.workloads.ad_transformer.data import RegionSamples, Streams

        self._cfg = cfg
        if not cfg.data.prepared_dir:
            self.prepare(cfg)
        train, held_out = self.goals(cfg)
        folder = Path(cfg.data.prepared_dir)
        try:
            h = histories.load(folder, train)
        except ValueError as e:
            raise ConfigError(f"data.histories: {e}") from None
        try:
            ds = RegionSamples(Streams.of(h, cfg.data.streams), cfg.data.region, batched=cfg.model.path == "optimized")
        except ValueError as e:  # streams too short for one region
            raise ConfigError(f"data.region ({cfg.data.region}): {e}") from None
        # evaluation is a rollout on the held-out goals: its "dataset" is those goals
        return ds, [{"goal": torch.tensor(int(g))} for g in held_out]

    def collate(self, batch) -> dict:
        from raysys.workloads.ad_transformer.data import collate

        if isinstance(batch, list) and "goal" in batch[0]:  # evaluation's items (a naive item is a list)
            return {"goals": torch.stack([b["goal"] for b in batch])}
        return collate(batch)

    def build_model(self, cfg: ADConfig) -> torch.nn.Module:
        from raysys.workloads.ad_transformer.model import ADTransformer

        m = cfg.model
        return ADTransformer(m.d_model, m.layers, m.heads, m.ffn, m.dropout, m.max_len)

    def loss(self, model, batch):
        from raysys.workloads.ad_transformer.model import loss_fn

        weight = (self._cfg.model if self._cfg else ModelConfig).type_loss_weight
        return loss_fn(model, batch, weight)

    def baselines(self, cfg: ADConfig, goals: np.ndarray) -> dict:
        """The random policy's return and the source PPO's learning curve on ``goals`` (computed once)."""
        from raysys.workloads.ad_transformer import histories, icl

        if self._baselines is None:
            source = None
            try:
                source = icl.episode_returns(histories.load(Path(cfg.data.prepared_dir), goals).rewards)
            except (ValueError, OSError):  # a user's folder without the held-out goals: no source comparison
                pass
            self._baselines = {"random": icl.random_returns(goals), "source": source}
        return self._baselines

    def evaluate(self, model, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        from raysys.workloads.ad_transformer import icl

        cfg = self._cfg
        goals = np.concatenate([b["goals"].cpu().numpy() for b in batches])
        e = cfg.eval
        out = icl.rollout(model, goals, e.streams, e.episodes, cfg.data.region, seed=e.seed)
        base = self.baselines(cfg, goals)
        metrics = icl.summarize(out["returns"], e.last_episodes, base["random"], goals, base["source"])
        if np.isfinite(out["end_token_accuracy"]):  # no region closed in episodes this short: nothing measured
            metrics["end_token_accuracy"] = out["end_token_accuracy"]
        return metrics


def _bench(quick: bool = False) -> dict:
    from raysys.workloads.ad_transformer.bench import run_bench

    return run_bench(quick=quick)


def _dataset(cfg: ADConfig) -> dict:
    d = cfg.data
    profile = {"region": d.region, "train_goals": d.train_goals or "all", "streams_per_goal": d.streams or "all"}
    return {"name": Path(d.prepared_dir).name if d.prepared_dir else "learning_histories",
            "source": d.prepared_dir or str(d.histories), "profile": profile}


WORKLOAD = Workload(
    name="ad_transformer",
    description="Algorithm-distillation transformer on Darkroom: PPO histories in JAX, in-context RL",
    config_cls=ADConfig,
    presets=PRESETS,
    bench=_bench,
    task=DistillationTask(),
    path_key="model.path",
    dataset=_dataset,
    extra={"identity_sections": ("model", "data", "source"), "local_keys": LOCAL_KEYS},
)
