"""The shared loop's knobs on deep_gpcm's quick preset, in-process: AMP, accumulation, schedules,
loaders, compile (slow), and CUDA paths (skipped without a GPU)."""

import json
import statistics

import pytest
import torch

from raysys.cli import main

QUICK = ["train", "deep_gpcm", "--preset", "quick", "--workers", "0"]


def _final(workdir, name):
    return json.loads((workdir / "raysys_runs" / name / "final_metrics.json").read_text())


def test_bf16_accumulation_adamw_warm_restarts_loader_workers(workdir, capsys):
    assert main([*QUICK, "--name", "knobs", "--set", "train.precision=bf16", "--set", "train.grad_accum=2",
                 "--set", "optim.name=adamw", "--set", "optim.schedule=cosine_warm_restarts",
                 "--set", "optim.restart_period=2", "--set", "optim.warmup_steps=1",
                 "--set", "loader.num_workers=1", "--set", "loader.prefetch_factor=2"]) == 0
    final = _final(workdir, "knobs")
    assert final["step"] == 2 * 3  # 6 micro-batches per epoch / accumulation 2
    assert final["stability/nonfinite_loss"] == 0 and -1 <= final["eval/qwk"] <= 1  # barely trained: any finite kappa
    # a GPU's knob on a CPU, where it is usually slower: said once (audit AQ F8)
    assert capsys.readouterr().out.count("train.precision=bf16 on a CPU: autocast's half-precision kernels are "
                                         "usually slower there than fp32") == 1


def test_absurd_lr_is_reported_diverged_not_crashed(workdir, capsys):
    """A run whose loss stops being finite ends FAILED with why, not "done": exit 1, one line, the
    MLflow tag and events.log say it diverged; its final metrics are still written."""
    from mlflow.tracking import MlflowClient

    assert main([*QUICK, "--name", "div", "--set", "optim.lr=1e12", "--set", "optim.clip_grad_norm=none",
                 "--set", "train.epochs=8"]) == 1
    out = capsys.readouterr().out
    assert "[raysys] run 'div' FAILED: diverged: " in out and "[raysys] done" not in out
    final = _final(workdir, "div")
    assert final["stability/nonfinite_loss"] > 0
    assert "failed: diverged: " in (workdir / "raysys_runs" / "div" / "events.log").read_text()
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raysys-deep_gpcm").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["raysys.error"].startswith("diverged: ")


@pytest.mark.slow
def test_torch_compile(workdir):
    assert main([*QUICK, "--name", "compiled", "--set", "train.compile=true", "--set", "train.epochs=1"]) == 0
    assert _final(workdir, "compiled")["step"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_amp(workdir, precision):
    assert main([*QUICK, "--name", f"cuda-{precision}", "--gpus-per-worker", "1", "--set", f"train.precision={precision}",
                 "--set", "loader.pin_memory=true", "--set", "train.cudnn_benchmark=true"]) == 0
    final = _final(workdir, f"cuda-{precision}")
    assert final["stability/nonfinite_loss"] == 0 and final["eval/qwk"] > 0


def test_cross_validation_runs_each_fold_under_one_parent(workdir, capsys):
    from mlflow.tracking import MlflowClient

    assert main([*QUICK, "--cv", "--name", "cv", "--set", "data.n_folds=2", "--set", "train.epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "2-fold cross-validation" in out and "| **mean** |" in out
    # one breakdown table: the other fold's is named, not repeated
    assert out.count("| phase | ms/step | share |") == 1
    assert f"[deep_gpcm] step-time breakdown: {workdir / 'raysys_runs' / 'cv-fold1' / 'breakdown.md'}" in out
    assert f"| {workdir / 'raysys_runs' / 'cv-fold'}*\n" in out  # where the folds are (not their whole runs folder)
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raysys-deep_gpcm")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("raysys.kind") == "cross_validation"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and "cv_mean/qwk" in parent.data.metrics and "| **std** |" in out
    qwk = [c.data.metrics["eval/qwk"] for c in children]
    assert parent.data.metrics["cv_std/qwk"] == pytest.approx(statistics.stdev(qwk), abs=1e-9)
    # the held-out fold is each child's; the parent has the fold count instead
    assert "data.fold" not in parent.data.params and parent.data.params["cv.folds"] == "2"
    # a Description as a run's has (audit BE F8): what it is, how to run it again and resume it
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("deep_gpcm, 2-fold cross-validation, preset `quick`") and "--cv" in note and "--resume" in note
    assert sorted(c.data.params["data.fold"] for c in children) == ["0", "1"]


@pytest.mark.parametrize("workers,gpus,backend", [(2, 0, "gloo"), (1, 1, "nccl"), (4, 1, "nccl"), (0, 1, "nccl"),
                                                  (1, 0.5, "nccl"), (2, 0.5, "gloo"), (3, 0.25, "gloo")])
def test_workers_that_can_share_a_gpu_all_reduce_with_gloo(workers, gpus, backend, capsys):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", ray-project/ray#48012), and Ray
    packs fractional GPUs onto one device: such runs all-reduce with gloo, and say so once."""
    from raysys.train.runtime import process_group_backend

    assert process_group_backend(workers, gpus) == backend
    assert ("NCCL refuses" in capsys.readouterr().out) == (backend == "gloo" and gpus > 0)


@pytest.mark.parametrize("kind", ["config", "own", "plateau"])
def test_a_resume_trains_with_the_optimizer_settings_it_was_given(kind):
    """``--resume --set optim.lr=... optim.weight_decay=...``: the checkpoint's optimizer state put back the
    settings it was built with (AZ F1). The groups take the new ones; the LR keeps its place in the schedule:
    the config's LambdaLR goes on from the new peak, a task's own schedule is rebuilt from it and taken to the
    step, a ReduceLROnPlateau keeps its cuts."""
    from types import SimpleNamespace

    from raysys.train.optim import apply_changed_settings, build_scheduler, group_settings
    from raysys.workloads.deep_gpcm.workload import quick

    cfg = quick()
    cfg.optim.schedule, cfg.optim.warmup_steps = "linear", 0

    def own(opt, cfg, total):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"], total_steps=total)

    def plateau(opt, cfg, total):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)

    task = SimpleNamespace(scheduler={"config": None, "own": own, "plateau": plateau}[kind])

    def session(lr, wd):  # the optimizer and scheduler a session builds from its config
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
        built = group_settings(opt)
        sched = build_scheduler(cfg.optim, opt, 10) if task.scheduler is None else task.scheduler(opt, cfg, 10)
        return model, opt, sched, built

    model, opt, sched, saved = session(0.1, 0.0)
    for _ in range(4):  # four steps; the plateau scheduler cuts once
        opt.step()
        sched.step(0.0) if kind == "plateau" else sched.step()
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    was = opt.param_groups[0]["lr"]
    model, opt, sched, built = session(0.01, 0.5)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    assert opt.param_groups[0]["lr"] == was and opt.param_groups[0]["weight_decay"] == 0.0  # what the bug trained with
    sched, changes = apply_changed_settings(task, cfg, opt, sched, built, saved, 10, 4)
    assert changes == ["lr: 0.1 -> 0.01", "weight_decay: 0.0 -> 0.5"]
    assert opt.param_groups[0]["weight_decay"] == 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(was / 10)  # the same place in the schedule, from the new peak
    assert apply_changed_settings(task, cfg, opt, sched, built, built, 10, 4)[1] == []  # nothing changed: untouched


def test_a_persistent_false_buffer_that_training_changes_is_said_once():
    """Audit BB F9: a ``persistent=False`` buffer (a counter that anneals noise) is in no checkpoint, so a
    resume restarts it from its built value: said at the first checkpoint that finds one changed. One that
    training leaves alone (a constant table), or rebuilds at another size (a cache), is not named."""
    from raysys.train.loop import UnsavedBuffers

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("calls", torch.zeros(()), persistent=False)
            self.register_buffer("table", torch.arange(3.0), persistent=False)
            self.register_buffer("cache", torch.zeros(2), persistent=False)
            self.register_buffer("ema", torch.zeros(2))  # persistent: in every checkpoint

        def forward(self, x):
            self.calls += 1
            self.ema.mul_(0.9).add_(x.mean(0))
            self.cache = torch.ones(len(x))  # rebuilt at the batch's size
            return self.lin(x)

    outer = torch.nn.Sequential(Net())
    unsaved = UnsavedBuffers(outer)
    assert unsaved.changed(outer) == []
    outer(torch.ones(4, 2))
    assert unsaved.changed(outer) == ["0.calls"]
    outer(torch.ones(4, 2))
    assert unsaved.changed(outer) == []  # said once a run
    assert UnsavedBuffers(torch.nn.Linear(2, 2)).changed(torch.nn.Linear(2, 2)) == []


def test_sparse_gradients_are_measured_and_clipped():
    """Audit BB F1: nn.Embedding(sparse=True) could not train at all: the loop measures the gradient norm
    with torch's fused norm, which has no sparse kernel. Now its norm is that of the coalesced values."""
    from raysys.train.optim import clip_grads

    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)
    head(emb(torch.tensor([1, 2, 2, 3]))).sum().backward()
    params = [*emb.parameters(), *head.parameters()]
    dense = torch.cat([emb.weight.grad.to_dense().flatten(), head.weight.grad.flatten(), head.bias.grad])
    assert float(clip_grads(params, None)) == pytest.approx(float(dense.norm()))
    assert float(clip_grads(params, 0.5)) == pytest.approx(float(dense.norm()))  # the norm before clipping
    after = torch.cat([emb.weight.grad.to_dense().flatten(), head.weight.grad.flatten(), head.bias.grad])
    assert float(after.norm()) == pytest.approx(0.5, rel=1e-4) and emb.weight.grad.is_sparse
    torch.optim.SGD(params, lr=0.1).step()  # SGD takes sparse gradients


def test_a_ray_train_workers_whole_traceback_is_kept():
    """Audit BB F7: Ray Train cuts a worker's traceback to 1,000 characters in the error the driver gets, and
    the frames it cut were those of the workload's own file: error.txt and the console's last frames lacked
    them. The whole one travels in the error (its worker_failures) and is kept."""
    import pickle

    from ray.train.v2.api.exceptions import WorkerGroupError

    from raysys.cli import _traceback_tail
    from raysys.train.failures import full_traceback

    whole = ('Traceback (most recent call last):\n'
             + "".join(f'  File "/site-packages/torch/f{i}.py", line {i}, in f{i}\n    x()\n' for i in range(30))
             + '  File "/home/me/my_task.py", line 42, in loss\n    out = self.model(batch["x"])\n'
             + "RuntimeError: mat1 and mat2 must have the same dtype\n")
    failure = RuntimeError("mat1 and mat2 must have the same dtype")
    failure.raysys_traceback = whole  # as loop.train_loop_per_worker sends it; Ray Train keeps the bare error
    try:
        raise WorkerGroupError(whole[:500] + "\n... (Output truncated) ...\n" + whole[-500:],
                               {0: pickle.loads(pickle.dumps(failure))})
    except WorkerGroupError as e:
        text, tail = full_traceback(e), _traceback_tail(e)
    assert "my_task.py\", line 42, in loss" in text and "Rank 0's whole traceback" in text
    assert "my_task.py\", line 42, in loss" in tail and tail.rstrip().endswith("must have the same dtype")
