"""Config sections shared by every workload: how to optimise, load data, and launch on Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from raysys.config import ConfigError, at_least, require

Precision = Literal["fp32", "fp16", "bf16"]


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    name: Literal["adam", "adamw", "sgd"] = "adam"
    """Adam (the originals), AdamW (decoupled weight decay) or SGD (with ``momentum``/``nesterov``)."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """L2 (adam) or decoupled (adamw) weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW betas."""
    momentum: float = 0.0
    """SGD momentum (0 = plain SGD)."""
    nesterov: bool = False
    """SGD with Nesterov momentum (needs momentum > 0)."""
    schedule: Literal["constant", "cosine", "cosine_warm_restarts", "linear"] = "constant"
    """LR schedule after warmup: constant, cosine decay to lr*min_lr_ratio, cosine with warm restarts
    (SGDR; period ``restart_period`` optimizer steps, doubling by ``restart_mult``), or linear decay."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many optimizer steps."""
    min_lr_ratio: float = 0.0
    """Floor of the decaying schedules as a fraction of ``lr``."""
    restart_period: int = 500
    """First period of cosine_warm_restarts, in optimizer steps."""
    restart_mult: int = 1
    """Period multiplier after each warm restart."""
    clip_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value (None disables clipping)."""

    def validate(self) -> None:
        if not self.lr > 0:  # also refuses nan
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ConfigError("optim.nesterov needs optim.name=sgd and optim.momentum > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two values in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0 or self.restart_period < 1 or self.restart_mult < 1:
            raise ConfigError("optim.warmup_steps >= 0, optim.restart_period >= 1 and optim.restart_mult >= 1 are required")
        at_least(self, "optim.", 0, "weight_decay")
        require(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.clip_grad_norm is None or self.clip_grad_norm > 0,
                f"optim.clip_grad_norm must be > 0 (or none to disable clipping), got {self.clip_grad_norm}")


@dataclass
class LoaderConfig:
    """torch DataLoader knobs (the seeds argue about each of these)."""

    num_workers: int = 0
    """Background loader processes (0 = load in the training process)."""
    pin_memory: bool = False
    """Page-locked host buffers, for faster and asynchronous host->GPU copies (CUDA only)."""
    prefetch_factor: Optional[int] = None
    """Batches each loader worker prepares ahead (needs num_workers > 0)."""
    persistent_workers: bool = False
    """Keep loader workers alive between epochs (needs num_workers > 0)."""
    bucket_batches: int = 0
    """Length bucketing, for datasets with a ``lengths`` array (text): sort each window of this many
    batches of the shuffled order by length, so a batch pads little. 0 = off."""
    drop_last: bool = False
    """Leave out each epoch's last, partial batch of a worker (a BatchNorm layer cannot train on a batch of
    one sample; per-batch statistics are noisy on a small one). The samples it held come first in another
    epoch's shuffled order."""

    def validate(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"loader.num_workers must be >= 0, got {self.num_workers}")
        if self.bucket_batches < 0:
            raise ConfigError(f"loader.bucket_batches must be >= 0, got {self.bucket_batches}")
        if self.num_workers == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            raise ConfigError("loader.prefetch_factor and loader.persistent_workers need loader.num_workers > 0")


@dataclass
class TrainConfig:
    """The shared PyTorch training loop (raysys.train.loop)."""

    epochs: int = 10
    """Passes over the training set."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (overrides epochs when reached first)."""
    batch_size: int = 32
    """Micro-batch size per worker."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; DDP gradient sync happens only on the last one."""
    precision: Precision = "fp32"
    """fp32, fp16 (autocast + GradScaler) or bf16 (autocast, no scaler)."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    cudnn_benchmark: bool = False
    """Let cuDNN pick the fastest kernels for fixed shapes (CUDA only)."""
    seed: int = 0
    """Seed of model init, data order and dropout."""
    log_every_steps: int = 10
    """Progress line and step metrics every this many optimizer steps."""
    eval_every_epochs: int = 1
    """Evaluate quality every this many epochs (and always after the last)."""
    checkpoint_every_steps: Optional[int] = None
    """Checkpoint every this many optimizer steps (None: only at epoch ends)."""
    checkpoint_every_minutes: Optional[float] = None
    """Also checkpoint when this many minutes passed since the last one."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk; older ones are deleted only after a newer one is complete."""
    breakdown_every_steps: int = 1
    """Time the phases of every k-th step (on CUDA each timed phase costs a device sync)."""
    spike_factor: float = 4.0
    """A loss above this multiple of the running median counts as a spike (if it also rises above the median
    by a quarter of the run's starting loss: ``metrics.StabilityMonitor``)."""

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "grad_accum", "log_every_steps", "eval_every_epochs", "keep_checkpoints",
                     "breakdown_every_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:  # numpy's and torch's seeds; a negative one failed after the run began
            raise ConfigError(f"train.seed must be in [0, 2**32), got {self.seed}")
        # max_steps=0 trained nothing and reported success; a run must take at least one step
        at_least(self, "train.", 1, "max_steps", "checkpoint_every_steps")
        require(self.checkpoint_every_minutes is None or self.checkpoint_every_minutes > 0,
                f"train.checkpoint_every_minutes must be > 0, got {self.checkpoint_every_minutes}")
        require(self.spike_factor > 1, f"train.spike_factor must be > 1, got {self.spike_factor}")


@dataclass
class LaunchConfig:
    """Where and how a run executes: Ray cluster, workers, tracking and storage."""

    workers: int = 1
    """Ray Train workers (data-parallel ranks). 0 runs the loop in this process, without Ray actors."""
    gpus_per_worker: float = 0.0
    """GPUs per worker; > 0 selects CUDA and NCCL (gloo where several workers may share a GPU: a fraction < 1), else CPU and gloo."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker."""
    address: Optional[str] = None
    """Ray cluster address (e.g. 'auto', 'ray://host:10001'); None starts Ray in-process unless RAY_ADDRESS is set."""
    tracking_uri: Optional[str] = None
    """MLflow tracking URI; None uses $RAYSYS_TRACKING_URI, else $MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db."""
    experiment: Optional[str] = None
    """MLflow experiment name (default: raysys-<workload>)."""
    name: Optional[str] = None
    """Run name: the run's folder under storage_path and its MLflow run name. Default: <workload>-<time>."""
    storage_path: str = "raysys_runs"
    """Folder (shared by all nodes on a cluster) for checkpoints and run state."""
    resume: bool = False
    """Continue the run called ``name`` (or the newest run of this workload) from its last checkpoint."""
    max_failures: int = 2
    """Worker-group restarts (from the last checkpoint) before the run fails. Errors a restart cannot fix
    (config, unknown workload, bad data) fail at once."""
    threads: Optional[int] = None
    """torch intra-op threads per training process. None: one per physical core (half the usable logical
    CPUs) for an in-process run (workers=0); Ray's default (cpus_per_worker) on Ray Train workers."""
    find_unused_parameters: bool = False
    """DDP's ``find_unused_parameters``, for a model some trainable parameters of which a step's loss may not
    reach (an auxiliary head, a branch the data picks): DDP then walks the graph each step to mark them ready.
    Without it DDP fails at the second step of such a model: a run of 2+ workers whose loss leaves a parameter
    without a gradient is refused before it starts."""

    def validate(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"launch.workers must be >= 0, got {self.workers}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"launch.threads must be >= 1, got {self.threads}")
        at_least(self, "launch.", 0, "gpus_per_worker", "max_failures")
        require(self.cpus_per_worker > 0, f"launch.cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if self.name is not None:
            from raysys.lifecycle import validate_name

            validate_name(self.name, "--name (launch.name)")


@dataclass
class JaxLaunchConfig(LaunchConfig):
    """Launch options of a JAX workload: as for PyTorch, plus the TPU slice to run on.

    ``workers == 0`` runs in this process on every local device (the env batch sharded across them).
    ``workers > 0`` starts that many JAX actors under Ray Train's ``JaxTrainer``, one per host, with
    ``jax.distributed`` initialised so all of them train one model together.
    """

    workers: int = 0
    """JAX processes (one per host). 0 runs in this process on all local devices, without Ray actors."""
    use_tpu: bool = False
    """Schedule the workers on a TPU slice (JaxTrainer ``use_tpu``)."""
    topology: Optional[str] = None
    """TPU slice topology, e.g. '2x2x2' (v4-16: 2 hosts) or '2x2x1' (v4-8: 1 host)."""
    accelerator_type: Optional[str] = None
    """TPU generation, e.g. 'TPU-V4', 'TPU-V5E'."""
    jax_platforms: str = ""
    """JAX_PLATFORMS of the JAX processes: the workers', or this one with --workers 0 ('' lets JAX choose;
    'cpu' runs a TPU-scheduled job on the hosts' CPUs)."""

    def validate(self) -> None:
        super().validate()
        if self.use_tpu and (not self.topology or not self.accelerator_type):
            raise ConfigError("launch.use_tpu needs launch.topology (e.g. 2x2x2) and launch.accelerator_type (e.g. TPU-V4)")
        if self.use_tpu and self.gpus_per_worker:
            raise ConfigError("launch.use_tpu and launch.gpus_per_worker > 0 exclude each other")
        if self.use_tpu and self.workers < 1:
            raise ConfigError("launch.use_tpu needs launch.workers >= 1 (one JAX process per TPU host)")
