"""Deep-GPCM model: naive and optimized paths agree (logits and gradients), read-before-write
order, padding isolation, the masked loss, and the ordinal metrics against sklearn/scipy."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import kendalltau, spearmanr
from sklearn.metrics import accuracy_score, cohen_kappa_score

from raysys.workloads.deep_gpcm.metrics import OrdinalMetricAccumulator, ordinal_metrics
from raysys.workloads.deep_gpcm.model import DeepGPCM, masked_loss

Q, K = 40, 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are small: intra-op threads only add synchronisation, which turns into long
    stalls when other jobs share the machine's 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def batch(lengths, seed=0, n_questions=Q, n_cats=K):
    """Random right-padded batch: ids 1..Q and responses where valid, 0 where padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    T = int(lengths.max())
    mask = torch.arange(T)[None, :] < lengths[:, None]
    q = torch.randint(1, n_questions + 1, (len(lengths), T), generator=g) * mask
    r = torch.randint(0, n_cats, (len(lengths), T), generator=g) * mask
    return q, r, mask


def pair(seed=0, **kw):
    """A naive and an optimized model sharing one state_dict."""
    torch.manual_seed(seed)
    naive = DeepGPCM(Q, K, path="naive", **kw)
    opt = DeepGPCM(Q, K, path="optimized", **kw)
    opt.load_state_dict(naive.state_dict())
    return naive, opt


@pytest.fixture(scope="module")
def models():
    return pair(chunk=7)  # a chunk that does not divide T: checkpoints, a partial last chunk


def test_forward_leaves_parameters_alone(models):
    naive, opt = models
    before = {k: v.clone() for k, v in opt.state_dict().items()}
    for b in (1, 3):  # at B=1 an expanded initial memory is contiguous: it must still be copied
        q, r, _ = batch([9] * b, seed=5)
        with torch.no_grad():
            opt(q, r)
    for k, v in opt.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_recurrence_threads_option(models):
    _, opt = models
    single = DeepGPCM(Q, K, recurrence_threads=1)
    single.load_state_dict(opt.state_dict())
    q, r, mask = batch([15, 9], seed=8)
    torch.set_num_threads(2)
    try:
        out = single(q, r)
        masked_loss(out, r, mask).backward()
        assert torch.get_num_threads() == 2  # restored after forward and backward
    finally:
        torch.set_num_threads(1)
    with torch.no_grad():
        assert torch.allclose(out.detach(), opt(q, r), atol=1e-6)


def test_parameter_count_matches_the_original():
    n = sum(p.numel() for p in DeepGPCM(400, 4).parameters())
    assert 440_000 < n < 460_000, n


def test_logits_match(models):
    naive, opt = models
    q, r, mask = batch([37, 12, 30, 1, 25])
    with torch.no_grad():
        a, b = naive(q, r), opt(q, r)
    assert a.shape == b.shape == (5, 37, K)
    assert (a - b)[mask].abs().max() <= 1e-4  # padded steps: the optimized path skips their memory work
    assert torch.isfinite(b).all()
    assert a[mask].std() > 0.1  # not trivially equal (e.g. all zero)


def test_the_value_table_is_the_same_built_for_every_pair_or_for_the_pairs_seen(models):
    """A batch with more steps than (question, response) pairs builds erase/add for every pair (no
    host sync); a short one for the distinct pairs it holds (torch.unique). Row by row, the same."""
    _, opt = models
    q, r, _ = batch([40, 33, 25, 40, 12], seed=3)
    assert (Q + 1) * K <= q.numel()
    with torch.no_grad():
        every = opt._value_inputs(q, r)  # [T,B,2Dv]
        for b in range(q.shape[0]):
            assert (Q + 1) * K > q.shape[1]
            assert torch.allclose(opt._value_inputs(q[b:b + 1], r[b:b + 1])[:, 0], every[:, b], atol=1e-6)


def test_masked_loss_is_the_mean_over_valid_steps_and_ignores_padded_logits():
    q, r, mask = batch([9, 4, 7], seed=4)
    logits = torch.randn(*q.shape, K)
    expected = F.cross_entropy(logits[mask], r[mask])
    logits[~mask] = 1e30  # padded logits are unspecified: whatever they hold, the loss is the same
    assert torch.allclose(masked_loss(logits, r, mask), expected)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_gradients_match(chunk):
    naive, opt = pair(seed=1, chunk=chunk)
    q, r, mask = batch([21, 9, 16], seed=1)
    for m in (naive, opt):
        masked_loss(m(q, r), r, mask).backward()
    for (name, p1), p2 in zip(naive.named_parameters(), opt.parameters()):
        scale = p1.grad.abs().max().clamp(min=1e-3)
        assert (p1.grad - p2.grad).abs().max() <= 1e-4 * scale, name
        assert p1.grad.abs().max() > 0 or name == "q_embed.weight", name  # every part is trained


def test_optimized_path_under_autocast(models):
    _, opt = models
    q, r, mask = batch([20, 13, 7], seed=6)
    ref = opt(q, r)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the memory recurrence itself stays float32
        out = opt(q, r)
    assert (out.float() - ref)[mask].abs().max() < 0.05
    masked_loss(out.float(), r, mask).backward()
    assert torch.isfinite(opt.init_value_memory.grad).all() and opt.init_value_memory.grad.abs().max() > 0
    opt.zero_grad()


def test_a_compiled_optimized_path_is_not_recompiled_for_each_batch(models):
    """Audit AR F3: under train.compile the loop recurrence's step and row counts (Python ints of each batch)
    were traced into the graph, and every batch recompiled (~1 minute each on a CPU, for ever). The loop
    runs eagerly now: after the first change of shape makes the graphs dynamic, batches of other lengths
    and other padding reuse them, and predict what the eager model does."""
    import torch._dynamo

    _, opt = models
    torch._dynamo.reset()
    compiled = torch.compile(opt, backend="eager")  # Dynamo's guards decide recompiles, whatever the backend
    graphs = []
    for seed, lengths in enumerate([[20, 13, 7], [17, 17, 3], [25, 9, 9], [11, 10, 2], [30, 5, 4]]):
        q, r, mask = batch(lengths, seed=seed)
        out = compiled(q, r)
        assert torch.allclose(out[mask], opt(q, r)[mask], atol=1e-6)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[2:] == [graphs[1]] * 3, graphs


@pytest.mark.parametrize("path", ["naive", "optimized"])
def test_read_before_write(models, path):
    model = models[path == "optimized"]
    q, r, _ = batch([30, 30], seed=2)
    t0 = 17
    r2 = r.clone()
    r2[:, t0:] = (r2[:, t0:] + 1) % K  # change the response at t0 and every later one
    with torch.no_grad():
        a, b = model(q, r), model(q, r2)
    assert torch.equal(a[:, : t0 + 1], b[:, : t0 + 1])  # the prediction at t0 never sees r_t0
    assert (a[:, t0 + 1:] - b[:, t0 + 1:]).abs().max() > 1e-3  # ... but later ones do


@pytest.mark.parametrize("path", ["naive", "optimized"])
def test_padding_does_not_leak(models, path):
    model = models[path == "optimized"]
    q, r, mask = batch([25, 11], seed=3)
    with torch.no_grad():
        together = model(q, r)
        alone = model(q[1:, :11], r[1:, :11])
        r_pad = r.clone()
        r_pad[~mask] = 3  # whatever sits in padded slots
        repadded = model(q, r_pad)
    assert (together[1, :11] - alone[0]).abs().max() <= 1e-5
    assert (together[mask] - repadded[mask]).abs().max() <= 1e-6


def test_masked_loss_ignores_padding():
    logits = torch.randn(3, 6, K)
    targets = torch.randint(0, K, (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2], dtype=torch.bool)
    loss = masked_loss(logits, targets, mask)
    expected = torch.stack([F.cross_entropy(logits[i, j], targets[i, j])
                            for i in range(3) for j in range(6) if mask[i, j]]).mean()
    assert torch.allclose(loss, expected)
    junk = logits.clone()
    junk[~mask] = 1e4 * torch.randn_like(junk[~mask])
    assert torch.equal(masked_loss(junk, targets, mask), loss)


def test_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    model = DeepGPCM(Q, K, memory_size=10, key_dim=16, value_dim=32, final_fc_dim=16)
    q, r, mask = batch([30] * 8, seed=4)
    r = torch.where(mask, (q * 7) % K, r)  # a learnable rule: the response is a function of the question
    losses = []
    for _ in range(20):  # plain SGD by hand: torch.optim's first use imports dynamo (seconds)
        model.zero_grad()
        loss = masked_loss(model(q, r), r, mask)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# ---- metrics -------------------------------------------------------------------------------------

def noisy_predictions(n, seed):
    """Logits whose argmax is the truth, off by one, or random; a random validity mask."""
    rng = np.random.default_rng(seed)
    true = rng.integers(0, K, n)
    pred = np.where(rng.random(n) < 0.5, true, rng.integers(0, K, n))
    pred = np.clip(pred + rng.integers(-1, 2, n) * (rng.random(n) < 0.3), 0, K - 1)
    logits = torch.randn(n, K)
    logits[torch.arange(n), torch.from_numpy(pred)] += 20
    return logits, torch.from_numpy(true), torch.from_numpy(rng.random(n) < 0.7), pred, true


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_sklearn_and_scipy(seed):
    logits, targets, mask, pred, true = noisy_predictions(400, seed)
    m = ordinal_metrics(logits, targets, mask)
    keep = mask.numpy()
    p, t = pred[keep], true[keep]
    assert m["qwk"] == pytest.approx(cohen_kappa_score(t, p, weights="quadratic"), abs=1e-12)
    assert m["categorical_acc"] == pytest.approx(accuracy_score(t, p), abs=1e-12)
    assert m["ordinal_acc"] == pytest.approx(np.mean(np.abs(p - t) <= 1), abs=1e-12)
    assert m["mae"] == pytest.approx(np.mean(np.abs(p - t)), abs=1e-12)
    assert m["spearman"] == pytest.approx(spearmanr(t, p)[0], abs=1e-10)
    assert m["kendall_tau"] == pytest.approx(kendalltau(t, p)[0], abs=1e-10)
    assert 0.2 < m["qwk"] < 0.95  # a non-degenerate case


def test_metrics_on_padded_batches_and_accumulation():
    logits, targets, mask, _, _ = noisy_predictions(3 * 5 * 20, 7)
    logits, targets, mask = logits.view(3, 5, 20, K), targets.view(3, 5, 20), mask.view(3, 5, 20)
    acc = OrdinalMetricAccumulator(K)
    for i in range(3):
        acc.update(logits[i], targets[i], mask[i])
    whole = ordinal_metrics(logits, targets, mask)
    assert acc.compute() == pytest.approx(whole, abs=1e-12)
    # masked-out steps do not count, whatever they hold
    junk = targets.clone()
    junk[~mask] = 0
    assert ordinal_metrics(logits, junk, mask) == pytest.approx(whole, abs=1e-12)
    assert acc.confusion.sum() == int(mask.sum())


def test_perfect_predictions():
    targets = torch.tensor([[0, 1, 2, 3, 3, 2]])
    m = ordinal_metrics(F.one_hot(targets, K).float(), targets, torch.ones_like(targets, dtype=torch.bool))
    assert m == pytest.approx({"categorical_acc": 1, "ordinal_acc": 1, "qwk": 1, "mae": 0, "spearman": 1,
                               "kendall_tau": 1})


# A separate interpreter: TRITON_INTERPRET must be set before triton is first imported, and the
# rest of the suite runs Triton-free (torch.compile on a CPU must not see the interpreter).
TRITON_CHECK = r"""
import json, sys
import torch
from raysys.workloads.deep_gpcm.model import DeepGPCM, masked_loss
# The kernels write every element of their uninitialised outputs: poisoned with NaN, any element
# left unwritten would show in the logits or the gradients.
_new_empty, _empty_like = torch.Tensor.new_empty, torch.empty_like
_poison = lambda x: x.fill_(float("nan")) if x.is_floating_point() else x
torch.Tensor.new_empty = lambda self, *a, **k: _poison(_new_empty(self, *a, **k))
torch.empty_like = lambda *a, **k: _poison(_empty_like(*a, **k))
Q, K = 40, 4
import raysys.workloads.deep_gpcm.memory_kernel as mk
narrow = mk._wide
out = {}
# the last case again with 64-bit offsets (WIDE), which only inputs of 2**31 elements and more choose
for case, (lengths, mem, dv, chunk, wide) in enumerate([([19, 7, 13, 1], 5, 70, 4, False), ([9, 9], 50, 200, 16, False),
                                                        ([12], 3, 8, 5, False), ([19, 7, 13, 1], 5, 70, 4, True)]):
    mk._wide = (lambda *t: True) if wide else narrow
    torch.manual_seed(case)
    naive = DeepGPCM(Q, K, memory_size=mem, value_dim=dv, path="naive")
    fused = DeepGPCM(Q, K, memory_size=mem, value_dim=dv, path="optimized", chunk=chunk, recurrence="triton")
    fused.load_state_dict(naive.state_dict())
    g = torch.Generator().manual_seed(case)
    lengths = torch.tensor(lengths)
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    q = torch.randint(1, Q + 1, mask.shape, generator=g) * mask
    r = torch.randint(0, K, mask.shape, generator=g) * mask
    logits = {}
    for name, m in (("naive", naive), ("fused", fused)):
        logits[name] = m(q, r)
        masked_loss(logits[name], r, mask).backward()
    grads = {n: max(float((p1.grad - p2.grad).abs().max() / p1.grad.abs().max().clamp(min=1e-3)), 0.0)
             for (n, p1), p2 in zip(naive.named_parameters(), fused.parameters())}
    out[case] = {"logits": float((logits["naive"] - logits["fused"])[mask].abs().max()),
                 "logit_std": float(logits["naive"][mask].std()), "grads": grads,
                 "memory_grad": float(fused.init_value_memory.grad.abs().max())}
print(json.dumps(out))
"""


def test_triton_recurrence_matches_the_naive_path_in_the_interpreter():
    """The fused CUDA kernels of model.recurrence=triton (memory_kernel.py), run by Triton's CPU
    interpreter: logits and every parameter's gradient equal the naive path's to 1e-4, with padded
    rows (one of length 1), several column blocks (Dv 70 and 200 > 64), N not a power of two,
    chunks that do not divide T, outputs allocated full of NaN (each element must be written), and the
    64-bit offsets the kernels take for inputs past 2**31 elements."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel is unchecked")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, res in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert res["logits"] <= 1e-4 and res["logit_std"] > 0.1, (case, res)
        assert res["memory_grad"] > 0, case
        for name, rel in res["grads"].items():
            assert rel <= 1e-4, (case, name, rel)


def test_triton_kernels_compile_for_an_h100_without_spills():
    """Triton's whole compiler (to PTX and cubin) for sm_90, no GPU needed: the kernels the interpreter
    checked above are valid GPU programs in every configuration the tuner may pick, and their tiles
    fit in registers (no local memory)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel is unchecked")
    # n=1024: a memory of more rows than one warp's registers hold a tile of (audit BC F8: it spilled)
    code = ("import json; from raysys.workloads.deep_gpcm.memory_kernel import compile_for; "
            "print(json.dumps({f'{k} n={n}': ['.local' in v, len(v)] for n in (50, 1024) "
            "for k, v in compile_for(90, n=n).items()}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k.split()[0] for k in res} == {"fwd", "bwd"} and len(res) >= 4, res
    for name, (spills, size) in res.items():
        assert not spills and size > 1000, (name, spills, size)


def test_triton_recurrence_without_a_gpu_is_a_config_error(monkeypatch):
    from raysys.config import ConfigError, apply_overrides
    from raysys.workloads.deep_gpcm.workload import default

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="runs on a GPU|triton package"):
        apply_overrides(default(), {"model.recurrence": "triton"})
    apply_overrides(default(), {"model.recurrence": "loop"})  # the CPU's own: fine


def test_bench_batch_sizes_runs_every_variant(tmp_path):
    """The GPU bench's table (naive, optimized, optimized with the loop recurrence at several batch
    sizes), run here on a CPU with a small synthetic set: every variant times and agrees."""
    from raysys.workloads.deep_gpcm.bench import batch_sizes
    from raysys.workloads.deep_gpcm.workload import DeepGPCMTask, quick

    task = DeepGPCMTask()
    cfg = quick()
    cfg.data.data_dir = str(tmp_path / "oc")
    cfg = task.prepare(cfg)
    res = batch_sizes(task, cfg, (2, 5), repeats=1, device="cpu")
    assert len(res) == 2 and all(name.startswith(("B=2 ", "B=5 ")) for name in res)
    for r in res.values():
        for k in ("naive", "optimized", "optimized_loop"):
            assert r[k]["step_s"] > 0 and r[k]["max_abs_logit_diff_vs_naive"] <= 1e-4, (k, r[k])


@pytest.mark.slow  # ~35 s: two quality runs; the judgement's wiring, kept out of the ~25 min default suite
def test_the_bench_fails_an_optimized_path_that_computes_another_function(tmp_path, monkeypatch):
    """The bench printed its speedup, exit 0, whatever the paths' logits or QWK (audit AX F5): an optimized
    forward 10% off now fails it, said as a problem (raysys.bench prints it and exits 1)."""
    from raysys.workloads.deep_gpcm import bench, model

    real = model.DeepGPCM._forward_optimized
    monkeypatch.setattr(model.DeepGPCM, "_forward_optimized", lambda self, q, r: real(self, q, r) * 1.1)
    monkeypatch.chdir(tmp_path)
    res = bench.run_bench(quick=True, overrides={"data.data_dir": str(tmp_path / "oc")})
    assert res["max_abs_logit_diff"] > bench.LOGIT_PARITY
    assert res["problems"][0].startswith("the paths compute different functions: on shared weights their logits "
                                         "differ by"), res["problems"]
