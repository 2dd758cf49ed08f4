"""Pointer-generator naive vs optimized, in one process, on the same data and weights:

* training throughput (target tokens/s): the original's optimizer step (16 micro-batches of one
  note, full distribution every decoder step) vs the optimized one (one bucketed batch of the same
  16 notes), interleaved so drift on a shared machine hits both alike;
* loss parity: both paths' loss on the same weights and batch;
* peak memory of each path's training step (tensors alive at once: CUDA allocator / torch profiler);
* beam search: per-example (the original) vs batched, on the same weights: identical summaries?
  (those that differ: by how much log-probability?) and summaries/s; batching alone (per example
  with the batched search's scores; batched with the original's tanh);
* learning: each path trained from the same weights on the same notes (12 optimizer steps, quick, or
  24), its loss on the held-out notes against the first weights', and the ROUGE of its summaries (near
  zero this early; docs/benchmarks.md has the 400-step runs).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Optional

import torch

from raysys import console
from raysys.config import ConfigError, apply_overrides
from raysys.train.data import to_device


def peak_memory(phases, device: torch.device) -> int:
    """Peak bytes of tensors alive at once while ``phases`` (callables, in order) run, above what was alive
    before: the CUDA allocator's peak, or on CPU the allocation/free events torch's profiler records, replayed
    in order (a resident-set reading would mostly show what the allocator kept from earlier steps). Each phase
    is profiled on its own and what it left alive carried into the next: one profile of a whole step of 16
    per-note micro-batches holds millions of events (gigabytes, a minute of bookkeeping)."""
    phases = [phases] if callable(phases) else list(phases)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for fn in phases:
            fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch's Kineto prints two lines per trace otherwise
    from torch.profiler import ProfilerActivity, profile

    live = peak = 0
    for fn in phases:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e for e in prof.events() if e.name == "[memory]" or e.self_cpu_memory_usage),
                        key=lambda e: e.time_range.start)
        for e in events:  # an op's own allocations and frees; "[memory]" marks frees outside any op
            live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
            peak = max(peak, live)
    return peak


LEARN_STEPS = {True: 12, False: 24}
"""Optimizer steps of the learning check (quick, full): the timed steps and more, on 16 notes each."""
PARITY = 0.5
"""The least share of the naive path's fall in held-out loss the optimized path must reach. Not 1: the
paths average their loss differently (per note, as the original's batches of one, vs per token) and their
dropout draws differ."""


def _held_out_loss(model, batches) -> float:
    """Mean loss per target token over ``batches`` (teacher-forced, dropout off)."""
    was, total, n = model.training, 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in batches:
            t, k = model(b["src"], b["src_len"], b["tgt"])
            total, n = total + float(t), n + int(k)
    model.train(was)
    return total / max(1, n)


def _step_phases(model, opt, micro_batches, device, dtype=None, tokens: Optional[list] = None) -> list:
    """One optimizer step over ``micro_batches`` (gradient accumulation), under autocast to ``dtype`` if
    given, as its phases: zero the gradients, each micro-batch's forward and backward, clip and step. Each
    micro-batch's target tokens go to ``tokens`` (tensors, read once the step is done)."""
    tokens = [] if tokens is None else tokens

    def micro(b):
        def run():
            bd = to_device(b, device)
            with torch.autocast(device.type, dtype or torch.float32, enabled=dtype is not None):
                total, n = model(bd["src"], bd["src_len"], bd["tgt"])
            (total / n / len(micro_batches)).backward()
            tokens.append(n.detach() if torch.is_tensor(n) else n)  # counted after the step: int() here would
            # wait for the GPU at every micro-batch, which training does not
        return run

    def finish():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return [lambda: opt.zero_grad(set_to_none=True), *(micro(b) for b in micro_batches), finish]


def _opt_step(model, opt, micro_batches, device, dtype=None) -> int:
    """One optimizer step (``_step_phases``); returns target tokens."""
    tokens: list = []
    for phase in _step_phases(model, opt, micro_batches, device, dtype, tokens):
        phase()
    return sum(int(n) for n in tokens)


def run_bench(quick: bool = False, overrides: Optional[dict] = None) -> dict:
    from raysys.workloads.pointer_generator.beam import beam_search, per_example
    from raysys.workloads.pointer_generator.model import EOS
    from raysys.workloads.pointer_generator.workload import SummarizationTask, default, small

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = small() if quick else default()  # quick: the CPU-sized model; else the original's size
    # beam search decodes the workload's evaluation subset (50 notes, the original's), the batch it serves
    cfg = apply_overrides(base, {"data.n_train": 400, "data.n_eval": 50, "data.eval_examples": 50,
                                 "data.data_dir": "raysys_data/pointer_generator_bench"} | (overrides or {}))
    task = SummarizationTask()
    cfg = task.prepare(cfg)
    train_ds, eval_ds = task.datasets(cfg)
    accum, steps = 16, (2 if quick else 4)
    if len(train_ds) < (steps + 1) * accum:  # each timed step takes 16 notes of its own, as the original's
        raise ConfigError(f"data.path: {len(train_ds)} training notes; the bench needs at least {(steps + 1) * accum} "
                          f"({steps + 1} optimizer steps of {accum} notes, the warm-up's included)")

    torch.manual_seed(0)
    models = {"naive": task.build_model(apply_overrides(cfg, {"model.path": "naive"})).to(device)}
    models["optimized"] = copy.deepcopy(models["naive"])
    models["optimized"].path = "optimized"
    n_params = models["naive"].num_params()

    # loss parity: the same weights and batch, dropout off
    batch = to_device(task.collate([train_ds[i] for i in range(4)]), device)
    losses = {}
    with torch.no_grad():
        for path, m in models.items():
            m.eval()
            total, n = m(batch["src"], batch["src_len"], batch["tgt"])
            losses[path] = float(total / n)
            m.train()

    held = [to_device(task.collate([eval_ds[i] for i in range(j, min(j + 10, len(eval_ds)))]), device)
            for j in range(0, len(eval_ds), 10)]  # in tens: a full-size vocabulary's distributions are large
    held_out_first = _held_out_loss(models["naive"], held)

    # training throughput: the same 16 notes per optimizer step, as the original (16 x batch 1)
    # or as one batch (sorted by length, as the bucketing sampler does within a window)
    opts = {k: torch.optim.Adam(m.parameters(), lr=cfg.optim.lr) for k, m in models.items()}
    groups = [[train_ds[i] for i in range(s * accum, (s + 1) * accum)] for s in range(steps + 1)]
    plans = {"naive": [[task.collate([it]) for it in g] for g in groups],
             "optimized": [[task.collate(sorted(g, key=lambda it: len(it["src"])))] for g in groups]}
    times, tokens, peak = {k: [] for k in models}, {k: 0 for k in models}, {k: 0 for k in models}
    print(f"[bench] training steps: {steps} timed of each path (16 notes a step), then a step's peak memory",
          flush=True)
    for k in models:  # warm-up: allocator, lazy init
        _opt_step(models[k], opts[k], plans[k][0], device)
    for s in range(1, steps + 1):
        for k in (("naive", "optimized") if s % 2 else ("optimized", "naive")):
            t0 = time.perf_counter()
            tokens[k] += _opt_step(models[k], opts[k], plans[k][s], device)
            times[k].append(time.perf_counter() - t0)
    with console.held_stderr():  # the profiler's native "Memory block of unknown size" warning: -v shows it
        for k in models:  # one more step each, untimed, for its memory
            peak[k] = peak_memory(_step_phases(models[k], opts[k], plans[k][0], device), device)

    # beam search, per example vs batched, on the same (optimized-path-trained) weights
    m = models["optimized"].eval()
    ev = task.collate([eval_ds[i] for i in range(len(eval_ds))])
    ev_dev = to_device(ev, device)
    mc = cfg.model
    kw = dict(beam=mc.beam, min_len=mc.min_len, max_len=mc.max_len, length_penalty=mc.length_penalty,
              block_trigrams=mc.block_trigrams)

    # the batched search's fused attention scores compile once per process (torch.compile): timed apart
    t0 = time.perf_counter()
    beam_search(m, ev_dev["src"][:2], ev_dev["src_len"][:2], beam=mc.beam, min_len=0, max_len=2)
    compile_s = time.perf_counter() - t0

    def gaps(model, one, many) -> list[tuple[float, float]]:
        """For each summary that differs: (log-prob of the batched one minus the per-example one,
        log-prob of the per-example one), teacher-forced: how near a tie the flip was."""
        out = []
        for i, (a, b) in enumerate(zip(one, many)):
            if a != b:
                src, src_len = ev_dev["src"][i:i + 1, :int(ev_dev["src_len"][i])], ev_dev["src_len"][i:i + 1]
                lp = [-float(model(src, src_len, torch.tensor([seq or [EOS]], device=device))[0]) for seq in (a, b)]
                out.append((lp[1] - lp[0], lp[0]))
        return out

    def timed(search, model, **more) -> tuple[list, float]:
        t0 = time.perf_counter()
        out = search(model, ev_dev["src"], ev_dev["src_len"], **kw, **more)
        return out, time.perf_counter() - t0

    def same_count(xs, ys) -> int:
        return sum(a == b for a, b in zip(xs, ys))

    print(f"[bench] beam search over {len(eval_ds)} notes, per example and batched (minutes on a CPU)", flush=True)
    (one, t_one), (many, t_many) = timed(per_example, m), timed(beam_search, m)
    n_ev, same = len(one), same_count(one, many)
    with torch.no_grad():
        flips = gaps(m, one, many)
    # batching alone: per example with the batched search's scores, and batched with the tanh
    one_exp, t_one_exp = timed(per_example, m, exp_scores=True)
    same_exp = same_count(one_exp, many)
    tanh, t_tanh = timed(beam_search, m, exp_scores=False)
    same_tanh = same_count(one, tanh)
    # the seed's dot-product attention: per source position a dot product instead of an H-wide tanh,
    # so per-example decoding is dominated by per-step overheads that batching removes
    torch.manual_seed(0)
    dot = task.build_model(apply_overrides(cfg, {"model.attention": "dot"})).to(device).eval()
    (one, t_one_dot), (many, t_many_dot) = timed(per_example, dot), timed(beam_search, dot)
    same_dot = same_count(one, many)

    # On a GPU: the optimized step as a GPU runs it, bf16 autocast, with additive and with dot (SDPA,
    # flash where it applies) attention, on the same batches, next to its fp32 figure above
    gpu_steps = {}
    if device.type == "cuda":
        for name, attention in (("optimized bf16", "additive"), ("optimized bf16 dot/SDPA", "dot")):
            torch.manual_seed(0)
            mod = task.build_model(apply_overrides(cfg, {"model.attention": attention})).to(device)
            o = torch.optim.Adam(mod.parameters(), lr=cfg.optim.lr)
            _opt_step(mod, o, plans["optimized"][0], device, torch.bfloat16)  # warm-up
            t0, n_tok = time.perf_counter(), 0
            for st in range(1, steps + 1):
                n_tok += _opt_step(mod, o, plans["optimized"][st], device, torch.bfloat16)
            gpu_steps[name] = {"throughput": n_tok / (time.perf_counter() - t0),
                               "peak_memory_mb": peak_memory(_step_phases(mod, o, plans["optimized"][0], device,
                                                                                  torch.bfloat16), device) / 2**20}

    # learning: both paths go on to LEARN_STEPS optimizer steps from the same weights on the same notes (16 a
    # step), then their loss on the held-out notes (teacher-forced) against the weights' first; and the ROUGE
    # of their summaries, which after so few steps is near zero (docs/benchmarks.md has 400-step runs)
    # (so far: a warm-up step, the timed ones and the memory step's, which repeats the warm-up's notes)
    n_learn = max(steps + 2, min(LEARN_STEPS[quick], len(train_ds) // accum + 1))
    print(f"[bench] learning check: both paths on to {n_learn} steps from the same weights, then their held-out "
          "loss and summaries", flush=True)
    for s in range(steps + 1, n_learn - 1):
        group = [train_ds[i] for i in range(s * accum, (s + 1) * accum)]
        _opt_step(models["naive"], opts["naive"], [task.collate([it]) for it in group], device)
        _opt_step(models["optimized"], opts["optimized"],
                  [task.collate(sorted(group, key=lambda it: len(it["src"])))], device)
    held_out, quality = {}, {}
    for k, model in models.items():
        model.eval()
        held_out[k] = _held_out_loss(model, held)
        quality[k] = task.evaluate(model, [ev_dev])
    drops = {k: held_out_first - held_out[k] for k in models}
    problems = [f"{k}: its held-out loss did not fall in {n_learn} steps ({held_out_first:.4f} -> {held_out[k]:.4f})"
                for k in models if not drops[k] > 0]
    if not problems and drops["optimized"] < PARITY * drops["naive"]:
        problems.append(f"optimized learns less than naive: its held-out loss fell {drops['optimized']:.4f} in "
                        f"{n_learn} steps, naive's {drops['naive']:.4f} (at least {PARITY:.0%} of it expected)")

    res = {"workload": "pointer_generator", "throughput_unit": "target tokens/s (train step)",
           "quality_metric": f"held-out loss after {n_learn} steps", "quality_mode": "min",
           "speedup": (tokens["optimized"] / sum(times["optimized"])) / (tokens["naive"] / sum(times["naive"])),
           "loss": losses, "loss_abs_diff": abs(losses["naive"] - losses["optimized"]),
           "beam": {"examples": n_ev, "identical": same, "differing_logprob_gaps": flips,
                    "identical_with_tanh_scores": same_tanh, "per_example_summaries_per_s": n_ev / t_one,
                    "per_example_exp_scores": {"identical": same_exp, "summaries_per_s": n_ev / t_one_exp,
                                               "speedup": t_one_exp / t_many},
                    "batched_summaries_per_s": n_ev / t_many, "speedup": t_one / t_many,
                    "batched_tanh_scores_summaries_per_s": n_ev / t_tanh, "compile_s": compile_s,
                    "dot": {"identical": same_dot, "per_example_summaries_per_s": n_ev / t_one_dot,
                            "batched_summaries_per_s": n_ev / t_many_dot, "speedup": t_one_dot / t_many_dot}},
           "model": {"params": n_params, "vocab": models["naive"].V, "emb_dim": mc.emb_dim, "hidden": mc.hidden,
                     "layers": mc.layers}}
    for k in models:
        res[k] = {"throughput": tokens[k] / sum(times[k]), "step_s": statistics.median(times[k]),
                  "peak_memory_mb": peak[k] / 2**20, "quality": held_out[k],
                  "eval": {q: quality[k][q] for q in ("rouge1", "rouge2", "rougeLsum", "entity_copy") if q in quality[k]}}
    res["extra"] = {
        "model": f"{n_params / 1e6:.2f}M parameters, vocabulary {models['naive'].V}",
        "optimizer step": f"16 notes: naive 16 x batch 1, optimized 1 x batch 16; {steps} timed steps each",
        "loss on the same weights and batch": f"naive {losses['naive']:.6f} optimized {losses['optimized']:.6f} "
                                              f"(|diff| {res['loss_abs_diff']:.1e})",
        "peak memory of a training step": f"naive {res['naive']['peak_memory_mb']:.0f} MB, "
                                          f"optimized {res['optimized']['peak_memory_mb']:.0f} MB",
        "beam search": f"{same}/{n_ev} summaries identical"
                       + "".join(f"; one differs by {d:+.1e} nats of log-prob ({lp:.1f})" for d, lp in flips) + "; "
                       f"per-example {res['beam']['per_example_summaries_per_s']:.2f}/s, "
                       f"batched {res['beam']['batched_summaries_per_s']:.2f}/s ({res['beam']['speedup']:.1f}x; "
                       f"{n_ev / t_tanh:.2f}/s and {same_tanh}/{n_ev} identical with a tanh per score; compile {compile_s:.1f} s, untimed)",
        "beam search, the same scores both ways": f"{same_exp}/{n_ev} identical; per-example {n_ev / t_one_exp:.2f}/s, "
                                                  f"batched {n_ev / t_many:.2f}/s ({t_one_exp / t_many:.1f}x: batching alone)",
        "beam search, dot attention": f"{same_dot}/{n_ev} identical; per-example {n_ev / t_one_dot:.2f}/s, batched "
                                      f"{n_ev / t_many_dot:.2f}/s ({t_one_dot / t_many_dot:.1f}x)",
        f"learning: {n_learn} optimizer steps of each path from the same weights on the same notes": (
            f"held-out loss {held_out_first:.4f} -> naive {held_out['naive']:.4f}, optimized "
            f"{held_out['optimized']:.4f}; ROUGE-2 naive {quality['naive']['rouge2']:.3f}, optimized "
            f"{quality['optimized']['rouge2']:.3f} (near zero this early: docs/benchmarks.md has 400-step runs)"),
    }
    if problems:
        res["problems"] = problems
    if gpu_steps:
        res["gpu_steps"] = gpu_steps
        for name, r in gpu_steps.items():
            res["extra"][f"training, {name}"] = (f"{r['throughput']:.0f} target tokens/s "
                                                 f"({r['throughput'] / res['naive']['throughput']:.1f}x naive), "
                                                 f"peak {r['peak_memory_mb']:.0f} MB")
    return res
