"""A workload's own loop (``Workload.train_fn``) on several data-parallel Ray Train workers.

``run_custom`` (raysys.session) runs ``train_fn(cfg, session)`` in this process. With
``launch.workers > 0`` this module runs the same function on every worker of a Ray Train
trainer instead: the driver opens the run (folder, config snapshot, MLflow run) once, each
worker gets a :class:`Session` with its rank (rank 0 logs and checkpoints, every rank restores).

- ``extra["distributed"] = "torch"``: a ``TorchTrainer``; Ray Train initialises
  ``torch.distributed`` (gloo on CPU, NCCL with GPUs) and the workload all-reduces its gradients
  with plain ``torch.distributed`` calls.
- ``extra["runner"] = "jax"``: a ``JaxTrainer``, one JAX process per host, with
  ``jax.distributed`` initialised, so ``jax.devices()`` lists every chip of every host and one
  jitted SPMD program trains one model on all of them. On a TPU slice (``launch.use_tpu``) Ray
  reserves the whole slice and initialises JAX itself; on CPU/GPU hosts the workers rendezvous
  here.

Either way the workload never imports Ray.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from raysys import console, lifecycle, storage, tracking
from raysys import workload as registry
from raysys.checkpoint import record_final
from raysys.config import from_dict
from raysys.session import Session
from raysys.train.failures import fit_with_restarts, newest_checkpoint
from raysys.train.launcher import OpenRun, RunResult, open_run, ray_storage, recorded_final
from raysys.train.runtime import (init_ray, process_group_backend, set_threads, train_logging,
                                  work_where_the_driver_works)


def worker_session(payload: dict, rank: int, world_size: int, run_dir: Path) -> tuple[Any, Session]:
    """Rebuild the config and a rank-aware Session inside a worker from the driver's payload."""
    work_where_the_driver_works(payload)
    wl = registry.get(payload["workload"])
    cfg = from_dict(wl.config_cls, payload["config"])
    logger = (tracking.MLflowLogger(payload["tracking_uri"], payload["run_id"],
                                    buffer=run_dir / tracking.BUFFER_FILE, fence=storage.lease_fence(run_dir))
              if rank == 0 else tracking.NullLogger())
    run = OpenRun(wl, cfg, payload["config"], payload["name"], run_dir, payload["identity"],
                  payload["tracking_uri"], payload["run_id"], logger, holder=payload.get("holder"))
    set_threads(cfg.launch)
    return cfg, Session(run, rank=rank, world_size=world_size, sink=console.Sink(payload.get("console")),
                        stop=payload.get("stop"))


def _train_worker(payload: dict) -> None:
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if payload["kind"] == "jax":
        _init_jax_distributed(rank, world)
    # the shared folder, or this process's copy of a remote run; the worker's warnings on the driver's console
    with storage.worker_run_dir(payload) as run_dir, console.forwarding(console.Sink(payload.get("console"))):
        cfg, session = worker_session(payload, rank, world, run_dir)
        returned = session.run.wl.train_fn(cfg, session)
        ran_to_end = not session.saw_stop  # never told to stop: a stop asked after its last check came too late
        final = session.finish(returned if returned is not None else {})
        if rank == 0 and ran_to_end:
            lifecycle.reached_end(payload["stop"])
            if not session.kept_final:
                record_final(session.store, {**final, "world_size": world})


def _init_jax_distributed(rank: int, world: int) -> None:
    """``JaxTrainer`` initialises ``jax.distributed`` only for TPU or GPU workers; CPU workers
    (a CPU cluster, or tests) get the same here: rank 0 hosts the coordinator on a free port."""
    import jax  # inside the worker: a TPU host's runtime is claimed by the first process that imports it

    if world == 1 or jax.distributed.is_initialized():
        return
    import socket

    from ray.train.collective import broadcast_from_rank_zero
    from ray.util import get_node_ip_address

    address = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = f"{get_node_ip_address()}:{s.getsockname()[1]}"
    jax.distributed.initialize(broadcast_from_rank_zero(address), num_processes=world, process_id=rank)


def distributed_kind(wl: registry.Workload) -> Optional[str]:
    """'torch' or 'jax' when the workload's loop can run on several Ray Train workers, else None."""
    return "jax" if wl.extra.get("runner") == "jax" else wl.extra.get("distributed")


def run_distributed(wl: registry.Workload, cfg: Any, parent_run_id: Optional[str] = None,
                    tags: Optional[dict] = None) -> RunResult:
    from ray.train import FailureConfig

    kind = distributed_kind(wl)
    run = open_run(wl, cfg, wl.extra.get("prepare"), parent_run_id, tags)
    launch = run.cfg.launch
    init_ray(launch.address)
    use_gpu = launch.gpus_per_worker > 0
    resources = {"CPU": launch.cpus_per_worker, **({"GPU": launch.gpus_per_worker} if use_gpu else {})}
    backend = process_group_backend(launch.workers, launch.gpus_per_worker) if kind == "torch" else None
    # a restarted worker group resumes from the run's own checkpoints (Session.restore); restarts are
    # fit_with_restarts', which fails at once on errors a restart cannot fix
    failure = FailureConfig(max_failures=0)
    final_path = run.run_dir / "final_metrics.json"
    recorded = recorded_final(run.run_dir) if launch.resume else None
    at_start = newest_checkpoint(run.run_dir) if recorded is not None else None
    with run.tracked() as outcome, console.live(remote=True) as sink:
        payload = {"workload": registry.ref(wl), "kind": kind, "config": run.cfg_dict, "name": run.name,
                   "run_dir": str(run.run_dir), **storage.payload(run.run_dir), "identity": run.identity, "tracking_uri": run.tracking_uri,
                   "run_id": run.run_id, "console": sink.handle, "stop": lifecycle.stop_flag_actor(), "cwd": os.getcwd(),
                   "holder": lifecycle.holder_of(run.run_dir)}  # a fence against this session's orphaned workers
        fit_with_restarts(lambda: _trainer(kind, launch, run, payload, use_gpu, resources, failure, backend),
                          launch.max_failures, run.run_dir, sink)
        lifecycle.settle_stop(payload["stop"])  # a worker's SIGTERM stops the run as the driver's would
        final = json.loads(final_path.read_text()) if storage.pull(final_path) else {}
        outcome.check(final)
        # a session stopped before its end records no new final metrics, but it trained: its checkpoint says so
        outcome.trained_nothing = recorded is not None and final == recorded and newest_checkpoint(run.run_dir) == at_start
    return RunResult(run.name, run.run_dir, run.run_id, run.tracking_uri, final, stopped_by=lifecycle.stop_requested(),
                     resume_command=run.resume_command(), failure=outcome.failure)


def _trainer(kind: str, launch: Any, run: OpenRun, payload: dict, use_gpu: bool, resources: dict, failure: Any,
             backend: Optional[str]):
    from ray.train import RunConfig, ScalingConfig

    if kind == "jax":
        from raysys.train.cleaner import JaxTrainer

        env = {"JAX_PLATFORMS": launch.jax_platforms} if launch.jax_platforms else {}
        return JaxTrainer(
            _train_worker,
            train_loop_config=payload,
            # on a TPU slice Ray derives each host's chips from topology + accelerator_type
            scaling_config=ScalingConfig(num_workers=launch.workers, use_gpu=use_gpu, use_tpu=launch.use_tpu,
                                         topology=launch.topology, accelerator_type=launch.accelerator_type,
                                         resources_per_worker=None if launch.use_tpu else resources),
            run_config=RunConfig(name=run.name, **ray_storage(run.run_dir), failure_config=failure,
                                 worker_runtime_env={"env_vars": env}, logging_config=train_logging()),
        )
    from ray.train.torch import TorchConfig

    from raysys.train.cleaner import TorchTrainer

    return TorchTrainer(
        _train_worker,
        train_loop_config=payload,
        scaling_config=ScalingConfig(num_workers=launch.workers, use_gpu=use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(name=run.name, **ray_storage(run.run_dir), failure_config=failure,
                             logging_config=train_logging()),
    )
