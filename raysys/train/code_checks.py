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
from typing import Any, Callable, Optional

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
        saved = state.get("model") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            return
        model = built(wl.task, wl.name, cfg, say=False)
        if model is None:  # not buildable here: the workers build it, and a mismatch fails there in one line
            return
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


def _batches_left(name: str, cfg: Any, train: Any) -> None:
    """A training set that ``loader.drop_last`` leaves without one batch per worker: said as the loop would
    say it, but before the run exists."""
    import math

    loader, tc, launch = (getattr(cfg, k, None) for k in ("loader", "train", "launch"))
    if not getattr(loader, "drop_last", False) or not hasattr(tc, "batch_size") or not len(train):
        return
    per_worker = math.ceil(len(train) / max(1, getattr(launch, "workers", 1)))  # as ShardSampler shards it
    if per_worker < tc.batch_size:
        raise DataError(f"loader.drop_last leaves no batch: {per_worker} training samples per worker, fewer than "
                        f"train.batch_size={tc.batch_size} ({name}; nothing was created)")


def built(task: Any, name: str, cfg: Any, say: bool = True) -> Any:
    """The model a worker will build (Task.datasets, then Task.build_model on torch's meta device: shapes, no
    memory), before the run exists; None where it cannot be built here. An error of the code itself
    (``CODE_ERRORS``) is one line naming the hook, the error and where it was raised (with ``say``), not the
    workers' traceback after the run was made and restarted ``max_failures`` times. A ConfigError is left to
    the workers: it may check this process's devices, and there it fails the run at once with its message."""
    import torch

    for hook in ("datasets", "build_model"):
        try:
            if hook == "datasets":
                out = task.datasets(cfg)
            else:
                with torch.device("meta"):
                    return task.build_model(cfg)
        except ConfigError:  # may be a check of this process's own devices ("needs a GPU"): the workers' to make
            return None
        except CODE_ERRORS as e:
            if not say:
                return None
            frames = traceback.extract_tb(e.__traceback__)  # where in the workload's code, not inside torch
            where = ([f for f in frames if "site-packages" not in f.filename and "/lib/python" not in f.filename]
                     or frames)[-1]
            what = DataError if hook == "datasets" and isinstance(e, ValueError) else WorkloadCodeError
            detail = (str(e).strip().splitlines() or [""])[0][:300]
            raise what(f"{name}: its Task.{hook} raised {type(e).__name__}"
                       + (f": {detail}" if detail else "") + f" ({Path(where.filename).name}:{where.lineno}; "
                       "nothing was created)") from None
        except Exception:  # what may fail here alone: the workers build it, and meet any error there
            return None
        if hook == "datasets" and say:
            _batches_left(name, cfg, map_style(name, out)[0])
    return None


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
        model = built(task, wl.name, cfg, say)
        if model is None or not hooks_used(task):
            return
        try:
            opt = task_optimizer(task, cfg, model, wl.name)
            task_scheduler(task, cfg, opt, 1000, wl.name, wl.quality_metric, wl.quality_mode)
        except ConfigError:
            raise
        except Exception:  # a hook of its own failing on meta tensors: the workers find out, with its traceback
            return
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
