"""The small interface every workload implements, and how raysys finds one by name.

A workload is a config class, presets, and one of two ways to train:

* ``task`` (a :class:`TorchTask`): a supervised PyTorch job. It supplies data, a model, a loss and
  an evaluation; the shared loop in :mod:`raysys.train.loop` does everything else (DDP, AMP,
  accumulation, compile, checkpoints, metrics, tracking) under Ray Train.
* ``train_fn``: a workload with its own loop (RL learners, JAX). It receives the config and a
  :class:`raysys.session.Session` that gives it tracking, checkpoints and metrics.

``population`` is optional, for a ``train_fn`` workload: K configurations trained as one program,
which ``python -m raysys.tune --vectorize K`` uses (:class:`Population`).

``bench`` is optional: without one, ``python -m raysys.bench`` times the training step of a
``TorchTask`` itself (both paths where the workload names its ``path_key``).
Workload modules never import Ray; the shared layer does that for them.

Where a workload comes from (:func:`get`), in this order:

1. a built-in name (``deep_gpcm``, ...);
2. an installed plug-in: an entry point in the ``raysys.workloads`` group whose name is the
   workload name and whose value is the ``Workload`` object (``my_pkg.lm:WORKLOAD``); a name two installed
   packages both claim is refused, naming them, and one a built-in has is reached only as ``module:attr``;
3. a ``module:attr`` spec (``my_pkg.lm:WORKLOAD``) importable from the working directory, or a
   ``path/to/file.py:attr`` spec naming the module's file from anywhere (its ``ref`` is the absolute path).

Every process of a run (the driver, each Ray Train worker, each Tune trial, a ``ray job``) finds the
workload again with :func:`ref`, the string that names it; a plug-in loaded from a local file is
carried to the cluster's workers with :func:`runtime_env`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import io
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Protocol

if TYPE_CHECKING:  # annotations only: a JAX workload's process never imports torch
    import torch

ENTRY_POINT_GROUP = "raysys.workloads"


class TorchTask(Protocol):
    """What a supervised PyTorch workload provides to the shared Ray Train loop."""

    quality_metric: str
    """Name of the evaluation metric (a key of ``evaluate``'s dict) that measures quality, e.g. 'qwk'.
    Named once: the workload's ``eval/<name>`` and sweeps' objective follow. Higher is better, unless
    the task also sets ``quality_mode = "min"`` (a loss, an error rate, perplexity)."""
    token_name: str
    """Optional (default 'tokens'): what a 'token' is for tokens/s (e.g. 'responses'); samples/s is always reported."""

    def prepare(self, cfg: Any) -> Any:
        """Optional: make or validate the data; return the config with paths made absolute. Called once on
        the driver before workers start, and again (idempotently) in each worker, since on a cluster
        every node needs its own copy of generated data."""

    def datasets(self, cfg: Any) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        """(train, eval) datasets; the loop shards train across workers."""

    def collate(self, batch: list) -> Any:
        """Optional: one batch from dataset items (without it, torch's ``default_collate``); a dict of tensors
        or a tuple of them, as the task's ``loss`` and ``evaluate`` take it."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        """Construct the model (on CPU; the loop moves it)."""

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        """Forward pass -> (scalar loss, {'samples': n, 'tokens': n_valid_tokens}); a count left out is the
        batch's own (samples: its first tensor's leading size; tokens: the samples)."""

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        """Quality metrics over already-on-device eval batches."""

    # Optional, each (the loop looks them up with getattr; see raysys.train.optim); besides prepare, collate and
    # token_name:
    #   param_groups(model, cfg) -> list[dict]: torch parameter groups (no weight decay on biases and
    #       norms, another LR for an embedding) for the optimizer the config's ``optim`` section builds;
    #   optimizer(model, cfg) -> torch.optim.Optimizer: an optimizer of your own instead;
    #   scheduler(optimizer, cfg, total_steps): a torch LR scheduler stepped after each optimizer step,
    #       or a ReduceLROnPlateau (its mode the quality's direction) stepped after each evaluation.


_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Population:
    """How a workload trains K configurations as one program (``python -m raysys.tune --vectorize K``):
    one process, one compile, each member with its own params, optimizer state and PRNG streams."""

    train_fn: Callable[[list, list], list]
    """train_fn(cfgs, sessions) -> one final-metrics dict per member. Member i logs, checkpoints and
    restores through ``sessions[i]`` exactly as ``train_fn`` does with its one session; a member whose
    ``sessions[i].halted`` is set (unstable) is masked from then on while the others go on."""
    member_knobs: tuple[str, ...]
    """Dotted config keys that may differ between members of one program: those that change no
    array shape (learning rate, coefficients, seed...). Configs that differ in anything else run
    as separate programs."""
    explore_knobs: tuple[str, ...] = ()
    """The member knobs that population-based training may perturb (``--scheduler pbt``): the
    hyper-parameters of the update (learning rate, coefficients), not a seed or a budget. Non-empty
    says ``train_fn`` runs the sweep's PBT rounds (raysys/train/pbt.py: three calls); empty, the
    workload's sweeps refuse ``--scheduler pbt``."""
    rank_metric: Optional[str] = None
    """What PBT ranks members by, a metric every chunk logs, higher is better (an RL workload's episode
    return); None: the sweep's quality metric, in its quality_mode (it must be logged during training)."""

    def program_key(self, cfg: Any) -> str:
        """Equal for configs that can share one program: everything but the member knobs and ``launch``."""
        from raysys.config import flatten, to_dict

        return program_key(flatten(to_dict(cfg)), self.member_knobs)

    def check(self, cfg: Any, workload: str) -> None:
        """Each member knob must be a key of ``cfg``: a misspelt one is no knob at all, and the workload
        would train as if its intended key could differ inside one program while it never does."""
        import difflib

        from raysys.config import ConfigError, flatten, to_dict

        keys = flatten(to_dict(cfg))
        unknown = [k for k in self.member_knobs if k not in keys]
        stray = [k for k in self.explore_knobs if k not in self.member_knobs]
        if stray:
            raise ConfigError(f"workload {workload}: Population.explore_knobs names {', '.join(stray)}, not one of "
                              "its member_knobs (PBT changes knobs inside one program: they must change no shape)")
        if unknown:
            near = [m for k in unknown for m in difflib.get_close_matches(k, keys, n=1)]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"workload {workload}: Population.member_knobs names {', '.join(unknown)}, not a key "
                              f"of its config{hint}")


def program_key(values: Mapping[str, Any], member_knobs: Iterable[str]) -> str:
    """Dotted config values (a whole flattened config, or a sweep's knobs over one base config) -> a key
    that is equal exactly where they differ only in ``member_knobs`` and ``launch``."""
    import json

    skip = set(member_knobs)
    return json.dumps({k: v for k, v in sorted(values.items()) if k not in skip and not k.startswith("launch.")},
                      default=str)


class _FromTask(str):
    """A ``Workload`` default filled in from its task (``quality_metric``, ``quality_mode``): filled
    in again when ``dataclasses.replace`` gives the workload another task, where a plain string
    would keep the old task's metric."""


@dataclass(frozen=True)
class Workload:
    name: str
    """Short name: MLflow experiment ``raysys-<name>``, default run names ``<name>-<time>``."""
    description: str
    """One line for ``python -m raysys list``."""
    config_cls: type
    """The root config dataclass; it must have a ``launch`` section (``raysys.train.config.LaunchConfig``)."""
    presets: Mapping[str, Callable[[], Any]]
    """Named config constructors; 'default' must exist. Presets derive from each other in code."""
    bench: Optional[Callable[..., dict]] = None
    """bench(quick: bool) -> {'naive': {...}, 'optimized': {...}}, each row with ``throughput`` (a number)
    and optionally ``quality``; optionally ``device``, ``speedup``, ``throughput_unit`` (default samples/s),
    ``quality_metric``, ``paths`` (the rows' names, where not naive/optimized), ``notes`` (lines),
    ``extra`` ({label: value}) and ``problems`` (lines; the bench then exits 1). A ``bench`` that takes an
    ``overrides`` argument gets ``--set``/``--config`` as a dict (``--set`` values typed as its config's fields). Optional: without it
    ``python -m raysys.bench`` times the task's training step (raysys.bench_generic.generic_bench)."""
    task: Optional[TorchTask] = None
    train_fn: Optional[Callable[[Any, Any], dict]] = None
    throughput_metric: str = "perf/samples_per_s"
    """What sweeps maximise as speed."""
    quality_metric: Optional[str] = None
    """What sweeps optimise as quality. Default: ``eval/<task.quality_metric>`` for a task, else
    ``eval/quality`` (which a ``train_fn`` returns)."""
    quality_mode: Optional[str] = None
    """'max' when a higher quality is better, 'min' when lower is (a loss, an error, perplexity), as in
    Ray Tune's ``mode``. Default: the task's ``quality_mode`` attribute where the quality metric is
    the task's own, else 'max'."""
    path_key: Optional[str] = None
    """Dotted config key choosing the slow ('naive') or fast ('optimized') path, where the workload has
    both (e.g. 'model.path'); the generic bench then measures both and their ratio."""
    dataset: Optional[Callable[[Any], Optional[Mapping[str, Any]]]] = None
    """dataset(prepared cfg) -> {'name', 'source' (a path or URI), 'profile': {...}, 'digest' (optional:
    by default a digest of the content at source)} or None: the data a run trains on, recorded as its
    MLflow input (the runs table's Dataset column). Optional; called before the run exists."""
    population: Optional[Population] = None
    """Optional, for a ``train_fn`` workload: K configurations as one program (sweeps' ``--vectorize``)."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        from raysys.config import ConfigError

        if not _NAME.match(str(self.name)):
            raise ConfigError(f"workload name {self.name!r}: use letters, digits, '_', '-', '.' (at most 64)")
        if (self.task is None) == (self.train_fn is None):
            raise ConfigError(f"workload {self.name}: give exactly one of task= (a TorchTask) or train_fn=")
        if "default" not in self.presets:
            raise ConfigError(f"workload {self.name}: presets must include 'default'")
        q = getattr(self.task, "quality_metric", None) if self.task is not None else None
        if self.quality_metric is None or isinstance(self.quality_metric, _FromTask):
            object.__setattr__(self, "quality_metric", _FromTask(f"eval/{q}" if q else "eval/quality"))
        if self.quality_mode is None or isinstance(self.quality_mode, _FromTask):
            # the task's mode is its own metric's: another metric named here is maximised unless told
            own = q is not None and self.quality_metric == f"eval/{q}"
            object.__setattr__(self, "quality_mode", _FromTask((own and getattr(self.task, "quality_mode", None)) or "max"))
        if self.quality_mode not in ("max", "min"):
            raise ConfigError(f"workload {self.name}: quality_mode must be 'max' or 'min', got {self.quality_mode!r}")

    def config(self, preset: str = "default") -> Any:
        from raysys.config import ConfigError

        if preset not in self.presets:
            raise ConfigError(f"unknown preset '{preset}' for {self.name}; available: {', '.join(sorted(self.presets))}")
        try:
            cfg = self.presets[preset]()
        except ConfigError:
            raise
        except Exception as e:  # a config field without a default, a preset's own bug: the workload's, said once
            raise ConfigError(f"workload {self.name}: its preset '{preset}' cannot be built: {type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
        _check_config(cfg, self, preset)
        return cfg


TASK_HOOKS = {"datasets": ("cfg",), "build_model": ("cfg",), "loss": ("model", "batch"), "evaluate": ("model", "batches")}
"""A TorchTask's required methods and the arguments the loop passes each."""
TASK_OPTIONAL = {"prepare": ("cfg",), "collate": ("batch",), "param_groups": ("model", "cfg"), "optimizer": ("model", "cfg"),
                 "scheduler": ("optimizer", "cfg", "total_steps")}


def collate_of(task: Any) -> Callable[[list], Any]:
    """A task's ``collate``, or torch's ``default_collate`` where it has none (items of tensors, numbers or
    dicts of them become one batch of the same structure, as a plain DataLoader makes)."""
    from torch.utils.data import default_collate

    return getattr(task, "collate", None) or default_collate


def _check_hooks(wl: "Workload") -> None:
    """The workload's functions exist and take the arguments raysys passes them: a missing ``evaluate``
    or a ``train_fn(cfg)`` is said when the workload loads, not after a run was made and trained."""
    from raysys.config import ConfigError

    def takes(fn: Any, what: str, *args: str, **kwargs: Any) -> None:
        form = f"{what.rsplit('.', 1)[-1]}({', '.join([*args, *(f'{k}=...' for k in kwargs)])})"
        if not callable(fn):
            raise ConfigError(f"workload {wl.name}: its {what} is a {type(fn).__name__}, not a function {form}")
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError:
            raise ConfigError(f"workload {wl.name}: its {what} cannot be called as {form} (its signature: "
                              f"{inspect.signature(fn)})") from None
        except ValueError:  # a builtin without a signature: taken as it is
            pass

    task = wl.task
    if isinstance(task, type):
        raise ConfigError(f"workload {wl.name}: its task is the class {task.__name__}, not one of its objects: "
                          f"task={task.__name__}()")
    if task is not None:
        kind = type(task).__name__
        missing = [m for m in TASK_HOOKS if getattr(task, m, None) is None]
        if missing:
            raise ConfigError(f"workload {wl.name}: its task ({kind}) has no {', '.join(missing)}; a task needs "
                              f"{', '.join(TASK_HOOKS)} and quality_metric (raysys.workload.TorchTask)")
        for m, args in {**TASK_HOOKS, **TASK_OPTIONAL}.items():
            if getattr(task, m, None) is not None:
                takes(getattr(task, m), f"{kind}.{m}", *args)
        q = getattr(task, "quality_metric", None)
        if not isinstance(q, str) or not q:
            raise ConfigError(f"workload {wl.name}: its task ({kind}) needs quality_metric, the name of the metric "
                              f"its evaluate() returns that measures quality (got {q!r})")
    if wl.train_fn is not None:
        takes(wl.train_fn, "train_fn", "cfg", "session")
    if wl.population is not None:
        takes(wl.population.train_fn, "Population.train_fn", "cfgs", "sessions")
    if wl.bench is not None:
        takes(wl.bench, "bench", quick=True)
    if wl.dataset is not None:
        takes(wl.dataset, "dataset", "cfg")


def check_sets(wl: "Workload", sets: Mapping[str, Any]) -> None:
    """An empty ``--set`` value of a key saying where the workload's data lies (``extra['local_keys']``) is
    refused: it would read as none, and the run would train on the workload's own data instead of the
    user's (``--set data.path=$DATA`` with $DATA unset). ``none`` says that on purpose."""
    from raysys.config import ConfigError

    for key in wl.extra.get("local_keys", ()):
        if isinstance(sets.get(key), str) and not sets[key].strip():
            raise ConfigError(f"--set {key}= is empty (an unset shell variable?): give the path, or {key}=none "
                              "for the workload's own data")
    for key, value in sets.items():  # a folder key (data.data_dir) naming a file failed later as "[Errno 17]"
        if key.rsplit(".", 1)[-1].endswith("_dir") and isinstance(value, str) and Path(value).expanduser().is_file():
            raise ConfigError(f"--set {key}={value}: that is a file; {key} names a folder")


def _check_config(cfg: Any, wl: "Workload", preset: str) -> None:
    """What every command relies on in a workload's config: an instance of its dataclass ``config_cls``, with
    a ``launch`` section, and no attribute a preset set that is not a field (a typo would be ignored)."""
    import dataclasses

    from raysys.config import ConfigError

    cls = wl.config_cls
    where = f"workload {wl.name}: its preset '{preset}'"
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"workload {wl.name}: its config_cls {getattr(cls, '__name__', cls)!r} is not a dataclass "
                          "(decorate it with @dataclass)")
    if not isinstance(cfg, cls):
        raise ConfigError(f"{where} returned a {type(cfg).__name__}, not a {cls.__name__}")
    if not any(f.name == "launch" for f in dataclasses.fields(cls)):
        raise ConfigError(f"workload {wl.name}: its config {cls.__name__} has no launch section; add "
                          "launch: LaunchConfig = field(default_factory=LaunchConfig) (from raysys.train.config)")

    def walk(obj: Any, path: str) -> None:
        names = {f.name for f in dataclasses.fields(obj)}
        stray = sorted(k for k in getattr(obj, "__dict__", {}) if k not in names and not k.startswith("_"))
        if stray:
            raise ConfigError(f"{where} sets {', '.join(path + k for k in stray)}, not a field of "
                              f"{type(obj).__name__} (its fields: {', '.join(sorted(names))})")
        for name in names:
            value = getattr(obj, name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{path}{name}.")

    walk(cfg, "")
    if wl.path_key:  # the bench sets it to both paths: a key that is not there, or takes neither, said now
        from raysys.config import apply_overrides, flatten, to_dict

        keys = flatten(to_dict(cfg))
        if wl.path_key not in keys:
            import difflib

            near = difflib.get_close_matches(wl.path_key, list(keys), n=1)
            raise ConfigError(f"workload {wl.name}: its path_key '{wl.path_key}' is not a key of its config"
                              + (f" (did you mean '{near[0]}'?)" if near else ""))
        for path in ("naive", "optimized"):
            try:
                apply_overrides(cfg, {wl.path_key: path})
            except ConfigError as e:
                raise ConfigError(f"workload {wl.name}: its path_key '{wl.path_key}' must take 'naive' and "
                                  f"'optimized' (the bench's two paths); '{path}': {e}") from None


# Built-in workloads: imported lazily so `python -m raysys --help` stays fast.
BUILTIN = {
    "deep_gpcm": "raysys.workloads.deep_gpcm.workload",
    "mpn_dqn": "raysys.workloads.mpn_dqn.workload",
    "hackmatrix_ppo": "raysys.workloads.hackmatrix_ppo.workload",
    "pointer_generator": "raysys.workloads.pointer_generator.workload",
    "ad_transformer": "raysys.workloads.ad_transformer.workload",
    "ad_source": "raysys.workloads.ad_transformer.source_workload",
}

_LOADED: dict[str, Workload] = {}   # ref -> workload
_REFS: dict[int, str] = {}          # id(workload) -> the ref it was found by
_LOCAL_ROOTS: set[str] = set()      # files/folders of plug-ins imported from outside installed packages


def register(workload: Workload, ref_: Optional[str] = None) -> Workload:
    """Make ``workload`` findable in this process as ``ref_`` (default: its name). A workload found the
    first time is validated here, before any command creates anything (its functions take what raysys
    passes them; its default config is built; ``Population.check``)."""
    key = ref_ or workload.name
    if id(workload) not in _REFS:
        _check_hooks(workload)
        default = workload.config()  # a config class that cannot be built is the workload's error, said here
        if workload.population is not None:
            workload.population.check(default, workload.name)
    _LOADED[key] = workload
    _REFS.setdefault(id(workload), key)
    return workload


_SWEEP_DRIVER: contextvars.ContextVar[bool] = contextvars.ContextVar("raysys_sweep_driver", default=False)


@contextlib.contextmanager
def sweep_driver():
    """Around a sweep's driver's call of ``prepare``: it makes or checks the data once for every trial, but
    it trains nothing, and on a cluster it may run where no trial does (a CPU head, TPU workers)."""
    token = _SWEEP_DRIVER.set(True)
    try:
        yield
    finally:
        _SWEEP_DRIVER.reset(token)


def on_sweep_driver() -> bool:
    """True inside :func:`sweep_driver`: a ``prepare`` leaves checks of this process's own devices to the
    trials, which prepare again in their processes."""
    return _SWEEP_DRIVER.get()


def ref(wl: Workload) -> str:
    """The string that finds ``wl`` again in any process of the run (payloads, trials, jobs)."""
    return _REFS.get(id(wl), wl.name)


def _entry_points() -> dict[str, list[metadata.EntryPoint]]:
    """{name: its entry points of the ``raysys.workloads`` group}: more than one where installed packages clash."""
    out: dict[str, list[metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if all(ep.value != other.value for other in out.get(ep.name, [])):  # one package seen twice is one
            out.setdefault(ep.name, []).append(ep)
    return out


def _package(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an installed package"


def plugins() -> list[str]:
    """Names of the installed plug-ins (entry points of the ``raysys.workloads`` group)."""
    return sorted(n for n in _entry_points() if n not in BUILTIN)


def shadowed() -> list[str]:
    """Installed entry points named like a built-in, which that name never reaches: 'name (package version,
    module:attr)' for each, the module:attr that does reach it."""
    return [f"{n} ({_package(ep)}: {ep.value})" for n, eps in sorted(_entry_points().items()) if n in BUILTIN
            for ep in eps]


def installed_package(name: str) -> Optional[tuple[str, str]]:
    """(distribution, version) of the installed plug-in ``name`` (one entry point, not a built-in), else None."""
    eps = _entry_points().get(name, []) if name not in BUILTIN else []
    dist = getattr(eps[0], "dist", None) if len(eps) == 1 else None
    return (dist.metadata["Name"], dist.version) if dist is not None else None


def origin(wl: Workload) -> Optional[str]:
    """Where a plug-in's code comes from, for the run's record: its package and version (and entry point), or
    its file; None for a built-in."""
    key = ref(wl)
    if key in BUILTIN:
        return None
    eps = _entry_points().get(key, [])
    if len(eps) == 1:
        return f"{_package(eps[0])} (entry point {key} = {eps[0].value})"
    # the module that made the Workload (a wrapper's file, whose config may be another's), else its config's
    module = _defined_in(wl) or getattr(wl.config_cls, "__module__", "") or ""
    dists = metadata.packages_distributions().get(module.split(".")[0], [])
    if dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dists[0]} {metadata.version(dists[0])} ({key})"
    file = getattr(sys.modules.get(module), "__file__", None)
    return f"{key} ({file})" if file and str(file) not in key else key


def available() -> list[str]:
    """Built-in workloads whose module is importable, then installed plug-ins."""
    return [n for n in BUILTIN if _has_workload(BUILTIN[n])] + plugins()


def _has_workload(module: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), "WORKLOAD")
    except ImportError:  # not built yet, or an optional dependency is missing
        return False


def _as_workload(obj: Any, where: str) -> Workload:
    from raysys.config import ConfigError

    if not isinstance(obj, Workload):
        raise ConfigError(f"{where} is a {type(obj).__name__}, not a raysys.workload.Workload")
    return obj


def _quiet_import(module: str):
    """``importlib.import_module``, keeping back what a module that exits while imported printed (the usage
    text of an argparse run at import), which :func:`_import` says in one line instead."""
    said = io.StringIO()  # what the module prints to stderr while imported: an argparse usage before it exits
    try:
        with contextlib.redirect_stderr(said):
            mod = importlib.import_module(module)
    except SystemExit:
        raise  # said below in one line, without the usage text it printed
    except BaseException:
        sys.stderr.write(said.getvalue())
        raise
    else:
        sys.stderr.write(said.getvalue())
    return mod


def _import(module: str, spec: str):
    from raysys.config import ConfigError

    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # `module:attr` names code in the working directory, as `python -m` does
    try:
        mod = _quiet_import(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise ConfigError(f"workload '{spec}': no module named '{e.name}' (looked in {cwd} and the installed "
                              "packages)") from None
        raise ConfigError(f"workload '{spec}': importing {module} failed: {e}") from None
    except ImportError as e:
        raise ConfigError(f"workload '{spec}': importing {module} failed: {e}") from None
    except SyntaxError as e:
        raise ConfigError(f"workload '{spec}': importing {module} failed: {type(e).__name__}: {e.msg} "
                          f"({e.filename}, line {e.lineno})") from None
    except (Exception, SystemExit) as e:  # the module's own code raised (or exited) while it was imported
        import traceback

        frames = traceback.extract_tb(e.__traceback__)
        skip = (str(Path(__file__).resolve().parent), str(Path(sysconfig.get_paths()["stdlib"]).resolve()))
        own = [f for f in frames if not f.filename.startswith("<") and not str(Path(f.filename).resolve()).startswith(skip)]
        frame = (own or frames)[-1]  # the user's line, not raysys's check (nor a dataclass's generated __init__)
        what = (str(e) if isinstance(e, ConfigError) else
                f"importing {module} exited (SystemExit {e.code}): a plug-in module must not parse sys.argv or "
                "exit when imported" if isinstance(e, SystemExit) else
                f"importing {module} failed: {type(e).__name__}: {e}")
        if not what.startswith("workload "):  # Workload's own checks name it already
            what = f"workload '{spec}': {what}"
        raise ConfigError(f"{what} ({frame.filename}, line {frame.lineno})") from None
    return mod


def _module_of_file(path: str, spec: str) -> tuple[str, Path]:
    """``path/to/my_wl.py`` (of a ``path:attr`` spec) -> (``my_wl``, its absolute path), importable from
    now on: its folder goes first on ``sys.path``. In a Ray worker on a node without the file, the copy Ray's
    ``runtime_env`` carried (see :func:`runtime_env`) is imported. A file whose module name another
    module already holds is refused."""
    import importlib.util

    from raysys.config import ConfigError

    file = Path(path).expanduser().resolve()
    module = file.stem
    if file.suffix != ".py" or not module.isidentifier():
        raise ConfigError(f"workload '{spec}': a plug-in file is a Python module: my_workload.py:WORKLOAD")
    if not file.is_file():
        if not (_in_ray_worker() and importlib.util.find_spec(module) is not None):
            raise ConfigError(f"workload '{spec}': no Python file {file}")
        return module, file
    held = sys.modules.get(module)
    if held is not None and Path(getattr(held, "__file__", "") or "").resolve() != file:
        raise ConfigError(f"workload '{spec}': the module name '{module}' is already taken by "
                          f"{getattr(held, '__file__', None) or 'a built-in module'}; rename {file.name}")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    return module, file


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def _file_root(path: str) -> Path:
    """A module's own file, or its package's folder where ``path`` is the package's ``__init__.py``."""
    p = Path(path).resolve()
    return p.parent if p.name == "__init__.py" else p


def _note_local(mod) -> None:
    """Remember the top-level file/folder of a plug-in that is not an installed package, to carry it."""
    path = getattr(mod, "__file__", None)
    if not path:
        return
    top = sys.modules.get(mod.__name__.split(".")[0])
    root = _file_root(getattr(top, "__file__", path) or path)
    if not any(part in ("site-packages", "dist-packages") for part in root.parts):
        _LOCAL_ROOTS.add(str(root))
        if root.is_file():  # the modules beside it that it imports travel with it
            _LOCAL_ROOTS.update(str(p) for p in _siblings(root))


def _siblings(root: Path) -> list[Path]:
    """The modules and packages beside a one-file plug-in that it imports, anywhere in its code (an import
    inside ``build_model`` too), and those they import in turn: a model in ``model.py`` next to the workload
    file is part of the workload's code, compared on a resume and carried to a cluster's nodes."""
    import ast

    found: list[Path] = []
    seen, todo = {root}, [root]
    while todo:
        try:
            tree = ast.parse(todo.pop().read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        for name in sorted(names):
            for cand in (root.parent / f"{name}.py", root.parent / name):
                if cand in seen or not (cand.is_file() or (cand / "__init__.py").is_file()):
                    continue
                seen.add(cand)
                found.append(cand)
                if cand.is_file():
                    todo.append(cand)
                break
    return found


def _code_root(module: str) -> Optional[Path]:
    """The folder (or single file) of ``module``'s own code: a built-in's package under raysys.workloads, else
    the top-level package (or module) it belongs to, as ``_note_local`` carries it."""
    parts = module.split(".")
    top = ".".join(parts[:3]) if parts[:2] == ["raysys", "workloads"] else parts[0]
    mod = sys.modules.get(top)
    if mod is None or top == "raysys":  # raysys's own shared code is not the workload's
        return None
    if getattr(mod, "__file__", None):
        return _file_root(mod.__file__)
    folders = list(getattr(mod, "__path__", []))  # a namespace package (no __init__.py)
    return Path(folders[0]).resolve() if len(folders) == 1 else None


CODE_FILES_MAX = 500
"""A workload's own code is a few files; a root with more than this (a plug-in module at the top of a big
folder) is digested by its first files in name order."""


def _defined_in(wl: Workload) -> Optional[str]:
    """The module a plug-in's Workload object was found in (its spec's or entry point's), if it is imported."""
    key = ref(wl)
    eps = _entry_points().get(key, []) if key not in BUILTIN else []
    module = eps[0].module if len(eps) == 1 else key.rpartition(":")[0] if ":" in key else None
    if module and module.endswith(".py"):  # path/to/file.py:attr: imported under the file's stem
        module = Path(module).stem
    return module if module in sys.modules else None


def code_digest(wl: Workload) -> dict[str, str]:
    """``{file: sha256 prefix}`` of the Python source of ``wl``'s own code (its config class's, its task's,
    its train functions' packages): what a resume compares to say that the code changed since the run's last
    session. Files are named relative to their root's folder (``deep_gpcm/model.py``), so a copy of the
    project elsewhere digests the same."""
    import hashlib

    objs = (wl.config_cls, wl.train_fn, wl.task, wl.population.train_fn if wl.population else None)
    modules = {o.__name__ if isinstance(o, type(sys)) else getattr(o, "__module__", None) or type(o).__module__
               for o in objs if o is not None}
    modules.add(_defined_in(wl))  # the module that made the Workload (its extra, presets), maybe of others' parts
    roots = {r for r in (_code_root(m) for m in modules if m) if r is not None}
    roots |= {sib for r in list(roots) if r.is_file() for sib in _siblings(r)}
    out: dict[str, str] = {}
    for root in sorted(roots):
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*.py") if not any(part.startswith((".", "__pycache__")) for part in p.relative_to(root).parts))
        for f in files[:CODE_FILES_MAX]:
            try:
                out[str(f.relative_to(root.parent))] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
            except OSError:  # unreadable now: not part of what can be compared
                pass
    return out


def get(name: str) -> Workload:
    """The workload called ``name``: a built-in, an installed plug-in, or a ``module:attr`` or
    ``path/to/file.py:attr`` spec."""
    from raysys.config import ConfigError

    if name in _LOADED:
        return _LOADED[name]
    if name in BUILTIN:
        mod = importlib.import_module(BUILTIN[name])
        return register(mod.WORKLOAD, name)
    eps = _entry_points().get(name, [])
    if len(eps) > 1:  # which one wins would depend on the order the file system lists packages in
        raise ConfigError(f"workload '{name}': installed by {len(eps)} packages ("
                          + "; ".join(sorted(f"{_package(ep)}: {ep.value}" for ep in eps))
                          + "); uninstall all but one, or name the one you mean as module:attr")
    if eps:
        ep = eps[0]
        obj = _import(ep.module, name)  # its errors as a module:attr's, with the file and line
        for part in (ep.attr or "").split("."):
            if not hasattr(obj, part):
                raise ConfigError(f"workload '{name}': entry point {ep.value}: module {ep.module} has no "
                                  f"attribute '{ep.attr}'")
            obj = getattr(obj, part)
        wl = _as_workload(obj, f"workload '{name}': entry point {name} = {ep.value}")
        if wl.name != name:  # runs, experiments and tags use wl.name, which `train <name> --resume` must find
            raise ConfigError(f"workload '{name}': entry point {name} = {ep.value} is a workload named "
                              f"'{wl.name}'; an entry point's name is its workload's name (rename one)")
        return register(wl, name)
    if ":" in name:
        module, _, attr = name.rpartition(":")
        if not module or not attr:
            raise ConfigError(f"workload '{name}': a plug-in spec is module:attr, e.g. my_pkg.lm:WORKLOAD")
        ref_ = name
        if module.endswith(".py") or "/" in module or os.sep in module:
            module, file = _module_of_file(module, name)
            ref_ = f"{file}:{attr}"  # the same in every process and from any working directory
            if ref_ in _LOADED:
                return register(_LOADED[ref_], name)
        mod = _import(module, name)
        obj = mod
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ConfigError(f"workload '{name}': module {module} has no attribute '{attr}'")
            obj = getattr(obj, part)
        wl = _as_workload(obj, f"'{name}'")
        _note_local(mod)
        register(wl, ref_)
        return register(wl, name)
    if name.endswith(".py") and ":" not in name:
        raise ConfigError(f"workload '{name}': name the Workload in the file too, e.g. {name}:WORKLOAD "
                          "(path/to/file.py:attr, docs/your-workload.md)")
    raise ConfigError(f"unknown workload '{name}'; available: {', '.join(available()) or '(none)'}; "
                      "or name your own as module:attr or path/to/file.py:attr (docs/your-workload.md)")


def runtime_env() -> Optional[dict]:
    """A Ray runtime_env that carries the plug-ins imported from local files to every node, or None.

    Inside a ``ray job`` the job's own working_dir already carries them (and a second py_modules
    would conflict with the job's runtime_env), so nothing is added there."""
    if not _LOCAL_ROOTS or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return None
    return {"py_modules": sorted(_LOCAL_ROOTS)}
