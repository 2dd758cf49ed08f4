"""A workload's own loop (``Workload.train_fn``) on several data-parallel Ray Train workers.

``run_custom`` (raysys.session) runs ``train_fn(cfg, session)`` in this process. With
``launch.workers > 0`` and a workload that declares ``extra["distributed"] = "torch"``, this
module runs the same function on every worker of a Ray Train ``TorchTrainer`` instead: the
driver opens the run (folder, config snapshot, MLflow run) once, each worker gets a
:class:`Session` with its rank (rank 0 logs and checkpoints, every rank restores), and
``torch.distributed`` is initialised by Ray Train (gloo on CPU, NCCL with GPUs), so the workload
reduces its gradients with plain ``torch.distributed`` calls and never imports Ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from raysys import tracking
from raysys import workload as registry
from raysys.config import from_dict
from raysys.session import Session
from raysys.train.launcher import OpenRun, RunResult, init_ray, open_run


def worker_session(payload: dict, rank: int, world_size: int) -> tuple[Any, Session]:
    """Rebuild the config and a rank-aware Session inside a worker from the driver's payload."""
    wl = registry.get(payload["workload"])
    cfg = from_dict(wl.config_cls, payload["config"])
    logger = tracking.MLflowLogger(payload["tracking_uri"], payload["run_id"]) if rank == 0 else tracking.NullLogger()
    run = OpenRun(wl, cfg, payload["config"], payload["name"], Path(payload["run_dir"]), payload["identity"],
                  payload["tracking_uri"], payload["run_id"], logger)
    return cfg, Session(run, rank=rank, world_size=world_size)


def _train_worker(payload: dict) -> None:
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg, session = worker_session(payload, rank, world)
    final = session.run.wl.train_fn(cfg, session) or {}
    if rank == 0:
        final = {**session.last_metrics, **final, "world_size": world}
        Path(payload["run_dir"], "final_metrics.json").write_text(json.dumps(final, indent=1, default=float))


def run_distributed(wl: registry.Workload, cfg: Any, parent_run_id: Optional[str] = None,
                    tags: Optional[dict] = None) -> RunResult:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run = open_run(wl, cfg, wl.extra.get("prepare"), parent_run_id, tags)
    launch = run.cfg.launch
    init_ray(launch.address)
    payload = {"workload": wl.name, "config": run.cfg_dict, "name": run.name, "run_dir": str(run.run_dir),
               "identity": run.identity, "tracking_uri": run.tracking_uri, "run_id": run.run_id}
    use_gpu = launch.gpus_per_worker > 0
    resources = {"CPU": launch.cpus_per_worker, **({"GPU": launch.gpus_per_worker} if use_gpu else {})}
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config=payload,
        scaling_config=ScalingConfig(num_workers=launch.workers, use_gpu=use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        # a restarted worker group resumes from the run's own checkpoints (Session.restore)
        run_config=RunConfig(name=run.name, storage_path=str(run.run_dir.parent),
                             failure_config=FailureConfig(max_failures=launch.max_failures)),
    )
    with run.tracked():
        trainer.fit()
    final = json.loads((run.run_dir / "final_metrics.json").read_text())
    return RunResult(run.name, run.run_dir, run.run_id, run.tracking_uri, final)
