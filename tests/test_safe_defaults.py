"""What the Ray instance raysys starts by default exposes on the network (see cluster/README.md)."""

from __future__ import annotations

import psutil
import pytest


def _listeners(pids: set[int]) -> list[tuple[str, int, str]]:
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.NoSuchProcess:
                continue
            out.append((c.laddr.ip, c.laddr.port, name))
    return out


@pytest.mark.timeout(120)
def test_local_ray_serves_its_http_apis_on_loopback_only():
    """The dashboard port carries the Jobs API (it runs arbitrary commands) and the State API: it
    must bind 127.0.0.1. Ray 2.60's internal gRPC servers (GCS, raylet, workers) bind every
    interface whatever the options; token auth guards them (checked in test_jobs_e2e) and the
    cluster configs firewall them."""
    import ray

    from raysys.train.runtime import init_ray

    assert not ray.is_initialized()
    init_ray(None)
    try:
        ctx = ray.get_runtime_context()
        dash_host, dash_port = ray.worker.get_dashboard_url().rsplit(":", 1)
        assert dash_host == "127.0.0.1"
        me = psutil.Process()
        pids = {p.pid for p in me.children(recursive=True)} | {me.pid}
        socks = _listeners(pids)
        dash = [s for s in socks if s[1] == int(dash_port)]
        assert dash and all(ip == "127.0.0.1" for ip, _, _ in dash), dash
        assert ctx.get_node_id()
    finally:
        ray.shutdown()
