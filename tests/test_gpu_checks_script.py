"""scripts/gpu_checks.sh, the one call a session lent a GPU makes (audit BC): on a machine without CUDA,
and with a wrong argument, it stops at once and says why, with a status that is not 0, instead of
spending device time on skipped tests and CPU figures."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_checks.sh"


def _run(tmp_path, *args):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("args", [(), ("bogus",), ("kit", "nope")])
def test_a_wrong_argument_is_the_usage_and_exit_2(tmp_path, args):
    proc = _run(tmp_path, *args)
    assert proc.returncode == 2 and "usage: bash scripts/gpu_checks.sh" in proc.stderr
    assert not (tmp_path / "out" / "device.txt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its steps")
def test_without_cuda_it_stops_before_any_step(tmp_path):
    proc = _run(tmp_path, "all", "deep_gpcm")
    assert proc.returncode == 3 and "torch here sees no CUDA device" in proc.stderr
    assert "== bench-deep_gpcm" not in proc.stdout and not list((tmp_path / "out").glob("*.log"))
