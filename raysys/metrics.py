"""Measured step-time breakdown, throughput, and stability signals, shared by every loop.

Seed 002 could only *estimate* where a step's time goes. ``PhaseTimer`` measures it: wall time of
data wait, host->device copy, forward, backward, optimizer and the rest, per optimizer step.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

MAX_NONFINITE = 20  # consecutive non-finite losses after which the training loop declares a run diverged
PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "other")
TASK_LOOP_METRICS = frozenset({
    "train/loss", "train/lr", "train/epoch",
    "perf/samples_per_s", "perf/tokens_per_s", "perf/step_ms", "perf/data_wait_share", "perf/compute_share",
    "stability/diverged", "stability/nonfinite_loss", "stability/nonfinite_grad", "stability/loss_spikes",
    "stability/loss_spikes_total", "stability/grad_norm_mean", "stability/grad_norm_max"})
"""What the shared loop reports for a task, besides ``eval/<its evaluate() keys>``: a sweep naming another
metric outside eval/ for a task's workload has a typo, refused before it starts."""


class PhaseTimer:
    """Accumulates wall time per phase over timed steps.

    On CUDA, kernels run asynchronously, so a phase's wall time is only meaningful if the device
    is drained at its boundaries: ``sync`` (e.g. torch.cuda.synchronize) is called then. That sync
    costs overlap, so only every k-th step is timed (``every``); the others run free.
    """

    def __init__(self, sync: Optional[Callable[[], None]] = None, every: int = 1):
        self.sync, self.every = sync, every
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.active = False
        self._step_start = 0.0
        self._named_at_start = 0.0

    def start_step(self, step: int) -> None:
        self.active = step % self.every == 0
        if self.active:
            if self.sync:
                self.sync()
            self._named_at_start = self._named_total()
            self._step_start = time.perf_counter()

    def _named_total(self) -> float:
        return sum(self.totals[p] for p in PHASES if p != "other")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        t0 = time.perf_counter()
        yield
        if self.sync:
            self.sync()  # this is a CPU-GPU sync point, paid only on timed steps
        self.totals[name] += time.perf_counter() - t0

    def end_step(self) -> None:
        if not self.active:
            return
        if self.sync:
            self.sync()
        total = time.perf_counter() - self._step_start
        named = self._named_total() - self._named_at_start
        self.totals["other"] += max(0.0, total - named)
        self.totals["step"] += total
        self.steps += 1

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase, and the total."""
        n = max(self.steps, 1)
        return {f"{p}_ms": 1000 * self.totals[p] / n for p in (*PHASES, "step")}

    def summary_metrics(self) -> dict[str, float]:
        """A few numbers for charts (the whole breakdown is the table): the step's mean time and the
        shares of waiting for data and of the model's own compute (forward + backward)."""
        s = self.summary()
        step = s["step_ms"] or 1.0
        return {"perf/step_ms": s["step_ms"], "perf/data_wait_share": s["data_wait_ms"] / step,
                "perf/compute_share": (s["forward_ms"] + s["backward_ms"]) / step}

    def table(self) -> str:
        """A markdown table of the breakdown (ms/step and share of the step)."""
        s = self.summary()
        step = s["step_ms"] or 1.0
        rows = ["| phase | ms/step | share |", "|---|---:|---:|"]
        rows += [f"| {p} | {s[p + '_ms']:.2f} | {100 * s[p + '_ms'] / step:.1f}% |" for p in PHASES]
        rows.append(f"| **step** | {step:.2f} | 100% |")
        return "\n".join(rows) + f"\n\n{self.steps} timed steps (every session of the run)\n"

    def state_dict(self) -> dict:
        return {"totals": dict(self.totals), "steps": self.steps}

    def load_state_dict(self, d: dict) -> None:
        self.totals = defaultdict(float, d["totals"])
        self.steps = d["steps"]


def is_loss(key: str) -> bool:
    """train/loss, CleanRL's losses/*, any metric named ...loss: what stability rules watch."""
    return key.startswith("losses/") or key.rsplit("/", 1)[-1].endswith("loss")


def divergence(final: Mapping[str, Any]) -> Optional[str]:
    """Why a run that ended without an error did not train, or None: the loop stopped itself after
    consecutive non-finite losses, or a loss it reported last is not finite (any workload)."""
    if isinstance(final.get("stability/diverged"), (int, float)) and final["stability/diverged"] >= 1:
        return (f"diverged: {MAX_NONFINITE} non-finite losses in a row, the loop stopped itself at step "
                f"{int(final.get('step', 0))}")
    for key, v in final.items():
        if is_loss(key) and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v):
            return f"diverged: its last {key} is {v}"
    return None


def _median(values: Iterable[float]) -> float:
    """The upper median: one of the values, as the spike rule has always taken it."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class StabilityMonitor:
    """Non-finite loss/grad counts, loss spikes, grad-norm statistics.

    A spike is a loss above ``spike_factor`` x the median of the last ``window`` losses.
    ``stability/loss_spikes`` is the most spikes within ``window`` consecutive losses so far, not a
    count since the start: rare outliers of a run that learns well (a small batch with a few mistakes
    near convergence has several times the median loss) made that count grow with the run's length,
    so every long run ended up "unstable"; a run that oscillates or blows up has its spikes close
    together. The count since the start is ``stability/loss_spikes_total``.

    A spike must also rise above the median by ``NOISE`` x the run's starting loss (the median of its
    first ``window`` losses): a classifier converged to a loss of 0.03 has batches at 0.12 (4x) that
    are noise, not a blow-up, which takes the loss back toward where it started."""

    NOISE = 0.25

    def __init__(self, spike_factor: float = 4.0, window: int = 50):
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=window)
        self.flags: deque[bool] = deque(maxlen=window)  # which of the last `window` losses were spikes
        self.nonfinite_loss = 0
        self.nonfinite_grad = 0
        self.spikes = 0
        self.burst = 0
        self.grad_norms: deque[float] = deque(maxlen=200)  # the statistics are of the latest 200
        self.start: Optional[float] = None  # the median of the first `window` losses, once there are as many

    def observe(self, loss: float, grad_norm: Optional[float]) -> None:
        if not math.isfinite(loss):
            self.nonfinite_loss += 1
        else:
            spike = False
            if len(self.recent) >= 10:
                med = _median(self.recent)
                start = med if self.start is None else self.start
                spike = loss > self.spike_factor * max(med, 1e-8) and loss - med > self.NOISE * abs(start)
            self.spikes += spike
            self.flags.append(spike)
            self.burst = max(self.burst, sum(self.flags))
            self.recent.append(loss)
            if self.start is None and len(self.recent) == self.recent.maxlen:
                self.start = _median(self.recent)
        if grad_norm is not None:
            self.observe_grad_norms((grad_norm,))

    def observe_grad_norms(self, values: Iterable[float]) -> None:
        """Every update's gradient norm, for a loop that observes one loss per several updates (a mean
        over a log line): the statistics are then of updates, not of per-line maxima."""
        for v in values:
            if math.isfinite(v):
                self.grad_norms.append(float(v))
            else:
                self.nonfinite_grad += 1

    def metrics(self) -> dict[str, float]:
        g = self.grad_norms
        out = {
            "stability/nonfinite_loss": float(self.nonfinite_loss),
            "stability/nonfinite_grad": float(self.nonfinite_grad),
            "stability/loss_spikes": float(self.burst),
            "stability/loss_spikes_total": float(self.spikes),
        }
        if g:
            out["stability/grad_norm_mean"] = sum(g) / len(g)
            out["stability/grad_norm_max"] = max(g)
        return out

    @property
    def diverged(self) -> bool:
        return self.nonfinite_loss > 0

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "flags": list(self.flags), "nonfinite_loss": self.nonfinite_loss,
                "nonfinite_grad": self.nonfinite_grad, "spikes": self.spikes, "burst": self.burst,
                "grad_norms": list(self.grad_norms), "start": self.start}

    def load_state_dict(self, d: dict) -> None:
        self.recent.extend(d["recent"])
        self.flags.extend(d.get("flags", ()))  # checkpoints from before the windowed count have none
        self.nonfinite_loss, self.nonfinite_grad = d["nonfinite_loss"], d["nonfinite_grad"]
        self.spikes = d["spikes"]
        self.grad_norms.extend(d["grad_norms"])
        self.burst = d.get("burst", sum(self.flags))
        self.start = d.get("start")  # a checkpoint from before it: the window's median, once it is full
        if self.start is None and len(self.recent) == self.recent.maxlen:
            self.start = _median(self.recent)


class Throughput:
    """Samples/s and tokens/s over a sliding window of steps (and over the whole run)."""

    def __init__(self, window: int = 20):
        self.window: deque[tuple[float, int, int]] = deque(maxlen=window)
        self.total_samples = 0
        self.total_tokens = 0
        self.total_time = 0.0

    def update(self, seconds: float, samples: int, tokens: int) -> None:
        self.window.append((seconds, samples, tokens))
        self.total_samples += samples
        self.total_tokens += tokens
        self.total_time += seconds

    def window_sums(self) -> tuple[int, float]:
        """(samples, seconds) of the window: a loop of its own (env steps per chunk) takes its rate from them."""
        return sum(w[1] for w in self.window), sum(w[0] for w in self.window)

    def rates(self, world_size: int = 1) -> dict[str, float]:
        t = sum(w[0] for w in self.window) or 1e-9
        return {
            "perf/samples_per_s": world_size * sum(w[1] for w in self.window) / t,
            "perf/tokens_per_s": world_size * sum(w[2] for w in self.window) / t,
        }
