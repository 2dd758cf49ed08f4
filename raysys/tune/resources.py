"""Size a sweep to its cluster so that trials can never deadlock it.

A trial reserves its own CPU (plus its GPU when it trains itself); Ray Train workers, when a trial
uses them, get a separate placement group. Both must fit at the same time, or trials hold the CPUs
their workers wait for (ray issue 47439): the sweep runs at most floor(cluster / per-trial) at once.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from raysys.config import ConfigError
from raysys.tune import space as spaces

DRIVER_CPUS = 0.5
"""CPU a trial reserves when Ray Train workers do the training (it only drives and relays)."""


def _launch_values(sp: spaces.SweepSpace, base: Any, key: str) -> list[float]:
    """Every value a launch setting can take in this sweep (the base, or all of a knob's candidates)."""
    dotted = f"launch.{key}"
    if dotted in sp.knobs:
        return [float(v) for v in sp.knobs[dotted].candidates()]
    return [float(getattr(base.launch, key))]


def trial_resources(launch: dict[str, Any], knobs: dict[str, Any]) -> dict[str, float]:
    """What one trial reserves for itself; Train workers (if any) get their own placement group."""
    workers = int(knobs.get("launch.workers", launch["workers"]))
    gpus = float(knobs.get("launch.gpus_per_worker", launch["gpus_per_worker"]))
    cpus = float(knobs.get("launch.cpus_per_worker", launch["cpus_per_worker"]))
    if workers == 0:  # the trial trains itself (in its child process)
        return {"cpu": max(1.0, cpus), **({"gpu": gpus} if gpus > 0 else {})}
    return {"cpu": DRIVER_CPUS}


def footprint(sp: spaces.SweepSpace, base: Any) -> tuple[float, float]:
    """Worst-case (CPUs, GPUs) of one trial: its own reservation plus all its Train workers, which
    must fit at the same time or the sweep hangs with trials waiting on workers forever."""
    worst_cpu = worst_gpu = 0.0
    for w in _launch_values(sp, base, "workers"):
        for c in _launch_values(sp, base, "cpus_per_worker"):
            for g in _launch_values(sp, base, "gpus_per_worker"):
                own = trial_resources({"workers": w, "cpus_per_worker": c, "gpus_per_worker": g}, {})
                worst_cpu = max(worst_cpu, own["cpu"] + w * c)
                worst_gpu = max(worst_gpu, own.get("gpu", 0.0) + w * g)
    return worst_cpu, worst_gpu


def max_concurrent(cluster: dict[str, float], need_cpu: float, need_gpu: float, requested: Optional[int]) -> int:
    """How many trials fit at once; a sweep whose single trial cannot fit fails before it starts."""
    have_cpu, have_gpu = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    if need_cpu > have_cpu or need_gpu > have_gpu:
        raise ConfigError(f"one trial needs {need_cpu:g} CPU and {need_gpu:g} GPU (the trial plus its Train workers) "
                          f"but the cluster has {have_cpu:g} CPU and {have_gpu:g} GPU; lower launch.workers / "
                          "launch.cpus_per_worker in the space, or use a bigger cluster")
    fit = int(math.floor(have_cpu / need_cpu + 1e-9)) if need_cpu > 0 else 10**6
    if need_gpu > 0:
        fit = min(fit, int(math.floor(have_gpu / need_gpu + 1e-9)))
    if requested is not None and requested > fit:
        print(f"[raysys.tune] --max-concurrent {requested} does not fit ({need_cpu:g} CPU per trial, "
              f"{have_cpu:g} in the cluster): using {fit}", flush=True)
    return max(1, min(fit, requested or fit))
