"""Driver side of a training run: name it, track it, and hand it to Ray Train.

``run_training`` is what ``python -m raysys train`` and each Tune trial call. It resolves the
run's folder (refusing to clobber an existing run unless resuming), validates an existing
checkpoint *before* any worker starts, prepares data once, opens the MLflow run, and fits a Train
V2 ``TorchTrainer`` (``--workers 0`` runs the same loop in this process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from raysys import console, lifecycle, storage, tracking
from raysys import workload as registry
from raysys.checkpoint import CheckpointError, CheckpointStore, Superseded
from raysys.config import ConfigError, apply_overrides, flatten, to_dict
from raysys.metrics import divergence
from raysys.train import code_checks
from raysys.train.code_checks import DataError
from raysys.train.failures import error_line, fit_with_restarts, full_traceback, newest_checkpoint, record_event
from raysys.train.runtime import (check_local_resources, check_ray_address, init_ray, joins_cluster,
                                  process_group_backend, train_logging, use_jax_platforms)

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    name: str
    run_dir: Path
    run_id: Optional[str]
    tracking_uri: str
    metrics: dict[str, Any]
    stopped_by: Optional[int] = None
    """The signal that stopped the run at a step boundary (its checkpoint saved), or None."""
    resume_command: str = ""
    failure: str = ""
    """Why a run that ended without an error did not train (it diverged): its MLflow run is FAILED."""
    where: str = ""
    """Where its files are as users know them, where not ``storage.where(run_dir)`` (a cross-validation's folds)."""
    note: str = ""
    """A note on the program a population member trained in (members that differ ended alike), for a sweep's
    console, which does not see the trial's own lines."""


def identity_of(wl: registry.Workload, cfg: Any) -> dict:
    """Config sections a checkpoint must match (model shape and data by default)."""
    d = to_dict(cfg)
    return {k: d[k] for k in wl.extra.get("identity_sections", ("model", "data")) if k in d}


def _has_checkpoint(wl: registry.Workload, run_dir: Path):
    """Whether the run has a checkpoint now, for what an interrupted command says (``lifecycle.saved``)."""
    return lambda: CheckpointStore(run_dir, wl.name, {}).latest() is not None


def storage_root(path: str) -> Path:
    """The local folder of ``launch.storage_path`` (``file://`` URIs included)."""
    if storage.is_file_uri(path):
        from urllib.parse import unquote, urlparse

        host = urlparse(path).netloc
        if host not in ("", "localhost"):  # file://rel/runs: 'rel' is a host, and the folder /runs
            raise ConfigError(f"--storage-path {path}: a file URI names no host ({host!r} here); write "
                              f"file:///absolute/path, or the folder itself ({host}{urlparse(path).path})")
        return Path(unquote(urlparse(path).path)).resolve()
    return Path(path).resolve()


SWEEPS = "sweeps"
"""The folder of ``raysys_runs`` where ``python -m raysys.tune`` keeps its sweeps (its --storage-path default):
not a run name there."""


def resolve_run_dir(wl_name: str, launch: Any) -> tuple[str, Path]:
    """The run's name and folder, validated; nothing is created here. On remote storage the folder is this
    process's working copy (raysys.storage), with the run's files pulled when resuming."""
    remote = storage.Remote(launch.storage_path) if storage.is_remote(launch.storage_path) else None
    root = remote.display if remote else storage_root(launch.storage_path)
    if remote:
        remote.check()
    else:
        storage.check_local_folder(root, "--storage-path")
    name = launch.name
    if name is not None:
        lifecycle.validate_name(name)
        if name == SWEEPS and not remote and root == storage_root("raysys_runs"):
            raise ConfigError(f"--name {name}: {root}/{name} is where `python -m raysys.tune` keeps its sweeps; "
                              "choose another run name (nothing was changed)")
    if launch.resume and not name:  # newest run of this workload
        if remote:  # <workload>-<time>: sorts by time; the newest that has not ended, else the newest
            dirs = [n for n in remote.listdir() if n.startswith(f"{wl_name}-")]
            runs = [n for n in dirs if remote.kind(n, "final_metrics.json") != "file"] or dirs
        else:  # the newest one that has not ended and that no other command trains now, else the newest
            dirs = sorted((p for p in root.glob(f"{wl_name}-*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
            unfinished = [p for p in dirs if not (p / "final_metrics.json").exists()]
            runs = [p.name for p in ([p for p in unfinished if not lifecycle.RunLock.in_use(p)] or unfinished or dirs)]
        if not runs:
            raise ConfigError(f"--resume: no earlier {wl_name} run named by default ({wl_name}-<date>-<time>) under "
                              f"{root}; a run you named: --resume --name NAME")
        name = runs[-1]
    name = name or f"{wl_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if remote:
        exists = remote.kind(name) == "dir" and bool(remote.listdir(name))
        run_dir = storage.working_copy(remote, name)
        if exists and launch.resume:
            storage.pull_run_files(remote, name, run_dir)
    else:
        run_dir = root / name
        exists = run_dir.is_dir() and any(p.name != lifecycle.LOCK_FILE for p in run_dir.iterdir())
    if launch.resume and not exists:
        raise ConfigError(f"--resume: no run called '{name}' under {root}")
    if launch.resume and not _holds_a_run(run_dir):
        raise ConfigError(f"--resume: {root}/{name} holds no run (none of a run's config.yaml, events.log, code.json "
                          "or checkpoints in it); a resume writes only into a run's own folder (nothing was changed)")
    if not launch.resume and exists:
        raise ConfigError(f"a run called '{name}' already exists at {root}/{name}; pass --resume to continue it "
                          "or choose another --name (nothing was changed)")
    return name, run_dir


def _holds_a_run(run_dir: Path) -> bool:
    """A run's folder: the files a run writes as it starts (a killed one may have only some), or a checkpoint."""
    return (any((run_dir / f).is_file() for f in ("config.yaml", "events.log", "code.json"))
            or any(run_dir.glob("config.resume-*.yaml")) or newest_checkpoint(run_dir) is not None)


def ray_storage(run_dir: Path) -> dict:
    """``RunConfig`` storage arguments: Ray Train keeps its own run state in the run's storage too."""
    owner = storage.remote_of(run_dir)
    return owner[0].ray_storage() if owner else {"storage_path": str(run_dir.parent)}


def saved_config(run_dir: Path) -> Optional[Path]:
    """The config snapshot a resume continues from: the newest whole one of config.yaml,
    config.resume-N.yaml (a process killed mid-write by an older raysys left an empty file)."""
    snaps = sorted((p for p in run_dir.glob("config.resume-*.yaml") if p.stem.split("-")[-1].isdigit()),
                   key=lambda p: int(p.stem.split("-")[-1]), reverse=True)
    for snap in [*snaps, run_dir / "config.yaml"]:
        try:
            if isinstance(yaml.safe_load(snap.read_text()), dict):
                return snap
        except (OSError, yaml.YAMLError):
            pass
    return None


def _tracked_to(run_dir: Path) -> Optional[str]:
    """The tracking URI the run's newest config snapshot recorded (None: none recorded)."""
    snap = saved_config(run_dir)
    try:
        uri = (yaml.safe_load(snap.read_text()).get("launch") or {}).get("tracking_uri") if snap else None
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return uri if isinstance(uri, str) and uri else None


def _latest_step(store: CheckpointStore) -> int:
    latest = store.latest()
    return int(store.meta(latest).get("step", 0)) if latest is not None else 0


def _next_snapshot(run_dir: Path, resume: bool) -> Path:
    if not resume or not (run_dir / "config.yaml").exists():
        return run_dir / "config.yaml"
    n = 1
    while (run_dir / f"config.resume-{n}.yaml").exists():  # every resume keeps its own snapshot
        n += 1
    return run_dir / f"config.resume-{n}.yaml"


def _set_aside_buffer(run_dir: Path) -> str:
    """A resume that tracks to another store: what the run's last session could not send to its own store is
    kept for that store (``tracking-buffer.unsent.jsonl``), not sent into the new store's run; said in a few
    words, '' when nothing waited."""
    buffer = run_dir / tracking.BUFFER_FILE
    if not storage.pull(buffer):
        return ""
    aside, text = run_dir / "tracking-buffer.unsent.jsonl", buffer.read_text()
    n = sum(1 for line in text.splitlines() if line.strip())
    storage.write_text(aside, (aside.read_text() if storage.pull(aside) else "") + text)
    storage.remove(buffer)
    return f"its {n} records not sent there are kept in {storage.where(run_dir)}/{aside.name}"


def recorded_final(run_dir: Path) -> Optional[dict]:
    """The final metrics a run recorded when it last finished (``final_metrics.json``), or None. A resumed
    run that has nothing left to train keeps them: rewriting them would replace its measured speed with
    the zero of a session that trained nothing."""
    path = Path(run_dir) / "final_metrics.json"
    try:
        found = json.loads(path.read_text()) if storage.pull(path) else None
    except (OSError, ValueError) as e:
        found = e
    if found is None or isinstance(found, dict):
        return found
    # damaged (by hand, or cut by an older raysys): kept aside, and the run's end is recorded again
    aside = path.with_name(f"{path.name}.damaged")
    try:
        storage.write_text(aside, path.read_text(errors="replace"))
    except OSError:
        pass
    log.warning("%s cannot be read (%s): kept as %s; the run's end is recorded again (its speed is in its MLflow "
                "run)", path, str(found).splitlines()[0][:120] if isinstance(found, Exception) else "not a dict of "
                "metrics", aside.name)
    return None


@dataclass
class OpenRun:
    """A run whose folder, config snapshot and MLflow run exist; what both kinds of loop start from."""

    wl: registry.Workload
    cfg: Any
    cfg_dict: dict
    name: str
    run_dir: Path
    identity: dict
    tracking_uri: str
    run_id: str
    logger: tracking.MLflowLogger
    snapshot: Optional[Path] = None
    """This session's config snapshot (``config.yaml`` or ``config.resume-N.yaml``)."""
    holder: Optional[str] = None
    """On a Ray worker: the session that started it, as the run folder's lock named it (``lifecycle.holder_of``)."""
    watcher: Any = None
    """A command's own run: its ``raysys.watcher``, told at ``finish`` that the run was closed here."""
    tags_before: Optional[dict] = None
    """A resume with changed config: the run's ``CHANGE_TAGS`` before it (None: not read), put back where
    the session trains nothing (its changes are not kept, so the tags must not say they were)."""
    resume_changes: str = ""
    """What this resume changed in the run's config ('key: old -> new; ...'), as said when it opened."""

    def store(self, keep: int = 2) -> CheckpointStore:
        return CheckpointStore(self.run_dir, self.wl.name, self.identity, keep=keep,
                               local_keys=self.wl.extra.get("local_keys", ()), holder=self.holder, config=self.cfg_dict)

    def finish(self, status: str) -> None:
        handed = False
        try:
            handed = self._finish(status)
        finally:
            if self.watcher is not None:  # records left in the buffer: the watcher sends them once the store is back
                self.watcher.hand_off() if handed else self.watcher.done()

    def _finish(self, status: str) -> bool:
        """Close the run; True where its close (and what came before it) waits in the tracking buffer, for the
        watcher to send."""
        lifecycle.RunLock.release_dir(self.run_dir)
        if self.cfg.launch.resume and self.snapshot is not None and self.snapshot.is_file():
            try:  # kept: this session trained with it (one that trained nothing removed it in ``tracked``)
                self.logger.log_artifact(self.snapshot)
            except Exception as e:  # the file is still in the run folder; the close below matters more
                log.warning("could not log %s of run %s: %s", self.snapshot.name, self.name, e)
        if status == "FINISHED":  # an earlier session's failure is history now: events.log keeps it
            self.logger.delete_tag("raysys.error")
            self._retire_error_file()
        try:
            ended = self.logger.end(status)
        except Exception as e:  # nowhere to keep the close (a full disk): never in place of the run's own error
            log.warning("could not close the MLflow run of %s as %s (%s): it stays RUNNING until a --resume of the "
                        "run ends it", self.name, status, e)
            return False
        if not ended:
            why = self.logger.failure or "it did not answer: a server away, a full disk"
            # a run on remote storage keeps its buffer there (this folder is a copy the command removes): a
            # --resume sends it; a local one the watcher can send
            handed = (self.watcher is not None and self.watcher.proc.poll() is None
                      and storage.remote_of(self.run_dir) is None)
            console.Sink().message(f"[raysys] the tracking store did not take this run's last records ({why}): "
                                   f"{self.logger.pending} records wait in {storage.where(self.run_dir)}/"
                                   f"{self.logger.buffer.name}; "
                                   + ("a watcher process sends them once the store answers again (it keeps "
                                      "trying for a while), else " if handed else "")
                                   + f"--resume of this run sends them: {_resume_command(self.wl, self.cfg.launch, self.name)}")
            return handed
        elif self.logger.parked.is_file():
            console.Sink().message(f"[raysys] the tracking server did not store some artifacts of this run; they "
                                   f"wait in {storage.where(self.run_dir)}/{self.logger.parked.name} and are sent on "
                                   f"--resume of this run: {_resume_command(self.wl, self.cfg.launch, self.name)}")
        return False

    def _retire_error_file(self) -> None:
        """A finished run has no error.txt: the traceback of the session that failed before this resume
        is added to error.earlier.txt (moved, not deleted), so the run folder no longer reads as failed."""
        path, earlier = self.run_dir / ERROR_FILE, self.run_dir / EARLIER_ERROR_FILE
        try:
            if storage.pull(path):
                before = earlier.read_text() + "\n" if storage.pull(earlier) else ""
                storage.write_text(earlier, before + path.read_text())
                storage.remove(path)
        except Exception as e:  # storage away: the stale file is only misleading, never worth failing the run
            log.warning("could not move %s of run %s aside: %s", ERROR_FILE, self.name, e)

    def resume_command(self) -> str:
        return _resume_command(self.wl, self.cfg.launch, self.name)

    def record_failure(self, why: str | BaseException) -> str:
        """Keep why the run failed where it outlives the console: ``events.log``, the MLflow tag
        ``raysys.error``, and for an error its traceback in ``<run>/error.txt`` (also an artifact).
        An error gets ``raysys_failure`` (the line), which the CLI prints after the traceback."""
        line = why if isinstance(why, str) else error_line(why)

        def keep(what: str, write) -> None:  # each record on its own: a lost storage must not cost the tag
            try:
                write()
            except Exception as e:  # a full disk or a lost store must not hide the error itself
                log.warning("could not record the failure of run %s in %s: %s", self.name, what, e)

        keep("MLflow", lambda: self.logger.set_tags({"raysys.error": line[:5000]}))
        keep("events.log", lambda: record_event(self.run_dir, f"failed: {line}"))
        if isinstance(why, BaseException):
            def error_file():
                storage.write_text(self.run_dir / ERROR_FILE, full_traceback(why))
                self.logger.log_artifact(self.run_dir / ERROR_FILE)

            keep(ERROR_FILE, error_file)
            try:
                try:
                    saved = self.store().latest() is not None
                except Exception:  # storage away: say what usually holds
                    saved = True
                how = "resume from its last checkpoint" if saved else "no checkpoint yet; start it again from step 0"
                why.raysys_resume = self.resume_command()
                why.raysys_failure = (f"[raysys] run '{self.name}' failed: {line}\n  traceback: "
                                      f"{storage.where(self.run_dir)}/{ERROR_FILE}\n  {how}: {why.raysys_resume}")
            except AttributeError:  # an exception type without a __dict__: the plain traceback then
                pass
        return line

    @contextlib.contextmanager
    def tracked(self):
        """Close the MLflow run as FINISHED, KILLED (a signal, Ctrl-C) or FAILED, however the block ends.
        The block may set ``.failure`` (a run that diverged): FAILED, recorded."""
        from raysys.train.failures import find_cause

        status, outcome = "FAILED", _Outcome()
        try:
            yield outcome
            status = "KILLED" if lifecycle.stop_requested() is not None else "FINISHED"
            if status == "FINISHED" and outcome.failure:
                status = "FAILED"
                self.record_failure(outcome.failure)
            if outcome.trained_nothing and self.cfg.launch.resume and self.snapshot is not None:
                # resumed after its end: the config given now trained nothing, and must not become the one
                # the next --resume starts from (changes that never trained would pile up there)
                storage.remove(self.snapshot)
                self._take_back_changes()
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except Exception as e:
            if find_cause(e, (storage.LeaseLost,)) is not None:  # the run is another process's now: not a word
                status = None                                    # more to it (its MLflow run, events.log)
                raise
            if (isinstance(e, CheckpointError) and not isinstance(e, Superseded) and self.cfg.launch.resume
                    and self.snapshot is not None):
                # a resume its checkpoint refused trained nothing: its snapshot must not become the config
                # the next --resume starts from (it would be refused again, for ever)
                storage.remove(self.snapshot)
            self.record_failure(e)
            raise
        finally:
            if status is None:
                self.let_go()
            else:
                self.finish(status)

    def _take_back_changes(self) -> None:
        """A resume with changed config that trained nothing: the changes are not kept (the next --resume
        starts from the run's config as it was), so the run's tags say what they said before, and the
        console says it once."""
        if self.tags_before is None:
            return
        for key, value in self.tags_before.items():
            if value:
                self.logger.set_tags({key: value})
            else:
                self.logger.delete_tag(key)
        print(f"[raysys] the changed config trained nothing, so it is not kept ({self.resume_changes}): the next "
              "--resume starts from the run's config as it was; give the change together with a longer run",
              flush=True)

    def let_go(self) -> None:
        """Leave the run as it is, to the process that took it over (``storage.LeaseLost``): this one's lock
        released, its watcher told not to close the MLflow run, nothing written."""
        lifecycle.RunLock.release_dir(self.run_dir)
        if self.watcher is not None:
            self.watcher.done()


@dataclass
class _Outcome:
    failure: str = ""
    trained_nothing: bool = False
    """A resume after the run's end that trained nothing (its recorded final metrics kept)."""

    def check(self, final: dict, quality: Optional[str] = None, required: bool = True) -> None:
        """The block's run ended with these final metrics: a diverged loss makes it FAILED, and so does
        ending with a non-finite ``quality`` (a metric its workload declares), or without it where
        ``required``, unless it was asked to stop: a run that cannot be judged did not do what it was for."""
        self.failure = divergence(final) or ""
        if quality and not self.failure and lifecycle.stop_requested() is None:
            if quality not in final and required:
                self.failure = (f"no quality: the run ended without {quality} (Workload.quality_metric), neither "
                                "logged through its session nor in what train_fn returned")
            elif isinstance(final.get(quality), float) and not math.isfinite(final[quality]):
                # a model whose quality is NaN learned nothing that can be judged (its loss may have gone
                # non-finite too few times in a row for the loop to stop itself)
                self.failure = f"diverged: its final {quality} is {final[quality]}"


ERROR_FILE = "error.txt"
EARLIER_ERROR_FILE = "error.earlier.txt"


def _run_again(command: str) -> str:
    """The command that trains this configuration again as a new run: from the folder it ran in (a relative
    plug-in path or data path means the same there), without its ``--name`` (taken now) or ``--resume``."""
    import shlex

    words, out = shlex.split(command), []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--name":
            skip = True
        elif not (w.startswith("--name=") or w == "--resume"):
            out.append(w)
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(out)}"


def _resume_command(wl: registry.Workload, launch: Any, name: str) -> str:
    """The line that continues this run, from any folder: the run folder, the default MLflow store and a
    ``module:attr`` workload are all found relative to the folder the run started in."""
    import shlex

    train = f"python -m raysys train {shlex.quote(registry.ref(wl))} --name {name} --resume"
    if Path(launch.storage_path).resolve() != Path("raysys_runs").resolve():
        train += f" --storage-path {shlex.quote(launch.storage_path)}"  # an S3 URI's options hold '&'
    if RAY_PACKAGE not in str(Path.cwd().resolve()) + "/":
        return f"cd {shlex.quote(os.getcwd())} && {train}"
    # a `ray job submit` job: its folder is Ray's unpacked copy on the head, and a plain driver would start a
    # Ray of its own; a new job of the same source resumes it on the cluster (cluster/README.md)
    if launch.tracking_uri:
        train += f" --tracking-uri {shlex.quote(launch.tracking_uri)}"
    return (f"ray job submit --address {_job_dashboard()} --working-dir . --runtime-env cluster/runtime_env.yaml "
            f"-- {train}")


def _job_dashboard() -> str:
    """The dashboard a job of this cluster is submitted to: the one Ray joined, else its default port here (the
    head binds it to 127.0.0.1, reached through a tunnel: cluster/README.md)."""
    try:
        import ray

        url = ray._private.worker.get_dashboard_url() if ray.is_initialized() else ""
    except Exception:  # Ray's private helper moved
        url = ""
    return (url if "://" in url else f"http://{url}") if url else "http://127.0.0.1:8265"


def _lock_dir(launch: Any) -> Optional[Path]:
    """Where a remote run's lock file lives: runs of one machine share a lock folder (other machines are
    kept out by the run's lease on the storage, ``_hold``)."""
    if not storage.is_remote(launch.storage_path):
        return None
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / "raysys-locks" / hashlib.sha256(_same_place(launch.storage_path).encode()).hexdigest()[:16]


def _hold(run_dir: Path, name: str, launch: Any, create: bool) -> lifecycle.RunLock:
    """Lock the run folder (making it when ``create``); a run on remote storage is also leased there, so a
    process on another machine is refused too (``storage.Lease``)."""
    get = lifecycle.create_run_dir if create else lifecycle.RunLock.acquire
    lock = get(run_dir, name, lock_dir=_lock_dir(launch))
    owner = storage.remote_of(run_dir)
    if owner is not None and lock.lease is None:
        try:
            lock.lease = storage.Lease(*owner).acquire()
        except BaseException:
            lock.release()
            raise
    return lock


def _claim(wl_name: str, launch: Any, name: str, run_dir: Path) -> tuple[str, Path]:
    """Make and lock a new run's folder, under the next free name where its name is a default one
    (``lifecycle.claim_first``)."""
    import dataclasses

    def claim(candidate: str) -> tuple[str, Path]:
        got = (name, run_dir) if candidate == name else resolve_run_dir(wl_name, dataclasses.replace(launch, name=candidate))
        _hold(got[1], got[0], launch, create=True)
        return got

    return lifecycle.claim_first(name, launch.name is not None, claim)


def prepare_of(wl: registry.Workload):
    """The workload's data step: its task's ``prepare``, or a custom loop's ``extra['prepare']``."""
    return getattr(wl.task, "prepare", None) if wl.task is not None else wl.extra.get("prepare")


def _same_place(uri: str) -> str:
    """One spelling of a storage URI: its options in any order, a trailing slash or not, name one place."""
    from urllib.parse import parse_qsl, urlsplit

    u = urlsplit(uri)
    return f"{u.scheme.lower()}://{u.netloc}/{u.path.strip('/')}?{sorted(parse_qsl(u.query))}"


def _refuse_before_prepare(wl: registry.Workload, cfg: Any, run_dir: Path, changes: str) -> None:
    """A resume that changed a key of the checkpoint's identity is refused now, not after ``prepare``, which may
    make data for minutes (the ad_transformer's PPO histories, the pointer_generator's tokenizer) for a run that
    cannot go on. Only a key given anew on this resume counts (``changes``: 'key: old -> new; ...'), and those the
    workload can say before ``prepare`` (``extra["digest_before_prepare"]``: cfg -> {key: value}, a digest of the
    user's files): ``prepare`` fills in others (an absolute path), and the checkpoint's own check after it sees
    those."""
    early = wl.extra.get("digest_before_prepare")
    known: dict = {}
    if early is not None:
        try:
            known = dict(early(cfg) or {})
        except (OSError, ValueError):  # a file missing or unreadable: prepare says so, in its words
            known = {}
    given = {part.split(":", 1)[0] for part in changes.split("; ")} if changes else set()
    if not given and not known:
        return
    seen = apply_overrides(cfg, known) if known else cfg
    store = CheckpointStore(run_dir, wl.name, identity_of(wl, seen), local_keys=wl.extra.get("local_keys", ()))
    latest = store.latest()
    if latest is None:
        return
    diff = {k: v for k, v in store.differences(store.meta(latest)).items()
            if (k in given or k in known) and not _same_path(*v)}
    if diff:
        from raysys.checkpoint import refuse_different

        refuse_different(latest, diff)


def _same_path(a: Any, b: Any) -> bool:
    """Two spellings of one file (relative now, absolute in the checkpoint)."""
    return isinstance(a, str) and isinstance(b, str) and bool(a) and bool(b) and Path(a).resolve() == Path(b).resolve()


def _prepare(prepare, cfg: Any) -> Any:
    """Make or validate the data once, before any run folder or MLflow run exists; a data problem is one
    line (DataError), not a traceback."""
    if prepare is None:
        return cfg
    try:
        return prepare(cfg) or cfg
    except ConfigError:
        raise
    except (ValueError, LookupError, OSError, MemoryError) as e:  # pyarrow's ArrowInvalid/ArrowIOError are among these
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, MemoryError):  # data settings too large for this machine (numpy says how much it wanted)
            msg = f"preparing the data ran out of memory ({msg}): ask for less data"
        raise DataError(msg) from None  # said as "data error: ..."


def open_run(wl: registry.Workload, cfg: Any, prepare=None, parent_run_id: Optional[str] = None,
             tags: Optional[dict] = None, fits: Optional[Callable[[Any, dict], None]] = None,
             check: Optional[Callable[[Any], None]] = None) -> OpenRun:
    """Validate everything, then create: the run folder (locked), the config snapshot and the MLflow run
    (reopened when resuming). Any problem found before the folder exists leaves nothing behind.
    ``fits(cfg, state, code_changed)``: raises a CheckpointError when the model a resume builds (its settings changed, or its
    code) cannot take the checkpoint's state (a shape outside the checkpoint's identity). ``check(cfg)``: the
    workload's own check of the prepared config, which raises a ConfigError (before anything exists)."""
    launch = cfg.launch
    name, run_dir = resolve_run_dir(wl.name, launch)
    uri = tracking.resolve_tracking_uri(launch.tracking_uri)
    env = os.environ.get("RAYSYS_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    if launch.resume and parent_run_id is None and env and tracking.resolve_tracking_uri(env) != uri:
        print(f"[raysys] note: this resume tracks to {uri}, not to {env} from the environment: a run stays in its "
              "own MLflow store unless --tracking-uri moves it", flush=True)
    if parent_run_id is None:
        tracking.check_store(uri)  # a command's own store: bad input, one line before anything
        tracking.check_experiment(uri, launch.experiment or f"raysys-{wl.name}")
    else:
        tracking.wait_for_store(uri)  # a sweep's trial: its server answered when the sweep began
    if getattr(launch, "workers", 0) > 0 or wl.extra.get("needs_ray", False):
        check_ray_address(getattr(launch, "address", None))
        if joins_cluster(getattr(launch, "address", None)):  # a cluster that will not have us: before anything exists
            init_ray(launch.address)
        check_local_resources(launch)
    if getattr(launch, "jax_platforms", "") and launch.workers == 0:
        use_jax_platforms(launch.jax_platforms)
    if launch.resume:
        _hold(run_dir, name, launch, create=False)
        lifecycle.arm(_resume_command(wl, launch, name), _has_checkpoint(wl, run_dir))  # from here a signal stops the run with a checkpoint
    if launch.resume and ((tags or {}).get("raysys.resume_changes") or wl.extra.get("digest_before_prepare")):
        _refuse_before_prepare(wl, cfg, run_dir, (tags or {}).get("raysys.resume_changes", ""))
    cfg = _prepare(prepare, cfg)  # data made/validated once here; paths made absolute for workers
    if check is not None:
        check(cfg)
    dataset = code_checks.dataset_of(wl, cfg)  # the workload's hook: its mistake is one line before anything exists
    identity = identity_of(wl, cfg)
    store = CheckpointStore(run_dir, wl.name, identity, local_keys=wl.extra.get("local_keys", ()))
    resumed_from = None  # the checkpoint a resume goes on from
    code, code_changed = registry.code_digest(wl), ""  # the workload's code now; on a resume, its changed files
    plugin = code_checks.plugin_tag(wl)
    if launch.resume:
        for line in store.clean_stale():  # a crash mid-save: finish the swap or drop the half copy
            record_event(run_dir, f"checkpoint cleanup: {line}")
        resumed_from = store.latest()
        if resumed_from is not None:
            code_changed = code_checks.code_changes(run_dir, code)  # the last session's code.json, before this one's is written
            state, meta = store.load(resumed_from)  # a corrupt or foreign checkpoint fails here, before anything starts or is written
            added = store.added(meta)
            if added:  # the workload's config grew fields since the checkpoint: their values now are said
                many = len(added) > 1
                print(f"[raysys] note: the checkpoint predates config key{'s' if many else ''} "
                      + ", ".join(f"{k} (now {v!r})" for k, v in added.items())
                      + f": the run goes on with {'them as they are' if many else 'it as it is'} now", flush=True)
            if fits is not None:  # a changed setting, or the workload's code changed since the checkpoint
                fits(cfg, state, code_changed)
        else:  # stopped or killed before its first checkpoint: a resume is a new start (said, not silent)
            print(f"[raysys] --resume: run '{name}' has no checkpoint yet (it stopped before its first); "
                  "it starts again from step 0", flush=True)
    created = not launch.resume
    if created:
        name, run_dir = _claim(wl.name, launch, name, run_dir)
        if run_dir != store.run_dir:
            store = CheckpointStore(run_dir, wl.name, identity, local_keys=wl.extra.get("local_keys", ()))
        lifecycle.arm(_resume_command(wl, launch, name), _has_checkpoint(wl, run_dir))
    try:
        cfg_dict = to_dict(cfg)
        if hasattr(launch, "tracking_uri") and cfg_dict.get("launch", {}).get("tracking_uri") is None:
            cfg_dict["launch"]["tracking_uri"] = uri  # the store it tracks to: a --resume from elsewhere finds it
        tracked_to = _tracked_to(run_dir) if launch.resume else None  # before this session's snapshot
        cfg_file = _next_snapshot(run_dir, launch.resume)
        storage.write_text(cfg_file, yaml.safe_dump(cfg_dict, sort_keys=False))
        if code_changed:  # the checkpoint loads (its shapes fit), but what trains from here is other code: said,
            # and kept in events.log; not refused (a fix to the code is a reason to resume)
            print(f"[raysys] note: the workload's code changed since this run's last session: {code_changed}; the run "
                  "goes on from its checkpoint with the code as it is now", flush=True)
            record_event(run_dir, f"resumed with changed code: {code_changed}")
        storage.write_text(run_dir / code_checks.CODE_FILE, json.dumps(code, indent=1, sort_keys=True))
        experiment = launch.experiment or f"raysys-{wl.name}"
        new_mlflow_run = created or (parent_run_id is None and tracking.find_run(uri, experiment, name) is None)
        if launch.resume and new_mlflow_run:
            if tracked_to and getattr(launch, "tracking_uri", None) and tracking.resolve_tracking_uri(tracked_to) != uri:
                unsent = _set_aside_buffer(run_dir)
                print(f"[raysys] note: '{name}' tracked to {tracked_to}; this session tracks to {uri}: a new MLflow "
                      f"run there holds it from step {_latest_step(store)}, the earlier steps stay in {tracked_to}"
                      + (f" ({unsent})" if unsent else "") + f" (resume with --tracking-uri {tracked_to} to go on "
                      "in that run)", flush=True)
            elif getattr(launch, "tracking_uri", None) and tracking.resolve_tracking_uri(launch.tracking_uri) == uri:
                at = _latest_step(store)
                if at > 0:  # it trained, so it had made its run: the store lost it
                    print(f"[raysys] note: {uri} no longer has the MLflow run of '{name}' (the store was made anew, or "
                          f"the run deleted): a new MLflow run holds it from step {at}", flush=True)
                else:
                    print(f"[raysys] note: '{name}' has no MLflow run yet (its first session ended before it made one): "
                          "this session's holds it from here", flush=True)
            else:
                print(f"[raysys] note: {uri} has no MLflow run of '{name}' (it tracked to another store, or this one was made anew): a new MLflow "
                      "run holds this session; the earlier steps stay where they were recorded", flush=True)
        run_id = tracking.start_run(uri, experiment, name, tags={"raysys.workload": wl.name, "raysys.kind": "run",
                                                                 "raysys.code": code_checks.code_id(code), **plugin,
                                                                 **(tags or {})},
                                    parent_run_id=parent_run_id, resume=launch.resume, own=parent_run_id is None)
        watcher = None
        if parent_run_id is None and not os.environ.get(BENCH_ENV):  # a command's own run (see raysys.watcher)
            from raysys import watcher as watching

            held = lifecycle.RunLock.of(run_dir)
            watcher = watching.watch(uri, run_id, run_dir, held.path if held else None,
                                     _resume_command(wl, launch, name), remote=storage.remote_of(run_dir) is not None)
    except BaseException:
        if created:  # nothing of this run exists elsewhere yet: do not let a half-made folder block the name
            lifecycle.RunLock.release_dir(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    logger = tracking.MLflowLogger(uri, run_id, buffer=run_dir / tracking.BUFFER_FILE, fence=storage.lease_fence(run_dir))
    waiting = logger.pending if launch.resume else 0  # counted before the first call below sends them
    tags_before = None
    if launch.resume and (tags or {}).get("raysys.resume_changes"):  # the run's params keep their first values
        # each resume's changes, after the earlier ones': "resume-1: ... | resume-2: ..." (its config snapshot's name)
        said = f"{cfg_file.stem.split('.', 1)[-1]}: {tags['raysys.resume_changes']}"
        found = tracking.run_tags(uri, run_id)  # kept: a session that trains nothing takes its changes back
        tags_before = None if found is None else {k: found.get(k) for k in CHANGE_TAGS}
        before = (found or {}).get("raysys.resume_changes")
        logger.set_tags({"raysys.resume_changes": (f"{before} | {said}" if before else said)[-5000:]})
    if launch.resume:  # the code of the run's last session (a new MLflow run got it at its start)
        logger.set_tags({"raysys.code": code_checks.code_id(code), **plugin})
    if waiting and logger.flush():
        record_event(run_dir, f"tracking buffer sent ({waiting} records)")
    if launch.resume and storage.pull(logger.parked) and not logger.send_parked():
        record_event(run_dir, "parked artifacts sent")
    logger.log_params({k: v for k, v in flatten(cfg_dict).items() if not k.startswith("launch.")}
                      | {"launch.workers": launch.workers, "launch.gpus_per_worker": launch.gpus_per_worker})
    if not launch.resume:  # a resume's snapshot goes to MLflow when its session ends, if it trained (finish)
        logger.log_artifact(cfg_file)
    if dataset:
        tracking.log_dataset(uri, run_id, **dataset)
    if new_mlflow_run and "raysys.command" in (tags or {}) and tracking.NOTE_TAG not in (tags or {}):
        logger.set_note(f"{wl.name}, preset `{tags.get('raysys.preset', 'default')}`.\n\n"
                        f"Run again: `{_run_again(tags['raysys.command'])}`\n\nResume if interrupted: "
                        f"`{_resume_command(wl, launch, name)}`\n")
    link = tracking.ui_link(uri, tracking.experiment_of(uri, run_id), run_id)
    say_if_in_ray_package(run_dir, uri)
    if launch.resume and (tags or {}).get("raysys.resume_changes"):  # said once the checkpoint has taken it
        print(f"[raysys] resuming with changed config: {tags['raysys.resume_changes']}", flush=True)
    if os.environ.get(BENCH_ENV):  # a bench's quality run, in a store it removes: no links to follow
        print(f"[raysys] run '{name}' (the bench's own quality run)", flush=True)
    else:
        print(f"[raysys] run '{name}' -> {storage.where(run_dir)}\n{tracking.ui_lines(uri, link)}", flush=True)
    return OpenRun(wl, cfg, cfg_dict, name, run_dir, identity, uri, run_id, logger, snapshot=cfg_file, watcher=watcher,
                   tags_before=tags_before, resume_changes=(tags or {}).get("raysys.resume_changes", "") if launch.resume else "")


CHANGE_TAGS = ("raysys.resume_changes", tracking.PARAMS_CHANGED_TAG)
"""The tags a resume with changed config writes (``open``)."""

BENCH_ENV = "RAYSYS_IN_BENCH"
"""Set by ``python -m raysys.bench``: its quality runs live in temporary stores it removes."""


RAY_PACKAGE = "/runtime_resources/working_dir_files/"  # where Ray unpacks a job's --working-dir


def say_if_in_ray_package(run_dir: Path, uri: str, what: str = "run") -> None:
    """A `ray job submit` job works in Ray's unpacked copy of its working_dir, named after the source's
    hash: after any edit the next job gets a new, empty copy, and Ray may delete old ones. A run or an
    MLflow store kept there is said to be at risk (one line), not refused: a one-off job may not care."""
    cwd = str(Path.cwd().resolve())
    if RAY_PACKAGE not in cwd + "/":
        return
    inside = [name for name, path in ((f"the {what}'s folder", None if storage.remote_of(run_dir) else str(run_dir)),
                                      ("the MLflow store", str(tracking.sqlite_path(uri)) if uri.startswith("sqlite:///") else None))
              if path and str(Path(path).resolve()).startswith(cwd)]
    if inside:
        print(f"[raysys] note: {' and '.join(inside)} {'are' if len(inside) > 1 else 'is'} in Ray's unpacked copy "
              "of this job's working_dir, which a job with edited source does not see again (--resume finds nothing) "
              "and Ray may delete: pass --storage-path (a shared folder or s3://...) and --tracking-uri (an MLflow "
              "server)", flush=True)


def run_training(wl_name: str, cfg: Any, *, callbacks: Optional[list] = None, parent_run_id: Optional[str] = None,
                 tags: Optional[dict] = None) -> RunResult:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from raysys.train.cleaner import TorchTrainer
    from raysys.train.loop import train_loop_per_worker

    wl = registry.get(wl_name)
    if wl.task is None:
        raise ConfigError(f"{wl_name} is not a PyTorch supervised workload")
    run = open_run(wl, cfg, prepare_of(wl), parent_run_id, tags, fits=code_checks.model_fits(wl, tags),
                   check=code_checks.code_works(wl, say=parent_run_id is None))
    launch, name, run_dir, uri, run_id = run.cfg.launch, run.name, run.run_dir, run.tracking_uri, run.run_id
    cfg_dict, identity, logger = run.cfg_dict, run.identity, run.logger

    use_gpu = launch.gpus_per_worker > 0
    if launch.workers > 0:
        init_ray(launch.address)
    resources = {"CPU": launch.cpus_per_worker, **({"GPU": launch.gpus_per_worker} if use_gpu else {})}
    backend = process_group_backend(launch.workers, launch.gpus_per_worker)

    stop = lifecycle.stop_flag_actor() if launch.workers > 0 else None

    def make_trainer():
        payload = {"workload": registry.ref(wl), "config": cfg_dict, "run_dir": str(run_dir),
                   **storage.payload(run_dir), "identity": identity,
                   "tracking_uri": uri, "run_id": run_id, "console": sink.handle, "stop": stop, "cwd": os.getcwd(),
                   # --cv: the first fold's breakdown table is on the console; the others' are alike
                   "brief_breakdown": (tags or {}).get("raysys.cv_fold", "0") != "0",
                   "holder": lifecycle.holder_of(run_dir) if launch.workers > 0 else None}
        return TorchTrainer(
            train_loop_per_worker,
            train_loop_config=payload,
            scaling_config=ScalingConfig(num_workers=launch.workers, use_gpu=use_gpu,
                                         resources_per_worker=resources if launch.workers > 0 else None),
            torch_config=TorchConfig(backend=backend),
            run_config=RunConfig(name=name, **ray_storage(run_dir), callbacks=callbacks,
                                 failure_config=FailureConfig(max_failures=0), logging_config=train_logging(),
                                 checkpoint_config=CheckpointConfig(num_to_keep=1)),
        )

    final_path = run_dir / "final_metrics.json"
    recorded = recorded_final(run_dir) if launch.resume else None
    at_start = newest_checkpoint(run_dir) if recorded is not None else None
    with run.tracked() as outcome:
        trained = False
        try:
            with console.live(remote=launch.workers > 0) as sink:
                if launch.workers > 0 and not callbacks:  # a sweep's trial says nothing on the sweep's console
                    # placing the workers and building their data takes seconds to a minute: not a hang
                    sink.message(f"[raysys] starting {launch.workers} Ray Train worker(s); progress from their first step")
                fit_with_restarts(make_trainer, launch.max_failures, run_dir, sink)
            lifecycle.settle_stop(stop)  # a worker's SIGTERM stops the run as the driver's would
            trained = True
        finally:
            try:
                if storage.pull(final_path) and storage.pull(run_dir / "breakdown.md"):
                    logger.log_artifact(run_dir / "breakdown.md")
            except OSError:
                if trained:  # else the storage's outage is what failed the run: its own error is the one to record
                    raise
            try:  # Ray Train's probe of the storage, left in the run folder; the run's files are raysys's
                storage.remove(run_dir / ".validate_storage_marker")
            except OSError:
                pass
        metrics = json.loads(final_path.read_text()) if final_path.is_file() else {}
        outcome.check(metrics, quality=wl.quality_metric, required=False)  # the loop evaluates at its end
        # a session stopped before its end records no new final metrics, but it trained: its checkpoint says so
        outcome.trained_nothing = recorded is not None and metrics == recorded and newest_checkpoint(run_dir) == at_start
    return RunResult(name, run_dir, run_id, uri, metrics, stopped_by=lifecycle.stop_requested(),
                     resume_command=run.resume_command(), failure=outcome.failure)
