"""Where a run's processes run: Ray in this process or a cluster's, the resources a local Ray has,
the torch process-group backend, threads, and the JAX platform of an in-process run.

Each check here fails in one line, before anything of the run exists: ``ray.init`` and Ray Train
would otherwise retry or wait for minutes (an address nothing listens at, GPUs a machine lacks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

from raysys import console, lifecycle
from raysys import workload as registry
from raysys.config import ConfigError


def check_ray_address(address: Optional[str], timeout: float = 5.0) -> None:
    """One line in seconds, where ``ray.init`` would retry for minutes, when nothing listens at ``address``
    (or $RAY_ADDRESS), or something that is not Ray does: a Ray cluster's GCS (``host:port``, port 6379 unless
    given) or Ray Client server (``ray://host:port``, port 10001 unless given). ``auto``, ``local`` and no
    address start or find Ray by themselves."""
    from urllib.parse import urlsplit

    addr = (address or os.environ.get("RAY_ADDRESS", "")).strip()
    if addr in ("", "auto", "local"):
        return
    scheme, _, rest = addr.rpartition("://")
    if scheme in ("http", "https"):
        where = "--address" if address else "$RAY_ADDRESS"
        raise ConfigError(f"{where} {addr}: an http address is a Ray dashboard's, where `ray job submit` sends jobs; "
                          "a command joins a cluster at its GCS address, host:port (port 6379 unless given), at "
                          "ray://host:10001, or with auto (nothing was created)")
    if scheme not in ("", "ray"):
        return
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port or (10001 if scheme == "ray" else 6379)
    except ValueError as e:
        raise ConfigError(f"Ray address {addr!r}: {e}") from None
    if not host:
        raise ConfigError(f"Ray address {addr!r} names no host; give host:port, ray://host:port or auto")
    try:
        grpc = _speaks_grpc(host, port, timeout)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"no Ray cluster answers at {addr} ({host}:{port}: {reason}); start one with "
                          "`ray start --head`, or leave out --address and $RAY_ADDRESS to run Ray in this process "
                          "(nothing was created)") from None
    if not grpc:  # ray.init would wait on it for minutes, silent but for a warning every few seconds
        raise ConfigError(f"{host}:{port} answers, but not as Ray: a Ray cluster's GCS and Ray Client server speak "
                          "gRPC (a dashboard's port, 8265, serves web pages); join at host:6379, ray://host:10001 or "
                          "with auto (nothing was created)")
    if scheme == "" and not _is_ray_gcs(host, port, timeout):  # another gRPC service: minutes of retries too
        raise ConfigError(f"{host}:{port} answers gRPC, but has no Ray GCS service: a Ray cluster's head listens at "
                          "host:6379 unless `ray start --port` chose another; join at its GCS address, "
                          "ray://host:10001 or with auto (nothing was created)")


def _is_ray_gcs(host: str, port: int, timeout: float) -> bool:
    """Whether the gRPC server at host:port knows the GCS's cluster-id call: a GCS answers it, or refuses a
    client without its auth token (UNAUTHENTICATED); another service has no such method (UNIMPLEMENTED).
    Anything else (TLS, a connection that fails now) is left to ``ray.init`` to say."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    try:
        import grpc
    except ImportError:
        return True
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(b"", timeout=timeout)
    except grpc.RpcError as e:
        return e.code() != grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
    return True


def _speaks_grpc(host: str, port: int, timeout: float) -> bool:
    """Whether the server at host:port answers HTTP/2's opening as a gRPC server does, with its SETTINGS frame.
    True where the connection is TLS (RAY_USE_TLS): its handshake comes first, and is Ray's to make."""
    import socket

    with socket.create_connection((host, port), timeout=timeout) as conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return True
        try:
            conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # + empty SETTINGS
            head = b""
            while len(head) < 9:  # a frame header: length (3), type (1), flags (1), stream (4)
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    return False
                head += chunk
        except OSError:  # reset, or silent past the timeout: no gRPC server
            return False
    return head[3] == 4


def joins_cluster(address: Optional[str]) -> bool:
    """Whether ``init_ray`` joins a running cluster (``--address`` or $RAY_ADDRESS) rather than starting Ray here."""
    return (address or os.environ.get("RAY_ADDRESS", "")).strip() not in ("", "local")


def join_refused(addr: str, e: BaseException) -> str:
    """One line for a ``ray.init`` that reached the cluster at ``addr`` and was refused (its exception chain)."""
    chain = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(c) for c in chain)
    if "InvalidAuthToken" in text or "authentication token" in text.lower():
        return (f"the Ray cluster at {addr} asks for its auth token: set RAY_AUTH_MODE=token and give the token "
                "(~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN), as for `ray job submit` "
                "(nothing was created)")
    # its whole message on one line: Ray's first line alone may end at "Initialization failure from server:"
    said = " ".join(str(chain[0]).split()) or type(chain[0]).__name__
    return f"could not join the Ray cluster at {addr}: {said[:300]} (nothing was created)"


def held_stderr():
    """Ray's core worker writes each failed try of a join to file descriptor 2 (a cluster that refuses a
    missing auth token: a ``gcs_client.cc`` warning a second, for 20 s, before ``ray.init`` gives up): on a
    quiet console a refusal is then one line (``join_refused``); a join that succeeds passes on the rest."""
    return console.held_stderr(drop=lambda line: "gcs_client.cc" in line)


def local_gpus() -> int:
    """GPUs a Ray started in this process would see: $CUDA_VISIBLE_DEVICES when set, else the NVIDIA
    device files (what NVML counts), without importing torch, JAX or Ray."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def check_local_resources(launch: Any) -> None:
    """Ray Train waits, silently and for ever, for resources a cluster does not have. A Ray started in
    this process has this machine's, so a run that asks for more fails here, in one line, before
    anything is created. A cluster (--address, $RAY_ADDRESS) may grow, and is not checked."""
    addr = (getattr(launch, "address", None) or os.environ.get("RAY_ADDRESS", "")).strip()
    if launch.workers <= 0 or addr not in ("", "local") or "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    need_gpu, need_cpu = launch.workers * launch.gpus_per_worker, launch.workers * launch.cpus_per_worker
    if need_gpu > 0 and need_gpu > (have_gpu := local_gpus()):
        raise ConfigError(f"--workers {launch.workers} x --gpus-per-worker {launch.gpus_per_worker:g} needs {need_gpu:g} "
                          f"GPU(s); this machine has {have_gpu}, and the Ray started here has no more. Use fewer, "
                          "--gpus-per-worker 0 for the CPU, or --address of a cluster with GPUs (nothing was created)")
    if need_cpu > cpus:
        raise ConfigError(f"--workers {launch.workers} x launch.cpus_per_worker {launch.cpus_per_worker:g} needs "
                          f"{need_cpu:g} CPUs; this machine has {cpus}, and the Ray started here has no more. Use "
                          "fewer, or --address of a bigger cluster (nothing was created)")


class WaitingForWorkers:
    """Ray Train waits, silently and for ever, for a worker group the cluster cannot place now: more workers
    than it has CPUs or GPUs, a node lost, an autoscaler still adding one. While it does, a thread finds the
    group's placement group pending (one made after this began; checked every ``every_s``), says so once per
    group with what it needs and what the cluster has, and marks the run as waiting (``lifecycle.set_waiting``):
    a stop signal then stops at once, not at a step boundary that cannot come."""

    def __init__(self, say: Callable[[str], None], every_s: float = 5.0):
        self.say, self.every_s = say, every_s
        self._done = threading.Event()
        self._before: Optional[set] = set()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "WaitingForWorkers":
        import ray

        try:
            self._before = set(_placement_groups()) if ray.is_initialized() else None
        except Exception:  # Ray's state API not answering: nothing to watch with
            self._before = None
        if self._before is not None:
            self._thread = threading.Thread(target=self._watch, name="raysys-waiting-for-workers", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 5)
        lifecycle.set_waiting(False)

    def _watch(self) -> None:
        seen, said = set(), set()
        while not self._done.wait(self.every_s):
            try:
                table = _placement_groups()
                pending = {k: v for k, v in table.items() if k not in self._before
                           and v.get("state") in ("PENDING", "RESCHEDULING")}
                if pending and (seen & set(pending)) and not (set(pending) <= said):
                    self.say(_waiting_line(next(iter(pending.values()))))
                    said |= set(pending)
                lifecycle.set_waiting(bool(seen & set(pending)))  # pending at two looks: not a group being placed
                seen = set(pending)
            except Exception:  # Ray's state going away at the run's end: nothing to say
                return


def _placement_groups() -> dict:
    from ray.util import placement_group_table

    return placement_group_table() or {}


def _waiting_line(group: dict) -> str:
    import ray

    bundles = list((group.get("bundles") or {}).values())
    need = ", ".join(f"{k} {v:g}" for k, v in sorted((bundles[0] if bundles else {}).items()))
    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    has = "; ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in ("CPU", "GPU")
                    if k in total or any(k in b for b in bundles))
    return (f"[raysys] Ray Train waits for the cluster to place {len(bundles)} worker(s) of {{{need}}} each; it has "
            f"{nodes} node(s): {has}. It goes on once nodes join (an autoscaler's, or yours); a stop signal (Ctrl-C) "
            "now stops at once, and --resume continues the run, with fewer --workers too")


@contextlib.contextmanager
def keeping_stop_handlers():
    """Around ``ray.init`` in a process that chose how SIGTERM stops it (raysys's graceful stop, the bench's
    clean exit): ``ray.init`` first installs a SIGTERM handler of its own (``sys.exit(15)``), and a SIGTERM
    during the seconds Ray takes to start then ended the run with exit 15, no checkpoint, no resume line
    and its MLflow run RUNNING. The chosen handler stays instead (the run stops at its first step
    boundary); Ray has no option for this, so its setter is skipped."""
    try:
        from ray._private import utils
    except ImportError:
        utils = None
    setter = getattr(utils, "set_sigterm_handler", None)
    if setter is None or not callable(signal.getsignal(signal.SIGTERM)):
        yield
        return
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = setter


@contextlib.contextmanager
def ray_services_in_own_session():
    """Around the ``ray.init`` that starts Ray here: its processes (the GCS, the raylet and through it
    every worker, the dashboard) get a session of their own. A SIGTERM to this command's whole process
    group (``timeout``, Slurm's scancel, a systemd stop) then reaches this driver only, which stops the
    run at a step boundary with a checkpoint. Before, the same signal killed the GCS at once: no
    checkpoint, the MLflow run left RUNNING, and the driver waited 60 s for a GCS that was gone. Ray
    already keeps SIGINT from them (it blocks it), and they still die with this process (Ray's
    fate sharing). Ray has no option for this, so its process class is wrapped for the call."""
    try:
        from ray._private import services
    except ImportError:
        services = None
    base = getattr(services, "ConsolePopen", None)
    if base is None or sys.platform == "win32":
        yield
        return

    class _OwnSession(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = base


def process_group_backend(workers: int, gpus_per_worker: float) -> str:
    """torch.distributed backend of the Train workers: gloo on CPUs, NCCL on GPUs, except where
    workers hold a fraction of a GPU each: Ray may then place two ranks on one device, and NCCL
    refuses that ("Duplicate GPU detected", ray-project/ray#48012). gloo all-reduces CUDA tensors
    through the host, so such a run trains, slower, and says why once."""
    if gpus_per_worker <= 0:
        return "gloo"
    if workers > 1 and gpus_per_worker < 1:
        print(f"[raysys] {workers} workers x {gpus_per_worker:g} GPU can share a GPU, which NCCL refuses: "
              "gradients are all-reduced with gloo", flush=True)
        return "gloo"
    return "nccl"


def init_ray(address: Optional[str]) -> None:
    """Connect to ``address`` / $RAY_ADDRESS, or start Ray in this process with quiet defaults."""
    import ray

    if ray.is_initialized():
        return
    check_ray_address(address)
    # Train V2's preemption watcher polls every 5 s and dominates teardown of short local runs.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Train V2 reroutes a worker's print() into its logger *and* tees it to the wrapped stdout, so
    # every progress line reached the console twice; workers inherit this from the local raylet.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Workers' and actors' own output stays in Ray's log files: progress reaches the console through
    # raysys.console. `-v` forwards it all, as Ray does by default.
    quiet = not console.verbose()
    # a plug-in imported from a local file travels to every node's workers (registry.runtime_env)
    env = registry.runtime_env()
    if joins_cluster(address):
        try:
            with keeping_stop_handlers(), held_stderr():
                ray.init(address=address, log_to_driver=not quiet, runtime_env=env,
                         logging_level=logging.WARNING if quiet else logging.INFO)
        except Exception as e:  # it listens, but will not have us: say why in one line
            ray.shutdown()
            raise ConfigError(join_refused(address or os.environ["RAY_ADDRESS"], e)) from None
    else:
        # The dashboard process also serves the State API that Train V2's controller polls; it binds
        # to 127.0.0.1 only, so nothing listens beyond this machine. address="local": with no address,
        # ray.init joins any cluster a `ray start` left on this machine (another user's, say).
        with ray_services_in_own_session(), keeping_stop_handlers():
            ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=not quiet,
                     configure_logging=False, runtime_env=env)
    if quiet:
        one_line_cluster_errors()
    lifecycle.reinstall_if_active()  # in case a Ray that sets its handler elsewhere replaced ours


def one_line_cluster_errors() -> None:
    """Errors the cluster publishes to the driver (a worker process that died: a paragraph of ids, causes and
    advice), as one short line; ``-v`` keeps Ray's own. Ray prints them from a thread of its own, whatever
    ``log_to_driver`` says, through ``ray._private.worker.print_to_stdstream``, which this wraps."""
    import re

    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "raysys_one_line", False):
        return
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # a file or a job's log: no terminal escapes in it
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")

    def short(line: str) -> str:
        pid = re.search(r"Worker PID: (\d+)", line)
        detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", line)
        first = re.split(r"(?<=[.!?]) ", line.strip(), maxsplit=1)[0]
        if first == line.strip():
            return line
        extra = ", ".join(x for x in (pid and f"pid {pid.group(1)}", detail and detail.group(1).strip()) if x)
        return first.rstrip(".") + (f" ({extra})" if extra else "") + "; Ray's session logs hold the rest"

    def print_one_line(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            data = {**data, "lines": [short(line) for line in data.get("lines", [])]}
        original(data, ignore_prefix)

    print_one_line.raysys_one_line = True
    ray_worker.print_to_stdstream = print_one_line


def shutdown_ray() -> None:
    """End this process's Ray as a command's last step, about 1.5 s sooner than Ray's exit hook. That
    hook first sleeps 0.5 s so that workers' output reaches the console (raysys forwards it only with
    ``-v``, and then leaves the exit to Ray). Then the autoscaler's monitor of an in-process cluster
    used its whole 1 s SIGTERM grace before Ray killed it: it keeps nothing here, so it is killed at
    once, and the other processes stop as Ray stops them."""
    import ray

    if not ray.is_initialized() or console.verbose():
        return
    from ray._private import ray_constants, worker

    node = getattr(worker, "_global_node", None)
    if node is not None and node.is_head():
        for info in getattr(node, "all_processes", {}).get(ray_constants.PROCESS_TYPE_MONITOR, []):
            info.process.kill()
    ray.shutdown()


def train_logging():
    """Ray Train's own INFO lines ('Reporting training result N: TrainingReport(...)') only with -v."""
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if console.verbose() else "WARNING")


def work_where_the_driver_works(payload: dict) -> None:
    """In a Ray Train worker: work in the driver's folder (``payload["cwd"]``), as a run with
    ``--workers 0`` does, so that a relative data path names the same file and data made once there is
    found, not made again. Ray Train starts its workers in a folder of its own; a worker on a machine
    without the driver's folder stays there."""
    cwd = payload.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)


def set_threads(launch: Any) -> None:
    """torch intra-op threads of this process: ``launch.threads``, or for an in-process run one per
    physical core (half the logical CPUs this process may use; on a busy 2-core machine 1 thread ran
    5x faster than 2). Ray workers keep Ray's default (their ``cpus_per_worker``) unless it is set.
    A process that has not imported torch (a JAX workload's) does not import it for this (1-2 s):
    torch, if it comes later, starts with ``OMP_NUM_THREADS`` threads, set here."""
    n = getattr(launch, "threads", None)
    if n is None and launch.workers == 0:
        n = max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else None
    if not n:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(n))
    else:
        os.environ["OMP_NUM_THREADS"] = str(int(n))


def _jax_plugins() -> str:
    """The installed JAX accelerator plugins (jax-cuda12-plugin, libtpu...), for a message."""
    from importlib import metadata

    names = sorted({d.metadata["Name"] for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda", "libtpu", "jax-rocm"))})
    return "plugins: " + ", ".join(names) if names else "it has no GPU or TPU plugin"


def use_jax_platforms(platforms: str) -> None:
    """--workers 0: this process is the run's JAX process, so ``launch.jax_platforms`` applies here (it went
    to the workers only, and was silently ignored); a platform this machine lacks is one line, now."""
    import jax

    try:
        jax.config.update("jax_platforms", platforms)
        have = jax.devices()[0].platform
    except (RuntimeError, AssertionError) as e:  # a platform with no backend here: jax asserts one initialised
        said = (str(e).strip().splitlines() or [""])[0][:300] or \
            f"no JAX backend for it initialises in this install ({_jax_plugins()})"
        raise ConfigError(f"launch.jax_platforms={platforms}: {said}") from None
    if have not in platforms.replace("cuda", "gpu").split(",") and have not in platforms.split(","):
        raise ConfigError(f"launch.jax_platforms={platforms}: JAX in this process already runs on {have}")
