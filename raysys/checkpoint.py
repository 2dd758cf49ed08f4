"""Atomic, safe-to-load checkpoints in a run folder.

Layout: ``<storage>/<run>/checkpoints/step_000001234/{state.pt | state.npz, meta.json}``. A
checkpoint is written to a hidden temporary folder and renamed into place, so a crash mid-write
never leaves a half checkpoint that looks complete; older checkpoints are pruned only after a newer
one is in place. A state holding torch tensors is ``state.pt`` (``torch.save``; loaded with
``torch.load(weights_only=True)``); a state of numpy arrays and plain Python values (a JAX
workload's) is ``state.npz``, written and read without torch (its 1-2 s import) and without pickle.
Either way no arbitrary object is unpickled. A checkpoint written by another workload or an
incompatible config is refused with a message naming the difference. A corrupt checkpoint is
reported, never deleted or overwritten.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from raysys.config import flatten

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (corrupt, foreign workload, incompatible config)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


STEP_DIR = re.compile(r"step_(\d{9})")
"""The only folder names raysys reads or prunes: anything else (``step_6.bad``, a user's copy) is ignored."""


STATE_FILES = ("state.npz", "state.pt")
"""The two forms of a checkpoint's state (see the module docstring)."""


class _NotPlain(TypeError):
    pass


def _encode(obj: Any, arrays: list) -> list:
    """A state of numpy arrays and plain values -> a JSON tree of tagged nodes (arrays by index)."""
    import numpy as np

    if type(obj).__module__.split(".")[0] in ("jax", "jaxlib") and hasattr(obj, "__array__"):
        try:
            obj = np.asarray(obj)  # a jax.Array (on any device): its values, so a JAX process needs no torch
        except TypeError:  # a typed PRNG key: jax.random.key_data(key) is its plain form
            raise _NotPlain(f"a JAX {obj.dtype} array (save jax.random.key_data(key) instead)") from None
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype != object:
        a = np.asarray(obj)
        if a.dtype.kind == "V" and a.dtype.fields is None:  # bfloat16, float8 (ml_dtypes): npz keeps only bytes
            arrays.append(a.view(f"u{a.dtype.itemsize}"))
            return ["a", len(arrays) - 1, a.dtype.name]
        arrays.append(a)
        return ["a", len(arrays) - 1]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ["v", obj]
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return ["d", {k: _encode(v, arrays) for k, v in obj.items()}]
    if isinstance(obj, dict) and all(k is None or isinstance(k, (bool, int, float, str)) for k in obj):
        return ["m", [[k, _encode(v, arrays)] for k, v in obj.items()]]  # e.g. int keys: JSON's are strings
    if isinstance(obj, (list, tuple)):
        return ["l" if isinstance(obj, list) else "t", [_encode(v, arrays) for v in obj]]
    raise _NotPlain(f"a {type(obj).__module__}.{type(obj).__qualname__}")


def _decode(node: list, arrays) -> Any:
    tag, value = node[:2]
    if tag == "a":
        if len(node) == 3:
            import ml_dtypes

            return arrays[f"a{value}"].view(getattr(ml_dtypes, node[2]))
        return arrays[f"a{value}"]
    if tag == "v":
        return value
    if tag == "d":
        return {k: _decode(v, arrays) for k, v in value.items()}
    if tag == "m":
        return {k: _decode(v, arrays) for k, v in value}
    items = [_decode(v, arrays) for v in value]
    return items if tag == "l" else tuple(items)


def _as_npz(state: dict) -> Optional[dict]:
    """``state`` as the named arrays of an npz (its structure as JSON under ``__tree__``), or None when it
    holds more than numpy arrays and plain values (then torch stores it)."""
    import numpy as np

    arrays: list = []
    try:
        tree = json.dumps(_encode(state, arrays))
    except (_NotPlain, ValueError) as e:
        if not _holds_torch(state):  # torch would pickle it, and its safe loader would refuse it on resume
            raise TypeError(f"a checkpoint state holds {e}: save numpy or torch arrays, plain values and "
                            "dicts, lists or tuples of them") from None
        return None
    return {"__tree__": np.array(tree), **{f"a{i}": a for i, a in enumerate(arrays)}}


def _holds_torch(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_holds_torch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_torch(v) for v in obj)
    return type(obj).__module__.split(".")[0] == "torch"


def read_state(path: Path) -> dict:
    """The state of the checkpoint folder ``path`` (either form; nothing is unpickled). Raises what the
    reader raises on a damaged file."""
    path = Path(path)
    if (path / "state.npz").is_file():
        import numpy as np

        with np.load(path / "state.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        return _decode(json.loads(str(arrays.pop("__tree__"))), arrays)
    import torch

    return torch.load(path / "state.pt", map_location="cpu", weights_only=True)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, file too large, read-only storage). The half-written
    copy is removed; earlier checkpoints are untouched, so the run resumes from the last one."""


class Superseded(CheckpointError):
    """A worker of a session that ended (its driver killed) tried to save into a run that a new session
    (a --resume) holds now: the fence that keeps it from writing over the new session's checkpoints."""


def newest_meta(run_dir: str | Path, workload: str) -> tuple[Optional[Path], dict]:
    """(the newest complete checkpoint of a run, its meta.json), or (None, {}) where there is none or it cannot
    be read: for a resume's notes before the run opens; an unreadable checkpoint is the resume's to refuse,
    in its own words."""
    try:
        store = CheckpointStore(run_dir, workload, {})
        latest = store.latest()
        return (latest, store.meta(latest)) if latest is not None else (None, {})
    except Exception:
        return None, {}


class CheckpointStore:
    def __init__(self, run_dir: str | Path, workload: str, identity: dict[str, Any], keep: int = 2,
                 local_keys: tuple[str, ...] = (), holder: Optional[str] = None, config: Optional[dict] = None):
        """``identity``: the config subset a checkpoint must match to be resumed (model shape, data).
        ``local_keys``: dotted keys of it the workload declares machine-local (``Workload.extra["local_keys"]``:
        where its data is on this machine, not what the run is), so a run resumes from another folder or
        machine. ``holder``: on a Ray worker, the session its run folder's lock named when it started
        (``lifecycle.holder_of``); a save finding another there writes nothing (:class:`Superseded`).
        ``config``: the run's whole config, recorded in each checkpoint's meta.json: a resume whose config
        snapshots were damaged goes on with it (``cli._resumed_base``), not with whatever the command says."""
        from raysys import storage

        self.run_dir, self.holder, self.config = Path(run_dir), holder, config

        self.root = Path(run_dir) / "checkpoints"
        # a run on remote storage (raysys.storage): the folder here is a working copy, the storage the truth
        self.remote = storage.remote_of(Path(run_dir))
        # through JSON once, so tuples compare equal to the lists a saved meta.json holds; less the keys the
        # workload declares machine-local (where its data is here), which are neither recorded nor compared
        self.local = tuple(local_keys)
        self.workload, self.identity, self.keep = workload, _without(identity, self.local), keep

    def complete(self) -> list[Path]:
        """Checkpoints raysys wrote completely, oldest first: ``step_<9 digits>`` folders whose
        ``meta.json`` (written last) exists. Others are never read, and never deleted."""
        if self.remote is not None:
            remote, name = self.remote
            done = [self.root / n for n in remote.listdir(name, "checkpoints")
                    if STEP_DIR.fullmatch(n) and remote.kind(name, "checkpoints", n, "meta.json") == "file"]
        elif not self.root.is_dir():
            return []
        else:
            done = [p for p in self.root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / "meta.json").is_file()]
        return sorted(done, key=lambda p: int(p.name[len("step_"):]))

    def clean_stale(self) -> list[str]:
        """Finish or undo what a crash mid-save left behind (call only while holding the run's lock, so no
        other process is writing): a complete ``.tmp-step_N`` or ``.old-step_N`` whose ``step_N`` is
        missing is moved into place; the rest of those hidden folders (and ``.pruned-step_N``) is removed."""
        if not self.root.is_dir():
            return []
        done = []
        for p in sorted(self.root.iterdir()):
            m = re.fullmatch(r"\.(tmp|old|pruned)-(step_\d{9})-[0-9a-f]{8}", p.name)
            if not m or not p.is_dir():
                continue
            if m.group(1) == "pruned":  # an older checkpoint the run was removing
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"removed {p.name}")
                continue
            final = self.root / m.group(2)
            if (p / "meta.json").is_file() and not (final / "meta.json").is_file() and not final.exists():
                os.replace(p, final)
                done.append(f"{p.name} -> {final.name}")
            else:
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"removed {p.name}")
        return done

    def latest(self) -> Optional[Path]:
        done = self.complete()
        return done[-1] if done else None

    def save(self, state: dict, step: int, extra_meta: Optional[dict] = None) -> Path:
        if self.remote is not None:  # another process took the run over (this one was paused): nothing written
            from raysys import storage

            storage.check_lease(self.run_dir)
        if self.holder is not None:
            from raysys.lifecycle import holder_of

            now = holder_of(self.run_dir)
            if now is not None and now != self.holder:
                raise Superseded(f"run folder {self.run_dir} is now held by {now}, not by this worker's session "
                                 f"({self.holder}), which another session has taken over: checkpoint step {step} is "
                                 "not written")
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:09d}"
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        npz = _as_npz(state)
        state_file = "state.npz" if npz is not None else "state.pt"
        versions = {}
        try:
            tmp.mkdir()
            with open(tmp / state_file, "wb") as f:
                if npz is not None:
                    import numpy as np

                    np.savez(f, **npz)
                else:  # torch tensors (or other types torch can store): torch is imported only here
                    import torch

                    torch.save(state, f)
                    versions["torch"] = torch.__version__
                f.flush()
                os.fsync(f.fileno())
            meta = {"workload": self.workload, "identity": self.identity, "step": step, "time": time.time(),
                    **versions, **({"config": self.config} if self.config is not None else {}), **(extra_meta or {})}
            # meta.json is written last: its presence marks the checkpoint complete.
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
            _fsync_dir(tmp)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            err = _os_error(e)
            reason = f"{errno.errorcode.get(err.errno, err.errno)} {err.strerror}" if err else str(e).splitlines()[0][:200]
            raise CheckpointWriteError(err.errno if err else errno.EIO,
                                       f"could not write checkpoint {final.name} in {self.root} ({reason}); "
                                       "the earlier checkpoints are intact") from e
        if final.exists() and not (final / "meta.json").is_file():
            # not a checkpoint raysys completed (a user's or a foreign folder): moved aside, never deleted
            os.replace(final, self.root / f"{final.name}.incomplete-{uuid.uuid4().hex[:8]}")
        if final.exists():  # same step saved again after a restart: keep the old one until the swap
            old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        if self.remote is not None:
            remote, name = self.remote
            try:  # the state first, meta.json last: a half upload is never taken for a checkpoint
                for f in (state_file, "meta.json"):
                    remote.put(final / f, name, "checkpoints", final.name, f)
            except OSError as e:
                raise CheckpointWriteError(e.errno or errno.EIO, f"could not upload checkpoint {final.name} to "
                                           f"{remote.display}/{name} ({str(e).splitlines()[0][:200]}); the earlier "
                                           "checkpoints are intact") from e
        self._prune()
        return final

    def _prune(self) -> None:
        """Remove the checkpoints older than the newest ``keep`` (never one a run ended with). The new one is
        saved by now: a removal that fails (the storage not answering) is a clean-up's, said and tried
        again at the next save, never the training's error."""
        try:
            for stale in [c for c in self.complete()[:-self.keep] if not self.ended(c)]:
                if self.remote is not None:  # a resumed remote run's working copy holds only what it pulled
                    self.remote[0].delete_dir(self.remote[1], "checkpoints", stale.name)
                if stale.exists():
                    # out of sight first: a kill mid-removal leaves a hidden folder clean_stale removes, not
                    # a step_N half deleted
                    gone = self.root / f".pruned-{stale.name}-{uuid.uuid4().hex[:8]}"
                    os.replace(stale, gone)
                    shutil.rmtree(gone, ignore_errors=True)
        except OSError as e:
            log.warning("could not remove an older checkpoint of %s (%s); the next save tries again", self.run_dir,
                        " ".join(str(e).split())[:200])

    def mark_ended(self, path: Path) -> None:
        """Mark checkpoint ``path`` as the model the run ended with (``record_final``)."""
        if self.remote is not None:
            from raysys import storage

            storage.check_lease(self.run_dir)
        path.mkdir(parents=True, exist_ok=True)  # a remote run's checkpoint may have no local copy
        (path / ENDED_MARK).write_text("the model this run ended with: pruning keeps it\n")
        if self.remote is not None:
            self.remote[0].put(path / ENDED_MARK, self.remote[1], "checkpoints", path.name, ENDED_MARK)

    def ended(self, path: Path) -> bool:
        """Whether checkpoint ``path`` is one the run ended with (``mark_ended``)."""
        if self.remote is not None:
            return self.remote[0].kind(self.remote[1], "checkpoints", path.name, ENDED_MARK) == "file"
        return (path / ENDED_MARK).is_file()

    def load(self, path: Optional[Path] = None) -> tuple[dict, dict]:
        """Load (state, meta) from ``path`` or the latest checkpoint; raise CheckpointError if unusable."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.root}")
        if self.remote is not None and not any((path / n).is_file() for n in STATE_FILES):
            remote, name = self.remote
            state_file = next((n for n in STATE_FILES if remote.kind(name, "checkpoints", path.name, n) == "file"),
                              STATE_FILES[-1])
            remote.get(path / state_file, name, "checkpoints", path.name, state_file)  # then meta.json, below
        meta = self.meta(path)
        diff = self.differences(meta)
        if diff:
            refuse_different(path, diff)
        try:
            state = read_state(path)
        except Exception as e:  # empty or truncated file, bad zip, foreign pickle: one clear message
            raise CheckpointError(f"checkpoint {path} is corrupt or unsafe to load ({_why_unreadable(e)}). "
                                  f"It was left untouched; {self._aside_hint(path)}") from None
        return state, meta

    def _aside_hint(self, path: Path) -> str:
        """How to resume from the checkpoint before ``path``: moved aside (a name raysys never reads), not deleted."""
        import shlex

        earlier = [p for p in self.complete() if p.name != path.name]
        if not earlier:
            return "no earlier checkpoint is left to resume from"
        if self.remote is not None:
            return f"move it aside in {self.remote[0].display}/{self.remote[1]}/checkpoints to resume from {earlier[-1].name}"
        return (f"to resume from {earlier[-1].name}, move it aside first: "
                f"mv {shlex.quote(str(path))} {shlex.quote(str(path) + '.corrupt')}")

    def meta(self, path: Path) -> dict:
        """The checkpoint's meta.json (alone: its state is not fetched from remote storage), which must be
        this workload's."""
        if self.remote is not None and not (path / "meta.json").is_file():
            self.remote[0].get(path / "meta.json", self.remote[1], "checkpoints", path.name, "meta.json")
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt: unreadable meta.json ({e}). It was left untouched; "
                                  f"{self._aside_hint(path)}") from None
        if meta.get("workload") != self.workload:
            raise CheckpointError(
                f"checkpoint {path} belongs to workload '{meta.get('workload')}', not '{self.workload}'; "
                "refusing to resume from it")
        return meta

    def differences(self, meta: dict) -> dict[str, tuple[Any, Any]]:
        """Dotted identity key -> (the checkpoint's value, this config's), where they differ. A key the
        checkpoint never had is not a difference (:meth:`added`): the workload's config grew a field since."""
        a, b = flatten(_without(meta.get("identity", {}), self.local)), flatten(self.identity)  # older ones recorded them
        return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k in a and a.get(k) != b.get(k)}

    def added(self, meta: dict) -> dict[str, Any]:
        """Identity keys this config has and the checkpoint never had (its code added them), with their values."""
        a, b = flatten(_without(meta.get("identity", {}), self.local)), flatten(self.identity)
        return {k: b[k] for k in sorted(b) if k not in a}


def refuse_different(path: Path, diff: dict[str, tuple[Any, Any]]) -> None:
    """``diff``: what :meth:`CheckpointStore.differences` found."""
    said = "; ".join(f"{k}: checkpoint={a!r} now={b!r}" for k, (a, b) in diff.items())
    data = [k for k in diff if k.endswith("digest")]
    why = (f" ({', '.join(data)}: the data files now hold other data than the run trained on)" if data else "")
    raise CheckpointError(f"checkpoint {path} was written with a different config: {said}{why}. "
                          "Resume with the same settings, or start a new run (another --name).")


def _os_error(e: BaseException) -> Optional[OSError]:
    while e is not None:
        if isinstance(e, OSError) and e.errno:
            return e
        e = e.__cause__ or e.__context__
    return None


def _without(identity: dict, keys: tuple[str, ...]) -> dict:
    """A JSON copy of ``identity`` less the dotted ``keys``."""
    out = json.loads(json.dumps(identity, default=str))
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def _why_unreadable(e: Exception) -> str:
    """torch.load's error, in a line: an empty file raises a bare EOFError; torch's weights-only refusal
    advises loading with weights_only=False, which is no advice for a damaged or foreign file."""
    text = (str(e).strip().splitlines() or [""])[0]
    if "weights only load failed" in text.lower():
        text = "torch's weights-only loader refused what it holds"
    elif not text:
        text = "the file is empty or cut short" if isinstance(e, EOFError) else "no detail"
    return f"{type(e).__name__}: {text[:200]}"


FINAL_FILE = "final_metrics.json"
ENDED_MARK = "ENDED"
"""In a checkpoint's folder: the model the run ended with, kept when a --resume trains it further."""


def record_final(store: "CheckpointStore", final: dict, breakdown: Optional[str] = None) -> None:
    """Write the run's ``final_metrics.json`` (and its ``breakdown.md``), and mark its newest checkpoint as the
    model it ended with (``ENDED_MARK``: pruning keeps it). What an earlier session recorded when the run
    ended at another step (a --resume then trained it further) is kept beside them, as
    ``final_metrics.step_N.json`` and ``breakdown.step_N.md``, not overwritten."""
    from raysys import storage

    run_dir = store.run_dir
    path = run_dir / FINAL_FILE
    try:
        earlier = json.loads(path.read_text()) if storage.pull(path) else None
    except (OSError, ValueError):
        earlier = None
    done = store.complete()
    now = _step_of(done[-1]) if done else None
    if isinstance(earlier, dict):
        marked = next((c for c in reversed(done) if store.ended(c)), None)
        was = _step_of(marked) if marked else earlier.get("step")  # the mark, or (an older run) its file's step
        if isinstance(was, int) and was != now:
            storage.write_text(run_dir / f"final_metrics.step_{was}.json", path.read_text())
            if storage.pull(run_dir / "breakdown.md"):
                storage.write_text(run_dir / f"breakdown.step_{was}.md", (run_dir / "breakdown.md").read_text())
    if breakdown is not None:
        storage.write_text(run_dir / "breakdown.md", breakdown)
    storage.write_text(path, json.dumps(final, indent=1, default=float))
    if done:
        store.mark_ended(done[-1])


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1])
