"""The sweep's printed/recorded result: commands, table, plot (no Ray run)."""

import os
import shlex

from raysys.tune.pareto import OK, UNSTABLE, TrialRecord, pareto_front, recommend
from raysys.tune.plot import plot
from raysys.tune.report import commands, fmt_value, ordered, table, write_csv


def test_commands_are_exact_and_quoted(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    train, job = commands("deep_gpcm", "quick", {"train.epochs": 2, "data.path": "my data.parquet"},
                          {"train.compile": False, "optim.lr": 0.00123, "train.max_steps": None})
    assert train == ("python -m raysys train deep_gpcm --preset quick --set train.epochs=2 "
                     "--set 'data.path=my data.parquet' --set train.compile=false --set optim.lr=0.00123 "
                     "--set train.max_steps=none")
    # Ray ships the folder the line is pasted in: the line goes to the sweep's first, as the local one does
    assert job == f"cd {shlex.quote(os.getcwd())} && ray job submit --address http://127.0.0.1:8265 --working-dir . -- {train}"
    assert "data.path=my data.parquet" in shlex.split(train)
    # from the repo's root: its runtime_env too (the upload's excludes; the wait that lets `ray job stop` checkpoint)
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "runtime_env.yaml").write_text("working_dir: .\n")
    _, job = commands("deep_gpcm", "quick", {}, {})
    assert " --working-dir . --runtime-env cluster/runtime_env.yaml -- python -m raysys train deep_gpcm" in job


def test_commands_reproduce_the_trial_config():
    from raysys.cli import build_config, build_parser

    train, _ = commands("deep_gpcm", "quick", {"train.epochs": 2}, {"train.precision": "bf16", "train.batch_size": 8,
                                                                    "optim.lr": 0.0031, "train.compile": True})
    _, cfg = build_config(build_parser().parse_args(shlex.split(train)[3:]))
    assert (cfg.train.epochs, cfg.train.precision, cfg.train.batch_size, cfg.optim.lr, cfg.train.compile) == \
        (2, "bf16", 8, 0.0031, True)


def _records():
    return [TrialRecord("t1", {"train.batch_size": 16, "model.path": "naive"}, OK, 100.0, 0.6, seconds=10.0),
            TrialRecord("t2", {"train.batch_size": 64, "model.path": "optimized"}, OK, 900.0, 0.59),
            TrialRecord("t3", {"train.batch_size": 64, "model.path": "optimized"}, OK, 500.0, 0.3),
            TrialRecord("t4", {"train.batch_size": 32, "model.path": "optimized"}, UNSTABLE, 2000.0, None,
                        reason="non-finite loss (nan)")]


def test_table_csv_and_plot_mark_front_and_recommendation_in_one_order(tmp_path):
    recs = _records()
    front = pareto_front(recs)
    best = recommend(recs, 0.02)
    front_ids = {r.trial_id for r in front}
    text = table(recs, "perf/tokens_per_s", "eval/qwk", front_ids, best.trial_id)
    lines = text.splitlines()
    assert lines[0] == ("| # | trial | front | recommended | status | perf/tokens_per_s | eval/qwk | seconds | "
                        "model.path | train.batch_size |")
    assert lines[2].startswith("| 1 | t2 | yes | **yes** | ok | 900 | 0.59 |")
    assert lines[3].startswith("| 2 | t1 | yes |  | ok | 100 | 0.6 | 10 |")
    assert lines[4].startswith("| 3 | t3 |  |  | ok | 500 | 0.3 |")
    assert "| 4 | t4 |  |  | unstable: non-finite loss (nan) | 2000 | - |" in text
    png = plot(ordered(recs, front_ids), front_ids, best.trial_id, tmp_path / "p.png", "perf/tokens_per_s", "eval/qwk", "t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    csv = write_csv(recs, tmp_path / "t.csv", front_ids, best.trial_id).read_text().splitlines()
    assert csv[0] == ("rank,trial_id,on_front,recommended,status,reason,throughput,measured_throughput,quality,"
                      "seconds,run_name,"
                      "model.path,train.batch_size")
    assert [row.split(",")[1] for row in csv[1:]] == ["t2", "t1", "t3", "t4"]  # the table's order
    assert csv[1].startswith("1,t2,True,True,ok,") and csv[2].startswith("2,t1,True,False,ok,")
    assert csv[4].startswith("4,t4,False,False,unstable,non-finite loss (nan),2000.0,2000.0,,")  # own = pooled


def test_a_diverged_trial_does_not_set_the_plots_scale_and_prints_readably(tmp_path, monkeypatch):
    """A loss of 1.2e20 once scaled the quality axis so that the stable trials shared one pixel row."""
    import matplotlib.pyplot as plt

    recs = [TrialRecord("a", {"optim.lr": 0.002}, OK, 31298.0, 1.376, higher_is_better=False),
            TrialRecord("b", {"optim.lr": 0.0005}, OK, 30000.0, 1.401, higher_is_better=False),
            TrialRecord("c", {"optim.lr": 1e6}, UNSTABLE, 29000.0, 1.206e20, higher_is_better=False,
                        reason="train/loss = 1.206e+20 above its ceiling 20")]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its axes
    front_ids = {r.trial_id for r in pareto_front(recs)}
    plot(ordered(recs, front_ids), front_ids, "a", tmp_path / "p.png", "perf/tokens_per_s", "train/loss", "t")
    low, high = sorted(figures[0].axes[0].get_ylim())
    assert low < 1.376 and 1.401 < high < 2.0, (low, high)  # scaled to the stable trials
    listing = figures[0].axes[1].texts[0].get_text()
    assert "1.206e+20" in listing and "off scale" in listing
    assert sorted(t.get_text() for t in figures[0].axes[0].texts) == ["1", "2", "3 (off scale)"]
    assert fmt_value(1.206e20) == "1.206e+20" and fmt_value(5_540_000.0) == "5,540,000"


def test_a_trials_last_objective_throughput_in_mlflow_is_the_one_the_front_judged(tmp_path):
    """Audit BG F5: trials of one program are ranked by their program's pooled speed, yet MLflow's
    objective/throughput (the sweep view's column) kept each trial's own last measurement."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from raysys.tune import objectives as obj
    from raysys.tune.report import log_objective_history

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("raysys-w")).info.run_id
    df = pd.DataFrame([{"step": s, "training_iteration": i, obj.THROUGHPUT: t, obj.MEASURED_THROUGHPUT: t}
                       for i, (s, t) in enumerate([(5, 2_000_000.0), (10, 2_034_000.0)], 1)])
    log_objective_history(client, run, df, throughput=298_900.0)
    assert [(m.step, m.value) for m in client.get_metric_history(run, obj.THROUGHPUT)] == [(5, 2e6), (10, 298_900.0)]
    assert client.get_run(run).data.metrics[obj.MEASURED_THROUGHPUT] == 2_034_000.0  # its own, kept beside


def test_the_plot_draws_the_attainment_staircase_and_says_where_no_quality_was(tmp_path, monkeypatch):
    """Audit BG F2: the front's staircase had corners at (faster point's speed, slower point's quality), which
    no trial reached; F3: an unstable trial that never reported a quality was drawn at an invented one."""
    import matplotlib.pyplot as plt

    recs = [TrialRecord("a", {}, OK, 100.0, 0.9), TrialRecord("b", {}, OK, 200.0, 0.8),
            TrialRecord("c", {}, OK, 300.0, 0.6), TrialRecord("d", {}, UNSTABLE, 250.0, None, reason="nan loss")]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    front_ids = {r.trial_id for r in pareto_front(recs)}
    plot(ordered(recs, front_ids), front_ids, "a", tmp_path / "p.png", "perf/tokens_per_s", "eval/qwk", "t")
    ax = figures[0].axes[0]
    from matplotlib.cbook import STEP_LOOKUP_MAP

    (line,) = ax.get_lines()
    xs, ys = STEP_LOOKUP_MAP[line.get_drawstyle()](*line.get_data())  # the path as matplotlib draws it
    corners = {(float(x), float(y)) for x, y in zip(xs, ys)} - {(100.0, 0.9), (200.0, 0.8), (300.0, 0.6)}
    assert corners == {(100.0, 0.8), (200.0, 0.6)}  # each below a slower trial, none beyond what was reached
    labels = {t.get_text() for t in ax.texts}
    assert any(t.endswith("(no quality)") for t in labels), labels
    assert "no quality: drawn at the worse edge" in figures[0].axes[1].texts[0].get_text()


def test_every_report_is_kept_on_disk_and_becomes_one_point_per_step(tmp_path):
    """ObjectiveLog appends each report as it arrives (a killed driver loses nothing written before
    it), a resumed trial appends to the same file, and the history MLflow gets has one point per
    training step: a report without a step of its own (the final one) counts at the step before it,
    and a step reported again after a resume keeps its last value."""
    from types import SimpleNamespace

    from raysys.tune import objectives as obj
    from raysys.tune.progress import ObjectiveLog, objective_history
    from raysys.tune.report import _objective_history

    log, trial = ObjectiveLog(str(tmp_path / "objectives")), SimpleNamespace(trial_id="t1")
    first = [(1, 50, 0.5), (2, 100, 0.6)]
    after_resume = [(1, 100, 0.61), (2, 150, 0.7), (3, None, 0.7)]  # resumed at step 100; the final report has no step
    for it, step, q in first + after_resume:
        row = {"training_iteration": it, "timestamp": 1764000000 + it, obj.QUALITY: q, obj.THROUGHPUT: 9.0, "eval/x": 1.0}
        log.on_trial_result(0, [], trial, row | ({"step": step} if step is not None else {}))
    points = {(m.key, m.step): m.value for m in _objective_history(objective_history(log.folder, "t1"))}
    assert {s for k, s in points if k == obj.QUALITY} == {50, 100, 150}
    assert points[(obj.QUALITY, 100)] == 0.61 and points[(obj.QUALITY, 150)] == 0.7
    assert objective_history(log.folder, "other") is None


def test_a_trials_run_ends_with_the_same_status_however_it_ran():
    from raysys.tune.pareto import ERROR, INCOMPLETE
    from raysys.tune.report import _end_status

    def rec(status, ran_to_end=False):
        r = TrialRecord(trial_id="t", knobs={}, status=status)
        r.extra["ran_to_end"] = ran_to_end
        return r

    assert _end_status(rec(OK), "FINISHED") == "FINISHED"
    assert _end_status(rec(OK), "RUNNING") == "KILLED"
    assert _end_status(rec(ERROR), "FINISHED") == "FAILED"
    for before in ("FAILED", "RUNNING", "FINISHED"):  # a trial the stability rules or an interruption stopped
        assert _end_status(rec(INCOMPLETE), before) == "KILLED"
        assert _end_status(rec(UNSTABLE), before) == "KILLED"
    assert _end_status(rec(UNSTABLE, ran_to_end=True), "FINISHED") == "FINISHED"


def test_a_recommendation_keeps_the_sweeps_storage_and_tracking_and_its_cluster(monkeypatch, tmp_path):
    from raysys.cli import build_parser
    from raysys.tune.report import job_address

    flags = ("--storage-path", "s3://bkt/sweeps", "--tracking-uri", "http://mlflow.internal:5000")
    train, job = commands("deep_gpcm", "quick", {}, {"optim.lr": 0.01}, flags, job_address("10.0.0.5:6379"))
    args = build_parser().parse_args(shlex.split(train)[3:])
    assert (args.storage_path, args.tracking_uri) == ("s3://bkt/sweeps", "http://mlflow.internal:5000")
    assert job.startswith(f"cd {shlex.quote(os.getcwd())} && ray job submit --address http://10.0.0.5:8265 ")
    assert job.endswith(train)
    assert job_address("ray://head.example:10001") == "http://head.example:8265"
    assert job_address("http://head:8265/") == "http://head:8265"
    # the dashboard Ray said it joined beats a guess from the GCS address (a head that binds it to 127.0.0.1,
    # on another port: the guess refused connections, audit AV F5)
    assert job_address("10.0.0.5:6379", "127.0.0.1:8271") == "http://127.0.0.1:8271"
    # a workload file of the sweep's folder: the job (run in Ray's copy of --working-dir .) names it from there
    monkeypatch.chdir(tmp_path)
    train, job = commands(str(tmp_path / "mine" / "wl.py") + ":WORKLOAD", "quick", {}, {})
    assert train.startswith(f"python -m raysys train {tmp_path}/mine/wl.py:WORKLOAD ")
    assert job.endswith("--working-dir . -- python -m raysys train mine/wl.py:WORKLOAD --preset quick")
    # one outside it: the job ships the file's own folder and names the file from there
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    train, job = commands(str(tmp_path / "mine" / "wl.py") + ":WORKLOAD", "quick", {}, {})
    assert job.endswith(f"--working-dir {tmp_path}/mine -- python -m raysys train wl.py:WORKLOAD --preset quick")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_address("auto") == job_address(None) == "http://127.0.0.1:8265"


def test_a_trial_tune_never_recorded_is_closed_not_left_running(tmp_path):
    """A trial that started just before its sweep's driver was killed, before Tune saved it, is sampled again
    by the resumed sweep under a new id: its own child run is closed KILLED and says why, the others kept."""
    from mlflow.tracking import MlflowClient

    from raysys.tune.report import _close_abandoned

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("raysys-w")
    parent = client.create_run(exp, run_name="sw").info.run_id

    def child(name, end=None):  # as a trial's run: shown as its id and knobs, its folder's name as a tag
        run = client.create_run(exp, run_name=f"{name[3:]} lr=0.1", tags={"mlflow.parentRunId": parent,
                                                                          "raysys.run_name": name}).info.run_id
        if end:
            client.set_terminated(run, status=end)
        return run

    kept, orphan, finished = child("sw-a"), child("sw-b"), child("sw-c", "FINISHED")
    stopped = child("sw-e", "KILLED")  # a recorded trial the stability rules or a stop ended: not abandoned
    closed = child("sw-f", "KILLED")  # an orphan the killed driver's watcher closed already: said why too
    other_sweep = client.create_run(exp, run_name="sw-d").info.run_id  # no parent of this sweep: not ours
    _close_abandoned(client, "raysys-w", parent, known={"sw-a", "sw-c", "sw-e"})
    runs = (kept, orphan, finished, stopped, closed, other_sweep)
    status = {r: client.get_run(r).info.status for r in runs}
    assert status == {kept: "RUNNING", orphan: "KILLED", finished: "FINISHED", stopped: "KILLED", closed: "KILLED",
                      other_sweep: "RUNNING"}
    tagged = {r for r in runs if client.get_run(r).data.tags.get("raysys.trial_status") == "abandoned"}
    assert tagged == {orphan, closed}


def test_a_remote_sweeps_resume_lines_keep_the_storage_uris_options(tmp_path, monkeypatch):
    """The report's per-run resume lines (PBT's 'trains further', the failed trials') name the sweep's runs by
    its whole URI: without ?endpoint_override=... a pasted line went to AWS itself."""
    from raysys import storage
    from raysys.tune.report import runs_storage

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    uri = "s3://bkt/sweeps?endpoint_override=127.0.0.1:9&scheme=http"
    storage.register(tmp_path / "sw", uri, "sw")
    assert runs_storage(tmp_path / "sw") == "s3://bkt/sweeps/sw/runs?endpoint_override=127.0.0.1:9&scheme=http"
    assert runs_storage(tmp_path / "local") == str(tmp_path / "local" / "runs")


def test_an_installed_plugins_cluster_line_says_its_package_goes_there_too(monkeypatch, tmp_path):
    """A Ray job ships the working folder, not installed packages: for a plug-in installed with an entry point,
    the recommendation names its package and how a job installs it."""
    from raysys.tune.report import _install_hint

    info = tmp_path / "pkg_mine-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg-mine\nVersion: 1.2.0\n")
    (info / "entry_points.txt").write_text("[raysys.workloads]\nmine = mod_mine:WORKLOAD\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _install_hint("mine") == ("(mine is the installed package pkg-mine 1.2.0's: install it on every node of the "
                                     "cluster, e.g. add --runtime-env-json '{\"pip\": [\"pkg-mine==1.2.0\"]}' where "
                                     "an index serves it.)\n\n")
    assert _install_hint("deep_gpcm") == _install_hint("mine_module:WORKLOAD") == ""


def test_a_progress_line_says_the_loss_once_when_the_loss_is_the_quality(capsys):
    from types import SimpleNamespace

    from raysys.tune import objectives as obj
    from raysys.tune.progress import Progress

    trial = SimpleNamespace(trial_id="t1", config={})
    for quality, said in (("train/loss", 1), ("eval/qwk", 2)):
        Progress(2, "perf/tokens_per_s", quality).on_trial_result(
            0, [], trial, {"step": 2, "train/loss": 1.39, obj.MEASURED_THROUGHPUT: 26890.0, obj.MEASURED_QUALITY: 1.39})
        line = capsys.readouterr().out
        assert line.count("1.39") == said and "tokens_per_s 2.689e+04" in line, line


def test_a_sweep_summarised_again_logs_each_objective_step_once(tmp_path):
    """An interrupted sweep records its trials' objectives; its resume records them again with the
    steps trained since: each (key, step) is on the run once, the first value kept."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from raysys.tune import objectives as obj
    from raysys.tune.report import log_objective_history

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("raysys-w")).info.run_id
    rows = lambda pts: pd.DataFrame([{"step": s, "training_iteration": i, obj.QUALITY: q}  # noqa: E731
                                     for i, (s, q) in enumerate(pts, 1)])
    log_objective_history(client, run, rows([(5, 0.3), (10, 0.38)]))  # the interrupted sweep's summary
    log_objective_history(client, run, rows([(5, 0.3), (10, 0.39), (15, 0.42)]))  # its resume's
    history = [(m.step, m.value) for m in client.get_metric_history(run, obj.QUALITY)]
    assert sorted(history) == [(5, 0.3), (10, 0.38), (15, 0.42)]


def test_a_stability_rule_that_checks_nothing_is_said_once(capsys):
    from types import SimpleNamespace

    from raysys.tune import objectives as obj
    from raysys.tune.progress import Progress

    progress = Progress(2, "perf/tokens_per_s", "eval/qwk")
    for tid in ("t1", "t2"):
        result = {obj.FINAL: 1.0, obj.UNWATCHED: "train/los: never reported; this run reports train/loss"}
        trial = SimpleNamespace(trial_id=tid, config={}, last_result=result, status="TERMINATED")
        progress.on_trial_complete(0, [trial], trial)
    out = capsys.readouterr().out
    assert out.count("note: a stability rule of the space checks nothing: train/los: never reported") == 1


def test_a_note_on_a_vectorized_trials_program_is_said_on_the_sweeps_console(capsys):
    """Audit BD F2: members that differ yet ended alike were said in the trial's process only (a Ray
    worker's log); the members' final reports carry the note, and the sweep's console says it once."""
    from types import SimpleNamespace

    from raysys.tune import objectives as obj
    from raysys.tune.population import POPULATION, PREFIX
    from raysys.tune.progress import Progress

    note = "w: two members that differ in train.lr ended with the very same metrics; does its ..."
    result = {f"{PREFIX}/t1_{j}/{k}": v for j in (0, 1) for k, v in ((obj.FINAL, 1.0), (obj.NOTE, note))}
    trial = SimpleNamespace(trial_id="t1", config={POPULATION: [{"train.lr": 0.1}, {"train.lr": 0.2}]},
                            last_result=result, status="TERMINATED")
    Progress(2, "perf/samples_per_s", "eval/accuracy").on_trial_complete(0, [trial], trial)
    assert capsys.readouterr().out.count(f"note: trial t1's program: {note}") == 1


def test_a_trials_own_training_restart_is_said_on_the_sweeps_console(tmp_path, capsys):
    """A trial whose Ray Train worker was lost restarts its training from its checkpoint (launch.max_failures):
    its run's events.log said so, the sweep's console did not."""
    from types import SimpleNamespace

    from raysys.tune.progress import ObjectiveLog, Progress

    sweep = tmp_path / "g2"
    events = sweep / "runs" / "g2-53ad796b" / "events.log"
    events.parent.mkdir(parents=True)
    events.write_text("2026-11-29T12:30:40 started\n")
    progress = Progress(2, "perf/tokens_per_s", "eval/qwk", log=ObjectiveLog(str(sweep / "objectives")))
    trial = SimpleNamespace(trial_id="53ad796b", config={})
    progress.on_trial_result(0, [], trial, {"step": 10})
    with open(events, "a") as f:
        f.write("2026-11-29T12:30:53 restart 1/2 after: WorkerHealthCheckFailedError: A worker health check failed.\n"
                "2026-11-29T12:31:00 resumed step=15 epoch=5 from=step_000000015\n")
    for step in (16, 18):
        progress.on_trial_result(0, [], trial, {"step": step})
    out = capsys.readouterr().out
    assert out.count("trial 53ad796b: its training failed (WorkerHealthCheckFailedError: A worker health check "
                     "failed.); restarting from its last checkpoint (restart 1 of 2, launch.max_failures)") == 1, out
    # a resumed sweep's console does not say an earlier session's restarts again
    again = Progress(2, "perf/tokens_per_s", "eval/qwk", log=ObjectiveLog(str(sweep / "objectives")))
    again.on_trial_result(0, [], trial, {"step": 20})
    assert "restarting" not in capsys.readouterr().out
