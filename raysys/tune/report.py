"""The sweep's result: Pareto table, plot, recommendation with runnable commands, MLflow records."""

from __future__ import annotations

import csv
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from raysys.tune import objectives as obj
from raysys.tune.pareto import ERROR, INCOMPLETE, OK, UNSTABLE, TrialRecord, best_of, pareto_front, recommend

JOB_ADDRESS = "http://127.0.0.1:8265"
RUNTIME_ENV = "cluster/runtime_env.yaml"


def fmt_value(v: Optional[float], digits: int = 4) -> str:
    """A number for tables and the plot: 4 significant digits, large ones whole with separators.

    Beyond 10**12 (a blown-up loss, never a real rate) separators stop helping: 1.206e+20 reads at once.
    """
    if isinstance(v, float) and math.isfinite(v) and 10 ** digits <= abs(v) < 1e12:
        return f"{v:,.0f}"  # 18,572 rather than 1.857e+04
    return "-" if v is None else (f"{v:.{digits}g}" if isinstance(v, float) else str(v))


def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def sig(v: float, digits: int = 4) -> float:
    """Rounded for display (MLflow's table shows every digit it is given)."""
    return float(f"{v:.{digits}g}") if math.isfinite(v) else v


@dataclass(frozen=True)
class Verdict:
    """Which trials are on the Pareto front and which one is recommended."""

    front: tuple[str, ...]
    recommended: Optional[str]

    @classmethod
    def of(cls, records: Sequence[TrialRecord], tolerance: float) -> "Verdict":
        rec = recommend(records, tolerance)
        return cls(tuple(r.trial_id for r in pareto_front(records)), rec.trial_id if rec else None)


def ordered(records: Sequence[TrialRecord], front_ids: set[str]) -> list[TrialRecord]:
    """The one order of every table, CSV and plot legend: the front (fastest first), then the other
    finished trials (fastest first), then the rest by id."""
    return sorted(records, key=lambda r: (r.trial_id not in front_ids, r.status != OK,
                                          -(r.throughput or 0.0) if r.status == OK else 0.0, r.trial_id))


def table(records: Sequence[TrialRecord], throughput_metric: str, quality_metric: str,
          front_ids: set[str], recommended: Optional[str]) -> str:
    """Markdown table (readable in a terminal too), numbered as in the plot; knobs by their full key."""
    keys = sorted({k for r in records for k in r.knobs})
    head = ["#", "trial", "front", "recommended", "status", throughput_metric, quality_metric, "seconds", *keys]
    rows = []
    for i, r in enumerate(ordered(records, front_ids), 1):
        status = r.status if r.status == OK else f"{r.status}: {r.reason}"
        rows.append([i, r.trial_id, "yes" if r.trial_id in front_ids else "", "**yes**" if r.trial_id == recommended else "",
                     status, fmt_value(r.throughput), fmt_value(r.quality), fmt_value(r.seconds, 3), *(_cell(r.knobs.get(k, "")) for k in keys)])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _arg(key: str, value: Any) -> str:
    if isinstance(value, bool):
        value = str(value).lower()
    elif value is None:
        value = "none"
    return shlex.quote(f"{key}={value}")


def job_address(address: Optional[str], dashboard: Optional[str] = None) -> str:
    """The dashboard `ray job submit` talks to, for the cluster a sweep ran on: the one Ray said it joined
    (``dashboard``: its host and port, as seen from where the sweep ran; a head that binds it to 127.0.0.1,
    cluster/README.md's posture, is reached there through a tunnel), else ``--address`` or $RAY_ADDRESS's
    head with Ray's default dashboard port; a local sweep: a cluster started here."""
    addr = (address or os.environ.get("RAY_ADDRESS", "")).strip()
    if addr.startswith(("http://", "https://")):
        return addr.rstrip("/")
    if dashboard:
        return dashboard.rstrip("/") if "://" in dashboard else f"http://{dashboard.rstrip('/')}"
    host = addr.split("://", 1)[-1].rsplit(":", 1)[0] if addr not in ("", "auto", "local") else ""
    return f"http://{host or '127.0.0.1'}:8265"


def commands(workload: str, preset: str, fixed: dict[str, Any], knobs: dict[str, Any],
             flags: Sequence[str] = (), address: str = JOB_ADDRESS) -> tuple[str, str]:
    """The exact `raysys train` command of a trial's config, locally and as a Ray job; ``flags`` are the
    launch options that keep the run where the sweep's runs were (its storage and tracking store)."""
    sets = " ".join(f"--set {_arg(k, v)}" for k, v in {**fixed, **knobs}.items())
    where = " ".join(shlex.quote(str(f)) for f in flags)

    def line(wl: str) -> str:
        return " ".join(filter(None, [f"python -m raysys train {wl} --preset {shlex.quote(preset)}", where, sets]))

    # a job runs in Ray's copy of --working-dir: a workload file of this folder is named from it, and one
    # outside it ships its own folder (the head node has no copy of this machine's absolute path)
    file, _, attr = workload.rpartition(":")
    in_job, ship = workload, "."
    if file.endswith(".py") and os.path.isabs(file):
        if Path(file).resolve().is_relative_to(Path.cwd().resolve()):
            in_job = f"{os.path.relpath(Path(file).resolve(), Path.cwd().resolve())}:{attr}"
        else:
            in_job, ship = f"{Path(file).name}:{attr}", shlex.quote(str(Path(file).parent))
    # `--working-dir .` is the folder the line is pasted in: the line goes there first, as the local one does
    cd = f"cd {shlex.quote(os.getcwd())} && " if ship == "." else ""
    # the repo's runtime_env (what a job uploads, and the stop wait that lets `ray job stop` checkpoint)
    env = " --runtime-env cluster/runtime_env.yaml" if ship == "." and Path(RUNTIME_ENV).is_file() else ""
    return (line(shlex.quote(workload)),
            f"{cd}ray job submit --address {address} --working-dir {ship}{env} -- {line(shlex.quote(in_job))}")


def recommendation_text(rec: Optional[TrialRecord], records: Sequence[TrialRecord], tolerance: float,
                        sp, throughput_metric: str, quality_metric: str, launch: tuple = ((), JOB_ADDRESS)) -> str:
    eligible = [r for r in records if r.eligible]
    if rec is None:
        return "No recommendation: no trial finished stable with a finite quality.\n"
    best = best_of(eligible).quality
    lower = "" if rec.higher_is_better else ", lower is better"
    train, job = commands(sp.workload, sp.preset, sp.fixed, rec.knobs, *launch)
    return (f"Recommended: trial {rec.trial_id}, the fastest within {tolerance:g} of the best {quality_metric} "
            f"({fmt_value(best)}{lower}): {throughput_metric} {fmt_value(rec.throughput)}, {quality_metric} "
            f"{fmt_value(rec.quality)}.\n\n"
            f"Train it (from any folder):\n\n    cd {shlex.quote(os.getcwd())} && {train}\n\nOn a Ray cluster (with token auth on a local cluster, prefix "
            f"RAY_AUTH_MODE=token):\n\n    {job}\n\n{_install_hint(sp.workload)}"
            "(The sweep's fixed overrides are included, e.g. fewer epochs: raise them for a full run.)\n")


def _install_hint(workload: str) -> str:
    """For an installed plug-in: the cluster's nodes need its package too (the job ships files, not packages)."""
    from raysys import workload as registry

    package = registry.installed_package(workload)
    if package is None:
        return ""
    name, version = package
    return (f"({workload} is the installed package {name} {version}'s: install it on every node of the cluster, e.g. "
            f"add --runtime-env-json '{{\"pip\": [\"{name}=={version}\"]}}' where an index serves it.)\n\n")


def write_csv(records: Sequence[TrialRecord], path: Path, front_ids: set[str] = frozenset(),
              recommended: Optional[str] = None) -> Path:
    """Every trial, in the table's order, with its front and recommendation marks."""
    keys = sorted({k for r in records for k in r.knobs})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "trial_id", "on_front", "recommended", "status", "reason", "throughput",
                    "measured_throughput", "quality", "seconds", "run_name", *keys])
        for i, r in enumerate(ordered(records, front_ids), 1):
            w.writerow([i, r.trial_id, r.trial_id in front_ids, r.trial_id == recommended, r.status, r.reason,
                        r.throughput, r.extra.get("measured_throughput", r.throughput), r.quality, r.seconds,
                        r.run_name, *(r.knobs.get(k) for k in keys)])
    return path


def pbt_text(records: Sequence[TrialRecord]) -> str:
    """A PBT sweep's members: the knobs each was proposed with and ended with, and how often it took
    another member's weights (each round: its MLflow run's tag raysys.pbt); '' for any other sweep."""
    members = [r for r in records if "pbt_start" in r.extra]
    if not members:
        return ""
    rows = ["| trial | status | exploits | proposed | at its end |", "|---|---|---|---|---|"]
    for r in members:
        start, end = r.extra["pbt_start"], r.knobs
        moved = [k for k in end if start.get(k) != end[k]]
        rows.append(f"| {r.trial_id} | {r.status} | {r.extra.get('pbt_exploits', 0)} | "
                    + (", ".join(f"{k}={_cell(start.get(k))}" for k in moved) + " | "
                       + ", ".join(f"{k}={_cell(end[k])}" for k in moved) if moved else "| (unchanged)") + " |")
    return ("**Population-based training** (--scheduler pbt): the knobs that changed in each member; the rounds, "
            "with whose weights each took, are on its MLflow run (tag `raysys.pbt`), the schedule as metrics "
            "`pbt/<knob>`.\n\n" + "\n".join(rows) + "\n")


def runs_storage(sweep_dir: Path) -> str:
    """The --storage-path of a sweep's trial runs: on remote storage the whole URI, its options (an endpoint)
    kept, which ``storage.where`` leaves out as a display. The sweep's trials and its report both use it."""
    from raysys import storage

    owner = storage.remote_of(Path(sweep_dir))
    return storage.join(owner[0].uri, owner[1], "runs") if owner else str(Path(sweep_dir) / "runs")


def summarise(sp, wl, records: list[TrialRecord], tolerance: float, throughput_metric: str, quality_metric: str,
              sweep_dir: Path, parent_log, budget_hit: bool = False,
              launch: tuple = ((), JOB_ADDRESS), unstarted: int = 0) -> Optional[TrialRecord]:
    """Print the front and the recommendation; write them (and the plot) as parent-run artifacts, and the
    recommendation as the parent run's description. ``unstarted``: trials of ``--num-samples`` a budget left
    unstarted."""
    from raysys import storage
    from raysys.tune.plot import plot

    front = pareto_front(records)
    rec = recommend(records, tolerance)
    front_ids, rec_id = {r.trial_id for r in front}, rec.trial_id if rec else None
    counts = {s: sum(r.status == s for r in records) for s in ("ok", "unstable", "error", "incomplete")}
    head = (f"Sweep of {wl.name} ({sp.source}): {len(records)} trials — " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            + (f", {unstarted} not started" if unstarted > 0 else "")
            + (" (time budget reached)" if budget_hit else "") + f"; Pareto front: {len(front)} trial(s)")
    tbl = table(records, throughput_metric, quality_metric, front_ids, rec_id)
    text = recommendation_text(rec, records, tolerance, sp, throughput_metric, quality_metric, launch)
    if any("measured_throughput" in r.extra for r in records):
        tbl += (f"\n{throughput_metric}: the median of the trials that run the same program (they differ only "
                "in knobs that change no array shape); each trial's own measurement is in trials.csv.\n")
    pbt = pbt_text(records)
    if pbt and rec is not None and rec.extra.get("pbt_exploits"):
        text += (f"\nPBT: trial {rec.trial_id} took other members' weights {rec.extra['pbt_exploits']} time(s), and its "
                 "knobs above are those it ended with (report/pbt.md): the command above trains them from the start, "
                 "not the schedule that made its weights. Those weights are its run's, which a --resume trains "
                 f"further with the knobs it ended with (raise its budget with --set):\n\n    cd {shlex.quote(os.getcwd())} "
                 f"&& python -m raysys train {shlex.quote(sp.workload)} --storage-path {shlex.quote(runs_storage(sweep_dir))} "
                 f"--name {rec.run_name} --resume\n")
    if stuck := [r for r in records if r.extra.get("resumable")]:
        runs = shlex.quote(runs_storage(sweep_dir))
        again = sum(1 for r in records if r.extra.get("rerun_on_resume"))
        resume = (f"{again} of the failed trials lost their Ray process or node (or waited out a tracking outage): a "
                  "--resume of the sweep runs them again from their checkpoints, and with them every failed trial"
                  if again else "a --resume of the sweep keeps them failed")
        text += (f"\n{len(stuck)} failed trial(s) kept checkpoints: their restarts (--max-failures) were used up, "
                 f"and {resume}. Each run goes on alone from its last checkpoint:\n\n"
                 + "".join(f"    cd {shlex.quote(os.getcwd())} && python -m raysys train {shlex.quote(sp.workload)} --storage-path {runs} "
                           f"--name {r.run_name} --resume\n" for r in stuck[:5])
                 + (f"    (and {len(stuck) - 5} more: trials.csv)\n" if len(stuck) > 5 else ""))
    print(f"\n{head}\n\n{tbl}\n{text}", flush=True)

    out = sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pareto.md").write_text(f"**{head}**\n\n{tbl}")
    (out / "recommendation.md").write_text(text)
    write_csv(records, out / "trials.csv", front_ids, rec_id)
    names = ["pareto.png", "pareto.md", "recommendation.md", "trials.csv"]
    if pbt:
        (out / "pbt.md").write_text(pbt)
        names.append("pbt.md")
    plot(ordered(records, front_ids), front_ids, rec_id, out / "pareto.png", throughput_metric, quality_metric,
         f"{wl.name} sweep '{sweep_dir.name}': {len(records)} trials, {len(front)} on the front")
    print(f"[raysys.tune] plot and tables: {storage.where(sweep_dir)}/report", flush=True)
    for name in names:
        parent_log.log_artifact(out / name)
    metrics = {"sweep/trials": len(records), "sweep/unstable": counts["unstable"], "sweep/errors": counts["error"],
               "sweep/incomplete": counts["incomplete"], "sweep/front_size": len(front)}
    eligible = [r for r in records if r.eligible]
    if eligible:
        metrics["sweep/best_quality"] = sig(best_of(eligible).quality)
        metrics["sweep/best_throughput"] = sig(max(r.throughput for r in eligible))
    if rec is not None:
        # Not objective/*: sorted by an objective, the parent would rank as one more trial.
        metrics |= {"sweep/recommended_throughput": sig(rec.throughput), "sweep/recommended_quality": sig(rec.quality)}
        train, job = commands(sp.workload, sp.preset, sp.fixed, rec.knobs, *launch)
        parent_log.set_tags({"raysys.recommended_trial": rec.trial_id, "raysys.recommended_run": rec.run_name,
                             "raysys.recommended_command": train[:5000]})
    parent_log.set_note(f"{head}\n\n{text}\n{tbl}")
    # one step per summary (every one logs sweep/trials): a resumed sweep's new figures are recorded, not
    # dropped as a step already logged
    parent_log.log_metrics(metrics, step=parent_log.next_step("sweep/trials"))
    return rec


def finalize_children(uri: str, experiment: str, setup, records: Sequence[TrialRecord], grid,
                      verdict: Optional[Verdict] = None, objectives_dir: Optional[str] = None) -> None:
    """Record each trial's verdict on its MLflow child run (tags, description, both objectives with
    history) and close runs a stopped trial left RUNNING. Done here, on the driver, because a trial the
    stopper ended had no chance to do it. ``verdict``: the front and the recommendation, once the
    sweep is complete. ``objectives_dir``: where :class:`~raysys.tune.progress.ObjectiveLog` kept every
    report (else Tune's own per-trial history, which a killed driver may have cut short)."""
    from mlflow.tracking import MlflowClient

    from raysys import tracking
    from raysys.tune.population import POPULATION, member_frame, member_ids
    from raysys.tune.progress import objective_history

    client = MlflowClient(tracking_uri=uri)
    histories = {}
    for result in grid:
        tid = (result.metrics or {}).get("trial_id") or Path(result.path).name
        df = objective_history(objectives_dir, tid)
        df = result.metrics_dataframe if df is None else df
        members = (result.config or {}).get(POPULATION)
        if members is None:
            histories[tid] = df
        elif df is not None:
            histories |= {mid: member_frame(df, mid) for mid in member_ids(tid, len(members))}
    for r in records:
        run_id = tracking.find_run(uri, experiment, r.run_name)
        if run_id is None:  # failed before its run opened
            continue
        _send_buffered(uri, run_id, setup, r)  # before the verdict: the run's own records come first
        tags = {"raysys.trial_status": r.status, "raysys.knobs": " ".join(f"{k}={v}" for k, v in sorted(r.knobs.items()))}
        if r.extra.get("pbt_start") not in (None, r.knobs):  # PBT changed its knobs: the command trains those it ended with
            tags["raysys.command"] = setup.run_tags(r.trial_id, r.knobs)["raysys.command"]
        if r.reason:
            tags["raysys.trial_reason"] = r.reason[:5000]
        else:  # an earlier, interrupted session of the sweep may have left one
            _delete_tag(client, run_id, "raysys.trial_reason")
        if r.status == UNSTABLE:
            tags["raysys.unstable"] = "true"
        if verdict is not None:
            tags["raysys.on_front"] = str(r.trial_id in verdict.front).lower()
            tags["raysys.recommended"] = str(r.trial_id == verdict.recommended).lower()
        tags[tracking.NOTE_TAG] = trial_note(r, setup, verdict)
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
        log_objective_history(client, run_id, histories.get(r.trial_id),
                              r.throughput if "measured_throughput" in r.extra else None)
        status = client.get_run(run_id).info.status
        if (end := _end_status(r, status)) != status:
            client.set_terminated(run_id, status=end)
    _close_abandoned(client, experiment, setup.parent_run_id, {r.run_name for r in records})


def _close_abandoned(client, experiment: str, parent_run_id: str, known: set) -> None:
    """A trial that started just before the sweep's driver was killed, and that Tune's saved state did not
    hold yet, is never continued: a resumed sweep samples its configuration again, as a new trial. Its
    child run would stay RUNNING under a finished parent: it is closed KILLED, and says why. One the killed
    driver's watcher already closed KILLED says why too: untagged, it looked like a duplicate of the new trial."""
    from raysys.tracking import RUN_NAME_TAG

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return
    for run in client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'"):
        # the trial's run folder name (its MLflow name is the trial id and knobs, for the UI)
        if (run.data.tags.get(RUN_NAME_TAG, run.info.run_name) in known
                or run.info.status not in ("RUNNING", "KILLED")
                or run.data.tags.get("raysys.trial_status") == "abandoned"):
            continue
        client.set_tag(run.info.run_id, "raysys.trial_status", "abandoned")
        client.set_tag(run.info.run_id, "raysys.trial_reason", "the sweep's driver stopped before Ray Tune recorded "
                       "this trial, so the resumed sweep ran a new trial in its place; its run folder is kept")
        if run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, status="KILLED")


def close_running_children(uri: str, parent_run_id: str) -> None:
    """A sweep stopped at once (a signal sent again) took its trials' processes with it, before
    they could close their runs: each still RUNNING is closed KILLED, as its parent is. A resume
    that continues the trial opens its run again."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(parent_run_id)
    for run in client.search_runs([parent.info.experiment_id], filter_string=(
            f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'")):
        client.set_tag(run.info.run_id, "raysys.trial_status", INCOMPLETE)
        client.set_terminated(run.info.run_id, status="KILLED")


def _end_status(r: TrialRecord, status: str) -> str:
    """The MLflow status a trial's run ends with, the same however the trial ran (its own process,
    a Ray Train run, a member of a vectorized program): an error FAILED; a trial that was stopped,
    by an interruption, the budget or the stability rules, KILLED; one found unstable only after
    it ran to its end keeps FINISHED. A run still RUNNING was stopped."""
    if r.status == ERROR:
        return "FAILED"
    if r.status == INCOMPLETE or status == "RUNNING" or (r.status == UNSTABLE and not r.extra.get("ran_to_end")):
        return "KILLED"
    if r.status == UNSTABLE and status == "FAILED":  # it diverged and stopped itself: a stability stop
        return "KILLED"
    return status


def _delete_tag(client, run_id: str, key: str) -> None:
    if key in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, key)


def _send_buffered(uri: str, run_id: str, setup, r: TrialRecord) -> None:
    """What a trial's run buffered while the tracking server was down and could not send before it
    ended (its ``tracking-buffer.jsonl``), sent now in order: the child run is complete without a
    ``--resume`` of that run. A buffer that still fails to send stays for that resume."""
    import tempfile

    from raysys import storage, tracking

    if not setup.run_exists(r.trial_id, tracking.BUFFER_FILE):
        return
    run = setup.run_name(r.trial_id)
    if not storage.is_remote(setup.runs_storage):
        tracking.MLflowLogger.send_buffer(uri, run_id, Path(setup.runs_storage) / run / tracking.BUFFER_FILE)
        return
    remote = storage.Remote(setup.runs_storage)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / tracking.BUFFER_FILE
        local.write_text(setup.read_run_file(r.trial_id, tracking.BUFFER_FILE))
        if tracking.MLflowLogger.send_buffer(uri, run_id, local):
            remote.fs.delete_file(remote.path(run, tracking.BUFFER_FILE))


def trial_note(r: TrialRecord, setup, verdict: Optional[Verdict]) -> str:
    """A trial's description: where it stands, its objectives and its knobs."""
    where = "the sweep did not finish: no front yet" if verdict is None else (
        "**recommended** (on the Pareto front)" if r.trial_id == verdict.recommended
        else "on the Pareto front" if r.trial_id in verdict.front else "not on the Pareto front")
    status = r.status if r.status == OK else f"{r.status} ({r.reason})"
    lines = [f"Trial {r.trial_id} of sweep {setup.sweep_name}: {where}; {status}.", "",
             "| | value |", "|---|---|",
             f"| {setup.throughput_metric} | {fmt_value(r.throughput)} |", f"| {setup.quality_metric} | {fmt_value(r.quality)} |"]
    start = r.extra.get("pbt_start")
    lines += [f"| {k} | {_cell(v)}" + (f" (PBT; proposed {_cell(start[k])})" if start and start.get(k) != v else "") + " |"
              for k, v in sorted(r.knobs.items())]
    if start is not None:
        lines.append(f"| PBT exploits | {r.extra.get('pbt_exploits', 0)} (rounds: tag raysys.pbt) |")
    return "\n".join(lines) + "\n"


def log_objective_history(client, run_id: str, df, throughput: Optional[float] = None) -> None:
    """objective/* of a trial's reports on its run, each (key, step) once: a sweep summarised again
    (after an interruption, on its resume) adds the steps that are new and keeps the ones logged.
    ``throughput``: the one the front judged it by, where not its own last (a program's members share
    one measured speed, population.pool_throughput): its last objective/throughput point."""
    points = _objective_history(df, throughput)
    if not points:
        return
    logged = {(m.key, m.step) for key in {p.key for p in points} for m in client.get_metric_history(run_id, key)}
    points = [p for p in points if (p.key, p.step) not in logged]
    for i in range(0, len(points), 1000):  # MLflow takes at most 1,000 metrics a batch
        client.log_batch(run_id, metrics=points[i:i + 1000])


def _objective_history(df, throughput: Optional[float] = None) -> list:
    """objective/* at every report, one value per step (the last report of a step wins; step = the
    run's optimizer step where it has one), rounded to 4 significant digits for the runs table."""
    from mlflow.entities import Metric

    if df is None or len(df) == 0:
        return []
    by_step: dict[tuple[int, str], Metric] = {}
    rows = df.to_dict("records")
    stepped = lambda row: isinstance(row.get("step"), (int, float)) and math.isfinite(row["step"])  # noqa: E731
    has_steps, step = any(stepped(row) for row in rows), 0
    for i, row in enumerate(rows):
        if not has_steps:
            step = int(row.get("training_iteration", i))
        elif stepped(row):  # a report without a step of its own (the final one) belongs to the step before it
            step = int(row["step"])
        ts = int(1000 * float(row.get("timestamp", 0) or 0))
        for key in (obj.THROUGHPUT, obj.QUALITY, obj.MEASURED_THROUGHPUT, obj.MEASURED_QUALITY):
            v = row.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                by_step[(step, key)] = Metric(key, sig(float(v)), ts, step)
    last = max((k for k in by_step if k[1] == obj.THROUGHPUT), default=None)
    if last is not None and throughput is not None and math.isfinite(throughput):
        m = by_step[last]
        by_step[last] = Metric(m.key, sig(float(throughput)), m.timestamp, m.step)
    return list(by_step.values())


def sweep_view(name: str, knobs: Sequence[str]) -> dict:
    """The runs-table view a sweep's link opens: this sweep's runs (the parent with its trials nested),
    newest first, with the objectives, the front/recommended marks and the knobs as columns, wide enough
    to read. (MLflow applies widths only to the columns it is given an order for.)"""
    from raysys.tracking import column

    metrics = [column("metrics", obj.QUALITY), column("metrics", obj.THROUGHPUT)]
    params = [column("params", k) for k in knobs]
    tags = [column("tags", t) for t in ("raysys.recommended", "raysys.on_front", "raysys.trial_status")]
    fixed = [column("attributes", "Run Name"), "runDateAndNestInfo", "duration"]
    widths = {fixed[0]: 380, fixed[1]: 150, fixed[2]: 80} | {c: 170 for c in metrics} | {c: 150 for c in tags} \
        | {c: 140 for c in params}
    return {"searchFilter": f"tags.`raysys.sweep` = '{name}'" if "'" not in name else "",
            "orderByKey": "attributes.start_time", "orderByAsc": False, "startTime": "ALL",
            "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
            "selectedColumns": [*metrics, *tags, *params], "columnOrder": [*fixed, *metrics, *params, *tags],
            "columnWidths": widths, "runsHiddenMode": "SHOW_ALL", "groupBy": None, "hideEmptyCharts": True}


def save_sweep_view(uri: str, parent_run_id: str, name: str, knobs: Sequence[str]) -> str:
    """Save the sweep's view on its experiment and return the link that opens it."""
    from raysys import tracking

    exp = tracking.experiment_of(uri, parent_run_id)
    key = tracking.view_key(name)
    tracking.save_view(uri, exp, key, f"sweep {name}", sweep_view(name, knobs))
    return tracking.ui_link(uri, exp, view=key)
