"""Experiment tracking behind one tiny interface, MLflow by default.

With no configuration runs go to an embedded sqlite store, ``./mlflow.db`` (artifacts beside it
in ``./mlruns``): ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows them. Any tracking
URI (an ``mlflow server``, Databricks, ...) is an option via ``--tracking-uri`` or
``$MLFLOW_TRACKING_URI``. Only rank 0 of a run logs.

We use ``MlflowClient`` with explicit run ids instead of the fluent ``mlflow.start_run`` API: the
same run is written from the driver and from a Ray worker process, and a resumed or restarted
run must append to the run it already has.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)

RUN_NAME_TAG = "raysys.run_name"
NOTE_TAG = "mlflow.note.content"  # the run's Description in the MLflow UI
VIEW_TAG = "mlflow.sharedViewState."  # + key: a saved runs-table view, opened by ?viewStateShareKey=key
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` listens by default


class Logger(Protocol):
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, subdir: Optional[str] = None) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def delete_tag(self, key: str) -> None: ...


class NullLogger:
    """For ranks other than 0, and for bench runs that track nothing."""

    def log_params(self, params): pass
    def log_metrics(self, metrics, step): pass
    def log_artifact(self, path, subdir=None): pass
    def log_text(self, text, name): pass
    def set_tags(self, tags): pass
    def delete_tag(self, key): pass
    def set_note(self, text): pass


def default_tracking_uri() -> str:
    uri = os.environ.get("RAYSYS_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or sqlite_uri(Path.cwd() / "mlflow.db")


def sqlite_uri(path: str | Path) -> str:
    """The sqlite URI of a database file. SQLAlchemy reads the URI's path as a URL's: a '?' starts its
    query and '%XX' is decoded, so a folder named 'really? 100%' put the store elsewhere; those two are
    escaped (and only those: the URI stays readable)."""
    return "sqlite:///" + str(path).replace("%", "%25").replace("?", "%3F")


def sqlite_path(uri: str) -> Path:
    """The database file an sqlite:/// URI names, as SQLAlchemy reads it."""
    from urllib.parse import unquote

    return Path(unquote(uri[len("sqlite:///"):].split("?", 1)[0]))


def resolve_tracking_uri(uri: Optional[str]) -> str:
    """Make local store URIs absolute, so Ray workers (other working dirs) write the same store."""
    uri = uri or default_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = sqlite_uri(sqlite_path(uri).resolve())
    elif "://" not in uri:  # a plain folder: MLflow's file store
        uri = Path(uri).resolve().as_uri()
    return uri


def _artifact_root(uri: str) -> Optional[str]:
    """Local stores keep artifacts beside the database; servers choose their own."""
    if uri.startswith("sqlite:///"):
        return (sqlite_path(uri).parent / "mlruns").resolve().as_uri()
    return None


_ready: set[str] = set()


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri not in _ready and uri.startswith("sqlite:///"):
        # The first use of a fresh sqlite store creates its schema (alembic migrations); two processes doing
        # that at once crash one of them. A file lock beside the database serialises the first touch.
        from filelock import FileLock

        db = sqlite_path(uri)
        db.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(db) + ".lock"):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    _ready.add(uri)
    return MlflowClient(tracking_uri=uri)


def open_in_background(uri: str):
    """Open a local store on a thread (a fresh one gets its schema: MLflow's imports and migrations took
    ~3 s on 2 cores) while the caller starts Ray. Errors are left to the next real call to report."""
    import threading

    def touch():
        try:
            if not is_server(uri):
                _client(uri)
        except Exception:  # noqa: BLE001 - reported by the caller's own first call
            pass

    thread = threading.Thread(target=touch, name="raysys-open-store", daemon=True)
    thread.start()
    return thread


def is_server(uri: str) -> bool:
    """A tracking server (HTTP), as opposed to a store this process opens itself."""
    return uri.startswith(("http://", "https://"))


STORE_SCHEMES = {"sqlite", "http", "https", "file", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc"}
"""The tracking URIs MLflow resolves to a store (SQLAlchemy's dialects with a driver, +pymysql etc., too)."""


def check_store(uri: str, timeout: float = 5.0) -> None:
    """A ConfigError, before anything is created, when the store cannot be used: an HTTP tracking server
    that does not answer (in seconds, not after minutes of retries), a local database whose folder
    cannot be written, or MLflow's retired folder store."""
    from raysys import storage
    from raysys.config import ConfigError

    if uri.startswith("file://") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        folder = unquote(urlparse(uri).path)
        name = Path(folder).name
        if re.fullmatch(r"[\w.-]+:\d+", name):  # host:port without its scheme
            meant = f"did you mean http://{name}?"
        elif name.endswith((".db", ".sqlite", ".sqlite3")):
            meant = f"did you mean sqlite:///{folder}?"
        elif Path(folder).is_file():  # not a folder either: a database beside it
            meant = f"pass sqlite:///{Path(folder).parent / 'mlflow.db'} or a server URL"
        else:
            meant = (f"pass sqlite:///{folder.rstrip('/')}/mlflow.db or a server URL, or set MLFLOW_ALLOW_FILE_STORE=true "
                     "to use the folder anyway")
        raise ConfigError(f"--tracking-uri {folder}: MLflow no longer writes its folder (file) store; {meant} "
                          "(nothing was created)")
    if uri.startswith("sqlite://") and not uri.startswith("sqlite:///"):
        raise ConfigError(f"--tracking-uri {uri}: an SQLite URL has three slashes before a relative path "
                          f"(sqlite:///{uri[len('sqlite://'):]}) and four before an absolute one (nothing was created)")
    scheme = urlparse(uri).scheme.lower().split("+")[0]  # postgresql+psycopg2: a dialect and its driver
    if scheme and scheme not in STORE_SCHEMES:
        raise ConfigError(f"--tracking-uri {uri}: MLflow has no tracking store for '{scheme}://' (use "
                          "sqlite:///path/mlflow.db, http(s)://server:port or a database URL; nothing was created)")
    if scheme in ("postgresql", "mysql", "mssql"):
        _check_database(uri, timeout)
    if uri.startswith("sqlite:///"):
        db = sqlite_path(uri)
        storage.check_local_folder(db.parent, f"--tracking-uri {uri}:")
        if db.is_dir():
            raise ConfigError(f"--tracking-uri {uri}: {db} is a folder, not a database file (nothing was created)")
        try:
            with open(db, "rb") as f:
                head = f.read(16)
        except FileNotFoundError:
            head = b""
        except OSError as e:
            raise ConfigError(f"--tracking-uri {uri}: cannot read {db} ({e.strerror})") from None
        if head and head != b"SQLite format 3\x00":  # an empty file is a new database to sqlite
            raise ConfigError(f"--tracking-uri {uri}: {db} is not an SQLite database; name a new file (e.g. "
                              f"sqlite:///{db.parent / 'mlflow.db'}) or an existing MLflow database (nothing was created)")
    if not is_server(uri):
        return
    import requests

    try:
        health = requests.get(uri.rstrip("/") + "/health", timeout=timeout, **_auth())
        # /health alone says the process is up, not that it lets this client in or that its database works; and
        # not every MLflow (a proxy, a managed service) serves /health: its REST API says both
        api = requests.get(uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name",
                           params={"experiment_name": "Default"}, timeout=timeout, **_auth())
    except requests.RequestException as e:
        reason = type(e).__name__
        raise ConfigError(f"the MLflow tracking server at {uri} does not answer ({reason}); start it or pass "
                          "another --tracking-uri (nothing was created)") from None
    mlflow_error = "error_code" in api.text[:2000]
    if api.status_code in (401, 403):
        raise ConfigError(f"the MLflow tracking server at {uri} refuses this client (HTTP {api.status_code}): set "
                          "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, to an "
                          "account it lets in (nothing was created)")
    if api.status_code == 200 or (mlflow_error and api.status_code < 500):  # a 404 for a deleted Default: MLflow
        return
    if health.status_code == 200 or mlflow_error:
        raise ConfigError(f"the MLflow tracking server at {uri} answers but its API fails (HTTP {api.status_code}: "
                          f"{_gist(Exception(api.text[:2000]), 120) or api.reason}); see the server's log, e.g. its "
                          "database (nothing was created)")
    raise ConfigError(f"--tracking-uri {uri} answers, but not as an MLflow tracking server (HTTP {api.status_code} "
                      f"to its REST API, {health.status_code} to /health); check the URL and port (nothing was created)")


def _check_database(uri: str, timeout: float) -> None:
    """A database URL MLflow would open with SQLAlchemy: its driver installed, and the server answering (a
    connection in ``timeout`` seconds where the dialect takes a connect timeout)."""
    import sqlalchemy

    from raysys.config import ConfigError

    safe = re.sub(r"//[^@/]*@", "//***@", uri)  # no password on the console
    try:
        url = sqlalchemy.engine.make_url(uri)
        engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": max(1, int(timeout))}
                                          if url.get_backend_name() in ("postgresql", "mysql") else {})
    except ModuleNotFoundError as e:
        raise ConfigError(f"--tracking-uri {safe}: MLflow opens it with the database driver '{e.name}', which is not "
                          "installed here (pip install it; nothing was created)") from None
    except Exception as e:  # a malformed URL, an unknown dialect or driver
        raise ConfigError(f"--tracking-uri {safe}: not a database URL SQLAlchemy can open ({_gist(e, 160)}; nothing "
                          "was created)") from None
    try:
        with engine.connect():
            pass
    except Exception as e:
        raise ConfigError(f"--tracking-uri {safe}: the database does not let this process in ({_gist(e, 160)}); "
                          "check that it runs and the URL's user, password and name (nothing was created)") from None
    finally:
        engine.dispose()


def _auth() -> dict:
    """What MLflow's own client sends a server (its environment variables), for requests' calls."""
    kw: dict[str, Any] = {}
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        kw["headers"] = {"Authorization": f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"}
    elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
        kw["auth"] = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        kw["verify"] = False
    elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
        kw["verify"] = os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"]
    return kw


class TrackingOutageError(Exception):
    """A tracking server that answered when the sweep began has not answered for the whole wait: an outage,
    not a mistake in the command; what was made meanwhile waits in its folders for a --resume."""


def wait_for_store(uri: str, max_wait_s: Optional[float] = None) -> None:
    """``check_store``, retried while an HTTP tracking server does not answer, for up to ``max_wait_s``
    (default ``$RAYSYS_TRACKING_WAIT_S``, else 600 s). For a sweep's trials and its last writes: the
    server answered when the sweep started, so a refusal now is an outage, which a sweep waits out
    rather than failing every trial that starts during it. Anything else fails at once, as before."""
    from raysys.config import ConfigError

    if max_wait_s is None:
        max_wait_s = float(os.environ.get("RAYSYS_TRACKING_WAIT_S", "600"))
    deadline, delay, told = time.monotonic() + max_wait_s, 2.0, False
    while True:
        try:
            return check_store(uri)
        except ConfigError:
            if not is_server(uri):
                raise
            if time.monotonic() + delay > deadline:
                wait = f"{max_wait_s / 60:.0f} min" if max_wait_s >= 90 else f"{max_wait_s:.0f} s"
                raise TrackingOutageError(f"the MLflow tracking server at {uri} has not answered for {wait} "
                                "($RAYSYS_TRACKING_WAIT_S)") from None
            if not told:
                told = True
                print(f"[raysys] the MLflow server at {uri} does not answer; waiting up to "
                      f"{f'{max_wait_s / 60:.0f} min' if max_wait_s >= 90 else f'{max_wait_s:.0f} s'} "
                      "for it ($RAYSYS_TRACKING_WAIT_S)", flush=True)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


def quick_failures() -> None:
    """Inside a run, a tracking call that fails should fail fast and be buffered (MLflowLogger), not hold
    training for MLflow's default seven retries with exponential backoff and 120 s timeouts."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    calm_http_client()
    # a local store that fails (its disk full) logs its whole SQLAlchemy traceback at every retry; the
    # buffer's own warning says it once, with the reason
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def calm_http_client() -> None:
    """raysys names its runs' pages itself (``ui_lines``) and says once when it buffers through an
    outage: MLflow's per-run "View run ... at" lines and urllib3's per-request retry warnings would
    repeat both, once for every run and every failed call."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


# MLflow 3's UI opens an experiment on its GenAI traces page unless the experiment says it holds
# model training; runs are what raysys writes.
KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def check_experiment(uri: str, name: str, flag: str = "--experiment NAME") -> None:
    """A ConfigError, before anything is created, where the experiment runs would go to is deleted (in the
    store's trash, from the UI): MLflow refuses runs in it, and no new one of that name can be made."""
    from raysys.config import ConfigError

    if uri.startswith("sqlite:///") and not sqlite_path(uri).is_file():
        return  # a store to be made: it has no experiment yet (and asking would make it)
    try:
        exp = _client(uri).get_experiment_by_name(name)
    except Exception:  # whether the store answers is check_store's, and a trial's wait's, business
        return
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise ConfigError(f"the MLflow experiment '{name}' (id {exp.experiment_id}) is deleted (in the trash of "
                          f"{uri}): restore it with `MLFLOW_TRACKING_URI={uri} mlflow experiments restore "
                          f"--experiment-id {exp.experiment_id}`, or track to another experiment ({flag}) "
                          "(nothing was created)")


def get_or_create_experiment(uri: str, name: str) -> str:
    client = _client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if KIND_TAG not in exp.tags:  # made by an older raysys, or by hand
            client.set_experiment_tag(exp.experiment_id, KIND_TAG, MODEL_TRAINING)
        return exp.experiment_id
    root = _artifact_root(uri)
    try:
        return client.create_experiment(name, artifact_location=f"{root}/{name}" if root else None, tags={KIND_TAG: MODEL_TRAINING})
    except Exception:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


# ---- links into the MLflow UI --------------------------------------------------------------------

def ui_base(uri: str) -> str:
    """Where the UI of this store is: the server itself, or `mlflow ui` on its default port."""
    return uri.rstrip("/") if is_server(uri) else LOCAL_UI


def ui_link(uri: str, experiment_id: str, run_id: Optional[str] = None, view: Optional[str] = None) -> str:
    """A link that lands on the runs (``workflowType=machine_learning``: MLflow 3's model-training side),
    on one run, or on a saved view of the runs table."""
    base = f"{ui_base(uri)}/#/experiments/{experiment_id}/runs"
    query = "workflowType=machine_learning" + (f"&viewStateShareKey={view}" if view else "")
    return f"{base}/{run_id}?{query}" if run_id else f"{base}?{query}"


def ui_lines(uri: str, link: str, prefix: str = "[raysys]") -> str:
    """What a command prints about where its runs are: the link, and how to serve a local store."""
    lines = f"{prefix} MLflow: {link}"
    if not is_server(uri):
        lines += f"\n{prefix}   (serve this store first: mlflow ui --backend-store-uri {shlex.quote(uri)})"
    return lines


def save_view(uri: str, experiment_id: str, key: str, name: str, state: Mapping[str, Any]) -> None:
    """A named runs-table view (columns, filter, sort) that ``ui_link(..., view=key)`` opens: the
    envelope MLflow's "Views > Save as new view" writes, with the state as plain JSON."""
    now = int(time.time() * 1000)
    value = json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(dict(state))})
    _client(uri).set_experiment_tag(experiment_id, VIEW_TAG + key, value)


def view_key(name: str) -> str:
    return "raysys-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:200]


def column(kind: str, key: str) -> str:
    """A runs-table column id: kind is params, metrics, tags or attributes."""
    return f"{kind}.`{key}`"


def find_run(uri: str, experiment: str, run_name: str) -> Optional[str]:
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    return runs[0].info.run_id if runs else None


def run_tags(uri: str, run_id: str) -> Optional[dict[str, str]]:
    """A run's tags, or None where the store did not answer."""
    try:
        return dict(_client(uri).get_run(run_id).data.tags)
    except Exception:
        return None


def start_run(uri: str, experiment: str, run_name: str, tags: Optional[Mapping[str, str]] = None,
              parent_run_id: Optional[str] = None, resume: bool = False, own: bool = False) -> str:
    """Create the MLflow run (or, when resuming, find the one with this name) and return its id. ``own``: a
    command's own run, on a server ``check_store`` just found answering: one that then refuses the run (a
    read-only or full database answers 503) is a ConfigError in a few seconds, not minutes of MLflow's
    retries and its urllib3 chain."""
    if not (own and is_server(uri)):
        return _start_run(uri, experiment, run_name, tags, parent_run_id, resume)
    from raysys.config import ConfigError

    was = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "1"
    try:
        return _start_run(uri, experiment, run_name, tags, parent_run_id, resume)
    except Exception as e:
        raise ConfigError(f"the MLflow tracking server at {uri} answers, but did not take the run "
                          f"({type(e).__name__}: {_gist(e, 160)}): its database may be read-only or full, or it may refuse this "
                          "client's writes; fix it "
                          "or pass another --tracking-uri " + ("(the run is as it was)" if resume else
                                                               "(no run was created)")) from None
    finally:
        if was is None:
            os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
        else:
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = was


def _start_run(uri: str, experiment: str, run_name: str, tags: Optional[Mapping[str, str]],
               parent_run_id: Optional[str], resume: bool) -> str:
    if resume:
        run_id = find_run(uri, experiment, run_name)
        if run_id is not None:
            _client(uri).update_run(run_id, status="RUNNING")
            return run_id
    exp_id = get_or_create_experiment(uri, experiment)
    all_tags = {**source_tags(tags or {}), RUN_NAME_TAG: run_name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id  # MLflow's own nesting convention
    # The name shown in the UI may differ from the run's folder name (e.g. a trial's id and knobs).
    shown = all_tags.pop("mlflow.runName", run_name)
    run = _client(uri).create_run(exp_id, run_name=shown, tags=all_tags)
    return run.info.run_id


def source_tags(tags: Mapping[str, str]) -> dict:
    """MLflow's Source, user and code version of a run, as ``mlflow.start_run`` would set them: the user and
    source type from MLflow's context providers, the source named by the raysys command (a trial's process
    is Ray's worker script), and the git commit of the raysys code that ran."""
    return {**_process_tags(), "mlflow.source.name": str(tags.get("raysys.command") or command_line())[:500]}


@functools.lru_cache(maxsize=1)
def _process_tags() -> dict:
    """The part of ``source_tags`` that is the same for every run of this process (git asked once)."""
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils.git_utils import get_git_commit

    out = {k: v for k, v in resolve_tags({}).items() if k in ("mlflow.user", "mlflow.source.type")}
    commit = get_git_commit(str(Path(__file__).resolve().parent))
    return out | ({"mlflow.source.git.commit": commit} if commit else {})


def experiment_of(uri: str, run_id: str) -> str:
    return _client(uri).get_run(run_id).info.experiment_id


def command_line(argv: Optional[list[str]] = None, module: str = "raysys") -> str:
    """This process's command as the user would type it again."""
    import shlex
    import sys

    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


DIGEST_WHOLE_BYTES = 256 * 2**20
"""Data up to this size is digested whole; beyond it, each file's size and its first and last MiB."""


def dir_digest(path: str | Path) -> str:
    """A short fingerprint of a data file or folder's content, for MLflow's dataset digest: the same data
    copied or restored elsewhere has the same digest, and data edited in place another. A folder over
    ``DIGEST_WHOLE_BYTES`` is read in part (each file's names, size and first and last MiB): a run's start
    does not read gigabytes for a label."""
    import hashlib

    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    sizes = [f.stat().st_size for f in files]
    whole = sum(sizes) <= DIGEST_WHOLE_BYTES
    h = hashlib.sha256()
    for f, size in zip(files, sizes):
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            if whole:
                while chunk := fh.read(2**20):
                    h.update(chunk)
            else:
                h.update(fh.read(2**20))
                fh.seek(max(size - 2**20, 0))
                h.update(fh.read(2**20))
    return h.hexdigest()[:8]


def log_dataset(uri: str, run_id: str, name: str, source: str, context: str = "training",
                profile: Optional[Mapping[str, Any]] = None, digest: Optional[str] = None) -> None:
    """Record the data a run trained on as an MLflow input (the runs table's Dataset column)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    is_uri = "://" in source
    if not digest and not is_uri:
        try:
            digest = dir_digest(source) if Path(source).exists() else None
        except OSError:  # a file it may not read: the record goes without a digest, never the run
            digest = None
    ds = Dataset(name=name, digest=digest or "-",
                 source_type=source.split("://", 1)[0] if is_uri else "local",
                 source=json.dumps({"uri": source}), profile=json.dumps(dict(profile or {}), default=str))
    # Concurrent runs (sweep trials) logging one new dataset race to create its row, and the loser's
    # insert fails on MLflow's unique constraint; a second try finds the row. A record of the data must
    # never stop training: after that, a warning.
    for attempt in range(3):
        try:
            existing = _client(uri).get_run(run_id).inputs.dataset_inputs
            if any(d.dataset.name == ds.name and d.dataset.digest == ds.digest for d in existing):
                return  # a resumed run, or an earlier attempt that did land
            _client(uri).log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])
            return
        except Exception as e:
            if attempt == 2:
                log.warning("could not record dataset %s as the run's MLflow input (%s)", name, type(e).__name__)
            else:
                time.sleep(0.5 * (attempt + 1))


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _client(uri).set_terminated(run_id, status=status)


BUFFER_FILE = "tracking-buffer.jsonl"
PARKED_FILE = "tracking-artifacts.jsonl"
"""Beside the buffer: the artifact records a server that answers would not store (its artifact store
failing); metrics, tags and the run's end go on without them, and they are tried again on ``--resume``."""


class ArtifactRefused(Exception):
    """An artifact the tracking server did not store while its tracking API answers: its artifact store
    fails (a full or read-only volume, a bucket it cannot write), which no retry of this run fixes."""


def _gist(e: BaseException, width: int = 200) -> str:
    """An error's first line, cut at a word: MLflow's REST errors quote the whole urllib3 retry chain."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # SQLAlchemy puts its advice first and the database's own words (a full disk) after it
    line = next((ln for ln in lines if not ln.startswith("(raised as a result of Query-invoked autoflush")), "")
    if " failed with exception " in line and "Max retries exceeded" in line:
        said = re.search(r"ResponseError\('([^']*)'\)", line)  # the server answered: what (too many 503s)
        line = line.split(" failed with exception ")[0] + f" failed: {said.group(1) if said else 'no answer'}"
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " …"


def is_bookkeeping(key: str) -> bool:
    """Counters that describe a session, not training (no chart of them means anything): they go to
    MLflow as tags, and stay in the run's final_metrics.json."""
    leaf = key.rsplit("/", 1)[-1]
    return leaf in ("step", "world_size") or leaf.endswith("_this_session")


PARAMS_CHANGED_TAG = "raysys.params_changed"
"""Params a later process of a run gave other values (MLflow keeps a param's first): 'key: first -> now' a line."""

RECORD_KINDS = ("params", "metrics", "artifact", "text", "tags", "untag", "end")
"""What a tracking buffer's lines hold (``MLflowLogger._send``)."""


class MLflowLogger:
    """Logs to one existing MLflow run by id.

    With a ``buffer`` file (the run folder's ``tracking-buffer.jsonl``), tracking never stops training:
    a call that fails is appended to the buffer and retried later in order (after 30 s, then backing
    off to 5 min), on the next call that finds the server back, at the end of the run, or on
    ``--resume``. Without one, errors propagate.
    """

    def __init__(self, uri: str, run_id: str, buffer: Optional[str | Path] = None,
                 fence: Optional[Callable[[], None]] = None):
        """``fence``: called before each record, raising where this process may no longer write to the run
        (``storage.lease_fence``: a remote run another process took over)."""
        self.uri, self.run_id, self.fence = uri, run_id, fence
        self.client = _client(uri)
        self.buffer = Path(buffer) if buffer is not None else None
        self._retry_at, self._backoff = 0.0, 30.0
        self._step, self._logged_at_step = None, set()
        self._recorded: Optional[dict[str, int]] = None  # each metric's last step in MLflow before this process
        self._latest: dict[str, int] = {}  # each metric's last step this process logged
        self.failure = ""  # the last call's failure, in a few words: what the run's end says of records left
        if self.buffer is not None:
            quick_failures()

    # -- the buffer ---------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Records waiting in the buffer."""
        if self.buffer is None or not self.buffer.is_file():
            return 0
        return sum(1 for line in self.buffer.read_text().splitlines() if line.strip())

    def _send(self, rec: dict) -> None:
        kind = rec["kind"]
        if kind == "params":
            self._log_params(rec["data"])
        elif kind == "metrics":
            self._log_metrics(rec["data"], rec["step"], rec.get("ts"))
        elif kind == "artifact":
            path = Path(rec["path"]) if "path" in rec else self.buffer.parent / rec["run_file"]
            if "run_file" in rec and not path.is_file():
                from raysys import storage

                storage.pull(path)  # a file of a remote run, in this process's copy
            if not path.is_file():  # gone for good: it must not hold back what waits behind it
                log.warning("tracking: %s is gone; its artifact record is dropped", path)
                return
            self._artifact(path.name, lambda: self.client.log_artifact(self.run_id, str(path), artifact_path=rec.get("subdir")))
        elif kind == "text":
            self._artifact(rec["name"], lambda: self.client.log_text(self.run_id, rec["text"], rec["name"]))
        elif kind == "tags":
            for k, v in rec["data"].items():
                self.client.set_tag(self.run_id, k, str(v))
        elif kind == "untag":
            if rec["key"] in self.client.get_run(self.run_id).data.tags:
                self.client.delete_tag(self.run_id, rec["key"])
        elif kind == "end":
            self.client.set_terminated(self.run_id, status=rec["status"])

    def flush(self) -> bool:
        """Send what the buffer holds, in order; True when it is empty afterwards."""
        if self.buffer is None or not self.buffer.is_file():
            return True
        lines = [line for line in self.buffer.read_text().splitlines() if line.strip()]
        sent = 0
        try:
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:  # cut by a full disk (an older raysys): it must not hold back the rest
                    rec = None
                if not (isinstance(rec, dict) and rec.get("kind") in RECORD_KINDS):  # nor one edited by hand
                    log.warning("tracking: a record that cannot be sent (cut short or not raysys's) in %s is "
                                "dropped: %.80s", self.buffer, line)
                    sent += 1
                    continue
                try:
                    self._send(rec)
                except ArtifactRefused as e:  # must not hold back the metrics and the end behind it
                    self._park(line, e)
                sent += 1
        except Exception as e:
            self.failure = f"{type(e).__name__}: {_gist(e, 120)}"
            self._write_rest(lines[sent:])
            return False
        from raysys import storage

        storage.remove(self.buffer)  # sent: neither this copy nor a remote one may be sent again
        return True

    def _write_rest(self, lines: list[str]) -> None:
        tmp = self.buffer.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.buffer)
        from raysys import storage

        storage.push(self.buffer)

    def _call(self, rec: dict) -> None:
        if self.fence is not None:
            self.fence()
        if self.buffer is None:
            return self._send(rec)
        now = time.monotonic()
        if self.buffer.is_file():  # an outage: queue behind what is waiting, retry now and then
            waiting = self.pending
            if now < self._retry_at or not self._back() or not self.flush():
                return self._append(rec, now)
            self._backoff, self.failure = 30.0, ""
            if waiting:
                log.warning("tracking store answers again: the %d records buffered meanwhile are sent", waiting)
        try:
            self._send(rec)
        except ArtifactRefused as e:
            self._park(json.dumps(rec, default=str), e)
        except Exception as e:
            reason = _gist(e)
            self.failure = f"{type(e).__name__}: {_gist(e, 120)}"
            log.warning("tracking call failed (%s%s); buffering in %s", type(e).__name__,
                        f": {reason}" if reason else "", self.buffer)
            self._append(rec, now)

    def _back(self) -> bool:
        """The server answers a quick look (2 s): a server that hangs (up, but answers nothing) costs the loop
        that, not a full call's timeouts and retry (~20 s) each time the buffer is retried."""
        if not is_server(self.uri):
            return True
        from raysys.config import ConfigError

        try:
            check_store(self.uri, timeout=2.0)
        except ConfigError:
            return False
        return True

    def _artifact(self, name: str, upload: Callable[[], None]) -> None:
        """An upload; its failure is ``ArtifactRefused`` where the run itself still answers (with a buffer
        to park it beside: a sweep's driver sending a finished trial's buffer keeps it in order)."""
        try:
            upload()
        except Exception as e:
            if self.buffer is None:
                raise
            try:
                self.client.get_run(self.run_id)
            except Exception:
                raise e from None  # the server is away: the buffer's business, in order
            status = getattr(getattr(e, "response", None), "status_code", None)  # a requests error's answer
            raise ArtifactRefused(f"{name}: {type(e).__name__}" + (f", HTTP {status}" if status else "")) from e

    @property
    def parked(self) -> Path:
        return self.buffer.with_name(PARKED_FILE)

    def _park(self, line: str, e: ArtifactRefused) -> None:
        from raysys import storage

        first = not self.parked.is_file()
        with open(self.parked, "a") as f:
            f.write(line + "\n")
        storage.push(self.parked)
        if first:
            log.warning("the tracking server answers, but its artifact store did not take %s (see the server's log): "
                        "this run's artifacts wait in %s and are sent on --resume; its metrics and status go on",
                        e, self.parked)

    def send_parked(self) -> int:
        """Try the parked artifacts once more (a resume); how many still wait."""
        if self.buffer is None or not self.parked.is_file():
            return 0
        lines = [line for line in self.parked.read_text().splitlines() if line.strip()]
        left = []
        for line in lines:
            try:
                self._send(json.loads(line))
            except Exception:
                left.append(line)
        from raysys import storage

        if left:
            self.parked.write_text("".join(line + "\n" for line in left))
            storage.push(self.parked)
        else:
            storage.remove(self.parked)
        return len(left)

    def _append(self, rec: dict, now: float) -> None:
        if now >= self._retry_at:
            self._retry_at, self._backoff = now + self._backoff, min(self._backoff * 2, 300.0)
        self.buffer.parent.mkdir(parents=True, exist_ok=True)
        existed = self.buffer.is_file()
        data = (json.dumps(rec, default=str) + "\n").encode()
        fd = os.open(self.buffer, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError as e:  # a full disk: no half record may stay behind to be sent (or to block the rest)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                if not existed:
                    with contextlib.suppress(OSError):
                        self.buffer.unlink()
                raise OSError(e.errno, e.strerror, str(self.buffer)) from e
        finally:
            os.close(fd)
        from raysys import storage

        storage.push(self.buffer)  # a run on remote storage: the buffer outlives this process's working copy

    @classmethod
    def send_buffer(cls, uri: str, run_id: str, buffer: str | Path) -> bool:
        """Send a finished run's buffered records from another process (a sweep's driver, once its
        server is back), with MLflow's usual retries; True when the buffer is sent and removed."""
        logger = cls(uri, run_id)  # no buffer given: the run's fail-fast settings stay out of this process
        logger.buffer = Path(buffer)
        return logger.flush()

    # -- the Logger interface -----------------------------------------------------------------------
    def _log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        data = self.client.get_run(self.run_id).data
        existing = data.params
        # MLflow refuses to change a logged param; on resume only log what is new. A value a resume
        # changed (a sweep's --tolerance) is said in a tag, so the params are not read as what ran last.
        new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        said = data.tags.get(PARAMS_CHANGED_TAG, "")
        latest = dict(existing)  # each param's value as last said: its first, or its tag line's
        for line in said.splitlines():
            latest[line.partition(": ")[0]] = line.rpartition(" -> ")[2]
        changed = [f"{k}: {existing[k]} -> {str(v)[:6000]}" for k, v in params.items()
                   if k in existing and latest.get(k) != str(v)[:6000]]
        if changed:
            self.client.set_tag(self.run_id, PARAMS_CHANGED_TAG, "\n".join(filter(None, [said] + changed))[-5000:])

    def _log_metrics(self, metrics: Mapping[str, float], step: int, ts: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        ts = ts or int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(ms), 500):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 500])

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._call({"kind": "params", "data": {k: str(v) for k, v in params.items()}})

    def _recorded_steps(self) -> dict[str, int]:
        """Each metric's latest step already in the run (from an earlier process of it), {} if none
        or the store does not answer (its outage is the buffer's business)."""
        try:
            return {m.key: m.step for m in self.client.get_run(self.run_id).data.to_proto().metrics}
        except Exception:
            return {}

    def next_step(self, key: str) -> int:
        """The step after the latest ``key`` has in the run (0 for none): a summary made again (a sweep resumed,
        or summarised with another tolerance) is a new point, not a value the first one keeps out."""
        if self._recorded is None:
            self._recorded = self._recorded_steps()
        return 1 + max(self._recorded.get(key, -1), self._latest.get(key, -1))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One value per metric and step: a later value for a step already logged (e.g. the run's
        final summary after its last epoch report) is left out, so no chart jumps at one step. So is
        a step an earlier process of the run logged after its last checkpoint and a resume trains
        again (a run killed without a final checkpoint): the first value stays."""
        if step != self._step:
            self._step, self._logged_at_step = step, set()
        if self._recorded is None:
            self._recorded = self._recorded_steps()
        book = {k: v for k, v in metrics.items() if is_bookkeeping(k)}
        if book:
            self.set_tags({f"raysys.{k.rsplit('/', 1)[-1]}": v for k, v in book.items()})
        data = {k: float(v) for k, v in metrics.items()
                if v is not None and k not in self._logged_at_step and k not in book and step > self._recorded.get(k, -1)}
        self._logged_at_step |= set(data)
        if not data:
            return
        self._latest.update({k: max(int(step), self._latest.get(k, -1)) for k in data})
        self._call({"kind": "metrics", "data": data, "step": int(step), "ts": int(time.time() * 1000)})

    def log_artifact(self, path: str | Path, subdir: Optional[str] = None) -> None:
        path = Path(path).resolve()
        run_dir = self.buffer.parent.resolve() if self.buffer is not None else None
        if run_dir is not None and path.is_relative_to(run_dir):
            # a buffered record may be sent by a later process, whose copy of a remote run is elsewhere
            return self._call({"kind": "artifact", "run_file": str(path.relative_to(run_dir)), "subdir": subdir})
        self._call({"kind": "artifact", "path": str(path), "subdir": subdir})

    def log_text(self, text: str, name: str) -> None:
        self._call({"kind": "text", "text": text, "name": name})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._call({"kind": "tags", "data": {k: str(v) for k, v in tags.items()}})

    def set_note(self, text: str) -> None:
        """The run's Description in the MLflow UI (markdown)."""
        self.set_tags({NOTE_TAG: text[:5000]})

    def delete_tag(self, key: str) -> None:
        self._call({"kind": "untag", "key": key})

    def end(self, status: str) -> bool:
        """Close the run; False when the close itself waits in the buffer (the server is down). What waits
        is tried once more now, whatever the backoff: a server back since the last try gets it all."""
        self._retry_at = 0.0
        self._call({"kind": "end", "status": status})
        return self.pending == 0
