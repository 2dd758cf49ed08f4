"""k-fold cross-validation: one run per fold, children of one MLflow parent run, and the mean.

A workload opts in with ``extra={"folds": ("data.n_folds", "data.fold")}``: the config key that
holds k and the one that selects the held-out fold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from raysys import lifecycle, tracking
from raysys import workload as registry
from raysys.config import ConfigError, apply_overrides, flatten, to_dict
from raysys.train.code_checks import plugin_tag
from raysys.train.launcher import RunResult, run_training


def run_cross_validation(wl, cfg: Any, tags: Optional[dict] = None) -> RunResult:
    if "folds" not in wl.extra:
        raise ConfigError(f"{wl.name} has no k-fold split; --cv is not available for it (a workload opts in with "
                          "Workload(extra={'folds': (<key of k>, <key of the held-out fold>)}), docs/your-workload.md)")
    k_key, fold_key = wl.extra["folds"]
    k = flatten(to_dict(cfg))[k_key]
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:  # one fold has no spread: no cross-validation
        raise ConfigError(f"--cv needs {k_key} >= 2 folds, got {k!r} (--set {k_key}=5, say)")
    uri = tracking.resolve_tracking_uri(cfg.launch.tracking_uri)
    if not cfg.launch.resume:  # bad input is one line before anything exists: the store, then the data
        from raysys.train.launcher import _prepare, prepare_of

        tracking.check_store(uri)
        tracking.check_experiment(uri, cfg.launch.experiment or f"raysys-{wl.name}")
        _prepare(prepare_of(wl), cfg)  # (each fold's run prepares it again: made once, then checked)
    claimed = not cfg.launch.resume and not cfg.launch.name
    base = _resumed(wl, cfg.launch) if cfg.launch.resume else cfg.launch.name or _claim_base(wl, cfg.launch)
    try:
        return _run(wl, cfg, tags, uri, base, k, fold_key)
    except BaseException:
        if claimed:  # stopped before its first fold's run existed: the folder claimed for it goes too
            _unclaim(wl, cfg.launch, base)
        raise


def _run(wl, cfg: Any, tags: Optional[dict], uri: str, base: str, k: int, fold_key: str) -> RunResult:
    _check_folds_free(wl, cfg.launch, base, k)
    experiment = cfg.launch.experiment or f"raysys-{wl.name}"
    parent = tracking.start_run(uri, experiment, base, tags={"raysys.workload": wl.name, "raysys.kind": "cross_validation",
                                                            **plugin_tag(wl), **(tags or {})},
                                resume=cfg.launch.resume)
    from raysys import watcher as watching

    watcher = watching.watch(uri, parent, resume=_resume_line(wl, cfg, tags, base))
    try:
        return _folds(wl, cfg, tags, base, uri, parent, k, fold_key)
    finally:
        if watcher is not None:
            watcher.done()


def _resume_line(wl, cfg: Any, tags: Optional[dict], base: str) -> str:
    command = (tags or {}).get("raysys.command") or f"python -m raysys train {registry.ref(wl)} --cv"
    command += f" --name {base}" * (cfg.launch.name is None) + " --resume" * (not cfg.launch.resume)
    return f"cd {shlex.quote(os.getcwd())} && {command}"


def _folds(wl, cfg: Any, tags: Optional[dict], base: str, uri: str, parent: str, k: int, fold_key: str) -> RunResult:
    logger = tracking.MLflowLogger(uri, parent)
    # the parent stands for every fold: the held-out one is each child's param, k is the parent's
    logger.log_params({key: v for key, v in flatten(to_dict(cfg)).items() if not key.startswith("launch.") and key != fold_key}
                      | {"cv.folds": k})
    if not cfg.launch.resume and "raysys.command" in (tags or {}):  # the Description a run's parent has, as a run's
        from raysys.train.launcher import _run_again

        logger.set_note(f"{wl.name}, {k}-fold cross-validation, preset `{tags.get('raysys.preset', 'default')}`: one "
                        f"child run per fold, their mean and spread here.\n\nRun again: "
                        f"`{_run_again(tags['raysys.command'])}`\n\nResume if interrupted: "
                        f"`{_resume_line(wl, cfg, tags, base)}`\n")
    results = []
    try:
        for fold in range(k):
            name = f"{base}-fold{fold}"
            # a resume continues the folds that exist (a finished one trains nothing) and starts the others
            again = cfg.launch.resume and _exists(wl, dataclasses.replace(cfg.launch, name=name, resume=True))
            fold_cfg = apply_overrides(cfg, {fold_key: fold, "launch.name": name, "launch.resume": again})
            # a fold this resume starts was never resumed: the changes said of a resume are not its own
            fold_tags = {k: v for k, v in (tags or {}).items() if again or k != "raysys.resume_changes"}
            result = run_training(registry.ref(wl), fold_cfg, parent_run_id=parent,
                                  tags={**fold_tags, "raysys.kind": "cv_fold", "raysys.cv_fold": str(fold)})
            results.append(result)
            stopped_by = result.stopped_by if result.stopped_by is not None else lifecycle.late_stop()
            if stopped_by is not None:  # Ctrl-C/SIGTERM: no later fold starts, and no mean of a part
                tracking.end_run(uri, parent, "KILLED")
                return RunResult(base, result.run_dir.parent, parent, uri, {}, stopped_by=stopped_by,
                                 resume_command=_resume_line(wl, cfg, tags, base), where=_folds_at(result))
    except BaseException as e:
        tracking.end_run(uri, parent, "FAILED")
        fold_line, cv_line = getattr(e, "raysys_resume", None), _resume_line(wl, cfg, tags, base)
        if fold_line:  # resuming the failed fold alone would end with no mean and the later folds untrained
            with contextlib.suppress(AttributeError):
                e.raysys_resume = cv_line
                e.raysys_failure = getattr(e, "raysys_failure", "").replace(fold_line, cv_line)
        raise
    names = sorted({m for r in results for m in r.metrics if m.startswith("eval/")})
    vals = {m.split("/", 1)[1]: [r.metrics[m] for r in results if m in r.metrics] for m in names}
    # a metric some folds do not report (an AUC of a fold with one class): its mean is of the others, said so
    part = {n: len(v) for n, v in vals.items() if len(v) < k}
    mean = {f"cv_mean/{n}": statistics.fmean(v) for n, v in vals.items()}
    # the folds' spread (sample standard deviation) says whether two configurations' means differ at all
    std = {f"cv_std/{n}": statistics.stdev(v) if len(v) > 1 else 0.0 for n, v in vals.items()}
    rows = ["| fold | " + " | ".join(vals) + " |", "|---" * (len(names) + 1) + "|"]
    rows += [f"| {i} | " + " | ".join(f"{r.metrics.get(n, float('nan')):.4f}" for n in names) + " |" for i, r in enumerate(results)]
    rows.append("| **mean** | " + " | ".join(f"{mean['cv_mean/' + n]:.4f}" for n in vals) + " |")
    rows.append("| **std** | " + " | ".join(f"{std['cv_std/' + n]:.4f}" for n in vals) + " |")
    table = "\n".join(rows) + "\n"
    # at the folds' steps trained in all: a cv trained further (--resume with a longer run) gets a new point,
    # where one at step 0 again would be dropped as a repeat and the parent keep the earlier mean
    logger.log_metrics(mean | std | {f"cv_n/{n}": c for n, c in part.items()},
                       step=int(sum(r.metrics.get("step", 0) or 0 for r in results)))
    logger.log_text(table, "cross_validation.md")
    logger.delete_tag("raysys.error")  # a killed session's (raysys.watcher): every fold is done now
    tracking.end_run(uri, parent, "FINISHED")
    print(f"[raysys] {k}-fold cross-validation of {wl.name}:\n{table}", flush=True)
    for n, c in part.items():
        print(f"[raysys] eval/{n} was reported by {c} of the {k} folds: its mean and std are of those {c} "
              f"(MLflow: cv_n/{n})", flush=True)
    # the summary's metrics are the folds' means, under the names one run reports
    speed = [r.metrics[wl.throughput_metric] for r in results if wl.throughput_metric in r.metrics]
    return RunResult(base, results[-1].run_dir.parent, parent, uri, where=_folds_at(results[-1]), metrics=
                     {**mean, **{n: mean[f"cv_mean/{n.split('/', 1)[1]}"] for n in names},
                      **({wl.throughput_metric: statistics.fmean(speed)} if speed else {})})


def _folds_at(fold: Any) -> str:
    """Where the folds' runs are, as users know it (on remote storage its URI, not a working copy's): their
    folder and the folds' names, ``<runs>/<name>-fold*`` (no folder of that name exists)."""
    from raysys import storage

    return storage.where(fold.run_dir).rsplit("-fold", 1)[0] + "-fold*"


def _resumed(wl, launch: Any) -> str:
    """The cross-validation a --resume continues: --name's, or the newest of this workload; one that does not
    exist is refused (it would otherwise start afresh, silently)."""
    from raysys import storage
    from raysys.train.launcher import storage_root

    if launch.name:
        if not _exists(wl, dataclasses.replace(launch, name=f"{launch.name}-fold0", resume=True)):
            raise ConfigError(f"--cv --resume: no cross-validation called '{launch.name}' (its first fold's run, "
                              f"{launch.name}-fold0, does not exist)")
        return launch.name
    remote = storage.Remote(launch.storage_path) if storage.is_remote(launch.storage_path) else None
    root = storage_root(launch.storage_path) if remote is None else None
    names = remote.listdir() if remote else [p.name for p in root.glob("*") if p.is_dir()]
    firsts = sorted(n for n in names if n.startswith(f"{wl.name}-cv-") and n.endswith("-fold0"))  # named by time
    if not firsts:
        raise ConfigError(f"--cv --resume: no earlier cross-validation of {wl.name} under {launch.storage_path}; "
                          "name one with --name")

    def read(name: str, file: str) -> Optional[str]:
        if remote is None:
            path = root / name / file
            return path.read_text() if path.is_file() else None
        if remote.kind(name, file) != "file":
            return None
        with tempfile.TemporaryDirectory() as tmp:
            remote.get(Path(tmp) / file, name, file)
            return (Path(tmp) / file).read_text()

    def ended(base: str) -> bool:  # every fold it has recorded its end, and it has all k of them
        folds = [n for n in names if n.startswith(f"{base}-fold") and n[len(base) + 5:].isdigit()]
        try:
            k = flatten(yaml.safe_load(read(f"{base}-fold0", "config.yaml") or "{}") or {}).get(wl.extra["folds"][0])
        except (OSError, ValueError, yaml.YAMLError):
            k = None
        return (not isinstance(k, int) or len(folds) >= k) and all(read(f, "final_metrics.json") for f in folds)

    # the newest that has not ended, as a bare --resume of one run takes (else the newest: it trains nothing);
    # a first fold's folder without its config holds no run (a cross-validation stopped as it began)
    bases = [n[: -len("-fold0")] for n in reversed(firsts) if read(n, "config.yaml") is not None]
    if not bases:
        raise ConfigError(f"--cv --resume: no earlier cross-validation of {wl.name} under {launch.storage_path} "
                          "trained a fold; name one with --name")
    return next((b for b in bases if not ended(b)), bases[0])


def _claim_base(wl, launch: Any) -> str:
    """A default name, <workload>-cv-<time>, whose first fold's folder this process makes and locks now (its
    run takes it over), the next free one if taken (``lifecycle.claim_first``)."""
    from raysys.train.launcher import _hold, resolve_run_dir

    def claim(candidate: str) -> str:
        name, run_dir = resolve_run_dir(wl.name, dataclasses.replace(launch, name=f"{candidate}-fold0"))
        _hold(run_dir, name, launch, create=True)
        return candidate

    return lifecycle.claim_first(f"{wl.name}-cv-{time.strftime('%Y%m%d-%H%M%S')}", False, claim)


def _unclaim(wl, launch: Any, base: str) -> None:
    """Remove the first fold's folder ``_claim_base`` made, where no run was made in it (only its lock)."""
    from raysys import storage
    from raysys.train.launcher import storage_root

    if storage.is_remote(launch.storage_path):
        return
    folder = storage_root(launch.storage_path) / f"{base}-fold0"
    if folder.is_dir() and all(p.name == lifecycle.LOCK_FILE for p in folder.iterdir()):
        lifecycle.RunLock.release_dir(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _check_folds_free(wl, launch: Any, base: str, k: int) -> None:
    """Before the parent run is opened (or reopened FAILED by a refusal): a new cross-validation's name is
    free, and no fold of one resumed is being trained by another process now."""
    from raysys import storage

    if not launch.resume:
        if launch.name and _exists(wl, dataclasses.replace(launch, name=f"{base}-fold0", resume=True)):
            raise ConfigError(f"a cross-validation called '{base}' already exists (its first fold's run, {base}-fold0); "
                              "pass --resume to continue it, or choose another --name (nothing was changed)")
        return
    if storage.is_remote(launch.storage_path):  # a remote fold's holder is refused by its lease, at the fold
        return
    from raysys.train.launcher import storage_root

    for fold in range(k):
        folder = storage_root(launch.storage_path) / f"{base}-fold{fold}"
        if lifecycle.RunLock.in_use(folder):
            raise ConfigError(f"cross-validation '{base}' is being trained by another process now (its fold "
                              f"{base}-fold{fold} is in use); wait for it to finish (nothing was changed)")


def _exists(wl, launch: Any) -> bool:
    from raysys.train.launcher import resolve_run_dir

    try:
        resolve_run_dir(wl.name, launch)
        return True
    except ConfigError:  # no such run (yet)
        return False
