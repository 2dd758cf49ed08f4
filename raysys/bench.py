"""``python -m raysys.bench <workload>``: the naive and optimized paths, measured in one process.

The seeds' speedups were mostly guesses. This runs both paths on the same data on this machine,
prints the ratio, and writes the figures as JSON (``--json``) with at least: workload, device,
naive.throughput, optimized.throughput, speedup, naive.quality, optimized.quality. A workload of
yours without a ``path_key`` (no naive/optimized pair) gets its configured training step, as
``configured.throughput``. The bench records nothing in MLflow: the runs it trains to judge quality go to
temporary stores, removed when it ends; ``--json`` keeps its figures. Exit 1 where a path computes another
function or learns worse than the other (the problem is said), 2 for bad input.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from raysys import console
from raysys import workload as registry
from raysys.config import ConfigError, apply_overrides, flatten, load_yaml, parse_set_args, to_dict


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def environment() -> dict:
    """What a reader of the JSON needs to compare it with another: when, which code, which libraries."""
    import datetime
    import subprocess
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "absent"

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "raysys_commit": commit,
            "python": platform.python_version(), **{pkg: version(pkg) for pkg in ("torch", "jax", "ray")},
            "cpus": os.cpu_count()}


def check_result(res: Any, name: str) -> dict:
    """A workload's own bench result, checked before the table reads it: a missing key is the bench's
    error, named in one line (the keys: ``raysys.workload.Workload.bench``)."""
    where = f"{name}'s bench returned"
    if not isinstance(res, dict):
        raise ConfigError(f"{where} a {type(res).__name__}, not a dict with 'naive' and 'optimized' rows")
    paths = res.get("paths", ("naive", "optimized"))
    for path in paths:
        row = res.get(path)
        if not isinstance(row, dict):
            raise ConfigError(f"{where} no '{path}' row (a dict with 'throughput' and optionally 'quality'); "
                              f"its keys: {', '.join(map(str, res)) or 'none'}")
        if not isinstance(row.get("throughput"), (int, float)) or isinstance(row.get("throughput"), bool):
            raise ConfigError(f"{where} a '{path}' row without a number 'throughput' (its keys: "
                              f"{', '.join(map(str, row)) or 'none'}); add it, in the unit 'throughput_unit' names")
    if "speedup" in res and not isinstance(res["speedup"], (int, float)):
        raise ConfigError(f"{where} a 'speedup' that is not a number ({res['speedup']!r})")
    if "speedup" not in res and set(paths) == {"naive", "optimized"} and res["naive"]["throughput"] > 0:
        res["speedup"] = res["optimized"]["throughput"] / res["naive"]["throughput"]  # as --help promises
    return res


def format_table(res: dict) -> str:
    unit = res.get("throughput_unit", "samples/s")
    qname = res.get("quality_metric", "quality") + (" (lower is better)" if res.get("quality_mode") == "min" else "")
    head_t = f"throughput ({unit})"
    w_t, w_q = len(head_t) + 2, max(len(qname), 10) + 2  # columns as wide as their headers
    lines = [f"workload {res['workload']} | device {res['device']}",
             f"{'path':<11}{head_t:>{w_t}}{qname:>{w_q}}"]
    for path in res.get("paths", ("naive", "optimized")):
        r = res[path]
        q = r.get("quality")
        q_text = f"{q:.4f}" if isinstance(q, (int, float)) else str(q)
        lines.append(f"{path:<11}{r['throughput']:>{w_t}.1f}{q_text:>{w_q}}")
    if "speedup" in res:
        lines.append(f"speedup    {res['speedup']:.2f}x")
    lines += [f"  ({note})" for note in res.get("notes", [])]  # what the rows compare, where it is not the path alone
    for k, v in res.get("extra", {}).items():
        lines.append(f"{k}: {v}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from raysys.train.launcher import BENCH_ENV

    before = os.environ.get(BENCH_ENV)
    os.environ[BENCH_ENV] = "1"  # its quality runs' stores are temporary: no MLflow links to them
    got: dict = {}

    def interrupt(signum, frame):  # SIGTERM (`timeout`, a scheduler), SIGHUP and SIGUSR1/2 end it as Ctrl-C does
        if signum == signal.SIGHUP:
            console.drop_lost_outputs()
        got.setdefault("signum", signum)
        raise KeyboardInterrupt

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        from raysys.lifecycle import STOP_SIGNALS, stop_signals

        handlers = {s: signal.signal(s, interrupt) for s in stop_signals(STOP_SIGNALS[1:])}
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C mid-measurement: no traceback into whatever it was timing
        signum = got.get("signum", signal.SIGINT)
        print(f"raysys.bench: {'interrupted' if signum == signal.SIGINT else signal.Signals(signum).name}; its "
              "temporary stores are removed and no results were written", file=sys.stderr)
        return 128 + signum
    finally:  # main called again from Python (a test, a notebook): the next train prints its links
        for s, h in handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        if before is None:
            os.environ.pop(BENCH_ENV, None)


def _main(argv: list[str] | None) -> int:
    p = console.ArgumentParser(prog="python -m raysys.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", help="a built-in or installed workload (an entry point of the 'raysys.workloads' group), or your "
                                    "own as module:attr or path/to/file.py:attr (see `python -m raysys list`)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and a shorter learning check (minutes on a laptop CPU, up to a quarter of an hour for ad_transformer, whose source tasks train first; the full bench takes longer)")
    p.add_argument("--preset", help="for a workload without its own bench: the preset whose training step is timed "
                                    "(default: quick with --quick where it exists, else default)")
    p.add_argument("--config", metavar="YAML", help="YAML file of config keys applied to the configuration the bench "
                                                    "measures (your data, your model's size), like train's --config")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", default=[],
                   help="one config key for the measured configuration, e.g. --set data.path=my.parquet "
                        "(repeatable; applied after --config)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH (a file there is replaced, "
                   "whole: written aside, then moved into place)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where both paths run: cuda (a GPU; JAX workloads on JAX's GPU backend), cpu (GPUs hidden "
                        "from torch and JAX), auto (default): cuda where a GPU is visible, else cpu")
    args = p.parse_args(argv)
    if args.device == "cpu":  # before torch or JAX first touch a GPU: both then see none
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["JAX_PLATFORMS"] = "cpu"
    elif args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("raysys.bench: --device cuda: no CUDA device is visible to torch", file=sys.stderr)
            return 2

    console.setup_logging()
    try:
        if args.json:  # before minutes of measuring, not after
            from raysys.storage import check_local_folder

            if Path(args.json).expanduser().is_dir():
                raise ConfigError(f"--json {args.json} is a folder; name the file to write, e.g. "
                                  f"{Path(args.json) / 'bench.json'}")
            check_local_folder(Path(args.json).expanduser().resolve().parent, "--json folder")
        wl = registry.get(args.workload)
        measured_on = device_name()  # before the bench's own training runs change torch's thread count
        sets = parse_set_args(args.sets)
        registry.check_sets(wl, sets)
        overrides = (load_yaml(args.config) if args.config else {}) | sets
        if wl.path_key and wl.path_key in overrides:
            raise ConfigError(f"--set/--config {wl.path_key}: the bench measures both paths (naive and optimized) "
                              f"itself; time one path with `python -m raysys train {args.workload} --set "
                              f"{wl.path_key}=...` (its perf/ metrics)")
        if wl.bench is None and wl.task is None:  # said before the banner: nothing is measured
            raise ConfigError(f"{wl.name} trains with its own loop (train_fn) and has no bench: give "
                              "Workload(bench=...) a function that measures it")
        if wl.bench is not None and args.preset:  # said, not ignored (AY F10)
            takes = "overrides" in inspect.signature(wl.bench).parameters
            raise ConfigError(f"--preset {args.preset}: {wl.name}'s bench measures a configuration of its own "
                              "(--preset is for a workload without one)"
                              + ("; change its keys with --set/--config" if takes else ""))
        if wl.bench is not None and overrides and "overrides" not in inspect.signature(wl.bench).parameters:
            raise ConfigError(f"{wl.name}'s bench measures fixed shapes of its own and takes no --set/--config; time "
                              f"your configuration with `python -m raysys train {wl.name} --set ...` (its perf/ "
                              "metrics), or compare configurations with `python -m raysys.tune`")
        if overrides or wl.bench is None:  # before the banner: every key and value, whoever applies them (a bench of
            from raysys.bench_generic import bench_preset  # its own may ignore one), the preset, the path key

            applied = flatten(to_dict(apply_overrides(wl.config(bench_preset(wl, args.quick, args.preset)), overrides)))
            # a bench of its own gets each --set value typed as its config field is ('128' -> 128), as --config's are
            overrides = {k: applied.get(k, v) if isinstance(v, str) else v for k, v in overrides.items()}
        what = ("step times, then how each path learns from the same weights" if wl.bench is None
                else "with its own bench")
        print(f"[raysys.bench] measuring {wl.name}{' (quick)' if args.quick else ''} on {measured_on}: {what}; "
              "the table comes at the end", flush=True)
        if wl.bench is None:
            from raysys.bench_generic import generic_bench

            res = generic_bench(wl, quick=args.quick, preset=args.preset, overrides=overrides)
        else:
            res = check_result(wl.bench(quick=args.quick, **({"overrides": overrides} if overrides else {})), wl.name)
    except ConfigError as e:
        from raysys.train.code_checks import error_kind

        print(f"raysys.bench: {error_kind(e)}: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # the user's data, read by the bench: one line, as train says it
        print(f"raysys.bench: data error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    if overrides:
        res["overrides"] = {k: str(v) for k, v in overrides.items()}
        res.setdefault("extra", {})["measured with"] = " ".join(f"{k}={v}" for k, v in overrides.items())
    res.setdefault("workload", wl.name)
    if not res.get("device"):
        res["device"] = measured_on
    res.setdefault("environment", environment())
    source = registry.origin(wl)
    if source:  # a plug-in: which package (and version) or file was measured
        res["environment"].setdefault("workload_source", source)
    print(format_table(res))
    if args.json:
        out = Path(args.json).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # whole or not at all: an earlier result stays whole
        tmp.write_text(json.dumps(res, indent=2, default=float))
        os.replace(tmp, out)
        print(f"wrote {args.json}")
    for problem in res.get("problems", []):
        print(f"raysys.bench: {problem}", file=sys.stderr)
    return 1 if res.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
