"""Deep-GPCM knowledge tracing as a raysys workload: config, presets, and the TorchTask.

Seed 004. The original trained a DKVMN memory with a GPCM head one timestep at a time; its
"parallel" model was 2x faster and lost half its accuracy because it broke the memory's
read-before-write order. Here ``model.path=naive`` is the original's loops and
``model.path=optimized`` vectorises everything that does not depend on the memory and runs the
memory recurrence tightly, with predictions equal to the naive path's (a test checks it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Optional

import torch

from raysys.config import ConfigError, at_least, require
from raysys.train.config import LaunchConfig, LoaderConfig, OptimConfig, TrainConfig
from raysys.workload import Workload


_SAID: set[str] = set()  # data notes already printed by this process


@dataclass
class DataConfig:
    path: Optional[str] = None
    """Your sequences; None generates synthetic_OC into `data_dir`. A parquet/JSONL/JSON/CSV/TSV file with
    a row per student (list columns `questions`, `responses`) or a row per response (student, question
    and response columns); the original's three-line text file (.txt, or a .csv starting with a bare
    length); or a folder with sequences.parquet or the original's `<name>_train` / `<name>_test` files.
    Responses are ordered categories 0..K-1; `meta.json`/`metadata.json` beside it may give Q and K.
    A relative path is read from the working directory of the command (kept as written: a resume elsewhere
    reads it there); a checkpoint records what the data holds (`digest`), not where it was."""
    student_column: Optional[str] = None
    """A row per response: the student column (None: student_id, user_id, student, user or learner_id)."""
    question_column: Optional[str] = None
    """A row per response: the question column (None: question_id, item_id, problem_id, question, item or
    skill_id); ids that are names are numbered 1..Q."""
    response_column: Optional[str] = None
    """A row per response: the response column (None: response, score, category or correct)."""
    order_column: Optional[str] = None
    """A row per response: the column that orders each student's responses (None: the file's order)."""
    id_base: Optional[int] = None
    """Smallest question id in your data: 1, or 0 (the original's files; shifted to 1..Q, since 0 pads).
    None: 0 when some id is 0, else 1."""
    response_base: Optional[int] = None
    """Smallest response category in your data: 0 (categories 0..K-1, the original's files), or 1 (a 1..K
    scale, e.g. Likert; shifted to 0..K-1). None: 1 when no response is 0 (and a meta.json's n_cats, if
    any, is the largest response), else 0."""
    data_dir: str = "raysys_data/synthetic_OC"
    """Where the synthetic dataset is written (once; reused when its generator settings match). A relative
    folder is in the working directory of the command, as for `path`; the generator settings below, not
    the folder, are what a checkpoint records."""
    n_students: int = 800
    """synthetic_OC: number of students (sequences)."""
    n_questions: int = 400
    """synthetic_OC: number of questions Q."""
    n_cats: int = 4
    """synthetic_OC: ordered response categories K (your data's K is its largest response + 1, or its meta.json's)."""
    min_len: int = 100
    """synthetic_OC: shortest sequence (inclusive)."""
    max_len: int = 400
    """synthetic_OC: longest sequence (exclusive)."""
    seed: int = 42
    """synthetic_OC generator seed (also the k-fold split seed)."""
    n_folds: int = 5
    """k of k-fold cross-validation."""
    fold: int = 0
    """Which fold is held out for evaluation (0..n_folds-1)."""
    base_dir: Optional[str] = None
    """Set by raysys (a value given is replaced): the working directory relative `path` and `data_dir` are
    read from, the command's, which Ray workers (in folders of their own) are handed."""
    digest: Optional[str] = None
    """Set by raysys for `path` (a value given is replaced): a short sha256 of the sequences as read. A
    checkpoint records it, so a resume refuses other data wherever it is; Ray workers check their copy."""

    def validate(self) -> None:
        at_least(self, "data.", 2, "n_folds")  # first: a fold's range is of k's
        if not 0 <= self.fold < self.n_folds:
            raise ConfigError(f"data.fold must be in 0..{self.n_folds - 1}, got {self.fold}")
        if self.min_len < 2 or self.max_len <= self.min_len:
            raise ConfigError("data.min_len >= 2 and data.max_len > data.min_len are required")
        at_least(self, "data.", 1, "n_questions")
        at_least(self, "data.", 2, "n_cats", "n_folds")
        at_least(self, "data.", 0, "seed")
        require(self.id_base in (None, 0, 1), f"data.id_base must be 0, 1 or null, got {self.id_base}")
        require(self.response_base in (None, 0, 1), f"data.response_base must be 0, 1 or null, got {self.response_base}")
        require(self.path is not None or self.n_students >= self.n_folds,
                f"data.n_students ({self.n_students}) must be >= data.n_folds ({self.n_folds})")
        if self.path is None:  # the generator's arrays: ids, lengths and 2 [n, K] float tables per response
            from raysys.train.code_checks import physical_memory

            about, have = self.n_students * (self.min_len + self.max_len - 1) // 2, physical_memory()
            need = about * 8 * (2 * self.n_cats + 6)
            require(have is None or need <= have,
                    f"data.n_students={self.n_students} with lengths data.min_len={self.min_len}..data.max_len="
                    f"{self.max_len}: about {about:,} responses to generate, ~{need / 2 ** 30:.0f} GiB, more than "
                    f"this machine's {(have or 0) / 2 ** 30:.1f} GiB of memory")


@dataclass
class ModelConfig:
    path: Literal["naive", "optimized"] = "optimized"
    """naive: the original per-timestep loops. optimized: vectorised over time, exact same predictions."""
    memory_size: int = 50
    """DKVMN memory slots N."""
    key_dim: int = 50
    """Question embedding / key memory width."""
    value_dim: int = 200
    """Value memory width."""
    final_fc_dim: int = 50
    """Summary network width."""
    chunk: int = 8
    """optimized: memory states kept every `chunk` steps; the backward recomputes the rest. Speed is
    flat from 8 to 32 on a CPU; on a GPU, where the kernels' backward recomputes a chunk into scratch
    memory, 8 beat 16 on an H200 (docs/benchmarks.md)."""
    recurrence_threads: Optional[int] = None
    """optimized: torch threads for the memory loop only (1 is faster on a busy CPU); None leaves it."""
    recurrence: Literal["auto", "loop", "triton"] = "auto"
    """optimized: how the memory recurrence runs. loop: step by step in torch ops; triton: two fused
    kernels that keep each row's memory on chip for all steps (CUDA; a CPU only in Triton's
    interpreter, TRITON_INTERPRET=1); auto: triton on CUDA where it is installed, else loop."""

    def validate(self) -> None:
        at_least(self, "model.", 1, "memory_size", "key_dim", "value_dim", "final_fc_dim", "chunk", "recurrence_threads")
        if self.recurrence == "triton":
            from raysys.workloads.deep_gpcm.model import triton_available

            require(triton_available(), "model.recurrence=triton needs the triton package (pip install triton)")
            require(self.path == "optimized", "model.recurrence=triton applies to model.path=optimized only")


@dataclass
class DeepGPCMConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=30, batch_size=32))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="adam", lr=1e-3, weight_decay=1e-5, clip_grad_norm=1.0))
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def validate(self) -> None:
        import os

        require(self.model.recurrence != "triton" or self.launch.gpus_per_worker > 0
                or os.environ.get("TRITON_INTERPRET") == "1",
                "model.recurrence=triton runs on a GPU: add --gpus-per-worker 1 (or set TRITON_INTERPRET=1 to run "
                "the kernels in Triton's CPU interpreter, slowly)")
        # Dynamo unrolls the naive path's per-step loop and specialises it on the batch's length: one
        # compile per distinct length, 1-2 minutes each on a CPU, then eager once its recompile limit is hit
        require(not (self.train.compile and self.model.path == "naive"),
                "train.compile=true applies to model.path=optimized only: the naive path's per-step loop is "
                "recompiled for every sequence length")


# ---- presets: plain functions deriving from each other -------------------------------------------

def original() -> DeepGPCMConfig:
    """The original's settings: 30 epochs, batch 32, Adam 1e-3 wd 1e-5, clip 1.0, per-timestep loops."""
    cfg = DeepGPCMConfig()
    cfg.model.path = "naive"
    return cfg


def default() -> DeepGPCMConfig:
    """The original's settings on the optimized path (same predictions, much faster)."""
    cfg = original()
    cfg.model.path = "optimized"
    return cfg


def parity() -> DeepGPCMConfig:
    """The documented quality-parity run: one fold, few epochs, both paths must reach QWK >= 0.55."""
    cfg = default()
    cfg.train.epochs = 3
    cfg.train.log_every_steps = 5
    return cfg


def quick() -> DeepGPCMConfig:
    """Seconds, not minutes: a small synthetic set and 2 epochs, for smoke tests and demos."""
    cfg = default()
    cfg.data.n_students, cfg.data.n_questions, cfg.data.min_len, cfg.data.max_len = 120, 50, 20, 60
    cfg.data.data_dir = "raysys_data/synthetic_OC_quick"
    cfg.train.epochs, cfg.train.batch_size, cfg.train.log_every_steps = 2, 16, 2
    return cfg


def fast() -> DeepGPCMConfig:
    """The seed's 'all optimizations' settings: batch 64 x accum 2, AdamW + cosine warm restarts."""
    cfg = default()
    cfg.train.batch_size, cfg.train.grad_accum = 64, 2
    cfg.optim.name, cfg.optim.schedule, cfg.optim.restart_period = "adamw", "cosine_warm_restarts", 100
    return cfg


PRESETS = {"default": default, "original": original, "parity": parity, "quick": quick, "fast": fast}


# ---- the task the shared loop drives -----------------------------------------------------------

def _read_options(d: DataConfig):
    """The data.* keys that say how to read the user's file (the same names in ReadOptions)."""
    from raysys.workloads.deep_gpcm.data import ReadOptions

    return ReadOptions(**{f.name: getattr(d, f.name) for f in fields(ReadOptions)})


LOCAL_KEYS = ("data.path", "data.data_dir", "data.base_dir")
"""Where the data is on this machine, not what the run is: left out of the checkpoint's identity (the data's
generator settings, or its `digest`, stay in it), so a run resumes from another folder or machine."""


def _data_source(cfg: DeepGPCMConfig) -> Path:
    """The data's absolute location: `path` (or `data_dir`) from `base_dir`, else the working directory."""
    d = cfg.data
    return (Path(d.base_dir or Path.cwd()) / Path(d.path or d.data_dir).expanduser()).resolve()


def _generator(d: DataConfig) -> dict:
    """synthetic_OC's generator settings (what the data is, where no ``path`` is given)."""
    return {"n_students": d.n_students, "n_questions": d.n_questions, "n_cats": d.n_cats, "min_len": d.min_len,
            "max_len": d.max_len, "seed": d.seed}


def _data_key(cfg: DeepGPCMConfig) -> tuple:
    """What a task's cached sequences were read as: the source and how to read it (and, for synthetic_OC,
    its settings: one folder holds whichever was made last)."""
    d = cfg.data
    return (str(_data_source(cfg)), _read_options(d), None if d.path else tuple(sorted(_generator(d).items())))


def _in_ray_worker() -> bool:
    """A Ray worker (a Ray Train worker, a Tune trial) works in a folder of Ray's: it reads relative data
    paths from the ``data.base_dir`` its driver hands it. The driver sets its own, also on a resume, whose
    saved config holds the first command's."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


class DeepGPCMTask:
    quality_metric = "qwk"
    token_name = "responses"

    def prepare(self, cfg: DeepGPCMConfig) -> DeepGPCMConfig:
        from raysys.workloads.deep_gpcm import data

        d = cfg.data
        worker = d.base_dir is not None and _in_ray_worker()
        if not worker:  # path and data_dir stay as written: the config snapshot names no folder of this machine
            d.base_dir = str(Path.cwd())
        # read afresh (a file may have changed since), once: a user's file fails now, with the column named
        seqs = self._read(cfg)
        if d.path:
            for note in seqs.notes:
                line = f"[deep_gpcm] {_data_source(cfg).name}: {note}"
                if line not in _SAID:  # prepared again in this process (the loop's own prepare): said once
                    _SAID.add(line)
                    print(line, flush=True)
            data.kfold_indices(len(seqs.questions), d.n_folds, d.fold, d.seed)  # enough rows for the folds
            digest = data.digest(seqs)
            if worker and d.digest not in (None, digest):
                raise ValueError(f"{_data_source(cfg)} holds other sequences here (digest {digest}) than the run's "
                                 f"driver read (digest {d.digest}): every node needs the same data")
            d.digest = digest
        else:  # the generator settings (in the checkpoint) say what the data is
            d.digest = None
        return cfg

    def _read(self, cfg: DeepGPCMConfig):
        """The user's sequences, or synthetic_OC made with the config's settings; cached by what was read."""
        from raysys.workloads.deep_gpcm import data

        d = cfg.data
        seqs = (data.load_sequences(_data_source(cfg), _read_options(d)) if d.path else
                data.synthetic_sequences(_data_source(cfg), _read_options(d), **_generator(d)))
        self._cache = (_data_key(cfg), seqs)
        return seqs

    def _data(self, cfg: DeepGPCMConfig):
        cache = getattr(self, "_cache", None)
        return cache[1] if cache is not None and cache[0] == _data_key(cfg) else self._read(cfg)

    def datasets(self, cfg: DeepGPCMConfig):
        from raysys.workloads.deep_gpcm import data

        seqs = self._data(cfg)
        train_idx, test_idx = data.kfold_indices(len(seqs.questions), cfg.data.n_folds, cfg.data.fold, cfg.data.seed)
        return data.SequenceDataset(seqs, train_idx), data.SequenceDataset(seqs, test_idx)

    def collate(self, items: list) -> dict:
        from raysys.workloads.deep_gpcm.data import collate_padded

        batch = collate_padded(items)
        batch["n_valid"] = int(batch["mask"].sum())  # counted on the host: no device sync later
        return batch

    def build_model(self, cfg: DeepGPCMConfig) -> torch.nn.Module:
        from raysys.workloads.deep_gpcm.model import DeepGPCM

        seqs = self._data(cfg)
        m = cfg.model
        return DeepGPCM(seqs.n_questions, seqs.n_cats, memory_size=m.memory_size, key_dim=m.key_dim,
                        value_dim=m.value_dim, final_fc_dim=m.final_fc_dim, path=m.path, chunk=m.chunk,
                        recurrence_threads=m.recurrence_threads, recurrence=m.recurrence)

    def loss(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict]:
        from raysys.workloads.deep_gpcm.model import masked_loss

        logits = model(batch["questions"], batch["responses"])
        loss = masked_loss(logits.float(), batch["responses"], batch["mask"])
        return loss, {"samples": batch["questions"].shape[0], "tokens": batch["n_valid"]}

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Mapping[str, Any]]) -> dict[str, float]:
        from raysys.workloads.deep_gpcm.metrics import OrdinalMetricAccumulator

        acc = None
        for b in batches:
            logits = model(b["questions"], b["responses"]).float()
            if acc is None:
                acc = OrdinalMetricAccumulator(logits.shape[-1])
            acc.update(logits, b["responses"], b["mask"])
        return acc.compute()


def _bench(quick: bool = False, overrides: Optional[dict] = None) -> dict:
    from raysys.workloads.deep_gpcm.bench import run_bench

    return run_bench(quick=quick, overrides=overrides)


def _dataset(cfg: DeepGPCMConfig) -> dict:
    d = cfg.data
    name = _data_source(cfg).stem if d.path else _data_source(cfg).name
    profile = {"fold": d.fold, "n_folds": d.n_folds} | ({} if d.path else {
        "generator": "synthetic_OC", "students": d.n_students, "questions": d.n_questions, "categories": d.n_cats})
    return {"name": name, "source": str(_data_source(cfg)), "profile": profile}


WORKLOAD = Workload(
    name="deep_gpcm",
    description="Deep-GPCM knowledge tracing (DKVMN + GPCM head) on synthetic_OC or your data (parquet/CSV/JSONL, the original's .txt)",
    config_cls=DeepGPCMConfig,
    presets=PRESETS,
    task=DeepGPCMTask(),
    bench=_bench,
    path_key="model.path",
    throughput_metric="perf/tokens_per_s",
    dataset=_dataset,
    extra={"folds": ("data.n_folds", "data.fold"), "local_keys": LOCAL_KEYS},
)
