"""Learning histories on disk: npz shards of a few goals each and a ``manifest.json``.

    python -m raysys.workloads.ad_transformer.histories --out DIR [--config '{"steps_per_goal": N, "streams": S}'] [--goals 0,1,...]

generates them (source.py) and writes them. A folder is written under a temporary name and renamed into
place when complete, so a reader never sees half a dataset and an interrupted run leaves nothing that
looks finished.

On a CPU the generator runs pinned to one core: this jaxlib's multi-threaded CPU runtime intermittently
wedges (every thread parked, the result never ready) on the population program's vmapped graph, and on
one core it never did in our runs. On a GPU or TPU nothing is pinned.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import os
import shutil
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np

from raysys.config import at_least, require

FORMAT = "raysys.darkroom_histories/1"
ARRAYS = ("states", "actions", "rewards", "next_states", "returns")


@dataclass
class SourceConfig:
    """The source PPO; defaults are the original's stable-baselines3 settings."""

    streams: int = 100
    """Parallel envs per goal (the original: 100); each is one learning history."""
    steps_per_goal: int = 100_000
    """Env steps each goal's learner takes, over all its streams (the original: 100k)."""
    n_steps: int = 20
    """Steps per stream per PPO update (the original: 20, one episode)."""
    minibatch: int = 50
    """Samples per Adam step (the original: 50)."""
    epochs: int = 20
    """Passes over each rollout (the original: 20)."""
    lr: float = 3e-4
    """Adam learning rate, constant (the original: 3e-4)."""
    gamma: float = 0.99
    """Discount (stable-baselines3's default)."""
    gae_lambda: float = 0.95
    """GAE lambda (stable-baselines3's default)."""
    clip_eps: float = 0.2
    """PPO clip range (stable-baselines3's default)."""
    vf_coef: float = 0.5
    """Value-loss weight (stable-baselines3's default)."""
    ent_coef: float = 0.0
    """Entropy bonus (stable-baselines3's default: none)."""
    max_grad_norm: float = 0.5
    """Gradient clip (stable-baselines3's default)."""
    hidden: tuple[int, ...] = (64, 64)
    """Policy/value MLP widths (stable-baselines3's MlpPolicy)."""
    seed: int = 42
    """Seed of all learners (goal g gets its own stream of it)."""
    updates_per_call: int = 10
    """PPO updates per jitted call (progress is reported between calls)."""

    def validate(self) -> None:
        at_least(self, "source.", 1, "streams", "n_steps", "minibatch", "epochs", "updates_per_call")
        batch = self.streams * self.n_steps
        require(self.steps_per_goal >= batch, f"source.steps_per_goal ({self.steps_per_goal}) must cover one "
                f"rollout of streams x n_steps = {batch}")
        require(batch % self.minibatch == 0, f"source.minibatch ({self.minibatch}) must divide streams x n_steps "
                f"= {batch}")
        # an update's return is the mean of the episodes its rollout ends (Darkroom's are 20 steps; darkroom.HORIZON,
        # not imported here: JAX): a shorter rollout ends none in some updates, and their 0 halved the curve
        require(self.n_steps >= 20, f"source.n_steps ({self.n_steps}) must be at least Darkroom's episode length, "
                "20: each update's mean return is of the episodes its rollout ends")
        require(self.lr > 0 and 0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1,
                "source.lr > 0, source.gamma in (0, 1] and source.gae_lambda in [0, 1] are required")

    @property
    def updates(self) -> int:
        return self.steps_per_goal // (self.streams * self.n_steps)


class Histories(NamedTuple):
    goals: np.ndarray  # int32[G]: cell numbers
    states: np.ndarray  # int8[G, S, T, 2]
    actions: np.ndarray  # int8[G, S, T]
    rewards: np.ndarray  # int8[G, S, T] (0/1)
    next_states: np.ndarray  # int8[G, S, T, 2]
    returns: np.ndarray  # float32[G, U]: mean episode return of each update (the learning curve)


def save(h: Histories, out: Path, goals_per_shard: int = 9, extra: Optional[dict] = None) -> Path:
    """Write histories ``h`` as ``out`` (which must not exist yet)."""
    out = Path(out)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        shards = []
        for i in range(0, len(h.goals), goals_per_shard):
            name = f"shard_{i // goals_per_shard:03d}.npz"
            np.savez(tmp / name, goals=h.goals[i:i + goals_per_shard],
                     **{k: getattr(h, k)[i:i + goals_per_shard] for k in ARRAYS})
            shards.append({"file": name, "goals": [int(g) for g in h.goals[i:i + goals_per_shard]]})
        G, S, T = h.actions.shape
        manifest = {"format": FORMAT, "goals": [int(g) for g in h.goals], "streams": S, "steps": T,
                    "updates": int(h.returns.shape[1]), "shards": shards, "created": time.time(), **(extra or {})}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{folder} is not a raysys Darkroom history folder (format {m.get('format') if isinstance(m, dict) else None!r})")
    lost = [k for k in ("goals", "streams", "steps", "shards") if k not in m]
    if lost:
        raise ValueError(f"{path} lacks {', '.join(lost)}")
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    cells = lambda v: isinstance(v, list) and all(whole(g) for g in v)  # noqa: E731
    odd = next((f"'{k}' is {m[k]!r}, not a whole number of at least 1" for k in ("streams", "steps")
                if not whole(m[k]) or m[k] < 1), None)
    if odd is None and not cells(m["goals"]):
        odd = "'goals' is not a list of cell numbers"
    if odd is None and not (isinstance(m["shards"], list) and all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and cells(s.get("goals")) for s in m["shards"])):
        odd = "'shards' is not a list of {\"file\": name, \"goals\": [cell numbers]}"
    if odd is None:
        held = [g for s in m["shards"] for g in s["goals"]]
        if sorted(held) != sorted(m["goals"]) or len(set(held)) != len(held):
            odd = "its shards' goals are not its 'goals', each once"
    if odd is not None:
        raise ValueError(f"{path}: {odd}")
    return m


def _hasher(m: dict):
    """sha256 of a manifest less its timings, to which each shard's bytes are added in the manifest's order."""
    import hashlib

    return hashlib.sha256(json.dumps({k: v for k, v in m.items() if k not in ("created", "wall_s")},
                                     sort_keys=True).encode())


def digest(folder: Path) -> str:
    """What a history folder holds, not where or when it was made: the sha256 of its manifest (less its
    timings) and of each shard's bytes (``check`` returns the same, from its one read of each shard)."""
    m = manifest(folder)
    h = _hasher(m)
    for s in m["shards"]:
        with open(Path(folder) / s["file"], "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _has_goals(folder: Path, m: dict, goals: Sequence[int]) -> None:
    missing = sorted(set(int(g) for g in goals) - set(m["goals"]))
    if missing:
        raise ValueError(f"{folder} has no histories of goals {missing}")


def check(folder: Path, goals: Sequence[int], region: int, streams: Optional[int] = None) -> str:
    """Raise ValueError, naming the problem, unless ``folder`` holds the histories a run needs: the
    ``goals``, streams long enough for one ``region`` plus its query, and shards numpy can open that hold
    every array, of the manifest's shape, holding Darkroom's values (a position on the grid, one of its
    actions, a reward of 0 or 1): histories of another size would fail inside the model, after the run began.
    Returns the folder's ``digest``: each shard is read once, for both."""
    folder, m = Path(folder), manifest(folder)
    h = _hasher(m)
    _has_goals(folder, m, goals)
    if streams is not None and streams > int(m["streams"]):
        raise ValueError(f"it holds {m['streams']} streams per goal; data.streams asks for {streams}")
    if int(m["steps"]) - 1 < region:
        raise ValueError(f"its streams are {m['steps']} steps long: no full region of data.region={region} steps "
                         "plus a query (lower data.region, or make longer histories)")
    for s in m["shards"]:
        path = folder / s["file"]
        try:  # read once: hashed, then its index and the arrays whose values are checked
            raw = path.read_bytes()
            h.update(raw)
            with np.load(io.BytesIO(raw), allow_pickle=False) as z:
                lost = [k for k in ("goals",) + ARRAYS if k not in z.files]
                arrays = {} if lost else {k: z[k] for k in ("goals", "states", "actions", "rewards", "next_states")}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # cut short, bytes changed (a CRC)
            raise ValueError(f"{path} is not a readable numpy .npz shard ({type(e).__name__})") from None
        if lost:
            raise ValueError(f"{path} lacks {', '.join(lost)}")
        if [int(g) for g in arrays["goals"]] != s["goals"]:  # load picks a shard's goals by the manifest's list
            raise ValueError(f"{path} holds goals {[int(g) for g in arrays['goals']]}; the manifest says {s['goals']}")
        _check_values(path, m, arrays)
    return h.hexdigest()[:16]


def _check_values(path: Path, m: dict, a: dict) -> None:
    from raysys.envs.darkroom import N_ACTIONS, SIZE

    want = (len(a["goals"]), int(m["streams"]), int(m["steps"]))
    for key, tail, low, high in (("actions", (), 0, N_ACTIONS - 1), ("rewards", (), 0, 1),
                                 ("states", (2,), 0, SIZE - 1), ("next_states", (2,), 0, SIZE - 1)):
        v = a[key]
        if v.shape != want + tail:
            raise ValueError(f"{path}: {key} has shape {v.shape}; the manifest's goals x streams x steps make "
                             f"{want + tail}")
        if v.dtype.kind not in "iub":
            raise ValueError(f"{path}: {key} are {v.dtype}, not whole numbers")
        if v.size and (v.min() < low or v.max() > high):
            raise ValueError(f"{path}: {key} must lie in {low}..{high} (a {SIZE}x{SIZE} Darkroom with {N_ACTIONS} "
                             f"actions), found {v.min()}..{v.max()}")


def load(folder: Path, goals: Optional[Sequence[int]] = None) -> Histories:
    """-> the Histories of ``goals`` (default: all) from the shards that hold them, in that order. Reads
    numpy only: a PyTorch reader never starts JAX."""
    folder, m = Path(folder), manifest(folder)
    want = m["goals"] if goals is None else [int(g) for g in goals]
    _has_goals(folder, m, want)
    parts, wanted = {k: [] for k in ("goals",) + ARRAYS}, set(want)
    for s in m["shards"]:
        keep = [i for i, g in enumerate(s["goals"]) if g in wanted]
        if keep:
            try:
                with np.load(folder / s["file"], allow_pickle=False) as z:
                    for k in parts:
                        parts[k].append(z[k][keep])
            except (OSError, ValueError, EOFError, KeyError, IndexError, zipfile.BadZipFile) as e:
                raise ValueError(f"{folder / s['file']} is not a readable shard of the manifest's goals "
                                 f"({type(e).__name__})") from None
    arrays = {k: np.concatenate(v) for k, v in parts.items()}
    order = np.argsort([want.index(int(g)) for g in arrays["goals"]])
    return Histories(**{k: v[order] for k, v in arrays.items()})


def pin_jax_to_one_core() -> bool:
    """On a CPU-only install, pin this process to one core (see the module docstring). Call it before
    anything imports raysys's JAX code: JAX's threads take the affinity they are created with."""
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")):
        return False
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.ad_transformer.histories",
                                 description="Generate Darkroom learning histories (population PPO) into a folder.")
    ap.add_argument("--out", required=True, help="folder to create (must not exist)")
    ap.add_argument("--config", default="{}", help="SourceConfig fields as JSON, e.g. '{\"steps_per_goal\": 20000}'")
    ap.add_argument("--goals", default="all", help="comma-separated cell numbers, or 'all' (81)")
    a = ap.parse_args(argv)
    from raysys.config import ConfigError, from_dict

    cells = 81  # darkroom.SIZE ** 2, not imported before the pinning below (JAX)
    try:  # the user's mistakes in one line, before anything is generated or written
        if Path(a.out).exists():
            raise ConfigError(f"{a.out} exists; histories are never overwritten")
        try:
            given = json.loads(a.config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config is not JSON ({e})") from None
        if not isinstance(given, dict):
            raise ConfigError("--config must be a JSON object of SourceConfig fields")
        c = from_dict(SourceConfig, given)
        c.validate()
        try:
            goals = np.arange(cells) if a.goals == "all" else np.array([int(g) for g in a.goals.split(",")])
        except ValueError:
            raise ConfigError(f"--goals must be 'all' or comma-separated cell numbers, got {a.goals!r}") from None
        if goals.min() < 0 or goals.max() >= cells or len(set(goals.tolist())) != len(goals):
            raise ConfigError(f"--goals must be distinct cells of the 9x9 grid, 0..{cells - 1}, got {a.goals}")
    except ConfigError as e:
        print(f"raysys: {e}", file=sys.stderr)
        return 2
    pin_jax_to_one_core()
    from raysys.envs import darkroom as dr
    from raysys.workloads.ad_transformer import source

    assert dr.SIZE * dr.SIZE == cells
    t0 = time.perf_counter()
    h = source.generate(c, goals, progress=lambda d, n: print(f"[histories] update {d}/{n} "
                                                               f"({time.perf_counter() - t0:.0f} s)", flush=True))
    wall = time.perf_counter() - t0
    final = source.final_return(h, 1)
    save(h, Path(a.out), extra={"source": dataclasses.asdict(c), "wall_s": wall,
                                "final_return": final.tolist(), "optimal_return": dr.optimal_return(goals).tolist()})
    print(f"[histories] {len(goals)} goals x {c.streams} streams x {h.actions.shape[2]} steps in {wall:.0f} s; "
          f"final return {final.mean():.2f} (optimum {dr.optimal_return(goals).mean():.2f}) -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
