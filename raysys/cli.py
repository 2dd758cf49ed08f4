"""``python -m raysys``: train a workload, list workloads, show a config.

Works unchanged as the entrypoint of ``ray job submit ... -- python -m raysys train ...``: inside
a job, $RAY_ADDRESS points at the cluster and the run joins it instead of starting Ray locally.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from raysys import console
from raysys import workload as registry
from raysys.config import ConfigError, apply_overrides, flatten, load_yaml, parse_set_args, to_dict

EPILOG = """examples:
  python -m raysys train deep_gpcm                              # embedded defaults: local Ray, ./mlflow.db
  python -m raysys train deep_gpcm --preset quick --workers 0   # in-process, no Ray actors
  python -m raysys train deep_gpcm --set train.precision=bf16 --set train.batch_size=64 --workers 2
  python -m raysys train deep_gpcm --name my-run --resume       # continue an interrupted run
  python -m raysys show deep_gpcm --preset parity               # print the resolved config as YAML
  python -m raysys.bench deep_gpcm --quick                      # naive vs optimized, measured
  python -m raysys.tune --space tune_spaces/deep_gpcm.yaml      # speed/quality sweep
  python -m raysys train mpn_dqn --set sequence_batch_size=64 --set train_freq=4 --device cpu   # the seed's flags
  bash examples/train_hackmatrix_ppo_tpu.sh                    # JAX on a TPU v4-16: one process per host
"""


WORKLOAD_HELP = ("a built-in or installed workload (a package's entry point in the 'raysys.workloads' group; see "
                 "`python -m raysys list`), or your own as module:attr, "
                 "e.g. my_pkg.lm:WORKLOAD, importable from the working directory, or as its file, e.g. "
                 "path/to/lm.py:WORKLOAD (docs/your-workload.md)")


def _config_args(p: argparse.ArgumentParser, resume: bool = False) -> None:
    p.add_argument("workload", help=WORKLOAD_HELP)
    p.add_argument("--preset", help="named config preset of the workload (default: default" + (
        "; a --resume continues from the run's own config, whatever the preset)" if resume else ")"))
    p.add_argument("--config", metavar="YAML", help="YAML file of config keys, nested or dotted, applied after the preset")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", default=[],
                   help="override one config key by dotted path, e.g. optim.lr=3e-4 (repeatable; applied last)")


def build_parser() -> argparse.ArgumentParser:
    parser = console.ArgumentParser(prog="python -m raysys", description=(
        "raysys: run training workloads on Ray with their slow (naive) and fast (optimized) paths, "
        "tracked in MLflow. Every knob is a config key: see `show`."),
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show Ray's and Ray Train's own logs (worker output, per-report lines); by default "
                             "they stay in Ray's log files and the console shows one progress display")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a workload", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train a workload under Ray Train (or in-process with --workers 0).", epilog=EPILOG)
    _config_args(t, resume=True)
    t.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="also show Ray's and Ray Train's own logs (as `python -m raysys -v`)")
    t.add_argument("--workers", type=int, help="data-parallel Ray Train workers; 0 = in this process (launch.workers; "
                                               "default: the preset's, see `show <workload>`)")
    t.add_argument("--gpus-per-worker", type=float, help="GPUs per worker; >0 uses CUDA + NCCL (launch.gpus_per_worker)")
    t.add_argument("--address", type=console.given_arg, help="Ray cluster address, e.g. auto or ray://head:10001; default: $RAY_ADDRESS or "
                                     "a Ray instance started in this process (launch.address)")
    t.add_argument("--tracking-uri", type=console.given_arg, help="MLflow tracking URI; default $RAYSYS_TRACKING_URI, else $MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db")
    t.add_argument("--experiment", type=console.name_arg, help="MLflow experiment name (default raysys-<workload>)")
    t.add_argument("--name", type=console.name_arg, help="run name: folder under --storage-path and MLflow run name "
                                                         "(default: <workload>-<YYYYmmdd-HHMMSS>)")
    t.add_argument("--storage-path", type=console.given_arg, help="folder or storage URI (s3://, gs://) for checkpoints and run state, shared "
                                          "by all nodes on a cluster (default: raysys_runs)")
    t.add_argument("--resume", action="store_true", help="continue run --name (or the newest unfinished run of this "
                                                          "workload named by default) from its last checkpoint, "
                                                          "without repeating finished steps")
    t.add_argument("--cv", action="store_true", help="k-fold cross-validation: one run per fold (children of one "
                                                      "MLflow parent run), then the per-fold table and the mean")
    t.add_argument("--max-failures", type=int, help="worker-group restarts from the last checkpoint (launch.max_failures; "
                                                    "default: 2)")
    t.add_argument("--device", help="the learner's device, for a workload whose config has a `device` key (mpn_dqn): cpu, cuda, cuda:1, auto; the others use --gpus-per-worker (torch) or the devices JAX sees")

    s = sub.add_parser("show", help="print a workload's resolved config as YAML (or every key with its meaning)")
    _config_args(s)
    s.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="also show Ray's and Ray Train's own logs (as `python -m raysys -v`)")
    s.add_argument("--keys", action="store_true", help="list every config key with its value and what it does")
    ls = sub.add_parser("list", help="list the workloads (built-in and installed plug-ins) and their presets",
                        description="The built-in workloads and the installed plug-ins (entry points of the "
                                    "'raysys.workloads' group, docs/your-workload.md), each with its presets; a "
                                    "plug-in that fails to load is listed with the reason.")
    ls.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                    help="only these, e.g. your own my_module:WORKLOAD or path/to/file.py:WORKLOAD")
    return parser


LAUNCH_FLAGS = {"workers": "workers", "gpus_per_worker": "gpus_per_worker", "address": "address",
                "tracking_uri": "tracking_uri", "experiment": "experiment", "name": "name",
                "storage_path": "storage_path", "max_failures": "max_failures"}


def build_config(args: argparse.Namespace) -> tuple[registry.Workload, Any]:
    wl = registry.get(args.workload)
    preset = wl.config(args.preset or "default")
    # a --resume continues from the run's own saved config (a --cv's: its first fold's, for every fold)
    base = None
    if getattr(args, "resume", False):
        base = _resumed_cv_base(wl, preset, args) if getattr(args, "cv", False) else _resumed_base(wl, preset, args)

    def overridden(c: Any) -> Any:
        if args.config:
            c = apply_overrides(c, load_yaml(args.config))
        sets = parse_set_args(args.sets)
        registry.check_sets(wl, sets)
        return apply_overrides(c, sets)

    cfg = overridden(base or preset)
    if base is not None and args.preset is not None:
        _say_preset_unused(wl, args.preset, preset, overridden(preset), cfg)
    launch = {f"launch.{key}": getattr(args, flag) for flag, key in LAUNCH_FLAGS.items()
              if getattr(args, flag, None) is not None}
    if getattr(args, "resume", False):
        launch["launch.resume"] = True
    if getattr(args, "device", None) is not None:
        if not hasattr(cfg, "device"):
            raise ConfigError(f"--device: {wl.name} has no `device` key (its device follows --gpus-per-worker)")
        launch["device"] = args.device
    cfg = apply_overrides(cfg, launch)
    if base is not None:
        args.resume_changes = _changes(base, cfg)
    return wl, cfg


def _say_preset_unused(wl: registry.Workload, name: str, preset: Any, asked: Any, cfg: Any) -> None:
    """A --resume continues from the run's own config: a --preset whose own keys (those it sets apart from
    the default preset; every key, for --preset default itself) would now mean other values is said, not
    silently dropped."""
    own, default, a, c = (flatten(to_dict(x)) for x in (preset, wl.config("default"), asked, cfg))
    differs = [k for k in sorted(own) if not k.startswith("launch.") and (own[k] != default.get(k) or name == "default")
               and a.get(k) != c.get(k)]
    if differs:
        print(f"[raysys] --resume continues from the run's own config, not from preset '{name}' (which sets "
              + ", ".join(f"{k}={a.get(k)!r}, the run has {c.get(k)!r}" for k in differs)
              + "); change a key with --set", flush=True)


TRAINING_LAUNCH_KEYS = ("launch.workers", "launch.gpus_per_worker")
"""The launch keys a resume's training feels: the global batch, the data's order and the device change."""


def _changes(before: Any, after: Any) -> str:
    """``key: old -> new`` for every config key that differs (of launch.*, those of ``TRAINING_LAUNCH_KEYS``),
    '; '-separated."""
    a, b = flatten(to_dict(before)), flatten(to_dict(after))
    return "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if (not k.startswith("launch.") or k in TRAINING_LAUNCH_KEYS) and a.get(k) != b.get(k))


def _resumed_base(wl: registry.Workload, cfg: Any, args: argparse.Namespace) -> Any:
    """``--resume`` continues from the run's own saved config; --config/--set given now apply on top."""
    from raysys.config import from_dict
    from raysys.tracking import sqlite_path
    from raysys.train.launcher import resolve_run_dir, saved_config

    launch = dict(name=args.name, resume=True, storage_path=args.storage_path or cfg.launch.storage_path)
    name, run_dir = resolve_run_dir(wl.name, type(cfg.launch)(**launch))
    snap = saved_config(run_dir)
    saved = yaml.safe_load(snap.read_text()) if snap is not None else _checkpoint_config(wl, run_dir)
    if saved is None:
        return None
    saved.get("launch", {}).update(resume=False, name=name)  # a remote run's folder here is a working copy
    _pbt_knobs(wl, run_dir, saved, {s.split("=", 1)[0].strip() for s in getattr(args, "sets", None) or []})
    store = saved.get("launch", {}).get("tracking_uri") or ""
    if args.tracking_uri is None and store.startswith("sqlite:///") and not sqlite_path(store).is_file():
        # its own store is on another machine (or gone): this session tracks where a new run would
        print(f"[raysys] the run's MLflow store {store} is not here (on another machine, moved or deleted): tracking "
              "to this command's store instead "
              "(--tracking-uri chooses another)", flush=True)
        saved["launch"]["tracking_uri"] = None
    try:
        return from_dict(wl.config_cls, saved)
    except ConfigError as e:  # a key renamed or removed in the workload's code since the run began
        owner = _trained_by(run_dir)
        if owner and owner != wl.name:  # not a code change: the run is another workload's
            raise ConfigError(f"run '{name}' is a run of {owner}, not {wl.name} (its checkpoints say so): resume it "
                              f"with its own workload ({owner})") from None
        where = snap or f"the newest checkpoint in {run_dir}"
        why = ("Its code changed since the run began: restore that code to resume" if owner else
               # no checkpoint names its workload: another workload's run says so as much as a code change
               f"Either it is a run of another workload (resume it with that one) or {wl.name}'s code changed since "
               "the run began (restore that code to resume)")
        raise ConfigError(f"the run's saved config ({where}) does not fit {wl.name}'s config: {e}. {why}, or start "
                          "a new run (another --name)") from None


def _resumed_cv_base(wl: registry.Workload, preset: Any, args: argparse.Namespace) -> Any:
    """A ``--cv --resume``'s base config: the cross-validation's own, as its first fold saved it, named as the
    cross-validation. Folds trained from the config given now (another length, another preset) averaged
    into one mean and spread that no configuration has."""
    from raysys.train.cv import _resumed

    if "folds" not in wl.extra:
        return None  # said by run_cross_validation, as for a --cv without --resume
    launch = dict(name=args.name, resume=True, storage_path=args.storage_path or preset.launch.storage_path)
    name = _resumed(wl, type(preset.launch)(**launch))
    saved = _resumed_base(wl, preset, argparse.Namespace(**{**vars(args), "name": f"{name}-fold0"}))
    return None if saved is None else apply_overrides(saved, {"launch.name": name})


def _trained_by(run_dir: Path) -> Optional[str]:
    """The workload the run's newest checkpoint names (None: no checkpoint, or one that does not say)."""
    from raysys.train.failures import newest_checkpoint

    newest = newest_checkpoint(run_dir)
    try:
        return json.loads((run_dir / "checkpoints" / newest / "meta.json").read_text()).get("workload") if newest else None
    except (OSError, ValueError, AttributeError):
        return None


def _pbt_knobs(wl: registry.Workload, run_dir: Path, saved: dict, overridden: set) -> None:
    """A member of a PBT sweep (raysys/train/pbt.py) goes on with the knobs its weights were trained with
    last, not those it was proposed with: set in ``saved`` (in place), and those PBT changed said, but
    for the ``overridden`` ones (--set keys, which change them again)."""
    from raysys.train.pbt import checkpoint_knobs

    changed = {}
    for key, value in checkpoint_knobs(run_dir, wl.name).items():
        *path, last = key.split(".")
        node = saved
        for part in path:
            node = node.setdefault(part, {})
        if node.get(last) != value and key not in overridden:
            changed[key] = value
        node[last] = value
    if changed:
        print(f"[raysys] note: population-based training left this run at {', '.join(f'{k}={v!r}' for k, v in changed.items())}"
              ": the resume goes on with them (--set changes them)", flush=True)


def _checkpoint_config(wl: registry.Workload, run_dir: Path) -> Optional[dict]:
    """Every config snapshot of the run damaged (by hand, a disk): the config its newest checkpoint recorded,
    said in a note; without one, this command's config, also said (not silently)."""
    from raysys.checkpoint import newest_meta

    damaged = [p.name for p in (run_dir / "config.yaml", *sorted(run_dir.glob("config.resume-*.yaml"))) if p.is_file()]
    latest, meta = newest_meta(run_dir, wl.name)
    config = meta.get("config")
    if not damaged and config is None:
        return None  # no snapshot was ever written (killed before it): nothing to say
    what = (f"the run's saved config ({', '.join(damaged)} in {run_dir}) cannot be read" if damaged
            else f"the run has no saved config in {run_dir}")
    if isinstance(config, dict):
        print(f"[raysys] note: {what}: this session continues with the config its checkpoint {latest.name} "
              "recorded", flush=True)
        return config
    print(f"[raysys] note: {what}: this session uses the config of this command line (give the run's --preset "
          "and --set again if it differs)", flush=True)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    from raysys.lifecycle import STOP_SIGNALS

    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        return _main(argv)
    finally:
        from raysys import lifecycle

        lifecycle.restore_signal_handlers(handlers)


def _main(argv: Optional[list[str]] = None) -> int:
    from raysys import lifecycle

    lifecycle.reset()  # a stop request belongs to one command (main may be called again in-process)
    args = build_parser().parse_args(argv)
    if args.verbose:
        os.environ[console.VERBOSE_ENV] = "1"  # child processes and Ray workers started from here inherit it
    console.setup_logging()
    try:
        if args.command == "list":
            plugins = set(registry.plugins())
            names = args.workloads or registry.available()
            w = max([16, *(len(n) for n in names)])
            loaded = {}
            for name in names:  # all loaded before one is printed: a name that fails is one line, alone
                try:
                    loaded[name] = registry.get(name)
                except ConfigError as e:  # a broken plug-in does not hide the others
                    if args.workloads:  # named on the command line: bad input
                        raise
                    loaded[name] = e
            for name, wl in loaded.items():
                if isinstance(wl, ConfigError):
                    print(f"{name:{w}s} (plug-in failed to load: {wl})")
                    continue
                kind = "yours" if ":" in name else "plug-in" if name in plugins else "built-in"
                vec = "; sweeps vectorize (--vectorize K)" if wl.population is not None else ""
                print(f"{name:{w}s} {wl.description} [{kind}]\n{'':{w}s} presets: {', '.join(wl.presets)}{vec}")
            if not args.workloads:
                for hidden in registry.shadowed():
                    print(f"(an installed plug-in named like a built-in, reached only as module:attr: {hidden})")
                print("\nYour own: python -m raysys train my_module:WORKLOAD (docs/your-workload.md); its presets: "
                      "python -m raysys list my_module:WORKLOAD; or install it with an entry point in the "
                      f"'{registry.ENTRY_POINT_GROUP}' group")
            return 0
        wl, cfg = build_config(args)
        if args.command == "show" and args.keys:
            from raysys.config import describe

            for key, value, doc in describe(cfg):
                print(f"{key} = {value!r}\n    {doc}" if doc else f"{key} = {value!r}")
            return 0
        if args.command == "show":
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        from raysys import lifecycle

        lifecycle.install_signal_handlers()  # SIGINT/TERM/HUP/USR1/USR2: checkpoint at the next step, then stop
        from raysys.tracking import command_line

        tags = {"raysys.command": command_line(argv)[:5000]}  # how to run it again
        if not getattr(args, "resume", False):  # a resume continues the run's own config, whatever --preset says
            tags["raysys.preset"] = args.preset or "default"
        if getattr(args, "resume_changes", ""):  # MLflow keeps a param's first value: the change goes in a tag
            tags["raysys.resume_changes"] = args.resume_changes[:5000]  # said when the run opens (or refused)
        if getattr(args, "cv", False):
            from raysys.train.cv import run_cross_validation

            result = run_cross_validation(wl, cfg, tags)
        elif wl.task is not None:
            from raysys.train.launcher import run_training

            result = run_training(registry.ref(wl), cfg, tags=tags)
        else:
            from raysys.session import run_custom

            result = run_custom(wl, cfg, tags=tags)
        if getattr(result, "stopped_by", None) is not None:
            print(f"[raysys] {signal.Signals(result.stopped_by).name}: run '{result.name}' stopped with a checkpoint "
                  f"(MLflow: KILLED). Resume with:\n  {result.resume_command}", flush=True)
            return lifecycle.exit_code(result.stopped_by)
        if getattr(result, "failure", ""):  # it ended without an error but diverged: the run is FAILED
            from raysys import storage

            print(f"[raysys] run '{result.name}' FAILED: {result.failure} (MLflow: FAILED, tag raysys.error)\n"
                  f"  {getattr(result, 'where', '') or storage.where(result.run_dir)}", flush=True)
            return 1
        print(_summary(wl, result))
        return 0
    except ConfigError as e:
        from raysys.train.code_checks import error_kind

        print(f"raysys: {error_kind(e)}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not lifecycle.armed():
            print("raysys: stopped before the run started; nothing to resume", file=sys.stderr)
        else:
            kept = ("the run keeps its last checkpoint" if lifecycle.saved()
                    else "the run had no checkpoint yet (a resume starts it again from step 0)")
            hint = lifecycle.resume_hint()
            print(f"raysys: interrupted; {kept}, " + (f"resume it with:\n  {hint}" if hint else "(resume with --resume)"),
                  file=sys.stderr)
        return lifecycle.exit_code(lifecycle.stop_requested() or signal.SIGINT)
    except BrokenPipeError:  # whoever read the output went away (`... | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1
    except Exception as e:
        from raysys import storage
        from raysys.checkpoint import CheckpointError
        from raysys.train.failures import environment_line, find_cause

        lost = find_cause(e, (storage.LeaseLost,))
        if lost is not None:  # another process trains the run now: nothing to resume here
            print(f"raysys: {lost}", file=sys.stderr)
            return 1
        root = find_cause(e, (CheckpointError, ConfigError))
        if root is not None:
            print(f"raysys: {type(root).__name__}: {root}", file=sys.stderr)
            return 2
        line = environment_line(e)
        if line and not lifecycle.armed():  # before the run existed: nothing to resume, and bad input
            print(f"raysys: {line} (nothing was created)", file=sys.stderr)
            return 2
        if line:  # a full disk, a lost tracking server: one line, the run resumable
            resume = getattr(e, "raysys_resume", None)
            print(f"raysys: {line}; the run keeps its last checkpoint, resume it with:\n  {resume}" if resume else
                  f"raysys: {line}; the run keeps its last checkpoint (resume with --resume)", file=sys.stderr)
            return 1
        failed = getattr(e, "raysys_failure", None)
        if failed:  # an error in the training code: where it was raised, then where the run keeps it all
            print(_traceback_tail(e), file=sys.stderr)
            print(failed, file=sys.stderr)
            return 1
        raise


def _traceback_tail(e: BaseException, frames: int = 3) -> str:
    """Where the training code raised an error: its last ``frames`` frames outside installed packages and
    raysys, and the error, not the frames of Ray's and torch's wrappers around it (all of it: ``-v``, and
    the run's error.txt)."""
    from raysys.train.failures import full_traceback

    text = full_traceback(e).rstrip()  # a Ray Train worker's whole traceback last: its own frames
    if console.verbose():
        return text
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not starts:
        return text
    end = next((i for i in range(starts[-1] + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    groups = [lines[i:j] for i, j in zip(starts, starts[1:] + [end])]
    own = [g for g in groups if "site-packages" not in g[0] and f"{os.sep}raysys{os.sep}" not in g[0]]
    shown = (own or groups)[-frames:]
    return "\n".join(["Traceback (its last frames; -v or the run's error.txt for all of it):",
                      *[line for g in shown for line in g], *lines[end:]])


def _summary(wl: registry.Workload, result: Any) -> str:
    """The one summary at the end: quality, speed, where the run lives."""
    from raysys import storage

    m = result.metrics

    def fmt(key: str) -> str:
        from raysys.tune.report import fmt_value

        v = m.get(key)
        return fmt_value(float(v)) if isinstance(v, (int, float)) else "n/a"  # 18,402 rather than 1.84e+04

    line = (f"[raysys] done: run '{result.name}' | {wl.quality_metric} {fmt(wl.quality_metric)} | "
            f"{wl.throughput_metric} {fmt(wl.throughput_metric)} | {getattr(result, 'where', '') or storage.where(result.run_dir)}")
    if result.run_id:
        from raysys import tracking

        try:  # the link again, where the user looks last; a tracking outage must not hide the result
            line += "\n" + tracking.ui_lines(result.tracking_uri, tracking.ui_link(
                result.tracking_uri, tracking.experiment_of(result.tracking_uri, result.run_id), result.run_id))
        except Exception:
            pass
    return line


def entry() -> None:
    """The ``raysys`` command (``python -m raysys``)."""
    console.exit_with(main())


if __name__ == "__main__":
    entry()
