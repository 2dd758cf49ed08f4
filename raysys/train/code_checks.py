"""What a run knows of its workload's code, and the checks of that code made before a run exists.

A run records a digest of the workload's own files (``code.json``, MLflow tag ``raysys.code``), so a resume
can say which files changed since its last session. Before a run's folder or MLflow run is made, the model
its config builds is built on torch's meta device: a mistake of the workload's own code is then one line
naming the hook and where it was raised, and a resume whose model no longer takes the checkpoint's weights
is refused naming why.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from raysys import storage
from raysys import workload as registry
from raysys.checkpoint import CheckpointError
from raysys.config import ConfigError


class DataError(ConfigError):
    """The user's data cannot be used (missing or wrong columns, bad values, unreadable files)."""


CODE_FILE = "code.json"
"""``<run>/code.json``: the digest of the workload's own code (``registry.code_digest``) in its last session."""


def plugin_tag(wl: registry.Workload) -> dict:
    """``raysys.plugin``: the package and version (or the file) a plug-in's code came from; none for a built-in
    (``mlflow.source.git.commit`` is raysys's own commit, not the plug-in's)."""
    source = registry.origin(wl)
    return {"raysys.plugin": source} if source else {}


def code_id(code: dict[str, str]) -> str:
    """One short id of a code digest: the MLflow tag ``raysys.code``, the code of the run's last session (runs
    with the same id ran the same workload code)."""
    import hashlib

    return hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()[:12]


def code_changes(run_dir: Path, code: dict[str, str]) -> str:
    """The workload's files that differ from the run's last session's ('' when none, or not known)."""
    path = run_dir / CODE_FILE
    try:
        before = json.loads(path.read_text()) if storage.pull(path) else None
    except (OSError, ValueError):
        before = None
    if not isinstance(before, dict) or before == code:  # a run from before this file, or the same code
        return ""
    changed = [f"{f} ({'added' if f not in before else 'removed' if f not in code else 'changed'})"
               for f in sorted(set(before) | set(code)) if before.get(f) != code.get(f)]
    return ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")


def model_fits(wl: registry.Workload, tags: Optional[dict]) -> Callable[[Any, dict, str], None]:
    """A resume's check that the model its config builds takes the checkpoint's weights: a setting that
    changes a shape may lie outside the sections a checkpoint compares (``identity_sections``). The model
    is built as a worker builds it (data first), on torch's meta device: shapes, no memory."""

    def fits(cfg: Any, state: dict, code_changed: str = "") -> None:
        import torch

        saved = state.get("model") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            return
        model = built(wl.task, wl.name, cfg, say=False)
        if model is None or any(map(torch.nn.parameter.is_lazy, model.parameters())):
            return  # not buildable here, or lazy modules of no shape yet: the workers build it, and say a mismatch
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = {k: tuple(v.shape) for k, v in saved.items() if hasattr(v, "shape")}
        odd = next((k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)), None)
        if odd is None:
            return
        seen = (f"{odd}: checkpoint {list(have[odd]) if odd in have else 'none'}, "
                f"now {list(want[odd]) if odd in want else 'none'}")
        changed = (tags or {}).get("raysys.resume_changes", "")
        if code_changed:  # the files are known: they, not a --set that may not touch a shape, are named first
            why = (f"the workload's code changed since the run's last session ({code_changed})"
                   + (f", and on this resume {changed}" if changed else "") + ". Resume with that code and settings")
        elif changed:
            why = f"changed on this resume: {changed}. Resume with the run's settings"
        else:
            why = ("the run's config is unchanged, so the workload's code builds another model than the one it saved. "
                   "Resume with that code")
        raise CheckpointError(f"the checkpoint does not fit the model this config builds ({seen}); {why}, or start "
                              "a new run (another --name)")

    return fits


class WorkloadCodeError(ConfigError):
    """The workload's own code (its Task's datasets or build_model) raised an error of the code itself."""


def error_kind(e: ConfigError) -> str:
    """How a command names a refusal on its one line: ``data error``, ``error in the workload's code`` or
    ``config error`` (train, bench and tune alike)."""
    return ("data error" if isinstance(e, DataError) else "error in the workload's code"
            if isinstance(e, WorkloadCodeError) else "config error")


CODE_ERRORS = (TypeError, ValueError, KeyError, AttributeError, NameError, IndexError, ZeroDivisionError)
"""Errors of a workload's own code, whatever node runs it. Not among them: what may fail on the driver alone
(RuntimeError: no GPU here, no Ray Train context, an op meta tensors lack; OSError: data on the workers' nodes;
ImportError: a package the workers' runtime env installs; AssertionError: torch without CUDA)."""


def map_style(name: str, out: Any) -> tuple[Any, Any]:
    """``Task.datasets``' answer, checked: a (train, eval) pair of map-style datasets. The loop shards,
    shuffles and resumes mid-epoch by index (``ShardSampler``), which a stream (an ``IterableDataset``) has
    not: one is refused in one line, not met as ``len()``'s TypeError in a worker after the run exists."""
    import torch

    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise WorkloadCodeError(f"{name}: its Task.datasets gave a {got}, not a (train, eval) pair of datasets")
    for which, ds in zip(("training", "evaluation"), out):
        if isinstance(ds, torch.utils.data.IterableDataset) or not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise WorkloadCodeError(
                f"{name}: its Task.datasets gave a {type(ds).__name__} as the {which} set, which cannot be indexed: "
                "raysys shards, shuffles and resumes an epoch by index, so it takes map-style datasets (__len__ "
                "and __getitem__: a list, a torch Dataset); make the stream a list, or index its source")
    return out[0], out[1]


def fits_the_loader(name: str, cfg: Any, train: Any, model: Any, world: int, cpu: bool, before: bool = False) -> None:
    """What the loop would refuse in a worker of a run of ``world`` workers (``cpu``: without GPUs), said in the
    same words by ``built`` before the run exists: a training set ``loader.drop_last`` leaves without a batch,
    an epoch ending on a batch of one sample its BatchNorm cannot train on, SyncBatchNorm on CPUs, and length
    bucketing of a dataset that has no lengths. ``before``: said before the run exists."""
    import math

    import torch

    loader, tc = cfg.loader, cfg.train
    per_worker = math.ceil(len(train) / max(1, world))  # as ShardSampler shards it
    if loader.drop_last and per_worker < tc.batch_size:
        raise DataError(f"loader.drop_last leaves no batch: {per_worker} training samples per worker, fewer than "
                        f"train.batch_size={tc.batch_size} ({name}" + ("; nothing was created)" if before else ")"))
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    if modules:
        model.train()  # as the loop trains it: a BatchNorm its train() keeps in eval (a frozen backbone) is fine
    # BatchNorm fails on one value per channel: a BatchNorm1d on (N, C) features, not a BatchNorm2d on images
    if per_worker % tc.batch_size == 1 and not loader.drop_last and any(
            isinstance(m, torch.nn.BatchNorm1d) and m.training for m in modules):
        # said now, not as BatchNorm's ValueError at the epoch's last step, restarted max_failures times
        raise ConfigError(f"{name}: each epoch would end with a batch of one sample ({per_worker} per worker, "
                          f"train.batch_size={tc.batch_size}), which its BatchNorm cannot train on: set "
                          "loader.drop_last=true, or another batch size")
    if world > 1 and cpu and any(isinstance(m, torch.nn.SyncBatchNorm) for m in modules):
        raise ConfigError(f"{name}: its model has SyncBatchNorm, which torch synchronises on GPUs only, and its "
                          f"{world} workers train on CPUs: set launch.gpus_per_worker, or keep plain BatchNorm")
    lengths = getattr(train, "lengths", None)
    if loader.bucket_batches and (lengths is None or not hasattr(lengths, "__len__") or len(lengths) != len(train)):
        had = ("none" if lengths is None else f"{len(lengths)}" if hasattr(lengths, "__len__")
               else type(lengths).__name__)
        raise ConfigError(f"loader.bucket_batches={loader.bucket_batches} sorts batches by the training set's "
                          f"`lengths` (one per sample), and {name}'s {type(train).__name__} has {had} for its "
                          f"{len(train)} samples: give it a `lengths` attribute, or set loader.bucket_batches=0")


def loss_contract(out: Any, name: str) -> tuple:
    """``Task.loss``'s answer checked: ``(scalar loss tensor, counts)``. A bare tensor would otherwise fail later as
    'iteration over a 0-d tensor', and a loss per sample as backward's 'grad can be implicitly created only for
    scalar outputs'."""
    import torch

    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and isinstance(out[1], Mapping)):
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, tuple) else "")
        raise ConfigError(f"{name}: its Task.loss returned a {got}, not (a scalar loss tensor, {{'samples': n, "
                          "'tokens': n}), the counts optional")
    if out[0].numel() != 1:
        raise ConfigError(f"{name}: its Task.loss returned a loss of shape {list(out[0].shape)}, not a scalar: reduce "
                          "it (.mean() over the batch)")
    return out


def _loss_on_meta(task: Any, name: str, model: Any, train: Any, cfg: Any) -> None:
    """``Task.loss`` of a first batch on the meta model: a loss that breaks its contract is one line before the run
    exists, and so, for a run of several workers, are trainable parameters its gradient does not reach (DDP
    fails at its second step then, unless ``launch.find_unused_parameters``). Anything else that fails here (an
    op meta tensors lack, a batch of another size than the code expects) is left to the workers."""
    import torch

    from raysys.train.data import to_device

    # the task's attributes as they were: a loss that builds state on its first call (a criterion with class
    # weights on the batch's device, a cached mask) must not keep meta tensors for the run that follows in this
    # process (--workers 0 trains this very task object)
    saved = dict(vars(task)) if hasattr(task, "__dict__") else None
    try:
        n = min(len(train), cfg.train.batch_size, 256)  # a batch as the loop's: a branch its data picks is taken
        batch = to_device(registry.collate_of(task)([train[i] for i in range(n)]), torch.device("meta"))
        out = task.loss(model, batch)
    except Exception:
        return
    finally:
        if saved is not None:
            vars(task).clear()
            vars(task).update(saved)
    loss, _ = loss_contract(out, name)
    launch = cfg.launch
    if launch.workers < 2 or getattr(launch, "find_unused_parameters", True) or not loss.requires_grad:
        return
    try:
        loss.backward()
    except Exception:
        return
    idle = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if idle:
        more = f" and {len(idle) - 3} more" if len(idle) > 3 else ""
        raise ConfigError(f"{name}: its Task.loss gives no gradient to trainable parameters {', '.join(idle[:3])}{more}, "
                          f"on which DDP's {launch.workers} workers fail at their second step: set "
                          "launch.find_unused_parameters=true (a branch the data picks), or freeze them "
                          "(requires_grad=False)")


def _on_meta_only(e: Exception) -> bool:
    """An error that meta tensors cause, not the code (``.numpy()``: "can't convert meta device type tensor")."""
    return "meta" in str(e)


def _raised(name: str, hook: str, e: BaseException) -> str:
    """One line for an error a workload's hook raised: the hook, the error, and where in the workload's own code
    (not inside torch or another library) it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = ([f for f in frames if "site-packages" not in f.filename and "/lib/python" not in f.filename]
             or frames)[-1]
    detail = (str(e).strip().splitlines() or [""])[0][:300]
    return (f"{name}: its {hook} raised {type(e).__name__}" + (f": {detail}" if detail else "")
            + f" ({Path(where.filename).name}:{where.lineno}; nothing was created)")


def built(task: Any, name: str, cfg: Any, say: bool = True, before_loss: Optional[Callable[[Any], None]] = None) -> Any:
    """The model a worker will build (Task.datasets, then Task.build_model on torch's meta device: shapes, no
    memory), before the run exists; None where it cannot be built here. An error of the code itself
    (``CODE_ERRORS``) is one line naming the hook, the error and where it was raised (with ``say``), not the
    workers' traceback after the run was made and restarted ``max_failures`` times; so are what the loop
    refuses of the data and model (``fits_the_loader``) and a loss that breaks its contract. A ConfigError is
    left to the workers: it may check this process's devices, and there it fails the run at once with its
    message. ``before_loss``: what the loop does to the model before its first step (the optimizer hooks, which
    may freeze parameters), done before the loss is checked."""
    import torch

    train = model = None
    for hook in ("datasets", "build_model"):
        try:
            if hook == "datasets":
                out = task.datasets(cfg)
            else:
                with torch.device("meta"):
                    model = task.build_model(cfg)
        except ConfigError:  # may be a check of this process's own devices ("needs a GPU"): the workers' to make
            return None
        except CODE_ERRORS as e:
            if not say or _on_meta_only(e):  # a model built with numpy, say: the workers build it on a real device
                return None
            what = DataError if hook == "datasets" and isinstance(e, ValueError) else WorkloadCodeError
            raise what(_raised(name, f"Task.{hook}", e)) from None
        except Exception:  # what may fail here alone: the workers build it, and meet any error there
            return None
        if hook == "datasets" and say:
            train = map_style(name, out)[0]
            _fits(name, cfg, train, None)  # the data's own refusals, whether or not the model builds here
    if say and model is not None:
        _fits_memory(name, cfg, model)
    if say and _fits(name, cfg, train, model):
        if before_loss is not None:
            before_loss(model)
        _loss_on_meta(task, name, model, train, cfg)
    return model


def physical_memory() -> Optional[int]:
    """This machine's memory in bytes; None where the OS does not say (no sysconf: Windows)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _fits_memory(name: str, cfg: Any, model: Any) -> None:
    """A model whose parameters, their gradients and its buffers alone (a lower bound: no optimizer state, no
    activations) outgrow this machine's memory, refused before the run exists, not as the workers' allocation
    error after it was made and restarted. Said for CPU workers of this machine only: a cluster's nodes and a
    GPU's memory are not this process's to measure."""
    import os

    import torch

    launch = getattr(cfg, "launch", None)
    if (not isinstance(model, torch.nn.Module) or getattr(launch, "gpus_per_worker", 0)
            or getattr(launch, "address", None) or os.environ.get("RAY_ADDRESS")):
        return
    from torch.nn.parameter import is_lazy  # a lazy module's tensors have no size until its first batch

    params = [p for p in model.parameters() if not is_lazy(p)]
    size = sum(p.numel() * p.element_size() for p in params)
    held = sum(b.numel() * b.element_size() for b in model.buffers() if not is_lazy(b))
    copies = max(1, getattr(launch, "workers", 1) or 1)  # each local worker holds its own replica
    need, have = (2 * size + held) * copies, physical_memory()
    if have is not None and need > have:
        gib = 2 ** 30
        count = sum(p.numel() for p in params)
        buffers = f" and {held / gib:.1f} GiB of buffers" if held >= gib / 10 else ""
        raise ConfigError(f"{name}: its model has {count:,} parameters ({size / gib:.1f} GiB){buffers}, "
                          f"{need / gib:.1f} GiB with the gradients"
                          f"{f' in {copies} workers' if copies > 1 else ''}, more than this "
                          f"machine's {have / gib:.1f} GiB of memory: choose smaller model sizes (nothing was created)")


def _fits(name: str, cfg: Any, train: Any, model: Any) -> bool:
    """``fits_the_loader`` for the run ``cfg`` launches; False where it has nothing to check."""
    launch = getattr(cfg, "launch", None)
    if not (len(train) and hasattr(launch, "workers") and hasattr(cfg, "loader") and hasattr(cfg, "train")):
        return False
    fits_the_loader(name, cfg, train, model, max(1, launch.workers), not getattr(launch, "gpus_per_worker", 0), before=True)
    return True


def dataset_of(wl: registry.Workload, cfg: Any) -> Optional[dict]:
    """What ``Workload.dataset`` says of the run's data (None where it has no hook or says nothing), checked
    before the run exists: an error it raises, or a record MLflow cannot take, is one line naming the hook."""
    if wl.dataset is None:
        return None
    try:
        info = wl.dataset(cfg)
    except ConfigError:
        raise
    except Exception as e:
        raise WorkloadCodeError(_raised(wl.name, "Workload.dataset", e)) from None
    if not info:
        return None
    shape = ('{"name": str, "source": a path or URI, "profile": {...} (optional), "digest": str (optional), '
             '"context": str (optional)}')
    if not isinstance(info, Mapping) or not {"name", "source"} <= set(info) or set(info) - {
            "name", "source", "profile", "digest", "context"}:
        got = sorted(info) if isinstance(info, Mapping) else type(info).__name__
        raise WorkloadCodeError(f"{wl.name}: its Workload.dataset returned {got}, not {shape} (nothing was created)")
    if info.get("profile") is not None and not isinstance(info["profile"], Mapping):
        raise WorkloadCodeError(f"{wl.name}: its Workload.dataset's profile is a {type(info['profile']).__name__}, "
                                "not a mapping of names to values (nothing was created)")
    return {k: (str(v) if k in ("name", "source", "digest", "context") and v is not None else v)
            for k, v in info.items()}


def code_works(wl: registry.Workload, say: bool = True) -> Callable[[Any], None]:
    """``open_run``'s check of a TorchTask workload: its model builds (``built``; ``say``: its errors are the
    command's, before the run exists; a sweep's trial or a fold leaves them to its run, which records them
    as a failed child run beside the others) and, for a task with its own
    optimizer hooks, the mistakes ``optim.task_optimizer`` and ``task_scheduler`` refuse (a parameter left
    out, a plateau's mode) are found on that meta model, before the run exists, not in its workers after.
    The hooks' own errors are left to the workers, which meet them again with their tracebacks."""
    from raysys.train.optim import hooks_used

    task = wl.task

    def check(cfg: Any) -> None:
        from raysys.train.optim import task_optimizer, task_scheduler

        if not say and not hooks_used(task):
            return
        ran: list[bool] = []

        def hooks(model: Any) -> None:
            try:
                opt = task_optimizer(task, cfg, model, wl.name)
                task_scheduler(task, cfg, opt, 1000, wl.name, wl.quality_metric, wl.quality_mode)
                ran.append(True)
            except ConfigError:
                raise
            except Exception:  # a hook of its own failing on meta tensors: the workers find out, with its traceback
                ran.append(False)

        # the hooks before the loss is checked, as in the loop: a parameter they freeze is one it need not reach
        model = built(task, wl.name, cfg, say, before_loss=hooks if hooks_used(task) else None)
        if model is None or not hooks_used(task):
            return
        if not ran:
            hooks(model)
        if ran[0]:
            say_unread_optim(task, cfg, model, wl.name)

    return check


def say_unread_optim(task: Any, cfg: Any, model: Any, name: str, knobs: Optional[set] = None,
                     prefix: str = "[raysys]") -> None:
    """One note naming the ``optim`` values a task's own optimizer or scheduler never reads: a ``--set``, a
    preset's value (those that differ from the section's defaults) or, with ``knobs``, a sweep's knob that
    changes nothing."""
    from raysys.train.optim import unread_optim

    unread = unread_optim(task, cfg, model, name)
    default = type(cfg.optim)()
    given = [f for f in unread if (f"optim.{f}" in knobs if knobs is not None else getattr(cfg.optim, f) != getattr(default, f))]
    if not given:
        return
    hooks = " and ".join(f"Task.{h}" for h in ("optimizer", "scheduler") if getattr(task, h, None) is not None)
    if knobs is not None:
        print(f"{prefix} note: the space searches {', '.join(f'optim.{f}' for f in given)}, which {name}'s {hooks} "
              "never reads: trials that differ only there train alike", flush=True)
    else:
        print(f"{prefix} note: {', '.join(f'optim.{f}={getattr(cfg.optim, f)!r}' for f in given)} "
              f"change{'s' if len(given) == 1 else ''} nothing: "
              f"{name}'s {hooks} never reads {'it' if len(given) == 1 else 'them'} (the run's MLflow params still "
              "show the value)", flush=True)
