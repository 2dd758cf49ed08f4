"""The GPU path as users run it (issue #14): `pytest -m gpu` on a machine with a CUDA device.

Skipped where there is none (CI). Each case is a real run or a real kernel on the device: the fused
deep_gpcm recurrence against the naive path, the CUDA-graphed mpn_dqn update against the eager one,
Ray Train with `--gpus-per-worker 1` and `torch.compile`, two DDP workers sharing one GPU (NCCL
collectives really run), a checkpoint written on CUDA resumed at the exact step, and a
``--vectorize`` population batched on the GPU against lone runs.
"""

import json

import pytest
import torch

from raysys.checkpoint import read_state
from raysys.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

QUICK = ["train", "deep_gpcm", "--preset", "quick"]


def _final(workdir, name):
    return json.loads((workdir / "raysys_runs" / name / "final_metrics.json").read_text())


@pytest.mark.parametrize("batch,T", [(7, 50), (64, 400)])
def test_fused_recurrence_matches_the_naive_path_on_cuda(batch, T):
    pytest.importorskip("triton", reason="the CUDA torch wheel brings triton; this one has none")
    from raysys.workloads.deep_gpcm.model import DeepGPCM, masked_loss

    torch.manual_seed(0)
    naive = DeepGPCM(400, 4, path="naive").cuda()
    fused = DeepGPCM(400, 4, path="optimized", recurrence="triton").cuda()
    fused.load_state_dict(naive.state_dict())
    lengths = torch.randint(T // 4, T + 1, (batch,))
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).cuda()
    q = torch.randint(1, 401, (batch, T), device="cuda") * mask
    r = torch.randint(0, 4, (batch, T), device="cuda") * mask
    out = {}
    for name, m in (("naive", naive), ("fused", fused)):
        out[name] = m(q, r)
        masked_loss(out[name], r, mask).backward()
    assert (out["naive"] - out["fused"])[mask].abs().max() <= 1e-4
    for (name, p1), p2 in zip(naive.named_parameters(), fused.parameters()):
        scale = p1.grad.abs().max().clamp(min=1e-3)
        assert (p1.grad - p2.grad).abs().max() <= 1e-4 * scale, name


def test_graphed_update_matches_eager_updates():
    from raysys.workloads.mpn_dqn.graphed import GraphedUpdate
    from raysys.workloads.mpn_dqn.loss import _setup, synthetic_batch, td_loss_optimized

    runs = {}
    for kind in ("eager", "graph"):
        online, target, _ = _setup(64, 10, 128, 7, 3, "cuda", 0)
        params = list(online.parameters())
        opt = torch.optim.Adam(params, lr=1e-3, capturable=kind == "graph")
        graphed = GraphedUpdate(online, target, opt, 0.99, 10.0, None) if kind == "graph" else None
        losses = []
        for seed in range(6):  # a new batch each update, as training samples them
            batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in synthetic_batch(64, 10, seed=seed).items()}
            if graphed is not None:
                loss, _ = graphed(batch)
            else:
                opt.zero_grad(set_to_none=True)
                loss = td_loss_optimized(online, target, batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 10.0)
                opt.step()
            losses.append(float(loss))
        runs[kind] = (losses, [p.detach().clone() for p in params])
    (l1, p1), (l2, p2) = runs["eager"], runs["graph"]
    assert l1 == pytest.approx(l2, rel=1e-4, abs=1e-6)  # the first replay is the first update: warm-up undone
    for a, b in zip(p1, p2):
        assert (a - b).abs().max() <= 1e-5


def test_mpn_dqn_trains_with_a_graphed_learner(workdir):
    assert main(["train", "mpn_dqn", "--preset", "quick", "--name", "graphed", "--set", "cuda_graph=true",
                 "--set", "device=cuda"]) == 0
    final = _final(workdir, "graphed")
    assert final["perf/env_steps"] > 0 and final["perf/updates_per_s"] > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_gpu_worker_under_ray_train(workdir, precision):
    assert main([*QUICK, "--workers", "1", "--gpus-per-worker", "1", "--name", f"w1-{precision}",
                 "--set", f"train.precision={precision}"]) == 0
    final = _final(workdir, f"w1-{precision}")
    assert final["stability/nonfinite_loss"] == 0 and final["eval/qwk"] > 0


def test_torch_compile_on_cuda(workdir):
    assert main([*QUICK, "--workers", "0", "--gpus-per-worker", "1", "--name", "compiled",
                 "--set", "train.compile=true", "--set", "train.epochs=1"]) == 0
    assert _final(workdir, "compiled")["step"] == 6


def test_two_ddp_workers_share_one_gpu(workdir):
    """Both ranks on one device: NCCL refuses that, so the run all-reduces CUDA gradients with gloo."""
    assert main([*QUICK, "--workers", "2", "--gpus-per-worker", "0.5", "--name", "ddp"]) == 0
    final = _final(workdir, "ddp")
    assert final["stability/nonfinite_loss"] == 0 and final["eval/qwk"] > 0


def test_checkpoint_on_cuda_resumes_at_the_exact_step(workdir):
    common = [*QUICK, "--workers", "0", "--gpus-per-worker", "1", "--set", "train.checkpoint_every_steps=2"]
    assert main([*common, "--name", "ck", "--set", "train.max_steps=4"]) == 0
    assert _final(workdir, "ck")["step"] == 4
    assert main([*common, "--name", "ck", "--resume", "--set", "train.max_steps=none"]) == 0
    events = (workdir / "raysys_runs" / "ck" / "events.log").read_text()
    assert "resumed step=4" in events
    assert _final(workdir, "ck")["step"] == 2 * 6  # quick: 2 epochs of 6 steps


def test_a_population_on_the_gpu_is_one_batched_program_equal_to_lone_runs(tmp_path):
    """``--vectorize``'s population (issue #17) where JAX sees the GPU: ``train.population=auto`` picks
    the batched program, and each member ends with its lone run's params and return."""
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("JAX sees no GPU")
    import dataclasses

    import numpy as np

    from raysys.session import run_custom, run_population
    from raysys.train.population import population_mode
    from raysys.workloads.hackmatrix_ppo.workload import WORKLOAD, quick

    assert population_mode("auto") == "vmap"

    def cfg(name, lr, seed):
        c = quick()
        c.train = dataclasses.replace(c.train, num_envs=64, num_steps=16, total_timesteps=64 * 16 * 10, seed=seed,
                                      compilation_cache_dir="")
        c.optim.lr = lr
        c.launch.storage_path, c.launch.name = str(tmp_path / "runs"), name
        c.launch.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        return c

    def params(name):
        last = sorted((tmp_path / "runs" / name / "checkpoints").glob("step_*"))[-1]
        return read_state(last)["params"]

    pair = [(2.5e-4, 0), (1e-3, 5)]
    # full fp32 matmuls (no TF32): batched and lone kernels then round alike enough to stay one learner
    with jax.default_matmul_precision("highest"):
        together = run_population(WORKLOAD, [cfg(f"pop-{i}", *p) for i, p in enumerate(pair)])
        alone = [run_custom(WORKLOAD, cfg(f"alone-{i}", *p)) for i, p in enumerate(pair)]
    for i, lone in enumerate(alone):
        err = max(float(np.abs(a - b).max()) for a, b in zip(params(f"pop-{i}"), params(f"alone-{i}")))
        assert err < 1e-4, (i, err)
        ret = lone.metrics["charts/episode_return"]
        assert together[i].metrics["charts/episode_return"] == pytest.approx(ret, rel=1e-4, abs=1e-3)
        assert together[i].metrics["perf/env_steps_per_s"] > 0
        assert together[i].metrics["perf/env_steps"] == lone.metrics["perf/env_steps"] == 64 * 16 * 10
