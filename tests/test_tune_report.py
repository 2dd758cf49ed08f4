"""The sweep's printed/recorded result: commands, table, plot (no Ray run)."""

import shlex

from raysys.tune.pareto import OK, UNSTABLE, TrialRecord, pareto_front, recommend
from raysys.tune.report import commands, plot, table, write_csv


def test_commands_are_exact_and_quoted():
    train, job = commands("deep_gpcm", "quick", {"train.epochs": 2, "data.path": "my data.parquet"},
                          {"train.compile": False, "optim.lr": 0.00123, "train.max_steps": None})
    assert train == ("python -m raysys train deep_gpcm --preset quick --set train.epochs=2 "
                     "--set 'data.path=my data.parquet' --set train.compile=false --set optim.lr=0.00123 "
                     "--set train.max_steps=none")
    assert job == f"ray job submit --address http://127.0.0.1:8265 --working-dir . -- {train}"
    assert "data.path=my data.parquet" in shlex.split(train)


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


def test_table_marks_front_recommendation_and_unstable(tmp_path):
    recs = _records()
    front = pareto_front(recs)
    best = recommend(recs, 0.02)
    text = table(recs, "perf/tokens_per_s", "eval/qwk", {r.trial_id for r in front}, best.trial_id)
    lines = text.splitlines()
    assert lines[0] == "|  | trial | status | perf/tokens_per_s | eval/qwk | s | path | batch_size |"
    assert lines[2].startswith("| *> | t2 | ok | 900 | 0.59 |") and lines[3].startswith("| * | t1 | ok | 100 | 0.6 | 10 |")
    assert "| t4 | unstable: non-finite loss (nan) | 2000 | - |" in text
    png = plot(recs, front, best, tmp_path / "p.png", "perf/tokens_per_s", "eval/qwk", "t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    csv = write_csv(recs, tmp_path / "t.csv").read_text().splitlines()
    assert csv[0] == "trial_id,status,reason,throughput,quality,seconds,run_name,model.path,train.batch_size"
    assert csv[4].startswith("t4,unstable,non-finite loss (nan),2000.0,,")
