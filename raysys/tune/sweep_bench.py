"""The same sweep twice, one trial per configuration vs ``--vectorize K``: wall time, fronts, qualities.

    python -m raysys.tune.sweep_bench --space tune_spaces/hackmatrix_ppo_members.yaml [--configs 8]
        [--preset quick] [--json out.json]

For any workload with a population program (``python -m raysys list`` marks those whose sweeps
vectorize). Both sweeps run
``python -m raysys.tune`` end to end (Ray, Optuna, MLflow, reports) in a fresh folder, with a fresh
JAX compilation cache each where the workload has ``train.compilation_cache_dir``, on the same space
and sampler seed, so they try the same configurations with the same steps each. A space whose knobs
change no shape makes the vectorized sweep one program; shape knobs split it into several. Wall
time is the whole command's.

``--warm-cache`` measures a sweep as a user's next sweep of the same shapes runs it: raysys keeps
compiled programs in a persistent cache (``train.compilation_cache_dir``), so there both sweeps
share one cache that untimed sweeps of each kind filled first, and neither pays a compile.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE_KEY = "train.compilation_cache_dir"


def run_sweep(folder: Path, space: Path, knobs: list[str], name: str, n: int, preset: str, vectorize: int,
              cache: Path | None) -> dict:
    cmd = [sys.executable, "-m", "raysys.tune", "--space", str(space), "--num-samples", str(n), "--name", name,
           "--preset", preset]
    if cache is not None:
        cmd += ["--set", f"{CACHE_KEY}={cache}"]
    if vectorize > 1:
        cmd += ["--vectorize", str(vectorize)]
    # each sweep runs in a fresh folder: a plug-in named module:attr is still found where the bench was started
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"sweep {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(folder / "raysys_runs" / "sweeps" / name / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    by_config = {tuple(r[k] for k in knobs): r for r in rows}
    return {"wall_s": wall, "trials": by_config,
            "front": sorted(k for k, r in by_config.items() if r["on_front"] == "True"),
            "recommended": [k for k, r in by_config.items() if r["recommended"] == "True"]}


def main(argv=None) -> int:
    from raysys.config import ConfigError, allowed_keys
    from raysys.tune import space as sp

    p = argparse.ArgumentParser(prog="python -m raysys.tune.sweep_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--space", required=True, help="tune space of a workload with a population program")
    p.add_argument("--configs", type=int, default=8, help="configurations in the sweep (default: %(default)s)")
    p.add_argument("--preset", default="quick", help="base preset of every trial (default: %(default)s)")
    p.add_argument("--warm-cache", action="store_true",
                   help="both sweeps share one JAX compilation cache, filled first by untimed sweeps of each kind: "
                        "a second sweep of the same shapes (default: each sweep starts from an empty cache)")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    try:
        space = sp.load(args.space, args.preset)
        cache = CACHE_KEY in allowed_keys(space.base_config())
        if args.warm_cache and not cache:
            raise ConfigError(f"--warm-cache: {space.workload} has no {CACHE_KEY}")
    except ConfigError as e:
        print(f"raysys: {e}", file=sys.stderr)
        return 2
    knobs, path = sorted(space.knobs), Path(args.space).resolve()
    with tempfile.TemporaryDirectory(prefix="raysys-sweep-bench-") as tmp:
        folder = Path(tmp)

        def cache_of(name: str) -> Path | None:
            return None if not cache else folder / ("jax-cache" if args.warm_cache else f"jax-cache-{name}")

        if args.warm_cache:  # every program either sweep compiles: a lone trial's, and the population's of K
            for name, n, k in (("warm-alone", 1, 1), ("warm-vectorized", args.configs, args.configs)):
                run_sweep(folder, path, knobs, name, n, args.preset, k, cache_of(name))
        alone = run_sweep(folder, path, knobs, "alone", args.configs, args.preset, 1, cache_of("alone"))
        vec = run_sweep(folder, path, knobs, "vectorized", args.configs, args.preset, args.configs,
                        cache_of("vectorized"))
    same_configs = set(alone["trials"]) == set(vec["trials"])
    diffs = [abs(float(alone["trials"][k]["quality"]) - float(vec["trials"][k]["quality"]))
             for k in alone["trials"] if k in vec["trials"]]
    out = {"workload": space.workload, "configs": args.configs, "preset": args.preset,
           "jax_cache": "warm" if args.warm_cache else ("cold" if cache else None),
           "wall_s": {"one_trial_each": round(alone["wall_s"], 1), "vectorized": round(vec["wall_s"], 1)},
           "speedup": round(alone["wall_s"] / vec["wall_s"], 2), "same_configurations": same_configs,
           "max_quality_difference": max(diffs) if diffs else None,
           "front": {"one_trial_each": alone["front"], "vectorized": vec["front"]},
           "same_front": alone["front"] == vec["front"],
           "same_recommendation": alone["recommended"] == vec["recommended"],
           "knobs": knobs,
           "trials": {side: [{"config": list(k), "throughput": float(r["throughput"] or "nan"),
                              "quality": float(r["quality"] or "nan"), "on_front": r["on_front"] == "True"}
                             for k, r in sorted(res["trials"].items())]
                      for side, res in (("one_trial_each", alone), ("vectorized", vec))}}
    print(f"{space.workload}: {args.configs} configurations, preset {args.preset}"
          f"{', warm JAX cache' if args.warm_cache else ''}: one trial each "
          f"{alone['wall_s']:.1f} s, vectorized {vec['wall_s']:.1f} s -> {out['speedup']:.2f}x less wall time")
    print(f"same configurations: {same_configs}; largest quality difference per configuration: "
          f"{out['max_quality_difference']}; same front: {out['same_front']} "
          f"({len(alone['front'])} vs {len(vec['front'])} on it); same recommendation: {out['same_recommendation']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
