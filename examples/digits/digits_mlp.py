"""A workload of your own: an MLP classifying scikit-learn's handwritten digits.

Everything here is specific to this model; raysys brings the rest (Ray Train DDP, AMP,
accumulation, checkpoints and resume, MLflow, sweeps, the bench). Train it from this folder:

    python -m raysys train digits_mlp:WORKLOAD --preset quick

Two paths compute the same function: ``naive`` feeds one example at a time, as code ported from a
per-sample loop often does; ``optimized`` feeds the whole batch. ``path_key`` tells raysys, so its
bench measures both and checks that their losses agree.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from raysys.config import ConfigError
from raysys.train.config import LaunchConfig, LoaderConfig, OptimConfig, TrainConfig
from raysys.workload import Workload


@dataclass
class DataConfig:
    test_fraction: float = 0.25
    """Share of the 1,797 images held out for evaluation."""
    seed: int = 0
    """Seed of the train/test split."""

    def validate(self) -> None:
        if not 0.05 <= self.test_fraction <= 0.5:
            raise ConfigError(f"data.test_fraction must be in [0.05, 0.5], got {self.test_fraction}")


@dataclass
class ModelConfig:
    hidden: int = 128
    """Width of the two hidden layers."""
    dropout: float = 0.1
    """Dropout after each hidden layer."""
    path: Literal["naive", "optimized"] = "optimized"
    """naive: one example at a time; optimized: the whole batch at once (same function)."""

    def validate(self) -> None:
        if self.hidden < 1 or not 0 <= self.dropout < 1:
            raise ConfigError("model.hidden >= 1 and model.dropout in [0, 1) are required")


@dataclass
class DigitsConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=10, batch_size=64, log_every_steps=5))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True))
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def quick() -> DigitsConfig:
    """Seconds: 3 epochs."""
    cfg = DigitsConfig()
    cfg.train.epochs = 3
    return cfg


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.path = cfg.path
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(), torch.nn.Dropout(cfg.dropout),
            torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.ReLU(), torch.nn.Dropout(cfg.dropout),
            torch.nn.Linear(cfg.hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "naive":
            return torch.cat([self.net(row[None]) for row in x])
        return self.net(x)


class DigitsTask:
    quality_metric = "accuracy"
    token_name = "images"

    def prepare(self, cfg: DigitsConfig) -> DigitsConfig:
        return cfg  # the data ships with scikit-learn: nothing to download or write

    def datasets(self, cfg: DigitsConfig):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x / 16.0, dtype=torch.float32)  # pixel values are 0..16
        y = torch.tensor(y)
        tr, te = train_test_split(range(len(y)), test_size=cfg.data.test_fraction, random_state=cfg.data.seed,
                                  stratify=y)
        return list(zip(x[tr], y[tr])), list(zip(x[te], y[te]))

    def collate(self, items: list) -> dict:
        return {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items])}

    def build_model(self, cfg: DigitsConfig) -> torch.nn.Module:
        return MLP(cfg.model)

    def loss(self, model, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        return loss, {"samples": len(batch["y"]), "tokens": len(batch["y"])}

    def evaluate(self, model, batches) -> dict:
        right = total = 0
        for b in batches:
            right += int((model(b["x"]).argmax(-1) == b["y"]).sum())
            total += len(b["y"])
        return {"accuracy": right / total}


WORKLOAD = Workload(
    name="digits_mlp",
    description="MLP on scikit-learn's 8x8 digits (the docs/your-workload.md example)",
    config_cls=DigitsConfig,
    presets={"default": DigitsConfig, "quick": quick},
    task=DigitsTask(),
    path_key="model.path",
)
