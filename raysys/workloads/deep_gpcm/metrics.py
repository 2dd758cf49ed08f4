"""Ordinal classification metrics over valid (unpadded) steps, accumulated across batches.

Predictions are the argmax category. Every metric here is a function of the K x K confusion matrix
(true x predicted), including the rank correlations: with K ordered categories, Spearman's rho is
the Pearson correlation of mid-ranks, and Kendall's tau-b counts concordant and discordant pairs,
both computable from the table. So the accumulator holds K*K counts, whatever the data size, and
two accumulators (e.g. from different workers) merge by adding their tables.
"""

from __future__ import annotations

import math

import numpy as np
import torch

METRICS = ("categorical_acc", "ordinal_acc", "qwk", "mae", "spearman", "kendall_tau")


def quadratic_weighted_kappa(confusion: np.ndarray) -> float:
    """Cohen's kappa with quadratic weights from a K x K confusion matrix (rows: true).

    0.0 when chance agreement is already perfect (a single category on both sides), where kappa is
    undefined.
    """
    c = confusion.astype(np.float64)
    K, n = len(c), c.sum()
    i = np.arange(K)
    weights = (i[:, None] - i[None, :]) ** 2 / max(K - 1, 1) ** 2
    expected = np.outer(c.sum(1), c.sum(0)) / n
    denom = (weights * expected).sum()
    return 0.0 if denom == 0 else float(1.0 - (weights * c).sum() / denom)


def _midranks(counts: np.ndarray) -> np.ndarray:
    """Average rank (1-based) of each category's members when all samples are sorted."""
    before = np.concatenate([[0.0], np.cumsum(counts)[:-1]])
    return before + (counts + 1) / 2


def spearman_from_confusion(confusion: np.ndarray) -> float:
    """Spearman's rho (ties as mid-ranks, as scipy.stats.spearmanr) from a confusion matrix."""
    c = confusion.astype(np.float64)
    n = c.sum()
    rt, rp = _midranks(c.sum(1)), _midranks(c.sum(0))
    mt, mp = (c.sum(1) * rt).sum() / n, (c.sum(0) * rp).sum() / n
    dt, dp = rt - mt, rp - mp
    cov = (c * np.outer(dt, dp)).sum()
    var = (c.sum(1) * dt**2).sum() * (c.sum(0) * dp**2).sum()
    return 0.0 if var <= 0 else float(cov / math.sqrt(var))


def kendall_tau_from_confusion(confusion: np.ndarray) -> float:
    """Kendall's tau-b (as scipy.stats.kendalltau) from a confusion matrix."""
    c = confusion.astype(np.float64)
    n = c.sum()
    # below_right[i, j] = pairs strictly greater on both axes; below_left: greater true, smaller pred
    tail = np.cumsum(np.cumsum(c[::-1, ::-1], 0), 1)[::-1, ::-1]  # sum over i' >= i, j' >= j
    below_right = np.zeros_like(c)
    below_right[:-1, :-1] = tail[1:, 1:]
    tail_left = np.cumsum(np.cumsum(c[::-1, :], 0), 1)[::-1, :]  # sum over i' >= i, j' <= j
    below_left = np.zeros_like(c)
    below_left[:-1, 1:] = tail_left[1:, :-1]
    concordant, discordant = (c * below_right).sum(), (c * below_left).sum()
    pairs = n * (n - 1) / 2
    ties_t = (c.sum(1) * (c.sum(1) - 1) / 2).sum()
    ties_p = (c.sum(0) * (c.sum(0) - 1) / 2).sum()
    denom = (pairs - ties_t) * (pairs - ties_p)
    return 0.0 if denom <= 0 else float((concordant - discordant) / math.sqrt(denom))


class OrdinalMetricAccumulator:
    """Accumulates a K x K confusion matrix of (true, argmax) over valid steps of many batches."""

    def __init__(self, n_cats: int):
        self.n_cats = n_cats
        self.confusion = np.zeros((n_cats, n_cats), dtype=np.int64)

    def update(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> None:
        """logits [..., K], targets [...] in 0..K-1, mask [...] bool (True = valid step)."""
        K = self.n_cats
        pred = logits.detach().argmax(-1)[mask]
        true = targets[mask].long()
        counts = torch.bincount(true * K + pred, minlength=K * K)  # one pass, on the logits' device
        self.confusion += counts.view(K, K).cpu().numpy()

    def merge(self, other: "OrdinalMetricAccumulator") -> None:
        self.confusion += other.confusion

    def compute(self) -> dict[str, float]:
        c = self.confusion
        n = c.sum()
        if n == 0:
            raise ValueError("no valid steps were accumulated")
        i = np.arange(self.n_cats)
        dist = np.abs(i[:, None] - i[None, :])
        return {
            "categorical_acc": float(np.trace(c) / n),
            "ordinal_acc": float(c[dist <= 1].sum() / n),
            "qwk": quadratic_weighted_kappa(c),
            "mae": float((c * dist).sum() / n),
            "spearman": spearman_from_confusion(c),
            "kendall_tau": kendall_tau_from_confusion(c),
        }


def ordinal_metrics(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The metrics of one batch (see ``OrdinalMetricAccumulator``)."""
    acc = OrdinalMetricAccumulator(logits.shape[-1])
    acc.update(logits, targets, mask)
    return acc.compute()
