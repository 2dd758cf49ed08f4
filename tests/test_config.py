from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from raysys.config import ConfigError, allowed_keys, apply_overrides, from_dict, load_yaml, parse_set_args, to_dict
from raysys.train.config import LaunchConfig, TrainConfig


@dataclass
class Inner:
    lr: float = 1e-3
    mode: Literal["a", "b"] = "a"
    clip: Optional[float] = 1.0
    betas: tuple[float, float] = (0.9, 0.99)


@dataclass
class Root:
    inner: Inner = field(default_factory=Inner)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    steps: int = 10
    flag: bool = False


def test_overrides_coerce_types():
    cfg = apply_overrides(Root(), parse_set_args(["inner.lr=3e-4", "inner.mode=b", "inner.clip=none", "steps=20",
                                                  "flag=true", "inner.betas=[0.8,0.9]", "train.precision=bf16"]))
    assert cfg.inner.lr == 3e-4 and cfg.inner.mode == "b" and cfg.inner.clip is None
    assert cfg.steps == 20 and cfg.flag is True and cfg.inner.betas == (0.8, 0.9) and cfg.train.precision == "bf16"
    assert Root().steps == 10  # the original is untouched


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(ConfigError) as e:
        apply_overrides(Root(), {"inner.lrr": "1"})
    msg = str(e.value)
    assert "inner.lrr" in msg and "lr" in msg and "mode" in msg
    with pytest.raises(ConfigError, match="'nope'"):
        apply_overrides(Root(), {"nope.x": 1})


@pytest.mark.parametrize("key,value,needle", [("steps", "ten", "integer"), ("inner.mode", "c", "not one of"),
                                              ("flag", "maybe", "true/false"), ("inner.lr", "fast", "number"),
                                              ("train.batch_size", 0, "train.batch_size must be >= 1"),
                                              # AY F1/F14: an infinite lr passed "> 0" and trained on NaN; a count
                                              # beyond int64 passed ">= 1" and failed in the DataLoader
                                              ("inner.lr", "inf", "inner.lr: inf is not a valid value"),
                                              ("inner.lr", "1e400", "inner.lr: inf is not a valid value"),
                                              ("inner.clip", "-inf", "inner.clip: -inf is not a valid value"),
                                              ("inner.lr", "nan", "inner.lr: nan is not a valid value"),
                                              ("inner.betas", "[0.9, inf]", "inner.betas: inf is not a valid value"),
                                              ("steps", "99999999999999999999999", "steps: 99999999999999999999999 is beyond")])
def test_wrong_types_and_values(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        apply_overrides(Root(), {key: value})


def test_yaml_nested_and_dotted(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lr: 0.5\ntrain.epochs: 3\n")
    cfg = apply_overrides(Root(), load_yaml(p))
    assert cfg.inner.lr == 0.5 and cfg.train.epochs == 3


def test_bad_yaml_says_where(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("inner:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad YAML in .*bad.yaml at line"):
        load_yaml(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_yaml(p)
    p.write_bytes(b"inner:\n  lr: 0.5\n\xff\xfe\x00")  # a binary file (AY F3): not a traceback
    with pytest.raises(ConfigError, match=r"bad.yaml is not UTF-8 text \(byte 17: b'\\xff'\)"):
        load_yaml(p)


def test_roundtrip_and_allowed_keys():
    cfg = apply_overrides(Root(), {"inner.lr": 0.1})
    assert from_dict(Root, to_dict(cfg)) == cfg
    keys = allowed_keys(Root)
    assert "inner.lr" in keys and "train.grad_accum" in keys and "launch.workers" in keys


def test_set_requires_equals():
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_set_args(["train.lr"])


def test_show_keys_documents_every_field(capsys):
    from raysys.cli import main

    assert main(["show", "deep_gpcm", "--keys", "--set", "train.batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "train.batch_size = 64" in out and "Micro-batch size per worker." in out
    assert "launch.workers = 1" in out and "model.path = 'optimized'" in out


def test_a_run_that_asks_the_local_ray_for_more_than_the_machine_has_fails_at_once(tmp_path):
    """Ray Train would wait for ever for a GPU or CPUs the Ray started in this process cannot have."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    cpus = len(os.sched_getaffinity(0))
    for args, words in [(["--workers", "1", "--gpus-per-worker", "1"], "needs 1 GPU(s); this machine has 0"),
                        (["--workers", str(cpus + 1)], f"needs {cpus + 1} CPUs; this machine has {cpus}")]:
        proc = subprocess.run([sys.executable, "-m", "raysys", "train", "deep_gpcm", "--preset", "quick", *args],
                              cwd=tmp_path, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_tracking_store_that_cannot_be_made_is_one_line_before_anything(tmp_path):
    """MLflow refuses its retired folder store, and a database cannot go where no folder can: exit 2
    from train and tune, with nothing made (no data, no run folder, no store)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")}
    (tmp_path / "afile").write_text("")
    (tmp_path / "space.yaml").write_text("workload: deep_gpcm\npreset: quick\nspace:\n  train.batch_size: {choice: [16, 32]}\n")
    train, tune = ["raysys", "train", "deep_gpcm", "--preset", "quick", "--workers", "0"], ["raysys.tune", "--space", "space.yaml"]
    for cmd, uri, words in [(train, "./store", "MLflow no longer writes its folder (file) store; pass sqlite:///"),
                            (tune, "./store", "MLflow no longer writes its folder (file) store; pass sqlite:///"),
                            (train, "sqlite:///afile/mlflow.db", "afile is a file, not a folder"),
                            (tune, "sqlite:////proc/raysys/mlflow.db", "cannot write in /proc"),
                            (tune, "foo://bar", "MLflow has no tracking store for 'foo://'"),
                            (tune, "sqlite:///space.yaml", "space.yaml is not an SQLite database"),
                            # AY F5: a database URL whose driver is missing (or whose server is not there)
                            (train, "postgresql://u:secret@127.0.0.1:1/db", "--tracking-uri postgresql://***@127.0.0.1:1/db: "),
                            # AY F7: a file store named at a file: the database goes beside it
                            (train, f"file://{tmp_path}/afile", f"pass sqlite:///{tmp_path}/mlflow.db or a server URL (nothing")]:
        proc = subprocess.run([sys.executable, "-m", *cmd, "--tracking-uri", uri], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (cmd, uri, proc.stderr[-2000:])
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "secret" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "space.yaml"]


def test_a_sweeps_other_bad_input_is_one_line_before_anything(tmp_path):
    """Said where it was written (a flag, --set, the space file), before any data, store or folder exists:
    a knob listed twice, an empty space, a bad --set, a bad count, missing data, a trial bigger than this
    machine."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    head = "workload: deep_gpcm\npreset: quick\n"
    (tmp_path / "twice.yaml").write_text(head + "space:\n  train.batch_size: {choice: [16]}\n  train.batch_size: {choice: [32]}\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "big.yaml").write_text(head + "fixed: {launch.workers: 64}\nspace:\n  train.batch_size: {choice: [16, 32]}\n")
    (tmp_path / "ok.yaml").write_text(head + "space:\n  train.batch_size: {choice: [16, 32]}\n")
    made = sorted(p.name for p in tmp_path.iterdir())
    for args, words in [(["--space", "twice.yaml"], "bad YAML in twice.yaml at line 5, column 3: duplicate key 'train.batch_size'"),
                        (["--space", "empty.yaml"], "empty.yaml: the file is empty"),
                        (["--space", "ok.yaml", "--set", "train.nosuch=1"], "config error: --set: unknown config key 'train.nosuch'"),
                        (["--space", "ok.yaml", "--max-concurrent", "0"], "--max-concurrent must be >= 1, got 0"),
                        (["--space", "ok.yaml", "--set", "data.path=nosuch.csv"], "raysys.tune: data error: no sequences file"),
                        (["--space", "big.yaml"], "one trial needs 64.5 CPU")]:
        proc = subprocess.run([sys.executable, "-m", "raysys.tune", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            (args, proc.stderr[-2000:])
        assert sorted(p.name for p in tmp_path.iterdir()) == made, args


def test_a_mapping_field_is_set_entry_by_entry_and_round_trips_as_typed():
    """A ``dict`` field holds free-form keyword arguments: ``--set kw.a.b=1`` sets one (nested) entry, read as
    YAML; a whole mapping may be given as YAML; a config rebuilt from its dict (a worker, a checkpoint) keeps
    each value's type, the string "20" included."""
    import dataclasses

    from raysys.config import apply_overrides, flatten, from_dict, to_dict

    @dataclasses.dataclass
    class Cfg:
        kw: dict = dataclasses.field(default_factory=dict)

    cfg = apply_overrides(Cfg(), {"kw.dt": "20", "kw.timing.fixation": "1e2", "kw.name": "'20'", "kw.on": "true"})
    assert cfg.kw == {"dt": 20, "timing": {"fixation": 100.0}, "name": "20", "on": True}
    assert from_dict(Cfg, to_dict(cfg)) == cfg
    assert flatten(to_dict(cfg))["kw.timing.fixation"] == 100.0  # MLflow's params, one per entry
    assert apply_overrides(Cfg(), {"kw": "{a: [1, 2]}"}).kw == {"a": [1, 2]}
    assert apply_overrides(cfg, {"kw": ""}).kw == {}
    for bad in ("[1]", "3", "{1: 2}"):
        with pytest.raises(ConfigError, match="kw: expected a mapping"):
            apply_overrides(Cfg(), {"kw": bad})
