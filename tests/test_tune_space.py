"""Tune spaces validate before anything starts; every file in tune_spaces/ is valid (no Ray)."""

import math
import re
from pathlib import Path

import pytest
import yaml

from raysys import workload as registry
from raysys.config import ConfigError
from raysys.tune import space as spaces
from raysys.tune.objectives import (FINAL, QUALITY, REASON, RUN_SECONDS, THROUGHPUT, UNSTABLE, UNWATCHED, ObjectiveTracker,
                                    StabilityRules)
from raysys.tune.resources import footprint, max_concurrent

SPACES = sorted((Path(__file__).resolve().parents[1] / "tune_spaces").glob("*.yaml"))


@pytest.mark.parametrize("path", SPACES, ids=[p.stem for p in SPACES])
def test_every_space_file_validates(path):
    name = yaml.safe_load(path.read_text())["workload"]
    try:
        registry.get(name)
    except ConfigError:
        pytest.skip(f"workload '{name}' is not registered yet; {path.name} is validated once it is")
    sp = spaces.load(path)
    # tune_spaces/<workload>.yaml, or a variant tune_spaces/<workload>_<what>.yaml
    assert sp.workload == name and (path.stem == name or path.stem.startswith(name + "_"))
    assert sp.knobs
    assert sp.base_config() is not None


def test_the_deep_gpcm_space_has_the_seed_knobs():
    sp = spaces.load(next(p for p in SPACES if p.stem == "deep_gpcm"))
    for key in ("train.batch_size", "train.grad_accum", "train.precision", "train.compile", "loader.num_workers",
                "model.path", "optim.lr"):
        assert key in sp.knobs, key
    assert "fp16" not in sp.knobs["train.precision"].values  # CPU spaces stay with fp32/bf16
    assert sp.grid_points() == [{"model.path": "naive"}, {"model.path": "optimized"}]


def _space(**over):
    data = {"workload": "deep_gpcm", "preset": "quick", "fixed": {"train.epochs": 1},
            "space": {"train.batch_size": {"choice": [8, 16]}}}
    data.update(over)
    return data


@pytest.mark.parametrize("space, words", [
    ({"train.batchsize": {"choice": [8]}}, ["train.batchsize", "batch_size"]),          # unknown path
    ({"train.precision": {"choice": ["fp32", "fp8"]}}, ["train.precision", "fp8"]),     # value the config refuses
    ({"optim.lr": {"loguniform": [0, 1]}}, ["optim.lr", "low > 0"]),
    ({"optim.lr": {"uniform": [1, 0.1]}}, ["optim.lr", "low < high"]),
    ({"optim.lr": {"normal": [0, 1]}}, ["optim.lr", "unknown domain 'normal'"]),
    ({"train.batch_size": {"uniform": [8, 64]}}, ["train.batch_size", "randint"]),     # floats for an int key
    ({"train.batch_size": {"randint": [8.5, 64]}}, ["train.batch_size", "integer bounds"]),
    ({"train.batch_size": {"choice": []}}, ["train.batch_size", "non-empty"]),
    ({"train.batch_size": {"choice": [0, 8]}}, ["train.batch_size", ">= 1"]),         # validate() hooks run too
    ({"launch.name": {"choice": ["x"]}}, ["launch.name", "set by the sweep"]),
    ({"optim.lr": [1, 2]}, ["optim.lr", "domain"]),
    # audit AS D1: written dotted and in its section, the first domain was dropped without a word
    ({"optim.lr": {"loguniform": [1e-4, 1e-2]}, "optim": {"lr": {"uniform": [0.5, 0.9]}}},
     ["space: 'optim.lr' is given twice (as a dotted key and inside its section)"]),
])
def test_bad_space_is_one_clear_config_error(space, words):
    with pytest.raises(ConfigError) as e:
        spaces.from_dict(_space(space=space), "s.yaml")
    msg = str(e.value)
    assert msg.startswith("s.yaml") and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("objectives, words", [
    ({"tolerance": -0.1}, ["objectives.tolerance", ">= 0"]),
    ({"tolerance": "small"}, ["objectives.tolerance", "number"]),
    ({"quality_penalty": float("nan")}, ["objectives.quality_penalty", "number"]),
    ({"throughput": 3}, ["objectives.throughput", "names a metric"]),
    ({"quality": ""}, ["objectives.quality", "names a metric"]),
    ({"quality_mode": "lowest"}, ["objectives.quality_mode", "'max'", "'min'"]),
    ({"quality": "eval/val_loss"}, ["eval/val_loss", "lower-is-better", "objectives.quality_mode: min"]),
    ({"quality": "eval/rmse"}, ["eval/rmse", "lower-is-better"]),
    ({"quality": "eval/error-rate"}, ["eval/error-rate", "lower-is-better"]),
    # a task's runs report eval/<its keys> and the shared loop's metrics: a name outside eval/ is known now (AY F8)
    ({"throughput": "perf/sample_per_s"}, ["objectives.throughput: deep_gpcm never reports perf/sample_per_s: did "
                                           "you mean perf/samples_per_s?"]),
    ({"quality": "charts/return"}, ["objectives.quality: deep_gpcm never reports charts/return: a task's runs "
                                    "report eval/<its evaluate() keys> and the loop's perf/compute_share, "]),
])
def test_bad_objectives_are_one_clear_config_error(objectives, words):
    with pytest.raises(ConfigError) as e:
        spaces.from_dict(_space(objectives=objectives), "s.yaml")
    msg = str(e.value)
    assert msg.startswith("s.yaml") and "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("objectives, mode", [
    ({}, "max"),  # deep_gpcm's own QWK
    ({"quality": "eval/val_loss", "quality_mode": "min"}, "min"),
    ({"quality": "eval/neg_loss"}, "max"),  # a negated loss is higher-is-better
    ({"quality": "eval/lossless_ratio"}, "max"),  # words, not substrings
    ({"quality": "eval/qwk", "quality_mode": "min"}, "min"),  # said outright: believed
])
def test_quality_mode_is_said_or_safely_inferred(objectives, mode):
    assert spaces.from_dict(_space(objectives=objectives), "s.yaml").objectives["quality_mode"] == mode


def test_other_space_errors():
    with pytest.raises(ConfigError, match="unknown workload 'nope'"):
        spaces.from_dict(_space(workload="nope"))
    with pytest.raises(ConfigError, match="unknown preset"):
        spaces.from_dict(_space(preset="nope"))
    with pytest.raises(ConfigError, match="fixed overrides.*train.epoch"):
        spaces.from_dict(_space(fixed={"train.epoch": 1}))
    with pytest.raises(ConfigError, match="both fixed and searched"):
        spaces.from_dict(_space(fixed={"train.batch_size": 8}))
    with pytest.raises(ConfigError, match="unknown top-level"):
        spaces.from_dict(_space(knobs={}))
    with pytest.raises(ConfigError, match="stability"):
        spaces.from_dict(_space(stability={"bounds": {"train/loss": {"ceiling": 3}}}))
    with pytest.raises(ConfigError, match=r"^s.yaml: stability.bounds: 1 is not a metric name"):
        spaces.from_dict(_space(stability={"bounds": {1: {"max": 3}}}), "s.yaml")
    with pytest.raises(ConfigError, match=r"^s.yaml: stability.collapse: deep_gpcm never reports train/los: did you mean train/loss\?$"):
        spaces.from_dict(_space(stability={"collapse": {"train/los": 0.5}}), "s.yaml")
    with pytest.raises(ConfigError, match="not found"):
        spaces.load("no/such/space.yaml")
    # audit AS: each of these was accepted; the first made every trial of its sweep unstable, exit 0
    for rules, said in [({"max_loss_spikes": -1}, "max_loss_spikes must be a whole number >= 0, got -1"),
                        ({"max_nonfinite_losses": 2.7}, "max_nonfinite_losses must be a whole number >= 0, got 2.7"),
                        ({"bounds": {"train/loss": {"min": 5, "max": 1}}}, "bounds 'train/loss': min 5 is above max 1")]:
        with pytest.raises(ConfigError, match=re.escape(f"s.yaml: stability: {said}")):
            spaces.from_dict(_space(stability=rules), "s.yaml")
    with pytest.raises(ConfigError, match=re.escape("fixed: 'train.epochs' is given twice")):
        spaces.from_dict(_space(fixed={"train.epochs": 1, "train": {"epochs": 3}}))
    # a --set that pins the last knob: said so (its value is checked first, and a bad one named)
    one = _space(space={"optim.lr": {"loguniform": [1e-4, 1e-2]}})
    with pytest.raises(ConfigError, match=re.escape("no knob left to search (--set pins optim.lr): to train")):
        spaces.from_dict(one, "s.yaml", overrides={"optim.lr": 0.1})
    with pytest.raises(ConfigError, match=re.escape("--set: optim.lr: expected a number, got 'abc'")):
        spaces.from_dict(one, "s.yaml", overrides={"optim.lr": "abc"})


def test_nested_sections_numbers_as_strings_and_pinning():
    sp = spaces.from_dict(_space(space={"train": {"batch_size": {"randint": [8, 32]}},
                                        "optim.lr": {"loguniform": ["1e-4", "1e-2"]}}),
                          overrides={"train.batch_size": "16"}, preset="quick")
    assert list(sp.knobs) == ["optim.lr"] and sp.fixed["train.batch_size"] == "16"
    assert sp.knobs["optim.lr"].low == 1e-4
    assert sp.base_config().train.batch_size == 16


def test_optuna_space_suggests_every_knob():
    import optuna

    sp = spaces.from_dict(_space(space={"train.batch_size": {"randint": [8, 12]}, "optim.lr": {"loguniform": [1e-4, 1e-2]},
                                        "train.precision": {"grid": ["fp32", "bf16"]}, "optim.weight_decay": {"uniform": [0, 0.1]}}))
    study = optuna.create_study(directions=["maximize", "maximize"])
    for point in sp.grid_points():
        study.enqueue_trial(point)
    seen = []
    for _ in range(3):
        t = study.ask()
        spaces.OptunaSpace(sp.knobs)(t)
        seen.append(t.params)
        assert 8 <= t.params["train.batch_size"] <= 12 and 1e-4 <= t.params["optim.lr"] <= 1e-2
    assert [p["train.precision"] for p in seen[:2]] == ["fp32", "bf16"]  # grid points come first


def test_stability_rules_and_tracker():
    rules = StabilityRules.from_dict({"max_loss_spikes": 1, "bounds": {"train/loss": {"max": 10}, "charts/entropy": {"min": 0.1}},
                                      "collapse": {"charts/return": 0.5}})
    t = ObjectiveTracker("perf/tokens_per_s", "eval/qwk", rules, quality_penalty=-1.0)
    out = t.update({"train/loss": 1.0, "perf/tokens_per_s": 500.0, "stability/loss_spikes": 0})
    assert out[THROUGHPUT] == 500.0 and math.isnan(out[QUALITY]) and out[UNSTABLE] == 0.0
    out = t.update({"train/loss": 0.9, "eval/qwk": 0.6, "done": 1.0})
    assert out[QUALITY] == 0.6 and out[FINAL] == 1.0 and "done" not in out

    for bad, word in [({"train/loss": float("nan")}, "non-finite loss"), ({"losses/value_loss": float("inf")}, "losses/value_loss"),
                      ({"eval/loss": float("nan")}, "non-finite loss"), ({"stability/nonfinite_loss": 1}, "non-finite losses"),
                      ({"stability/loss_spikes": 2}, "loss spikes"), ({"train/loss": 11.0}, "ceiling"),
                      ({"charts/entropy": 0.01}, "floor"), ({"stability/diverged": 1.0}, "diverged")]:
        t = ObjectiveTracker("perf/tokens_per_s", "eval/qwk", rules, quality_penalty=-1.0)
        t.update({"perf/tokens_per_s": 900.0, "eval/qwk": 0.7})
        out = t.update(bad)
        assert out[UNSTABLE] == 1.0 and word in out[REASON], (bad, out)
        assert out[THROUGHPUT] == 0.0 and out[QUALITY] == -1.0  # any stable trial dominates it
        assert t.update({"train/loss": 0.5})[UNSTABLE] == 1.0     # the verdict is sticky

    t = ObjectiveTracker("x", "charts/return", rules)
    t.update({"charts/return": 2.0})
    assert t.update({"charts/return": 1.6})[UNSTABLE] == 0.0
    assert "collapsed" in t.update({"charts/return": 1.4})[REASON]
    # a collapse of a metric where lower is better is a rise above its lowest: the sweep's quality where
    # quality_mode is min, a loss, or a metric given a mode; an MSE that falls is learning, not collapsing
    mins = StabilityRules.from_dict({"collapse": {"eval/mse": 0.1, "losses/value_loss": 1.0,
                                                  "charts/steps_to_goal": {"drop": 5, "mode": "min"}}})
    for metric, path, bad in [("eval/mse", [0.3, 0.09, 0.15], 0.25), ("losses/value_loss", [3.0, 1.0], 2.5),
                              ("charts/steps_to_goal", [40.0, 20.0, 24.0], 30.0)]:
        t = ObjectiveTracker("x", "eval/mse", mins, quality_mode="min")
        assert all(t.update({metric: v})[UNSTABLE] == 0.0 for v in path), metric
        assert "rose to" in t.update({metric: bad})[REASON], metric
    t = ObjectiveTracker("x", "eval/qwk", StabilityRules.from_dict({"collapse": {"eval/qwk": 0.1}}))
    assert t.update({"eval/qwk": 0.5})[UNSTABLE] == 0.0 and "collapsed" in t.update({"eval/qwk": 0.3})[REASON]
    # a rule on a metric the run never reports (a typo) checks nothing: its final report says so
    typo = StabilityRules.from_dict({"bounds": {"train/los": {"max": 10}}, "collapse": {"eval/qwk": 0.1}})
    t = ObjectiveTracker("x", "eval/qwk", typo)
    t.update({"x": 1.0, "train/loss": 0.5, "eval/qwk": 0.4})
    assert UNWATCHED not in t.update({"train/loss": 0.4})
    assert t.update({"done": 1})[UNWATCHED] == "train/los: never reported; this run reports train/loss"
    # audit BG F1: a drop of exactly the rule's `drop` is allowed, whatever the float rounding (0.2 - 0.02 > 0.18)
    for best, drop in [(0.2, 0.02), (0.1, 0.01), (0.4, 0.05), (0.9, 0.3)]:
        t = ObjectiveTracker("x", "eval/qwk", StabilityRules.from_dict({"collapse": {"eval/qwk": drop}}))
        t.update({"eval/qwk": best})
        assert t.update({"eval/qwk": round(best - drop, 10)})[UNSTABLE] == 0.0, (best, drop)
    # audit BG F4: a non-finite speed at the end (a timing window of no length) replaced the last one measured,
    # and the trial stayed "ok" yet off the front; it keeps the last finite one, and one never finite is said
    t = ObjectiveTracker("perf/x_per_s", "eval/q", StabilityRules())
    t.update({"perf/x_per_s": 10.0, "eval/q": 0.5})
    out = t.update({"perf/x_per_s": math.nan, "eval/q": 0.6, "done": 1})
    assert out[UNSTABLE] == 0.0 and out[THROUGHPUT] == 10.0
    t = ObjectiveTracker("perf/x_per_s", "eval/q", StabilityRules())
    out = t.update({"perf/x_per_s": math.inf, "eval/q": 0.6, "done": 1})
    assert out[UNSTABLE] == 1.0 and out[REASON] == "no finite throughput (perf/x_per_s = inf)"
    for bad in ({"eval/mse": {"drop": 1, "mode": "lowest"}}, {"eval/mse": {"mode": "min"}}, {"eval/mse": 0}):
        with pytest.raises(ValueError, match="collapse"):
            StabilityRules.from_dict({"collapse": bad})

    t = ObjectiveTracker("x", "eval/qwk", rules)
    assert "no finite quality" in t.update({"x": 1.0, "eval/qwk": float("nan"), "done": 1})[REASON]
    # an objective the run never reports (a typo in the space) is named, with what the run does report
    t = ObjectiveTracker("perf/nosuch", "eval/qwk", rules)
    t.update({"perf/samples_per_s": 10.0, "train/loss": 1.0})
    out = t.update({"eval/qwk": 0.5, "done": 1})
    assert out[REASON] == ("perf/nosuch never reported (an objective of the space); this run reports "
                           "perf/samples_per_s") and out[UNSTABLE] == 1.0
    # that verdict stops the sweep (every trial of the workload would end the same); an unstable one does not
    from raysys.tune.progress import StabilityStopper

    stopper = StabilityStopper()
    assert stopper("t1", {UNSTABLE: 1.0, REASON: "non-finite loss"}) and not stopper.stop_all()
    assert stopper("t2", out) and stopper.stop_all()


def test_concurrency_is_bounded_by_the_cluster():
    sp = spaces.from_dict(_space(fixed={"launch.workers": 0}))
    assert footprint(sp, sp.base_config()) == (1.0, 0.0)
    assert max_concurrent({"CPU": 2.0}, 1.0, 0.0, None) == 2
    assert max_concurrent({"CPU": 2.0}, 1.0, 0.0, 1) == 1
    assert max_concurrent({"CPU": 2.0}, 1.0, 0.0, 8) == 2
    # Train workers: the trial's own share plus every worker must fit at once
    sp = spaces.from_dict(_space(space={"launch.workers": {"choice": [1, 2]}}))
    cpu, _ = footprint(sp, sp.base_config())
    assert cpu == 2.5
    assert max_concurrent({"CPU": 8.0}, cpu, 0.0, None) == 3
    with pytest.raises(ConfigError, match="one trial needs 2.5 CPU"):
        max_concurrent({"CPU": 2.0}, cpu, 0.0, None)


def test_cli_refuses_a_bad_space_before_anything_starts(workdir, capsys):
    from raysys.tune.__main__ import main

    bad = workdir / "bad.yaml"
    bad.write_text(yaml.safe_dump(_space(space={"train.batch_size": {"choice": [16]}, "optim.lrr": {"uniform": [0.1, 1]}})))
    assert main(["--space", str(bad), "--num-samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and "lr" in err and err.count("\n") == 1
    assert not (workdir / "raysys_runs").exists() and not (workdir / "mlflow.db").exists()
    good = workdir / "good.yaml"
    good.write_text(yaml.safe_dump(_space()))
    for budget in ("nan", "inf", "0"):  # audit AS D3: nan passed `<= 0` and ran a whole sweep without a budget
        assert main(["--space", str(good), "--budget", budget]) == 2
        assert f"--budget must be a number of minutes > 0, got {float(budget)}" in capsys.readouterr().err
    assert not (workdir / "raysys_runs").exists() and not (workdir / "mlflow.db").exists()


def test_cli_refuses_vectorize_without_a_population_program_and_a_path_as_name(workdir, capsys):
    from raysys.tune.__main__ import main

    good = workdir / "good.yaml"
    good.write_text(yaml.safe_dump(_space(space={"train.batch_size": {"choice": [16, 32]}})))
    for args, words in ((["--vectorize", "4"], ("deep_gpcm", "no population program")),
                        (["--vectorize", "0"], ("--vectorize", ">= 1")),
                        (["--name", "a/b"], ("--name 'a/b' is not a valid run name",)),
                        (["--name", "../up"], ("not a valid run name",))):
        assert main(["--space", str(good), "--num-samples", "2", *args]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words) and err.count("\n") == 1, err
    assert not (workdir / "raysys_runs").exists() and not (workdir / "mlflow.db").exists()


@pytest.mark.parametrize("address", ["127.0.0.1:9", "ray://127.0.0.1:9", "http://127.0.0.1:9"])
def test_cli_refuses_a_ray_address_nothing_answers_at_before_anything_starts(workdir, capsys, address):
    """ray.init would retry an unreachable GCS for minutes; one line in seconds instead."""
    from raysys.tune.__main__ import main

    good = workdir / "good.yaml"
    good.write_text(yaml.safe_dump(_space(space={"train.batch_size": {"choice": [16, 32]}})))
    assert main(["--space", str(good), "--num-samples", "2", "--address", address]) == 2
    err = capsys.readouterr().err
    said = "an http address is a Ray dashboard's" if address.startswith("http") else "no Ray cluster answers at "
    assert said in err and address in err and err.count("\n") == 1, err
    assert not (workdir / "raysys_runs").exists() and not (workdir / "mlflow.db").exists()


def test_a_web_server_at_the_address_is_one_line_and_creates_nothing(workdir):
    """Audit AS D4: something listens at the address (a dashboard's port given as the GCS's, say), so the port
    probe passed, and ray.init waited on it for minutes; the sweep's MLflow store and dataset were made first.
    A server that does not answer HTTP/2's opening as gRPC does is told apart at once; and a cluster's join
    (one that would refuse us) now comes before the store or the data exist."""
    import http.server
    import subprocess
    import sys
    import threading

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    good = workdir / "good.yaml"
    good.write_text(yaml.safe_dump(_space(space={"train.batch_size": {"choice": [16, 32]}})))
    try:
        proc = subprocess.run([sys.executable, "-m", "raysys.tune", "--space", str(good), "--address",
                               f"127.0.0.1:{web.server_address[1]}"], cwd=workdir, capture_output=True, text=True,
                              timeout=300)
    finally:
        web.shutdown()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "answers, but not as Ray" in proc.stderr and "(nothing was created)" in proc.stderr
    assert sorted(p.name for p in workdir.iterdir()) == ["good.yaml"]


def test_cli_help_explains_every_flag(capsys):
    from raysys.tune.__main__ import build_parser

    text = build_parser().format_help()
    for flag in ("--space", "--num-samples", "--max-concurrent", "--budget", "--address", "--tracking-uri", "--resume",
                 "--name", "--storage-path", "--tolerance", "--vectorize"):
        assert flag in text, flag
    assert text.count("default") >= 5


def test_a_reused_run_reports_its_own_time_not_the_reuse(tmp_path):
    """A trial whose run had finished when the driver died is reused on --resume: Tune's clock then
    sees only the reuse (~0.1 s), so the table's seconds come from the sweep's event log instead, the
    run's last start to its end."""
    import json

    from raysys.tune.runner import _record
    from raysys.tune.trial import TrialSetup, finished_final, reused_final, run_seconds

    (tmp_path / "trial_events.log").write_text(
        "2026-11-25T08:00:00 start a1 run=s-a1 resume=False\n"
        "2026-11-25T08:00:05 start b2_0 run=s-b2_0 resume=False population=b2\n"
        "2026-11-25T08:00:30 start a1 run=s-a1 resume=True\n"  # a1 was interrupted and resumed
        "2026-11-25T08:01:12 end a1\n"
        "2026-11-25T08:02:00 reuse a1 run=s-a1\n")
    assert run_seconds(tmp_path, "a1") == 42.0
    assert run_seconds(tmp_path, "b2_0") is None  # no end: not finished
    assert run_seconds(tmp_path, "zz") is None and run_seconds(tmp_path / "none", "a1") is None
    setup = TrialSetup(workload="deep_gpcm", base_config={}, sweep_name="s", sweep_dir=str(tmp_path),
                       runs_storage=str(tmp_path / "runs"), tracking_uri="", experiment="", parent_run_id="",
                       throughput_metric="perf/x", quality_metric="eval/q", stability={}, quality_penalty=0.0)
    (tmp_path / "runs" / "s-a1").mkdir(parents=True)
    (tmp_path / "runs" / "s-a1" / "final_metrics.json").write_text('{"eval/q": 0.')  # damaged: resumed, not reused
    assert finished_final(setup, "a1") is None and finished_final(setup, "zz") is None
    (tmp_path / "runs" / "s-a1" / "final_metrics.json").write_text(json.dumps({"eval/q": 0.7}))
    last = reused_final(setup, "a1", finished_final(setup, "a1"))
    assert last == {"eval/q": 0.7, "done": 1.0, RUN_SECONDS: 42.0}
    assert "reuse a1 run=s-a1" in (tmp_path / "trial_events.log").read_text()
    assert _record("a1", {}, {**last, "time_total_s": 0.1}, None, setup).seconds == 42.0
    assert _record("c3", {}, {"time_total_s": 17.5}, None, setup).seconds == 17.5
    # a run that ended just before the driver's SIGKILL, its "end" line never written: its seconds end
    # when the run recorded its end, and its objectives belong to the step it ended at
    import os
    from datetime import datetime

    b2 = tmp_path / "runs" / "s-b2_0"
    (b2 / "checkpoints" / "step_000000040").mkdir(parents=True)
    (b2 / "final_metrics.json").write_text(json.dumps({"eval/q": 0.5}))
    ended = datetime.fromisoformat("2026-11-25T08:01:35").timestamp()
    os.utime(b2 / "final_metrics.json", (ended, ended))
    assert reused_final(setup, "b2_0", finished_final(setup, "b2_0")) == {"eval/q": 0.5, "done": 1.0, "step": 40,
                                                                         RUN_SECONDS: 90.0}


def test_a_resumed_trials_seconds_count_every_session_but_not_the_time_it_was_down(tmp_path):
    """Tune's clock of a trial resumed with its sweep starts again at the resume: the table's seconds
    sum its sessions instead, a cut one up to its last report."""
    import json
    from datetime import datetime
    from types import SimpleNamespace

    from raysys.tune.runner import collect
    from raysys.tune.trial import TrialSetup, report_times, run_seconds

    at = lambda text: datetime.fromisoformat(text).timestamp()  # noqa: E731 (local time, as the log writes it)
    (tmp_path / "trial_events.log").write_text(
        "2026-11-25T08:00:00 start a1 run=s-a1 resume=False\n"
        "2026-11-25T08:00:00 start c3 run=s-c3 resume=False\n"
        "2026-11-25T08:00:25 end c3\n"
        "2026-11-25T09:00:00 start a1 run=s-a1 resume=True\n"  # an hour down, then resumed
        "2026-11-25T09:00:4")  # a line cut by a kill
    (tmp_path / "objectives").mkdir()
    rows = [{"step": 1, "timestamp": at("2026-11-25T08:00:10")}, {"step": 2, "timestamp": at("2026-11-25T08:00:20")},
            {"step": 3, "timestamp": at("2026-11-25T09:00:30")}]
    (tmp_path / "objectives" / "a1.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{\"step\": 4, \"ti")
    reports = report_times(tmp_path / "objectives", "a1")
    assert len(reports) == 3
    assert run_seconds(tmp_path, "a1", reports) is None  # not ended
    with open(tmp_path / "trial_events.log", "a") as f:
        f.write("\n2026-11-25T09:00:40 end a1\n")
    assert run_seconds(tmp_path, "a1", reports) == 20.0 + 40.0
    assert run_seconds(tmp_path, "a1") == 40.0  # no reports: the cut session counts nothing
    assert run_seconds(tmp_path, "c3", resumed_only=True) is None and run_seconds(tmp_path, "c3") == 25.0
    setup = TrialSetup(workload="deep_gpcm", base_config={}, sweep_name="s", sweep_dir=str(tmp_path),
                       runs_storage=str(tmp_path / "runs"), tracking_uri="", experiment="", parent_run_id="",
                       throughput_metric="perf/x", quality_metric="eval/q", stability={}, quality_penalty=0.0)
    grid = [SimpleNamespace(metrics={"trial_id": t, "time_total_s": 40.5 if t == "a1" else 26.0}, config={},
                            error=None, path=str(tmp_path / t)) for t in ("a1", "c3")]
    assert {r.trial_id: r.seconds for r in collect(grid, setup)} == {"a1": 60.0, "c3": 26.0}


def test_a_resumed_trial_keeps_its_last_objectives_until_it_measures_new_ones(tmp_path):
    """Audit: a trial resumed mid-epoch reported NaN quality until its next evaluation (holes in its
    objective history). Its tracker starts from the last measured values of its ObjectiveLog rows."""
    import math

    import json

    from raysys.tune.objectives import MEASURED_QUALITY, MEASURED_THROUGHPUT
    from raysys.tune.trial import TrialSetup

    setup = TrialSetup(workload="deep_gpcm", base_config={}, sweep_name="s", sweep_dir=str(tmp_path),
                       runs_storage=str(tmp_path / "runs"), tracking_uri="", experiment="", parent_run_id="",
                       throughput_metric="perf/x", quality_metric="eval/q", stability={}, quality_penalty=0.0)
    (tmp_path / "objectives").mkdir()
    rows = [{"step": 2, MEASURED_THROUGHPUT: 90.0}, {"step": 4, MEASURED_THROUGHPUT: 100.0, MEASURED_QUALITY: 0.5}]
    (tmp_path / "objectives" / "a1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "obj')
    out = setup.tracker("a1").update({"step": 6, "train/loss": 0.3})
    assert out[QUALITY] == 0.5 and out[THROUGHPUT] == 100.0
    assert setup.tracker("a1").update({"step": 8, "eval/q": 0.6})[QUALITY] == 0.6
    fresh = setup.tracker("b2").update({"step": 2})  # a trial with no history: NaN until measured
    assert math.isnan(fresh[QUALITY]) and math.isnan(fresh[THROUGHPUT])


def test_an_unstable_trial_where_lower_is_better_is_left_out_not_scored():
    """No penalty value is worse than every loss: by default such a trial's quality objective is NaN
    (Optuna leaves it out), while higher-is-better sweeps keep their -1."""
    import math

    from raysys.tune import objectives as obj
    from raysys.tune.runner import _penalty

    def penalty(**objectives):
        return _penalty(spaces.SweepSpace("deep_gpcm", "quick", {}, {}, objectives, {}, "s.yaml"))

    assert penalty(quality_mode="min") is None and penalty() == obj.DEFAULT_QUALITY_PENALTY
    assert penalty(quality_mode="min", quality_penalty=9.0) == 9.0
    t = obj.ObjectiveTracker("perf/x", "eval/loss", quality_penalty=None, quality_mode="min")
    out = t.update({"perf/x": 1.0, "eval/loss": 0.3, "train/loss": float("nan")})
    assert out[obj.UNSTABLE] == 1.0 and math.isnan(out[obj.QUALITY]) and out[obj.MEASURED_QUALITY] == 0.3


def test_a_workload_given_another_task_takes_that_tasks_quality_metric_and_mode():
    """``dataclasses.replace(wl, task=...)``: the quality metric and mode filled in from the old task
    follow the new one; ones given outright stay; a bad mode is one ConfigError."""
    import dataclasses

    from raysys.workload import Workload

    class Accuracy:
        quality_metric = "accuracy"

    class ErrorRate:
        quality_metric, quality_mode = "error_rate", "min"

    base = Workload(name="w", description="", config_cls=object, presets={"default": object}, task=Accuracy())
    assert (base.quality_metric, base.quality_mode) == ("eval/accuracy", "max")
    moved = dataclasses.replace(base, task=ErrorRate())
    assert (moved.quality_metric, moved.quality_mode) == ("eval/error_rate", "min")
    pinned = dataclasses.replace(Workload(name="w", description="", config_cls=object, presets={"default": object},
                                          task=Accuracy(), quality_metric="eval/f1"), task=ErrorRate())
    assert (pinned.quality_metric, pinned.quality_mode) == ("eval/f1", "max")  # the task's mode is its own metric's
    with pytest.raises(ConfigError, match="quality_mode must be 'max' or 'min'"):
        dataclasses.replace(base, quality_mode="lowest")


def test_a_resumed_sweep_whose_space_changed_is_refused_naming_each_change(tmp_path):
    import json

    from raysys.tune.runner import _check_same_space

    path = Path(__file__).resolve().parents[1] / "tune_spaces" / "deep_gpcm.yaml"
    stored = {"space": json.loads(json.dumps(spaces.load(path).to_dict(), default=str))}
    _check_same_space(stored, spaces.load(path), path)  # the same space: resumes
    data = yaml.safe_load(path.read_text())
    data["space"]["optim.lr"] = {"loguniform": [1.0e-4, 3.0e-3]}
    del data["space"]["loader.num_workers"]
    data["space"]["train.spike_factor"] = {"choice": [5.0, 10.0]}
    changed = tmp_path / "space.yaml"
    changed.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        _check_same_space(stored, spaces.load(changed), changed)
    said = str(e.value)
    assert "optim.lr" in said and "0.0003" in said and "0.0001" in said, said
    assert "loader.num_workers" in said and "removed" in said and "train.spike_factor" in said and "added" in said


def test_a_resume_of_a_folder_without_its_sweep_state_says_so(tmp_path):
    """A folder of the name exists but its raysys_sweep.json does not (a storage that lost it, another
    command's folder): 'no sweep called x' alone read as a typo in --name."""
    from raysys.tune.runner import STATE_FILE, SweepOptions, resolve_sweep_dir

    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "experiment_state-2026.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"no sweep called 'k1' under {tmp_path} \\({tmp_path}/k1 exists, without "
                                          f"its {STATE_FILE}"):
        resolve_sweep_dir(SweepOptions(space="s.yaml", name="k1", resume=True, storage_path=str(tmp_path)), "w")
    with pytest.raises(ConfigError, match="no sweep called 'k2' under [^(]*$"):
        resolve_sweep_dir(SweepOptions(space="s.yaml", name="k2", resume=True, storage_path=str(tmp_path)), "w")
    # a bare --resume takes the newest default-named sweep, and says that is what it looked for
    with pytest.raises(ConfigError, match=r"no earlier w sweep named by default \(w-sweep-<date>-<time>\) under .*; "
                                          "continue a sweep of another name with --name"):
        resolve_sweep_dir(SweepOptions(space="s.yaml", resume=True, storage_path=str(tmp_path)), "w")
