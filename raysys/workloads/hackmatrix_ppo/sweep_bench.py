"""The same sweep twice, one trial per configuration vs ``--vectorize K``: wall time, fronts, qualities.

    python -m raysys.workloads.hackmatrix_ppo.sweep_bench [--configs 8] [--preset quick] [--json out.json]

Both sweeps run ``python -m raysys.tune`` end to end (Ray, Optuna, MLflow, reports) in a fresh folder
with a fresh JAX compilation cache each, on the same space and sampler seed, so they try the same
configurations with the same env steps each. The knobs change no shape (learning rate, entropy and
value coefficients, clip range, seed), so the vectorized sweep is one program. Wall time is the
whole command's.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SPACE = {
    "workload": "hackmatrix_ppo",
    "description": "shape-free knobs only: one program when vectorized",
    "fixed": {"launch.workers": 0},
    "space": {"optim.lr": {"loguniform": [1.0e-4, 2.0e-3]}, "ppo.ent_coef": {"choice": [0.0, 0.01, 0.05, 0.1]},
              "ppo.vf_coef": {"choice": [0.25, 0.5, 1.0]}, "ppo.clip_eps": {"choice": [0.1, 0.2, 0.3]},
              "train.seed": {"randint": [0, 1000]}},
    "objectives": {"throughput": "perf/env_steps_per_s", "quality": "eval/quality", "tolerance": 0.05},
}


def run_sweep(folder: Path, name: str, n: int, preset: str, vectorize: int) -> dict:
    cmd = [sys.executable, "-m", "raysys.tune", "--space", "space.yaml", "--num-samples", str(n), "--name", name,
           "--preset", preset, "--set", f"train.compilation_cache_dir={folder / ('jax-cache-' + name)}"]
    if vectorize > 1:
        cmd += ["--vectorize", str(vectorize)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"sweep {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(folder / "raysys_runs" / "sweeps" / name / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    knobs = sorted(SPACE["space"])
    by_config = {tuple(r[k] for k in knobs): r for r in rows}
    return {"wall_s": wall, "trials": by_config,
            "front": sorted(k for k, r in by_config.items() if r["on_front"] == "True"),
            "recommended": [k for k, r in by_config.items() if r["recommended"] == "True"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=int, default=8, help="configurations in the sweep (default: %(default)s)")
    p.add_argument("--preset", default="quick", help="base preset of every trial (default: %(default)s)")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raysys-sweep-bench-") as tmp:
        folder = Path(tmp)
        (folder / "space.yaml").write_text(yaml.safe_dump(SPACE))
        alone = run_sweep(folder, "alone", args.configs, args.preset, 1)
        vec = run_sweep(folder, "vectorized", args.configs, args.preset, args.configs)
    same_configs = set(alone["trials"]) == set(vec["trials"])
    diffs = [abs(float(alone["trials"][k]["quality"]) - float(vec["trials"][k]["quality"]))
             for k in alone["trials"] if k in vec["trials"]]
    out = {"configs": args.configs, "preset": args.preset,
           "wall_s": {"one_trial_each": round(alone["wall_s"], 1), "vectorized": round(vec["wall_s"], 1)},
           "speedup": round(alone["wall_s"] / vec["wall_s"], 2), "same_configurations": same_configs,
           "max_quality_difference": max(diffs) if diffs else None,
           "front": {"one_trial_each": alone["front"], "vectorized": vec["front"]},
           "same_front": alone["front"] == vec["front"],
           "same_recommendation": alone["recommended"] == vec["recommended"]}
    print(f"{args.configs} configurations, preset {args.preset}: one trial each {alone['wall_s']:.1f} s, "
          f"vectorized {vec['wall_s']:.1f} s -> {out['speedup']:.2f}x less wall time")
    print(f"same configurations: {same_configs}; largest quality difference per configuration: "
          f"{out['max_quality_difference']}; same front: {out['same_front']} "
          f"({len(alone['front'])} vs {len(vec['front'])} on it); same recommendation: {out['same_recommendation']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
