"""``python -m raysys.tune``: speed/quality sweep of one workload (Ray Tune + Optuna, tracked in MLflow)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from raysys import console, tracking
from raysys.config import ConfigError, parse_set_args

EPILOG = """examples:
  python -m raysys.tune --space tune_spaces/deep_gpcm.yaml                        # 8 trials, local Ray
  python -m raysys.tune --space tune_spaces/deep_gpcm.yaml --num-samples 6 --budget 15
  python -m raysys.tune --space tune_spaces/deep_gpcm.yaml --name s1 --resume     # continue an interrupted sweep
  python -m raysys.tune --space tune_spaces/deep_gpcm.yaml --address auto --max-concurrent 4
  python -m raysys.tune --space tune_spaces/deep_gpcm.yaml --set train.compile=false   # pin a knob
  python -m raysys.tune --space tune_spaces/hackmatrix_ppo_members.yaml --vectorize 8 --scheduler pbt

Objectives: the workload's throughput metric (maximised) and its quality metric (maximised, or
minimised with objectives.quality_mode: min, e.g. a loss or an error rate); a trial that
turns unstable (non-finite loss, too many loss spikes, a metric outside its bounds) is stopped,
tagged unstable and gets the space's quality penalty. See docs/tune.md and docs/objectives.md.
"""


def build_parser() -> argparse.ArgumentParser:
    p = console.ArgumentParser(prog="python -m raysys.tune", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Search a workload's speed knobs (batch size, accumulation, precision, "
                                            "compile, loader workers, naive vs optimized path, lr) for the Pareto "
                                            "front of throughput vs quality, and recommend a configuration.",
                                epilog=EPILOG)
    p.add_argument("-v", "--verbose", action="store_true", help="also show Ray's, Tune's and MLflow's own INFO logs")
    p.add_argument("--space", required=True, metavar="YAML",
                   help="tune space file (tune_spaces/<workload>.yaml): workload (a built-in, an installed plug-in's "
                        "entry point name, or module:attr), base preset, fixed overrides, knobs")
    p.add_argument("--num-samples", type=int, metavar="N",
                   help="trials to run in total (default: 8; a --resume keeps the sweep's own: another N is refused); "
                        "grid combinations are tried first")
    p.add_argument("--max-concurrent", type=int, metavar="K",
                   help="trials at once; default and upper bound: as many as fit the cluster's CPUs/GPUs (each "
                        "trial's own CPU plus all its Train workers must fit at the same time)")
    p.add_argument("--budget", type=float, metavar="MINUTES",
                   help="wall-clock budget of the sweep; trials still running then are stopped and left out of "
                        "the front, and the sweep ends (a --resume of it reports it again and runs nothing more; a "
                        "sweep stopped by a signal resumes with the --budget its resume gives). No budget by default")
    p.add_argument("--address", type=console.given_arg, help="Ray cluster address (e.g. auto, ray://head:10001); default: $RAY_ADDRESS or "
                                     "a Ray instance started in this process")
    p.add_argument("--tracking-uri", type=console.given_arg, help="MLflow tracking URI for the parent and trial runs; default "
                                          "$RAYSYS_TRACKING_URI, else $MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db")
    p.add_argument("--resume", action="store_true",
                   help="continue the sweep --name (or, without it, this workload's newest sweep named by default): finished trials are "
                        "kept, unfinished ones continue from their own checkpoints, the rest are run")
    p.add_argument("--name", type=console.name_arg, help="sweep name: its folder under --storage-path and its MLflow parent run name "
                                  "(default: <workload>-sweep-<time>)")
    p.add_argument("--storage-path", type=console.given_arg, default="raysys_runs/sweeps", metavar="DIR",
                   help="folder for the sweep's Tune state, trial runs, checkpoints and report (default: %(default)s; "
                        "on a multi-node cluster a folder all nodes share)")
    p.add_argument("--tolerance", type=float, metavar="T",
                   help="the recommendation is the fastest trial within T (absolute, in the quality metric's units) "
                        "of the best quality; default: the space's objectives.tolerance, else 0.02")
    p.add_argument("--seed", type=int, default=0, help="seed of the Optuna sampler (default: %(default)s)")
    p.add_argument("--vectorize", type=int, default=1, metavar="K",
                   help="train up to K configurations per trial as one program (one process, one compile), each "
                        "with its own params, optimizer state, seed and MLflow run; for workloads with a population "
                        "program (hackmatrix_ppo, ad_source, or yours: docs/your-workload.md). Configurations that differ in a shape knob (num_envs, widths, "
                        "precision...) go to separate programs. The members are batched (vmap) on a GPU/TPU and run "
                        "in turn through one compiled program on a CPU (train.population). "
                        "Default: 1 (one configuration per trial)")
    p.add_argument("--scheduler", choices=("fifo", "pbt"), default="fifo",
                   help="fifo (default): every trial runs to its end, only an unstable one stops early. pbt: "
                        "population-based training inside each vectorized program (needs --vectorize K): every "
                        "--pbt-interval chunks the worst members take a best member's weights and its "
                        "hyper-parameters, perturbed within the space's bounds (x0.8/x1.2, a neighbouring choice); "
                        "the knobs each member ended with are its trial's in the report, and its MLflow run charts "
                        "them (pbt/<knob>). See docs/tune.md")
    p.add_argument("--pbt-interval", type=int, metavar="N",
                   help="pbt: chunks (each member's reports) between two rounds (default: 4)")
    p.add_argument("--pbt-quantile", type=float, metavar="Q",
                   help="pbt: the worst Q of a program's members exploit the best Q (at least one each; default: 0.25)")
    p.add_argument("--max-failures", type=int, default=2, metavar="N",
                   help="times a failed trial (its process died, e.g. killed or out of memory, or it raised) is "
                        "started again, from its run's last checkpoint; a vectorized trial's finished members are "
                        "kept; an error no restart can fix (a config error from the trial's knobs, an unusable "
                        "checkpoint, a full disk) ends the trial at once (default: %(default)s; Tune's "
                        "FailureConfig(max_failures))")
    p.add_argument("--fresh-processes", action="store_true",
                   help="start every trial in a new process (default: a finished trial's process takes the next "
                        "trial of the same resources, keeping its imports and warm caches; Tune's reuse_actors)")
    p.add_argument("--preset", help="replace the space's base preset (e.g. quick for a smoke run)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra fixed override for every trial (repeatable); naming a knob pins it to this value")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        os.environ[console.VERBOSE_ENV] = "1"
    console.setup_logging()
    try:
        for flag in ("num_samples", "max_concurrent"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        if args.max_failures < 0:
            raise ConfigError(f"--max-failures must be >= 0, got {args.max_failures}")
        given = [f for f in ("pbt_interval", "pbt_quantile") if getattr(args, f) is not None]
        if given and args.scheduler != "pbt":
            raise ConfigError(f"--{given[0].replace('_', '-')} is a setting of --scheduler pbt, which this command "
                              "does not ask for")
        args.pbt_interval = 4 if args.pbt_interval is None else args.pbt_interval
        args.pbt_quantile = 0.25 if args.pbt_quantile is None else args.pbt_quantile
        if args.pbt_interval < 1:
            raise ConfigError(f"--pbt-interval must be >= 1, got {args.pbt_interval}")
        if args.vectorize < 1:
            raise ConfigError(f"--vectorize must be >= 1, got {args.vectorize}")
        if args.budget is not None and not 0 < args.budget < float("inf"):  # nan and inf too: no budget is no --budget
            raise ConfigError(f"--budget must be a number of minutes > 0, got {args.budget}")
        if args.tolerance is not None and not args.tolerance >= 0:
            raise ConfigError(f"--tolerance must be >= 0 (a quality difference), got {args.tolerance}")
        from raysys.tune.runner import SweepOptions, run_sweep

        outcome = run_sweep(SweepOptions(
            space=args.space, num_samples=args.num_samples, max_concurrent=args.max_concurrent,
            budget_minutes=args.budget, address=args.address, tracking_uri=args.tracking_uri, resume=args.resume,
            name=args.name, storage_path=args.storage_path, tolerance=args.tolerance, seed=args.seed,
            preset=args.preset, sets=parse_set_args(args.sets), vectorize=args.vectorize, max_failures=args.max_failures,
            reuse_processes=not args.fresh_processes, scheduler=args.scheduler, pbt_interval=args.pbt_interval,
            pbt_quantile=args.pbt_quantile,
            command=tracking.command_line(argv, module="raysys.tune")))
    except ConfigError as e:
        from raysys.train.code_checks import error_kind

        print(f"raysys.tune: {error_kind(e)}: {e}", file=sys.stderr)
        return 2
    except tracking.TrackingOutageError as e:  # an outage longer than the sweep waits: not the command's mistake
        print(f"raysys.tune: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a full disk, a lost tracking server: one line; the sweep keeps what it saved
        from raysys.train.failures import environment_line

        line = environment_line(e)
        if line is None:
            raise
        from raysys.tune.runner import SAVED

        print(f"raysys.tune: {line}; " + ("the sweep keeps its saved state and its trials' checkpoints (continue it "
                                          "with the same command and --resume)" if SAVED.get("sweep_dir") else "nothing to resume"),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a signal sent again: stopped at once, with what Tune had saved
        from raysys.tune.runner import SAVED

        if not SAVED.get("sweep_dir"):
            print("raysys.tune: stopped before the sweep started; nothing to resume", file=sys.stderr)
            return 130
        if not SAVED.get("fitting"):  # its MLflow parent and state exist, no trial started yet
            print(f"raysys.tune: stopped before its trials started (MLflow: KILLED); continue it with:\n  "
                  f"{SAVED['parent'][2]}", file=sys.stderr)
            return 130
        print("raysys.tune: stopped at once (MLflow: KILLED); the sweep keeps its saved state and its trials' "
              f"checkpoints; continue it with:\n  {SAVED['parent'][2]}", file=sys.stderr)
        return 130
    if outcome.interrupted:
        return 128 + outcome.signum  # 130 after Ctrl-C, 143 after SIGTERM
    from raysys.tune.pareto import INCOMPLETE
    from raysys.tune.progress import objective_never_reported

    never = objective_never_reported(outcome.records)
    if never is not None:  # the space names a metric no trial has
        print(f"raysys.tune: config error: no trial reported an objective of the space: {never}", file=sys.stderr)
        return 2
    ended = [r for r in outcome.records if r.status != INCOMPLETE]  # the others were cut by the stop
    if not ended:  # a --budget that ended before any trial did: a script must see that nothing was measured
        print(f"raysys.tune: no trial finished within the --budget ({len(outcome.records)} stopped by it): raise "
              "--budget, or shorten the trials", file=sys.stderr)
        return 1
    from raysys.tune.pareto import ERROR

    failed = [r for r in outcome.records if r.status == ERROR]
    if outcome.records and len(failed) == len(outcome.records):  # nothing trained: a script must see it
        print(f"raysys.tune: every trial failed; the first: {failed[0].reason.splitlines()[0] if failed[0].reason else '?'}",
              file=sys.stderr)
        # each with a configuration error (a quality metric evaluate() never returns): the workload's, exit 2
        return 2 if all(r.reason.startswith(("ConfigError", "DataError", "WorkloadCodeError")) for r in failed) else 1
    return 0


if __name__ == "__main__":
    console.exit_with(main())
