"""Experiment tracking behind one tiny interface, MLflow by default.

With no configuration runs go to an embedded sqlite store, ``./mlflow.db`` (artifacts beside it
in ``./mlruns``): ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows them. Any tracking
URI (an ``mlflow server``, Databricks, ...) is an option via ``--tracking-uri`` or
``$MLFLOW_TRACKING_URI``. Only rank 0 of a run logs.

We use ``MlflowClient`` with explicit run ids instead of the fluent ``mlflow.start_run`` API: the
same run is written from the driver and from a Ray worker process, and a resumed or restarted
run must append to the run it already has.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

log = logging.getLogger(__name__)

RUN_NAME_TAG = "raysys.run_name"


class Logger(Protocol):
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, subdir: Optional[str] = None) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...


class NullLogger:
    """For ranks other than 0, and for bench runs that track nothing."""

    def log_params(self, params): pass
    def log_metrics(self, metrics, step): pass
    def log_artifact(self, path, subdir=None): pass
    def log_text(self, text, name): pass
    def set_tags(self, tags): pass


def default_tracking_uri() -> str:
    uri = os.environ.get("RAYSYS_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_tracking_uri(uri: Optional[str]) -> str:
    """Make local store URIs absolute, so Ray workers (other working dirs) write the same store."""
    uri = uri or default_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    elif "://" not in uri:  # a plain folder: MLflow's file store
        uri = Path(uri).resolve().as_uri()
    return uri


def _artifact_root(uri: str) -> Optional[str]:
    """Local stores keep artifacts beside the database; servers choose their own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlruns").resolve().as_uri()
    return None


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def get_or_create_experiment(uri: str, name: str) -> str:
    client = _client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    root = _artifact_root(uri)
    try:
        return client.create_experiment(name, artifact_location=f"{root}/{name}" if root else None)
    except Exception:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_run(uri: str, experiment: str, run_name: str) -> Optional[str]:
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    return runs[0].info.run_id if runs else None


def start_run(uri: str, experiment: str, run_name: str, tags: Optional[Mapping[str, str]] = None,
              parent_run_id: Optional[str] = None, resume: bool = False) -> str:
    """Create the MLflow run (or, when resuming, find the one with this name) and return its id."""
    if resume:
        run_id = find_run(uri, experiment, run_name)
        if run_id is not None:
            _client(uri).update_run(run_id, status="RUNNING")
            return run_id
    exp_id = get_or_create_experiment(uri, experiment)
    all_tags = {RUN_NAME_TAG: run_name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id  # MLflow's own nesting convention
    run = _client(uri).create_run(exp_id, run_name=run_name, tags=all_tags)
    return run.info.run_id


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _client(uri).set_terminated(run_id, status=status)


class MLflowLogger:
    """Logs to one existing MLflow run by id."""

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id
        self.client = _client(uri)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        # MLflow refuses to change a logged param; on resume only log what is new.
        new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(ms), 500):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 500])

    def log_artifact(self, path: str | Path, subdir: Optional[str] = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=subdir)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))
