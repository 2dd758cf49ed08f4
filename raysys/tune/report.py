"""The sweep's result: Pareto table, plot, recommendation with runnable commands, MLflow records."""

from __future__ import annotations

import csv
import math
import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

from raysys.tune import objectives as obj
from raysys.tune.pareto import OK, UNSTABLE, TrialRecord, pareto_front, recommend
from raysys.tune.progress import short_names

JOB_ADDRESS = "http://127.0.0.1:8265"


def _fmt(v: Optional[float], digits: int = 4) -> str:
    return "-" if v is None else (f"{v:.{digits}g}" if isinstance(v, float) else str(v))


def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def table(records: Sequence[TrialRecord], throughput_metric: str, quality_metric: str,
          front_ids: set[str], recommended: Optional[str]) -> str:
    """Markdown table (readable in a terminal too); front rows first, fastest first."""
    keys = sorted({k for r in records for k in r.knobs})
    names = short_names(keys)
    head = ["", "trial", "status", throughput_metric, quality_metric, "s", *(names[k] for k in keys)]
    order = sorted(records, key=lambda r: (r.trial_id not in front_ids, r.status != OK,
                                           -(r.throughput or 0.0) if r.status == OK else 0.0, r.trial_id))
    rows = []
    for r in order:
        mark = ("*" if r.trial_id in front_ids else "") + (">" if r.trial_id == recommended else "")
        status = r.status if r.status == OK else f"{r.status}: {r.reason}"
        rows.append([mark, r.trial_id, status, _fmt(r.throughput), _fmt(r.quality), _fmt(r.seconds, 3),
                     *(_cell(r.knobs.get(k, "")) for k in keys)])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n\n`*` Pareto front, `>` recommended\n"


def _arg(key: str, value: Any) -> str:
    if isinstance(value, bool):
        value = str(value).lower()
    elif value is None:
        value = "none"
    return shlex.quote(f"{key}={value}")


def commands(workload: str, preset: str, fixed: dict[str, Any], knobs: dict[str, Any]) -> tuple[str, str]:
    """The exact `raysys train` command of a trial's config, locally and as a Ray job."""
    sets = " ".join(f"--set {_arg(k, v)}" for k, v in {**fixed, **knobs}.items())
    train = f"python -m raysys train {workload} --preset {shlex.quote(preset)} {sets}".rstrip()
    return train, f"ray job submit --address {JOB_ADDRESS} --working-dir . -- {train}"


def recommendation_text(rec: Optional[TrialRecord], records: Sequence[TrialRecord], tolerance: float,
                        sp, throughput_metric: str, quality_metric: str) -> str:
    eligible = [r for r in records if r.eligible]
    if rec is None:
        return "No recommendation: no trial finished stable with a finite quality.\n"
    best = max(r.quality for r in eligible)
    train, job = commands(sp.workload, sp.preset, sp.fixed, rec.knobs)
    return (f"Recommended: trial {rec.trial_id}, the fastest within {tolerance:g} of the best {quality_metric} "
            f"({best:.4g}): {throughput_metric} {rec.throughput:.4g}, {quality_metric} {rec.quality:.4g}.\n\n"
            f"Train it:\n\n    {train}\n\nOn a Ray cluster (with token auth on a local cluster, prefix "
            f"RAY_AUTH_MODE=token):\n\n    {job}\n\n"
            "(The sweep's fixed overrides are included, e.g. fewer epochs: raise them for a full run.)\n")


def plot(records: Sequence[TrialRecord], front: Sequence[TrialRecord], rec: Optional[TrialRecord], path: Path,
         throughput_metric: str, quality_metric: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    stable = [r for r in records if r.eligible]
    shaky = [r for r in records if r.status == UNSTABLE and r.throughput is not None]
    ax.scatter([r.throughput for r in stable], [r.quality for r in stable], c="#9aa5b1", s=28, label="trials")
    if front:
        ax.plot([r.throughput for r in front], [r.quality for r in front], "-o", c="#1f77b4", ms=7,
                drawstyle="steps-post", label="Pareto front")
        for r in front:
            ax.annotate(r.trial_id.split("_")[-1], (r.throughput, r.quality), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    if shaky:
        qs = [r.quality for r in stable] or [0.0]
        floor = min(qs) - 0.05 * (max(qs) - min(qs) or 1.0)
        ys = [r.quality if r.quality is not None and math.isfinite(r.quality) else floor for r in shaky]
        ax.scatter([r.throughput for r in shaky], ys, marker="x", c="#d62728", s=40, label="unstable")
    if rec is not None:
        ax.scatter([rec.throughput], [rec.quality], s=220, facecolors="none", edgecolors="#2ca02c", linewidths=2,
                   label="recommended")
    ax.set_xlabel(f"{throughput_metric} (higher is faster)")
    ax.set_ylabel(f"{quality_metric} (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_csv(records: Sequence[TrialRecord], path: Path) -> Path:
    keys = sorted({k for r in records for k in r.knobs})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial_id", "status", "reason", "throughput", "quality", "seconds", "run_name", *keys])
        for r in records:
            w.writerow([r.trial_id, r.status, r.reason, r.throughput, r.quality, r.seconds, r.run_name,
                        *(r.knobs.get(k) for k in keys)])
    return path


def summarise(sp, wl, records: list[TrialRecord], tolerance: float, throughput_metric: str, quality_metric: str,
              sweep_dir: Path, parent_log, budget_hit: bool = False) -> Optional[TrialRecord]:
    """Print the front and the recommendation; write them (and the plot) as parent-run artifacts."""
    front = pareto_front(records)
    rec = recommend(records, tolerance)
    counts = {s: sum(r.status == s for r in records) for s in ("ok", "unstable", "error", "incomplete")}
    head = (f"Sweep of {wl.name} ({sp.source}): {len(records)} trials — " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            + (" (time budget reached)" if budget_hit else "") + f"; Pareto front: {len(front)} trial(s)")
    tbl = table(records, throughput_metric, quality_metric, {r.trial_id for r in front}, rec.trial_id if rec else None)
    text = recommendation_text(rec, records, tolerance, sp, throughput_metric, quality_metric)
    print(f"\n{head}\n\n{tbl}\n{text}", flush=True)

    out = sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pareto.md").write_text(f"# {head}\n\n{tbl}")
    (out / "recommendation.md").write_text(text)
    write_csv(records, out / "trials.csv")
    plot(records, front, rec, out / "pareto.png", throughput_metric, quality_metric,
         f"{wl.name} sweep '{sweep_dir.name}': {len(records)} trials, {len(front)} on the front")
    from raysys import storage

    print(f"[raysys.tune] plot and tables: {storage.where(sweep_dir)}/report", flush=True)
    for name in ("pareto.png", "pareto.md", "recommendation.md", "trials.csv"):
        parent_log.log_artifact(out / name)
    metrics = {"sweep/trials": len(records), "sweep/unstable": counts["unstable"], "sweep/errors": counts["error"],
               "sweep/incomplete": counts["incomplete"], "sweep/front_size": len(front)}
    eligible = [r for r in records if r.eligible]
    if eligible:
        metrics["sweep/best_quality"] = max(r.quality for r in eligible)
        metrics["sweep/best_throughput"] = max(r.throughput for r in eligible)
    if rec is not None:
        metrics |= {obj.THROUGHPUT: rec.throughput, obj.QUALITY: rec.quality}
        train, job = commands(sp.workload, sp.preset, sp.fixed, rec.knobs)
        parent_log.set_tags({"raysys.recommended_trial": rec.trial_id, "raysys.recommended_run": rec.run_name,
                             "raysys.recommended_command": train[:5000]})
    parent_log.log_metrics(metrics, step=0)
    return rec


def finalize_children(uri: str, experiment: str, setup, records: Sequence[TrialRecord], grid) -> None:
    """Record each trial's verdict on its MLflow child run (tags, both objectives with history) and
    close runs a stopped trial left RUNNING. Done here, on the driver, because a trial the stopper
    ended had no chance to do it."""
    from mlflow.tracking import MlflowClient

    from raysys import tracking

    client = MlflowClient(tracking_uri=uri)
    histories = {}
    for result in grid:
        df = result.metrics_dataframe
        tid = (result.metrics or {}).get("trial_id") or Path(result.path).name
        histories[tid] = df
    for r in records:
        run_id = tracking.find_run(uri, experiment, r.run_name)
        if run_id is None:  # failed before its run opened
            continue
        tags = {"raysys.trial_status": r.status, "raysys.knobs": " ".join(f"{k}={v}" for k, v in sorted(r.knobs.items()))}
        if r.reason:
            tags["raysys.trial_reason"] = r.reason[:5000]
        if r.status == UNSTABLE:
            tags["raysys.unstable"] = "true"
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
        client.log_batch(run_id, metrics=_objective_history(histories.get(r.trial_id)))
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status="KILLED")


def _objective_history(df) -> list:
    """objective/* at every report (step = the run's optimizer step where it has one)."""
    from mlflow.entities import Metric

    if df is None or len(df) == 0:
        return []
    out = []
    for i, row in enumerate(df.to_dict("records")):
        step = row.get("step")
        step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else int(row.get("training_iteration", i))
        ts = int(1000 * float(row.get("timestamp", 0) or 0))
        for key in (obj.THROUGHPUT, obj.QUALITY, obj.MEASURED_THROUGHPUT, obj.MEASURED_QUALITY):
            v = row.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                out.append(Metric(key, float(v), ts, step))
    return out[:1000]
