import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Keep Ray Train's teardown short in tests (see ../shared/notes/ray-2.60.md).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in a fresh folder: embedded MLflow store, data and runs land there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAYSYS_TRACKING_URI", raising=False)
    return tmp_path
