"""The JAX multi-host path: hackmatrix_ppo on a simulated two-host TPU v4-16 slice.

``ray.cluster_utils.Cluster`` starts two extra Ray nodes on this machine that advertise what a
v4-16 slice's hosts advertise (4 TPU chips each, the slice's name, ``TPU-v4-16-head`` on host 0,
the ``ray.io/tpu-*`` labels). ``JaxTrainer(use_tpu=True, topology="2x2x2")`` reserves the slice,
starts one worker per host and initialises ``jax.distributed``; ``launch.jax_platforms=cpu`` lets
those workers compute on the CPU. The two processes must train one model together: each holds
half of the envs, and both end with the same params as one process stepping all envs. The same
two hosts without ``use_tpu`` check raysys's own ``jax.distributed`` rendezvous (CPU/GPU hosts),
and the slice run is resumed with twice the envs (both hosts restore rank 0's checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from raysys.checkpoint import read_state

SLICE = "raysys-test-slice"
# 2 updates of 32 envs x 32 steps in one minibatch: the gradient is the mean over all envs, so
# the result does not depend on how the envs are split over processes
COMMON = ["--preset", "quick", "--set", "train.total_timesteps=2048", "--set", "train.num_minibatches=1",
          "--set", "train.updates_per_chunk=1", "--set", "train.compilation_cache_dir="]


def _tpu_host(worker_id: int) -> dict:
    resources = {"TPU": 4, SLICE: 1, "accelerator_type:TPU-V4": 1}
    if worker_id == 0:
        resources["TPU-v4-16-head"] = 1
    labels = {"ray.io/tpu-slice-name": SLICE, "ray.io/tpu-worker-id": str(worker_id),
              "ray.io/tpu-topology": "2x2x2", "ray.io/tpu-pod-type": "v4-16"}
    return {"num_cpus": 1, "resources": resources, "labels": labels, "env_vars": {"TPU_NAME": SLICE}}


def _params(run_dir) -> list[np.ndarray]:
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return read_state(ckpt)["params"]


def _check_hosts(run_dir, local_envs: int) -> None:
    hosts = [json.loads((run_dir / "hosts" / f"process{i}.json").read_text()) for i in range(2)]
    for i, h in enumerate(hosts):
        # one jax.distributed job: 2 processes, 1 CPU device each, half of the envs each
        assert (h["process_index"], h["process_count"], h["devices"], h["local_devices"], h["local_envs"]) == (i, 2, 2, 1, local_envs), h
    assert hosts[0]["env_keys_sha256"] != hosts[1]["env_keys_sha256"]  # disjoint envs...
    assert hosts[0]["params_sha256"] == hosts[1]["params_sha256"]  # ...one model
    assert json.loads((run_dir / "final_metrics.json").read_text())["world_size"] == 2


@pytest.mark.slow  # ~4-6 min on 2 cores: two JAX processes per run, three runs
@pytest.mark.timeout(780)
def test_two_hosts_train_one_model(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    # the simulated nodes' processes (Train controller, workers) inherit this environment
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "JAX_PLATFORMS": "cpu"}
    env.pop("RAY_ADDRESS", None)
    base = [sys.executable, "-m", "raysys", "train", "hackmatrix_ppo", *COMMON, "--storage-path", str(tmp_path / "runs")]

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    runs = {"slice": ["--set", "launch.use_tpu=true", "--set", "launch.topology=2x2x2",
                      "--set", "launch.accelerator_type=TPU-V4", "--set", "launch.jax_platforms=cpu"],
            # no TPU: JaxTrainer leaves jax.distributed alone and raysys's own rendezvous runs
            "cpu-hosts": []}
    try:
        for worker_id in range(2):
            cluster.add_node(**_tpu_host(worker_id))
        cluster.wait_for_nodes()
        params = {}
        for name, extra in runs.items():
            out = subprocess.run([*base, "--name", name, "--set", "launch.workers=2", *extra,
                                  "--set", f"launch.address={cluster.address}"],
                                 env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
            # a failed worker group would be restarted from the last checkpoint: these runs needed none
            assert "resumed at" not in out.stdout + out.stderr
            assert "compiled in" in out.stdout + out.stderr  # the workers' output reached the driver
            _check_hosts(tmp_path / "runs" / name, local_envs=16)
            params[name] = _params(tmp_path / "runs" / name)
        # resume the slice run with twice the envs: both hosts load rank 0's checkpoint
        out = subprocess.run([*base, "--name", "slice", "--resume", "--set", "launch.workers=2", *runs["slice"],
                              "--set", f"launch.address={cluster.address}", "--set", "train.total_timesteps=4096",
                              "--set", "train.num_envs=64"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        assert "resumed at 2048 env steps" in out.stdout + out.stderr
        _check_hosts(tmp_path / "runs" / "slice", local_envs=32)
        assert json.loads((tmp_path / "runs" / "slice" / "final_metrics.json").read_text())["perf/env_steps"] == 4096
    finally:
        cluster.shutdown()

    # the same run in one process stepping all 32 envs reaches the same params
    ref = subprocess.run([*base, "--name", "one-process"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    one = _params(tmp_path / "runs" / "one-process")
    for name in runs:
        err = max(float(np.abs(a - b).max()) for a, b in zip(params[name], one))
        assert err < 1e-5, (name, err)


def test_tpu_launch_options_are_checked():
    from raysys.config import ConfigError
    from raysys.train.config import JaxLaunchConfig

    with pytest.raises(ConfigError, match="topology"):
        JaxLaunchConfig(workers=2, use_tpu=True).validate()
    with pytest.raises(ConfigError, match="workers >= 1"):
        JaxLaunchConfig(workers=0, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4").validate()
    JaxLaunchConfig(workers=2, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4").validate()
