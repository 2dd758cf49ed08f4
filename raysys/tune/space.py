"""Tune spaces: a YAML file that names a workload, its base preset, fixed overrides and the knobs.

```yaml
workload: deep_gpcm
preset: quick                        # the base config every trial starts from
fixed: {train.epochs: 2}             # applied to every trial, before the knobs
space:                               # dotted config paths -> one domain each
  train.batch_size: {choice: [16, 32, 64]}
  model.path: {grid: [naive, optimized]}
  optim.lr: {loguniform: [1.0e-4, 1.0e-2]}
objectives: {tolerance: 0.02, quality_penalty: -1.0}   # quality_mode: min where lower is better
stability: {max_loss_spikes: 3, bounds: {train/loss: {max: 20}}}
```

Everything is checked before anything starts: each candidate value of each knob is applied to the
workload's config with ``apply_overrides``, so an unknown path or a value the config refuses fails
with one ``ConfigError`` that names the file, the knob and the reason.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional


from raysys import workload as registry
from raysys.config import ConfigError, apply_overrides, flatten, put_once, read_yaml

DOMAINS = ("choice", "grid", "uniform", "loguniform", "randint")
TOP_KEYS = {"workload", "preset", "fixed", "space", "objectives", "stability", "description"}
# The sweep owns these: every trial gets its own run name, folder, tracking store and resume flag.
SWEEP_OWNED = {"launch.name", "launch.storage_path", "launch.tracking_uri", "launch.resume", "launch.address"}


@dataclass(frozen=True)
class Domain:
    """One knob: ``kind`` in DOMAINS; ``values`` for choice/grid, ``(low, high)`` bounds otherwise."""

    kind: str
    values: tuple = ()
    low: float = 0.0
    high: float = 0.0

    def candidates(self) -> list:
        """Values that stand for the whole domain when checking it against the config."""
        if self.kind in ("choice", "grid"):
            return list(self.values)
        return [self.low, self.high]

    def describe(self) -> str:
        if self.kind in ("choice", "grid"):
            return f"{self.kind}{list(self.values)}"
        return f"{self.kind}[{self.low}, {self.high}]"


@dataclass
class SweepSpace:
    workload: str
    preset: str
    fixed: dict[str, Any]
    knobs: dict[str, Domain]
    objectives: dict[str, Any] = field(default_factory=dict)
    stability: dict[str, Any] = field(default_factory=dict)
    source: str = "<dict>"

    @property
    def quality_mode(self) -> str:
        """'max' or 'min': which way quality is better (``from_dict`` settles it, ``quality_mode()``)."""
        return self.objectives.get("quality_mode", "max")

    def base_config(self) -> Any:
        """The workload's preset with the fixed overrides: what every trial starts from."""
        wl = registry.get(self.workload)
        return apply_overrides(wl.config(self.preset), self.fixed)

    def grid_points(self) -> list[dict[str, Any]]:
        """Every combination of the ``grid`` knobs (Optuna evaluates these first)."""
        grid = {k: d.values for k, d in self.knobs.items() if d.kind == "grid"}
        if not grid:
            return []
        keys = list(grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]

    def to_dict(self) -> dict:
        """Plain form, stored with the sweep so that --resume can check it is the same space."""
        return {"workload": self.workload, "preset": self.preset, "fixed": dict(self.fixed),
                "space": {k: d.describe() for k, d in self.knobs.items()},
                "objectives": dict(self.objectives), "stability": dict(self.stability)}


class OptunaSpace:
    """Define-by-run search space for ``OptunaSearch`` (picklable, so a restored sweep keeps it).

    Define-by-run rather than a distribution dict because grid points are enqueued as *partial*
    trials (only the grid knobs fixed), which Ray only accepts for define-by-run spaces.
    """

    def __init__(self, knobs: Mapping[str, Domain]):
        self.knobs = dict(knobs)

    def __call__(self, trial) -> None:
        for key, d in self.knobs.items():
            if d.kind in ("choice", "grid"):
                trial.suggest_categorical(key, list(d.values))
            elif d.kind == "uniform":
                trial.suggest_float(key, d.low, d.high)
            elif d.kind == "loguniform":
                trial.suggest_float(key, d.low, d.high, log=True)
            else:
                trial.suggest_int(key, int(d.low), int(d.high))


def parse_domain(where: str, spec: Any) -> Domain:
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise ConfigError(f"{where}: a domain is one of {{{', '.join(f'{d}: ...' for d in DOMAINS)}}}, got {spec!r}")
    (kind, arg), = spec.items()
    if kind not in DOMAINS:
        raise ConfigError(f"{where}: unknown domain '{kind}'; use one of {', '.join(DOMAINS)}")
    if kind in ("choice", "grid"):
        if not isinstance(arg, list) or not arg:
            raise ConfigError(f"{where}: {kind} needs a non-empty list of values, got {arg!r}")
        for v in arg:  # Optuna stores categorical values as-is: only scalars round-trip
            if not (v is None or isinstance(v, (bool, int, float, str))):
                raise ConfigError(f"{where}: {kind} values must be scalars (number, string, bool, null), got {v!r}")
        if len(set(map(repr, arg))) != len(arg):
            raise ConfigError(f"{where}: {kind} lists a value twice: {arg!r}")
        return Domain(kind, tuple(arg))
    bounds = [_number(x) for x in arg] if isinstance(arg, list) and len(arg) == 2 else [None]
    if None in bounds:
        raise ConfigError(f"{where}: {kind} needs [low, high] numbers, got {arg!r}")
    low, high = bounds
    if not low < high:
        raise ConfigError(f"{where}: {kind} needs low < high, got [{arg[0]}, {arg[1]}]")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0, got {arg[0]}")
    if kind == "randint" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigError(f"{where}: randint needs integer bounds, got {arg!r}")
    return Domain(kind, (), low, high)


def _number(x: Any) -> Optional[float]:
    """A finite number, also from a string: YAML 1.1 reads ``1e-4`` (no dot) as a string."""
    if isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def from_dict(data: Mapping[str, Any], source: str = "<dict>", preset: Optional[str] = None,
              overrides: Optional[Mapping[str, Any]] = None) -> SweepSpace:
    """Parse and validate a space (the YAML's top-level mapping). ``preset`` replaces the file's base
    preset; ``overrides`` are extra fixed settings, and pin a knob they name (it leaves the space)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the file is empty" if data is None else
                          f"{source}: the top level must be a mapping, got {type(data).__name__}")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    for key in ("workload", "space"):
        if key not in data:
            raise ConfigError(f"{source}: '{key}' is required")
    wl = registry.get(str(data["workload"]))  # ConfigError naming the available workloads
    preset = preset or str(data.get("preset", "default"))
    try:
        fixed = flatten(data.get("fixed") or {})
    except ConfigError as e:
        raise ConfigError(f"{source}: fixed: {e}") from None
    space = data["space"]
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(f"{source}: 'space' must map dotted config paths to domains")
    try:
        flat = flatten_space(space)
    except ConfigError as e:
        raise ConfigError(f"{source}: space: {e}") from None
    knobs = {str(k): parse_domain(f"{source}: space '{k}'", v) for k, v in flat.items()}
    pinned = [key for key in (overrides or {}) if key in knobs]
    for key, value in (overrides or {}).items():
        knobs.pop(key, None)
        fixed[key] = value

    for key in [*fixed, *knobs]:
        if key in SWEEP_OWNED:
            raise ConfigError(f"{source}: '{key}' is set by the sweep for each trial; remove it from the space file")
    both = set(fixed) & set(knobs)
    if both:
        raise ConfigError(f"{source}: {sorted(both)} are both fixed and searched; keep each in one place")
    try:
        preset_cfg = wl.config(preset)
    except ConfigError as e:
        raise ConfigError(f"{source}: preset: {e}") from None
    try:  # the file's fixed settings, then --set's: each error blamed on where it was written
        base = apply_overrides(preset_cfg, {k: v for k, v in fixed.items() if k not in (overrides or {})})
    except ConfigError as e:
        raise ConfigError(f"{source}: fixed overrides: {e}") from None
    try:
        base = apply_overrides(base, dict(overrides or {}))
    except ConfigError as e:
        raise ConfigError(f"--set: {e}") from None
    if not knobs:  # after --set's values were checked: a bad one is named, not this
        raise ConfigError(f"{source}: no knob left to search" + (
            f" (--set pins {', '.join(pinned)}): to train that one configuration, use python -m raysys train"
            if pinned else ""))
    for key, d in knobs.items():
        for value in d.candidates():
            try:
                apply_overrides(base, {key: value})
            except ConfigError as e:
                raise ConfigError(f"{source}: space '{key}' ({d.describe()}): value {value!r} is invalid: {e}") from None
        if d.kind in ("uniform", "loguniform") and isinstance(_leaf(base, key), int) and not isinstance(_leaf(base, key), bool):
            raise ConfigError(f"{source}: space '{key}' is an integer setting; {d.kind} draws floats, use randint or choice")

    objectives = dict(data.get("objectives") or {})
    _check_keys(source, "objectives", objectives, {"throughput", "quality", "quality_mode", "tolerance", "quality_penalty"})
    for key in ("throughput", "quality"):
        if key in objectives and (not isinstance(objectives[key], str) or not objectives[key].strip()):
            raise ConfigError(f"{source}: objectives.{key} names a metric, e.g. perf/samples_per_s; got {objectives[key]!r}")
    for key in ("tolerance", "quality_penalty"):
        if key in objectives and (not _is_number(objectives[key]) or key == "tolerance" and objectives[key] < 0):
            raise ConfigError(f"{source}: objectives.{key} must be a number{' >= 0' if key == 'tolerance' else ''}, "
                              f"got {objectives[key]!r}")
    objectives["quality_mode"] = quality_mode(source, wl, objectives)
    stability = dict(data.get("stability") or {})
    _check_keys(source, "stability", stability, {"max_nonfinite_losses", "max_loss_spikes", "bounds", "collapse"})
    from raysys.tune.objectives import StabilityRules  # late: objectives imports nothing from here

    try:
        StabilityRules.from_dict(stability)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: stability: {e}") from None
    _check_metric_names(source, wl, objectives, stability)
    return SweepSpace(registry.ref(wl), preset, fixed, knobs, objectives, stability, source)


def _check_metric_names(source: str, wl: Any, objectives: Mapping[str, Any], stability: Mapping[str, Any]) -> None:
    """A task's runs report ``eval/<its evaluate() keys>`` (known once one evaluates) and the shared loop's
    metrics (known now): a space naming another metric outside eval/ for a task's workload would only be
    found after a trial trained. A ``train_fn`` workload's metrics are its own: found at its first report."""
    if wl.task is None:
        return
    from raysys.metrics import TASK_LOOP_METRICS

    named = [(f"objectives.{key}", objectives[key]) for key in ("throughput", "quality") if key in objectives]
    named += [(f"stability.{section}", metric) for section in ("bounds", "collapse")
              for metric in (stability.get(section) or {})]
    for where, metric in named:
        if not isinstance(metric, str):  # a YAML key such as 1: or true:
            raise ConfigError(f"{source}: {where}: {metric!r} is not a metric name (e.g. train/loss)")
        if not metric.startswith("eval/") and metric not in TASK_LOOP_METRICS:
            import difflib

            near = difflib.get_close_matches(metric, sorted(TASK_LOOP_METRICS), n=1)
            raise ConfigError(f"{source}: {where}: {wl.name} never reports {metric}: "
                              + (f"did you mean {near[0]}?" if near else "a task's runs report eval/<its evaluate() "
                                 "keys> and the loop's " + ", ".join(sorted(TASK_LOOP_METRICS))))


_LOWER_IS_BETTER = {"loss", "error", "err", "mse", "rmse", "mae", "mape", "perplexity", "ppl", "nll", "brier", "ece",
                    "wer", "cer", "regret", "distance", "latency"}


def quality_mode(source: str, wl: Any, objectives: Mapping[str, Any]) -> str:
    """Which way the sweep's quality is better: the space's ``objectives.quality_mode``, else the
    workload's for its own metric, else 'max'. A metric named like a loss or an error with no mode
    given anywhere is refused: maximising it would recommend the worst configuration."""
    mode = objectives.get("quality_mode")
    if mode is not None:
        if mode not in ("max", "min"):
            raise ConfigError(f"{source}: objectives.quality_mode is 'max' (higher quality is better) or 'min', "
                              f"got {mode!r}")
        return mode
    metric = str(objectives.get("quality", wl.quality_metric))
    own = metric == wl.quality_metric
    if own and wl.quality_mode == "min":
        return "min"
    words = set(re.split(r"[^a-z0-9]+", metric.split("/")[-1].lower()))
    if words & _LOWER_IS_BETTER and not words & {"neg", "negative", "minus", "inv"}:
        where = "its task's quality_mode = 'min'" if own else "objectives.quality_mode: min"
        raise ConfigError(f"{source}: quality metric '{metric}' reads as lower-is-better, but sweeps maximise quality "
                          f"unless told: set {where} (or objectives.quality_mode: max if higher is better)")
    return str(wl.quality_mode) if own else "max"


def flatten_space(space: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Allow nested sections (``train: {batch_size: {choice: ...}}``) as well as dotted keys: a
    mapping of mappings is a section, anything else is (meant to be) a domain."""
    out: dict[str, Any] = {}
    for k, v in space.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and all(isinstance(x, Mapping) for x in v.values()):
            put_once(out, flatten_space(v, key + "."))
        else:
            put_once(out, {key: v})
    return out


def _leaf(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_keys(source: str, section: str, d: Mapping, allowed: set[str]) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"{source}: {section}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def load(path: str | Path, preset: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None) -> SweepSpace:
    """Read and validate a space file; one clear ConfigError on any problem."""
    data = read_yaml(path, what="tune space")
    return from_dict(data, str(path), preset, overrides)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
