"""The one PyTorch training loop, run by every Ray Train worker (or in-process with --workers 0).

A flat loop, nanoGPT-style: micro-batches -> forward/backward (DDP syncs only on the last
micro-batch) -> clip -> optimizer step -> LR schedule; metrics, checkpoints and evaluation at
fixed step/epoch boundaries so that every rank makes the same ``ray.train.report`` calls.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from raysys import lifecycle, storage
from raysys import workload as registry
from raysys.checkpoint import CheckpointStore, record_final
from raysys.console import Sink, forwarding
from raysys.config import ConfigError, from_dict
from raysys.metrics import MAX_NONFINITE, PhaseTimer, StabilityMonitor, Throughput
from raysys.tracking import BUFFER_FILE, MLflowLogger, NullLogger
from raysys.train.code_checks import DataError, fits_the_loader, loss_contract, map_style
from raysys.train.data import ShardSampler, batch_len, make_loader, to_device
from raysys.train.optim import (apply_changed_settings, clip_grads, fast_forward, group_settings, hooks_used, is_plateau,
                                 task_optimizer, task_scheduler)


def _ray_context() -> tuple[int, int]:
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


def _device(gpus_per_worker: float, workers: int) -> torch.device:
    if gpus_per_worker > 0 and torch.cuda.is_available():
        if workers == 0:  # in this process (Train's local mode): no worker was assigned a GPU by Ray
            return torch.device("cuda", torch.cuda.current_device())
        import ray.train.torch

        return ray.train.torch.get_device()
    return torch.device("cpu")


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _rng_state() -> dict:
    """Every RNG stream a step may draw from (dropout, a user's collate or augmentation), as what
    ``torch.load(weights_only=True)`` accepts; data order is a pure function of (seed, epoch)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "numpy": [torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _rng_states(world: int) -> list[dict]:
    """Every rank's ``_rng_state``, gathered (all ranks call it): they differ once rank 0 alone has evaluated
    (a metric that samples, a loader's seed), and a resume gives each rank its own back."""
    if world == 1:
        return [_rng_state()]
    states: list = [None] * world
    torch.distributed.all_gather_object(states, _rng_state())
    return states


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate((3, tuple(state["python"]), None))
    if "numpy" in state:
        keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _broadcast_flags(flags: tuple[bool, ...], world: int, device: torch.device) -> tuple[bool, ...]:
    """Rank 0's decisions for everyone (time-based checkpoints and stops are taken by all ranks together)."""
    if world == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], device=device)
    torch.distributed.broadcast(t, src=0)
    return tuple(bool(v) for v in t.tolist())


def _broadcast_value(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.broadcast(t, src=0)
    return float(t.item())


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    # the shared folder, or this process's copy of a remote run; the worker's warnings on the driver's console
    try:
        with storage.worker_run_dir(payload) as run_dir, forwarding(Sink(payload.get("console"))):
            _train(payload, run_dir)
    except BaseException as e:
        # the whole traceback travels with the error (its __dict__ is pickled): Ray Train cuts the one it
        # passes on to 1,000 characters, the workload's own frames among them (failures.full_traceback)
        import traceback

        with contextlib.suppress(Exception):
            e.raysys_traceback = traceback.format_exc()
        raise


def _train(payload: dict[str, Any], run_dir: Path) -> None:
    import ray.train

    # Train's local mode logs every report at INFO; our progress lines already say it once.
    for noisy in ("ray.train.v2._internal.execution.train_fn_utils", "ray.train.v2._internal.execution.context"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from raysys.lifecycle import StopPoller
    from raysys.train.failures import record_event
    from raysys.train.launcher import recorded_final
    from raysys.train.runtime import set_threads, work_where_the_driver_works

    # the schedule counts optimizer steps taken or skipped (a non-finite loss, fp16's scaler): torch's
    # warning about a skipped first step says nothing the run's stability metrics do not
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")

    work_where_the_driver_works(payload)
    wl = registry.get(payload["workload"])
    task = wl.task
    cfg = from_dict(wl.config_cls, payload["config"])
    tc = cfg.train
    rank, world = _ray_context()
    set_threads(cfg.launch)
    sink = Sink(payload.get("console"))
    device = _device(cfg.launch.gpus_per_worker, cfg.launch.workers)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = tc.cudnn_benchmark

    if getattr(task, "prepare", None) is not None:  # optional; idempotent: on a cluster each node makes
        task.prepare(cfg)  # or checks its own copy of the data
    train_ds, eval_ds = map_style(wl.name, task.datasets(cfg))
    collate = registry.collate_of(task)
    model = task.build_model(cfg).to(device)
    sampler = ShardSampler(len(train_ds), rank, world, seed=tc.seed, lengths=getattr(train_ds, "lengths", None),
                           bucket=cfg.loader.bucket_batches * tc.batch_size)
    if len(train_ds) == 0 or len(sampler) == 0:  # else a run of 0 steps "finishes" with an untrained model
        raise DataError(f"{wl.name}: its training set is empty (Task.datasets gave {len(train_ds)} items"
                        + (f" for {world} workers)" if len(train_ds) else ")"))
    per_worker = len(sampler)
    micro_per_epoch = per_worker // tc.batch_size if cfg.loader.drop_last else math.ceil(per_worker / tc.batch_size)
    # refused before the run existed (code_checks.built), and here again for a run it could not check (a model
    # its driver could not build, a resume's changed settings)
    fits_the_loader(wl.name, cfg, train_ds, model, world, device.type == "cpu")
    steps_per_epoch = math.ceil(micro_per_epoch / tc.grad_accum)
    shape_lazy_modules(task, model, train_ds, collate, tc.batch_size, device)
    # the task's optimizer hooks before DDP wraps the model: a parameter they freeze (fine-tuning) is one DDP's
    # reducer never waits for; an optimizer over the bare model's parameters is the same under DDP or compile
    opt = task_optimizer(task, cfg, model, wl.name)
    ddp = None  # after the checks above: DDP of a model they refuse fails in its own words
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                        find_unused_parameters=cfg.launch.find_unused_parameters)
    fwd_model = ddp or model
    unsaved = UnsavedBuffers(model) if rank == 0 else None
    if tc.compile:
        fwd_model = torch.compile(fwd_model)

    run_dir.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(run_dir, wl.name, payload["identity"], keep=tc.keep_checkpoints,
                            local_keys=wl.extra.get("local_keys", ()), holder=payload.get("holder"),
                            config=payload["config"])
    latest = store.latest()
    state, meta = store.load(latest) if latest is not None else (None, {})
    step, epoch, start = 0, 0, 0  # start: this worker's samples of the epoch already trained on
    if state is not None:
        step, epoch = state["step"], state["epoch"]
        start = min(per_worker, _epoch_samples(state, meta, tc.batch_size, world) // world)
    # where the epoch resumes, in this session's micro-batches: a resume with another batch size or worker count
    # (steps per epoch) goes on from the same share of the epoch, and trains the epochs that remain
    left = (per_worker - start) // tc.batch_size if cfg.loader.drop_last else math.ceil((per_worker - start) / tc.batch_size)
    micro_done = micro_per_epoch - left
    total_steps = (step + math.ceil(left / tc.grad_accum) + steps_per_epoch * max(0, tc.epochs - epoch - 1)
                   if epoch < tc.epochs else step)
    if tc.max_steps is not None:
        total_steps = min(tc.max_steps, total_steps)
    as_built = group_settings(opt)  # before a scheduler writes to the groups: a changed length rebuilds from it
    sched = task_scheduler(task, cfg, opt, total_steps, wl.name, wl.quality_metric, wl.quality_mode)
    plateau = is_plateau(sched)  # stepped with the quality after each evaluation, not at each step
    own_schedule = getattr(task, "scheduler", None) is not None
    scaler = torch.amp.GradScaler(device.type, enabled=tc.precision == "fp16")
    if device.type == "cpu" and tc.precision != "fp32" and rank == 0:  # a knob meant for GPUs, tried on a laptop
        sink.message(f"[{wl.name}] train.precision={tc.precision} on a CPU: autocast's half-precision kernels are "
                     "usually slower there than fp32 (python -m raysys.bench measures both)")
    if tc.precision != "fp32" and rank == 0 and any(p.dtype == torch.float64 for p in model.parameters()):
        sink.message(f"[{wl.name}] train.precision={tc.precision}: the model's float64 parameters stay float64 "
                     "(autocast casts float32 work only), so this knob changes little or nothing for it")
    timer = PhaseTimer(sync=torch.cuda.synchronize if device.type == "cuda" else None, every=tc.breakdown_every_steps)
    monitor = StabilityMonitor(spike_factor=tc.spike_factor)
    speed = Throughput()

    loss_val = float("nan")
    counted: set = set()  # the counts the task's loss gives: without tokens, its progress line says samples/s
    if state is not None:
        # a task's own schedule fixed to the run's length (OneCycleLR, a cosine's T_max) is rebuilt for a new one
        stretched = own_schedule and not plateau and state.get("total_steps", total_steps) != total_steps
        try:
            model.load_state_dict(state["model"])
            # another optimizer on this resume (optim.name, a task's own): the checkpoint's state (Adam's moments,
            # SGD's momentum buffers) is not the new one's; it starts afresh, and says so
            was_class = state.get("optim_class")
            fresh = was_class is not None and was_class != type(opt).__name__
            if not fresh:
                opt.load_state_dict(state["optimizer"])
            if stretched:
                sched = fast_forward(task, cfg, opt, total_steps, state["step"], as_built)
            else:
                sched.load_state_dict(state["scheduler"])
            # --resume --set optim.lr=...: the loaded state put back the settings the run was built with
            sched, optim_changes = apply_changed_settings(task, cfg, opt, sched, as_built, state.get("optim_built"),
                                                          total_steps, state["step"])
        except (RuntimeError, ValueError, KeyError) as e:  # a setting outside the checkpoint's identity changed
            from raysys.checkpoint import CheckpointError  # (a shape, the optimizer): no restart fixes it

            raise CheckpointError(f"checkpoint {latest.name} does not fit the model or optimizer this config builds: "
                                  f"{_first_mismatch(str(e)).rstrip('.')}. Resume with the run's settings, or start a new run "
                                  "(another --name)") from None
        scaler.load_state_dict(state["scaler"])
        timer.load_state_dict(state["timer"])
        monitor.load_state_dict(state["monitor"])
        ranks = state.get("rng_ranks")  # one per rank; a checkpoint of another worker count: rank 0's for all
        _set_rng_state(ranks[rank] if isinstance(ranks, list) and len(ranks) == world else state["rng"])
        # the last step's loss: an epoch-end report right after the resume must not say NaN
        loss_val = float(state.get("loss", float("nan")))
        if rank == 0:  # the epoch as the progress bar counts it (from 1), and where in it the run is
            where = f"epoch {min(epoch + 1, tc.epochs)}/{tc.epochs}" if epoch < tc.epochs else f"{epoch} epochs done"
            sink.message(f"[{wl.name}] resumed from {storage.where(run_dir)}/checkpoints/{latest.name} (step {step}, {where})")
            record_event(run_dir, f"resumed step={step} epoch={epoch} from={latest.name}")
            trains = step < total_steps  # else nothing trains: a change that takes no step is not said to go on
            if fresh and trains:
                sink.message(f"[{wl.name}] the optimizer changed ({was_class} -> {type(opt).__name__}): it starts with "
                             "fresh state (the checkpoint's moments are its old optimizer's); the weights go on")
            if optim_changes and trains and not fresh:  # a new optimizer's own settings are no change to it
                sink.message(f"[{wl.name}] the optimizer goes on with its changed settings: {'; '.join(optim_changes)}")
            if stretched and trains:
                sink.message(f"[{wl.name}] the run's length changed ({state['total_steps']} -> {total_steps} steps): "
                             f"Task.scheduler's schedule is rebuilt for {total_steps} and taken to step {step}")

    if rank == 0 and world > 1:  # where rank 0 runs, for audits of restarts after a lost node
        record_event(run_dir, f"worker group of {world} started; rank 0 on node {ray.get_runtime_context().get_node_id()}")
    logger = (MLflowLogger(payload["tracking_uri"], payload["run_id"], buffer=run_dir / BUFFER_FILE,
                           fence=storage.lease_fence(run_dir))
              if rank == 0 and payload.get("run_id") else NullLogger())
    hooks = hooks_used(task)
    if rank == 0 and hooks:  # the optim.* params describe the config's optimizer, not this one
        logger.set_tags(hooks | {"raysys.optimizer": type(opt).__name__, "raysys.scheduler": type(sched).__name__})
    stop_requested = StopPoller(payload.get("stop"))  # the driver's SIGINT/SIGTERM, seen at step boundaries
    eval_loader_items = None

    saved_at = -1

    def save_checkpoint() -> None:
        nonlocal saved_at
        saved_at = step
        rngs = _rng_states(world)
        if rank == 0:
            if changed := unsaved.changed(model):
                many = len(changed) > 1
                sink.message(f"[{wl.name}] {'buffers' if many else 'buffer'} {', '.join(changed[:3])} "
                             f"{'are' if many else 'is'} registered persistent=False but training changed "
                             f"{'them' if many else 'it'}: checkpoints do not hold such buffers, so a --resume starts "
                             "from their built values (register_buffer(..., persistent=True) keeps one)")
            store.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "scaler": scaler.state_dict(), "timer": timer.state_dict(), "monitor": monitor.state_dict(),
                        "rng": rngs[0], "rng_ranks": rngs, "step": step, "epoch": epoch, "micro_in_epoch": micro_done,
                        "data_seed": data_seed,  # the seed that orders this epoch (a resume with another finishes it)
                        "epoch_samples": min(per_worker, start + (micro_done - micro_at_start) * tc.batch_size) * world,
                        "loss": loss_val, "total_steps": total_steps, "epoch_loss": [float(epoch_loss[0]), epoch_loss[1]],
                        # what a resume with other optimizer settings, or another optimizer, compares with
                        "optim_built": as_built, "optim_class": type(opt).__name__},
                       step, {"epoch": epoch})

    def evaluate() -> dict[str, float]:
        nonlocal eval_loader_items
        if eval_loader_items is None:  # eval batches are fixed: build (and move) them once
            loader = make_loader(eval_ds, tc.batch_size, ShardSampler(len(eval_ds), shuffle=False), collate, cfg.loader,
                                 device, train=False)  # every sample is evaluated (loader.drop_last is training's)
            eval_loader_items = [to_device(b, device) for b in loader]
        model.eval()
        with torch.no_grad(), _autocast(tc.precision, device):
            metrics = task.evaluate(model, eval_loader_items)
        model.train()
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"{wl.name}: its Task.evaluate returned a {type(metrics).__name__}, not a dict of metrics")
        out = {f"eval/{k}": _number(v, k, wl.name) for k, v in metrics.items()}
        if task.quality_metric not in metrics:  # a typo would leave every sweep of it without a quality
            raise ConfigError(f"{wl.name}: its Task.quality_metric '{task.quality_metric}' is not among the metrics "
                              f"its evaluate() returned: {', '.join(map(str, metrics)) or 'none'}")
        out["eval/quality"] = out[f"eval/{task.quality_metric}"]  # the workload-neutral name
        return out

    last_ckpt_time = time.monotonic()
    step_at_start = step
    epoch_loss = (0.0, 0)  # (sum, count) of this epoch's finite step losses, for its progress line
    if state is not None and state.get("micro_in_epoch") and "epoch_loss" in state:  # resumed mid-epoch: its
        epoch_loss = (float(state["epoch_loss"][0]), int(state["epoch_loss"][1]))  # mean covers the whole epoch
    last_eval: dict[str, float] = {}
    eval_step = -1  # the step last_eval measured
    diverged = stopped = False
    nonfinite_streak = 0
    model.train()
    micro_at_start = micro_done  # micro_done counts from here in this epoch's first `start` samples
    # a resume with another train.seed mid-epoch: the epoch finishes in the order it began (the new seed's
    # order would train some of its samples twice and skip others); the new seed orders the epochs after it
    was_seed = state.get("data_seed", tc.seed) if state is not None else tc.seed
    seed_of = {epoch: was_seed} if start and was_seed != tc.seed else {}
    data_seed = seed_of.get(epoch, tc.seed)  # what a checkpoint records, also one saved before the loop turns
    if seed_of and rank == 0:
        sink.message(f"[{wl.name}] train.seed {was_seed} -> {tc.seed}: epoch {epoch + 1} finishes in the order it "
                     f"began; the new seed orders the epochs after it (the random streams go on from the checkpoint)")
    while epoch < tc.epochs and step < total_steps and not diverged and not stopped:
        data_seed = seed_of.get(epoch, tc.seed)
        sampler.seed = data_seed
        sampler.set_epoch(epoch, start=start)
        it = iter(make_loader(train_ds, tc.batch_size, sampler, collate, cfg.loader, device,
                              seed=data_seed * 100_003 + epoch))
        exhausted = False
        while not exhausted and step < total_steps and not diverged:
            timer.start_step(step)
            t0 = time.perf_counter()
            losses, samples, tokens, n_micro = [], 0, 0, 0
            # an epoch's last group may hold fewer micro-batches: its step takes their mean gradient, not a
            # fraction of it (loss / grad_accum would scale that step's gradient by n/grad_accum)
            group = max(1, min(tc.grad_accum, micro_per_epoch - micro_done))
            for i in range(tc.grad_accum):
                with timer.phase("data_wait"):
                    batch = next(it, None)
                if batch is None:
                    exhausted = True
                    break
                with timer.phase("h2d"):
                    batch = to_device(batch, device)
                last = i == tc.grad_accum - 1 or micro_done + 1 == micro_per_epoch
                # no DDP all-reduce on accumulation micro-steps: gradients sync once per optimizer step
                sync = ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext()
                with sync:
                    with timer.phase("forward"), _autocast(tc.precision, device), _unused_said(wl.name, world, step):
                        loss, stats = checked_loss(task, fwd_model, batch, wl.name, tc.batch_size, counted)
                    with timer.phase("backward"):
                        scaler.scale(loss / group).backward()
                losses.append(loss.detach())
                samples += int(stats.get("samples", 0))
                tokens += int(stats.get("tokens", 0))
                micro_done += 1
                n_micro += 1
                if last:
                    break
            if n_micro == 0:
                break
            with timer.phase("optimizer"):
                scaler.unscale_(opt)
                clip = cfg.optim.clip_grad_norm
                gn = clip_grads(model.parameters(), clip)  # the norm is a stability metric: measured unclipped too
                loss_val = float(torch.stack(losses).mean())  # this is a CPU-GPU sync point (once per step)
                if math.isfinite(loss_val):
                    scaler.step(opt)  # with fp16 the scaler itself skips steps with inf/nan grads
                    nonfinite_streak = 0
                else:
                    nonfinite_streak += 1
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if not plateau:
                    sched.step()
            timer.end_step()
            speed.update(time.perf_counter() - t0, samples, tokens)
            monitor.observe(loss_val, float(gn))
            if math.isfinite(loss_val):
                epoch_loss = (epoch_loss[0] + loss_val, epoch_loss[1] + 1)
            step += 1
            diverged = nonfinite_streak >= MAX_NONFINITE

            if step % tc.log_every_steps == 0 or diverged:
                metrics = {"train/loss": loss_val, "train/lr": opt.param_groups[0]["lr"],
                           "train/epoch": epoch + micro_done / micro_per_epoch,
                           **speed.rates(world), **monitor.metrics()}
                logger.log_metrics(metrics, step)
                if rank == 0:
                    sink.progress(wl.name, step, total_steps, _progress_text(epoch, tc.epochs, metrics, _unit(task, counted)))
                ray.train.report({**metrics, "step": step})
            minutes = tc.checkpoint_every_minutes
            due = minutes is not None and time.monotonic() - last_ckpt_time >= 60 * minutes
            asked = stop_requested() is not None  # every rank asks: a worker's own SIGTERM reaches the flag this way
            due, stopped = _broadcast_flags((due, rank == 0 and asked), world, device)
            if micro_done >= micro_per_epoch:
                exhausted = True  # the epoch-end checkpoint below covers this step: no second save of it
            every = tc.checkpoint_every_steps
            if (due or stopped or (every and step % every == 0)) and not exhausted:
                save_checkpoint()
                last_ckpt_time = time.monotonic()
            if stopped:
                break

        if stopped and not exhausted:
            break
        if exhausted and not diverged:  # epoch finished: evaluate, report, checkpoint at the boundary
            epoch += 1
            micro_done = micro_at_start = start = 0
            metrics = {"train/loss": loss_val, "train/lr": opt.param_groups[0]["lr"], "train/epoch": float(epoch),
                       **speed.rates(world), **monitor.metrics()}
            evals = epoch % tc.eval_every_epochs == 0 or epoch == tc.epochs
            if rank == 0 and evals:
                last_eval, eval_step = evaluate(), step
                metrics.update(last_eval)
            if plateau and evals:  # rank 0 evaluates; every rank steps with its quality, so their LRs stay equal
                q = last_eval.get(wl.quality_metric, last_eval.get("eval/quality", 0.0))
                sched.step(_broadcast_value(q, world, device))
            logger.log_metrics(metrics, step)
            metrics["step"] = step
            if rank == 0:
                # the epoch's mean: its last batch may be a handful of samples, its loss noise
                text = f"epoch {epoch}/{tc.epochs} done, mean loss {epoch_loss[0] / max(epoch_loss[1], 1):.4f}"
                if last_eval:
                    text += f" | {task.quality_metric} {last_eval.get('eval/quality', float('nan')):.4g}"
                sink.progress(wl.name, step, total_steps, text, keep=bool(evals))
            save_checkpoint()
            last_ckpt_time = time.monotonic()
            ray.train.report(metrics)
            epoch_loss = (0.0, 0)

    if stopped:  # a signal: the checkpoint of this step is saved; the driver marks the run KILLED
        if rank == 0:
            sink.message(f"[{wl.name}] stopped at step {step}/{total_steps}; checkpoint saved")
        ray.train.report({"step": step, "stopped": 1.0})
        return
    if saved_at != step and step > step_at_start and not diverged:
        save_checkpoint()  # ended by max_steps mid-epoch: a later --resume with more steps goes on from here
    if rank == 0:  # never stopped at a step boundary: a stop asked after the last one came too late
        lifecycle.reached_end(payload.get("stop"))
    kept = recorded_final(run_dir) if step == step_at_start and step > 0 else None
    if kept is not None:  # resumed after its end: nothing trained, and what it recorded stays as it was
        if rank == 0:
            sink.message(f"[{wl.name}] already trained to step {step}: nothing left to train (raise the run's "
                         "length to continue); its recorded final metrics and config are kept")
        ray.train.report({**kept, "done": 1.0})
        return
    shortened = state is not None and total_steps < state.get("total_steps", total_steps)  # than its checkpoint's
    if step == step_at_start and shortened and rank == 0:  # a resume that shortened the run below its checkpoint
        sink.message(f"[{wl.name}] the run's length ({tc.epochs} epochs"
                     + (f", train.max_steps={tc.max_steps}" if tc.max_steps is not None else "")
                     + f") ends before its checkpoint at step {step}: nothing left to train; that model is "
                     "evaluated and recorded as the run's result")
    final = {"step": step, "steps_this_session": step - step_at_start, "world_size": world,
             "stability/diverged": float(diverged), **monitor.metrics(),
             # no step this session (killed after its last checkpoint, before this): no speed to report, not 0
             **(speed.rates(world) if step > step_at_start else {})}
    if rank == 0:
        fresh = eval_step != step and not diverged
        if fresh:  # stopped by max_steps mid-epoch: the model trained since the last evaluation is the result
            last_eval = evaluate()
        final.update({f"breakdown/{k}": v for k, v in timer.summary().items()})
        # MLflow gets values that make charts: the logger turns the bookkeeping (step, world_size, steps this
        # session) into tags, and the per-phase breakdown is one table plus where the step's time goes.
        logger.log_metrics({**{k: v for k, v in final.items() if not k.startswith("breakdown/")},
                            **timer.summary_metrics(), **(last_eval if fresh else {})}, step)
        final.update(last_eval)
        breakdown = timer.table()
        logger.log_text(breakdown, "breakdown.md")
        record_final(store, final, breakdown)
        from raysys.train.launcher import BENCH_ENV

        what = ("of this quality run (its first steps included; the bench's ratio is timed apart)"
                if os.environ.get(BENCH_ENV) else "(measured)")
        if payload.get("brief_breakdown"):
            sink.message(f"[{wl.name}] step-time breakdown: {storage.where(run_dir)}/breakdown.md")
        else:
            sink.message(f"[{wl.name}] step-time breakdown {what}:\n{breakdown}")
    ray.train.report({**final, "done": 1.0})


def _number(v: Any, key: Any, name: str) -> float:
    """One metric of ``Task.evaluate`` as a float: a number, or a tensor or array of one element."""
    size = v.numel() if isinstance(v, torch.Tensor) else getattr(v, "size", None)
    if isinstance(v, (int, float)) or (size == 1 and callable(getattr(v, "item", None))):
        return float(v.item() if hasattr(v, "item") else v)
    what = f"a {type(v).__name__} of shape {list(v.shape)}" if hasattr(v, "shape") else f"a {type(v).__name__}"
    raise ConfigError(f"{name}: its Task.evaluate gave {what} for '{key}', not a number: MLflow and a sweep take one "
                      "number per metric (reduce it, or return one key per value)")


def _epoch_samples(state: dict, meta: dict, batch_size: int, world: int) -> int:
    """The samples of its epoch a checkpoint had trained on, over all workers. A checkpoint of an earlier
    version kept only its micro-batches: their size and the worker count come from the config it recorded."""
    if "epoch_samples" in state:
        return int(state["epoch_samples"])
    saved = meta.get("config") or {}
    batch = saved.get("train", {}).get("batch_size", batch_size)
    workers = max(1, saved.get("launch", {}).get("workers", world) or 1)
    return int(state.get("micro_in_epoch", 0)) * int(batch) * int(workers)


def _first_mismatch(text: str) -> str:
    """The first informative line of torch's load_state_dict error (its first line names no parameter)."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    detail = next((l for l in lines[1:] if "size mismatch" in l or "Missing key" in l or "Unexpected key" in l), None)
    return (detail or (lines[0] if lines else "state_dict mismatch"))[:300]


def _non_persistent(model: torch.nn.Module):
    """(name, tensor) of the buffers registered ``persistent=False``: no state_dict, so no checkpoint, holds them."""
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            if module._buffers.get(name) is not None:
                yield f"{prefix}.{name}" if prefix else name, module._buffers[name]


class UnsavedBuffers:
    """A ``persistent=False`` buffer that training changes (a step counter, an annealed value) starts from its
    built value on a --resume: torch's meaning, but it parts the resumed run from an uninterrupted one, so it
    is said once, at the first checkpoint that finds one changed. A cache rebuilt at another size (rotary
    tables for a longer sequence) is left alone: it is recomputed from the inputs after a resume too."""

    def __init__(self, model: torch.nn.Module):
        self.built = {name: b.detach().clone() for name, b in _non_persistent(model)}

    def changed(self, model: torch.nn.Module) -> list[str]:
        if not self.built:
            return []
        found = [name for name, b in _non_persistent(model) if name in self.built and b.shape == self.built[name].shape
                 and not torch.equal(b.detach().to(self.built[name].device), self.built[name])]
        if found:
            self.built = {}  # said once
        return found


def shape_lazy_modules(task: Any, model: Any, train_ds: Any, collate: Any, batch_size: int, device: Any) -> None:
    """Shapes for a model's lazy modules (``nn.LazyLinear``), if it has any: one forward of the first batch,
    without gradients and in eval mode (no running statistics moved). DDP refuses parameters of no shape yet,
    and an optimizer built before them would hold placeholders."""
    if not any(map(torch.nn.parameter.is_lazy, model.parameters())):
        return
    batch = to_device(collate([train_ds[i] for i in range(min(len(train_ds), batch_size))]), device)
    was = model.training
    model.eval()
    with torch.no_grad():
        task.loss(model, batch)
    model.train(was)


@contextlib.contextmanager
def _unused_said(name: str, world: int, step: int):
    """DDP's error for parameters a step left without gradients (it says so at the next step, as a constructor
    keyword the user never passes), said as the setting that fixes it; a ConfigError, as no restart would."""
    try:
        yield
    except RuntimeError as e:
        if "Expected to have finished reduction in the prior iteration" not in str(e):
            raise
        raise ConfigError(f"{name}: at step {step} some trainable parameters had no gradient from the step before "
                          "(a branch the data picks, a layer its loss skipped), which DDP's "
                          f"{world} workers cannot reduce: set launch.find_unused_parameters=true, or freeze them "
                          "(requires_grad=False)") from None


def checked_loss(task: Any, model: Any, batch: Any, name: str, size: int = 0, counted: Optional[set] = None) -> tuple:
    """``task.loss``, its contract checked (``code_checks.loss_contract``). Counts it leaves out are the batch's
    own: ``samples`` its first tensor's leading size (``size``, the loader's batch size, where the batch holds no
    tensor it can see), ``tokens`` the samples (a throughput of 0 would read as the slowest trial of a sweep).
    ``counted``: gets the counts the task gave."""
    loss, stats = loss_contract(task.loss(model, batch), name)
    if counted is not None:
        counted.update(stats)
    if "samples" not in stats or "tokens" not in stats:
        stats = dict(stats)
        stats.setdefault("samples", batch_len(batch) or size)
        stats.setdefault("tokens", stats["samples"])
    return loss, stats


def _unit(task: Any, counted: set) -> str:
    """What perf/tokens_per_s counts, as the progress line names it: the task's ``token_name``, else tokens where
    its loss counts them, else samples (what the metric then holds)."""
    return getattr(task, "token_name", None) or ("tokens" if "tokens" in counted else "samples")


def _progress_text(epoch: int, epochs: int, m: dict, token_name: str) -> str:
    return f"epoch {epoch + 1}/{epochs} loss {m['train/loss']:.4f} | {m['perf/tokens_per_s']:.0f} {token_name}/s"
