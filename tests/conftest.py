import os
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Keep Ray Train's teardown short in tests (see ../shared/notes/ray-2.60.md).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Rows of a GEMM bit-identical whatever the number of rows, as the pointer_generator workload sets on
# import (see its __init__): here, before any test's first MKL call, which is when MKL reads it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in a fresh folder: embedded MLflow store, data and runs land there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAYSYS_TRACKING_URI", raising=False)
    return tmp_path


def interrupt_sweep(args: list, cwd, ready, env=None, timeout: float = 400, poll_s: float = 0.2, group_sigterm=False):
    """Start ``python -m raysys.tune *args``, send it Ctrl-C (SIGINT) once ``ready()`` holds, and return
    (its exit code, its output). Fails if the sweep ends before it could be interrupted. With
    ``group_sigterm``: SIGTERM to its whole process group instead, as `timeout` or Slurm send it."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "raysys.tune", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=group_sigterm)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(poll_s)
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    if group_sigterm:
        os.killpg(proc.pid, signal.SIGTERM)  # Tune would die at once; raysys takes Tune's clean stop
    else:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: Tune saves its state and stops the running trials
    out, _ = proc.communicate(timeout=180)
    print(out[-5000:])
    return proc.returncode, out


def assert_like_a_lone_trial(member, lone) -> None:
    """A vectorized sweep's member run has the form of a lone trial's MLflow run: the same params,
    metrics and raysys tags (a lone trial's tags at least), its trial id first in its name."""
    assert set(member.data.params) == set(lone.data.params)
    assert set(member.data.metrics) == set(lone.data.metrics)
    assert {k for k in lone.data.tags if k.startswith("raysys.")} <= set(member.data.tags)
    assert member.info.run_name.split(" ")[0] == member.data.tags["raysys.trial_id"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 (sqlite backend, served artifacts) that a test can stop and
    start again on the same port and store, as an outage does."""

    def __init__(self, store: Path, artifacts: Optional[str] = None, read_only: bool = False):
        """``read_only``: its database opened read-only (made first): it answers reads, and 503 to writes."""
        self.store, self.port, self.proc, self.read_only = store, free_port(), None, read_only
        self.artifacts = artifacts or str(store / "art")  # where it stores artifacts; may change between starts
        store.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "MlflowServer":
        import subprocess
        import sys
        import time
        import urllib.request

        backend = f"sqlite:///{self.store / 'm.db'}"
        if self.read_only:
            from mlflow.tracking import MlflowClient

            MlflowClient(backend).search_experiments()  # the database made, as the server would
            backend = f"sqlite:///file:{self.store / 'm.db'}?mode=ro&uri=true"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", backend, "--artifacts-destination", self.artifacts],
            stdout=open(self.store / "server.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not become healthy:\n{(self.store / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and its uvicorn worker
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path):
    """The URL of a real `mlflow server`, stopped at the end of the test."""
    server = MlflowServer(tmp_path / "mlflow-server").start()
    yield server.url
    server.stop()


class TcpGate:
    """A TCP forwarder in front of a server (S3, MLflow): ``close()`` makes its port refuse connections
    (the endpoint gone, as when it restarts), ``open()`` brings it back; the server and its state stay."""

    def __init__(self, target: int):
        import socket

        self.target, self.port, self.sock, self.conns = target, free_port(), None, []
        self.socket = socket

    def open(self):
        import threading

        self.sock = self.socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.sock,), daemon=True).start()

    def close(self):
        try:
            self.sock.shutdown(self.socket.SHUT_RDWR)  # wakes the accept() that close() alone would leave listening
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:  # and the connections the client keeps alive
            try:
                c.shutdown(self.socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self, sock):
        import threading

        while True:
            try:
                a, _ = sock.accept()
            except OSError:
                return
            b = self.socket.create_connection(("127.0.0.1", self.target))
            self.conns += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(self.socket.SHUT_RDWR)
                except OSError:
                    pass
