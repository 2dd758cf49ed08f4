"""Deep-GPCM data: the synthetic_OC generator, parquet I/O with validation, k-fold splits, batching.

A dataset is one parquet table, a row per student, with list columns ``questions`` (ids 1..Q; 0 is
reserved for padding) and ``responses`` (ordered categories 0..K-1). ``meta.json`` next to it, when
present, gives Q and K; otherwise they are inferred from the data.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

SEQUENCES, IRT_PARAMS, META = "sequences.parquet", "irt_params.npz", "meta.json"
REQUIRED_COLUMNS = ("questions", "responses")
PathLike = Union[str, os.PathLike]


# ---- synthetic_OC -------------------------------------------------------------------------------

def gpcm_probs(theta: np.ndarray, alpha: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """GPCM category probabilities, P(k) proportional to exp(sum_{h<k} alpha (theta - beta_h)).

    theta, alpha: [n]; betas: [n, K-1]. Returns [n, K].
    """
    steps = alpha[:, None] * (theta[:, None] - betas)
    z = np.concatenate([np.zeros((len(theta), 1)), np.cumsum(steps, axis=1)], axis=1)
    z -= z.max(axis=1, keepdims=True)  # stable softmax
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def generate_synthetic_oc(n_students: int = 800, n_questions: int = 400, n_cats: int = 4, min_len: int = 100,
                          max_len: int = 400, seed: int = 42) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """Students answering ordered-category questions under a GPCM, like the original's synthetic_OC.

    Returns the sequences (columns student_id, questions, responses) and the true IRT parameters:
    theta [n_students], alpha [n_questions], betas [n_questions, n_cats-1]; question id q uses
    row q-1. Every draw is vectorised over all responses at once.
    """
    if min_len < 1 or max_len <= min_len:
        raise ValueError(f"need 1 <= min_len < max_len, got min_len={min_len}, max_len={max_len}")
    if n_cats < 2 or n_questions < 1 or n_students < 1:
        raise ValueError(f"need n_cats >= 2 and at least one question and student, got {n_cats=}, "
                         f"{n_questions=}, {n_students=}")
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 1.0, n_students)
    alpha = rng.lognormal(0.0, 0.3, n_questions)
    base = rng.normal(0.0, 1.0, n_questions)
    betas = np.sort(rng.normal(base[:, None], 0.5, (n_questions, n_cats - 1)), axis=1)

    lengths = rng.integers(min_len, max_len, n_students)  # max_len exclusive
    student = np.repeat(np.arange(n_students), lengths)
    questions = rng.integers(1, n_questions + 1, lengths.sum())  # uniform, with replacement
    p = gpcm_probs(theta[student], alpha[questions - 1], betas[questions - 1])
    # inverse-CDF sampling: the category is how many cumulative probabilities the uniform exceeds
    u = rng.random(len(questions))
    responses = (u[:, None] > np.cumsum(p, axis=1)[:, :-1]).sum(axis=1)

    cuts = np.cumsum(lengths)[:-1]
    df = pd.DataFrame({
        "student_id": np.arange(n_students),
        "questions": [x.tolist() for x in np.split(questions, cuts)],
        "responses": [x.tolist() for x in np.split(responses, cuts)],
    })
    return df, {"theta": theta, "alpha": alpha, "betas": betas}


def _atomic_write(path: Path, write) -> None:
    """Write through a temp file in the same folder, then rename: readers never see half a file,
    and concurrent writers (several workers preparing the same data) do not corrupt each other."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_synthetic_oc(out_dir: PathLike, **kwargs) -> Path:
    """Generate synthetic_OC into ``out_dir`` (sequences.parquet, irt_params.npz, meta.json).

    kwargs are ``generate_synthetic_oc``'s. A no-op when the folder already holds a dataset made
    with the same arguments. meta.json is written last, so its presence marks a complete dataset.
    """
    defaults = {k: v.default for k, v in inspect.signature(generate_synthetic_oc).parameters.items()}
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"unknown generator argument(s): {sorted(unknown)}")
    args = {**defaults, **kwargs}
    out = Path(out_dir)
    meta_path = out / META
    if meta_path.exists() and (out / SEQUENCES).exists() and (out / IRT_PARAMS).exists():
        try:
            if json.loads(meta_path.read_text()).get("generator") == args:
                return out
        except json.JSONDecodeError:
            pass  # a damaged meta.json: regenerate
    out.mkdir(parents=True, exist_ok=True)
    df, irt = generate_synthetic_oc(**args)
    _atomic_write(out / SEQUENCES, lambda p: df.to_parquet(p, index=False))

    def save_npz(p: str) -> None:
        with open(p, "wb") as f:  # a file object: np.savez would append ".npz" to a bare temp name
            np.savez(f, **irt)

    _atomic_write(out / IRT_PARAMS, save_npz)
    meta = {"name": "synthetic_OC", "n_questions": args["n_questions"], "n_cats": args["n_cats"],
            "n_students": args["n_students"], "generator": args}
    _atomic_write(meta_path, lambda p: Path(p).write_text(json.dumps(meta, indent=2)))
    return out


# ---- loading and validation ---------------------------------------------------------------------

@dataclass
class SequenceData:
    """Per-student int64 arrays (ids 1..n_questions, responses 0..n_cats-1)."""

    questions: list[np.ndarray]
    responses: list[np.ndarray]
    n_questions: int
    n_cats: int

    def __len__(self) -> int:
        return len(self.questions)


def _flatten(table, column: str, file: Path) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (all values int64, row offsets)."""
    import pyarrow as pa

    col = table.column(column).combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"{file}: column {column!r} must hold lists of integers, found type {col.type}")
    if col.null_count:
        raise ValueError(f"{file}: column {column!r} has {col.null_count} empty (null) row(s)")
    values = col.flatten()
    if not pa.types.is_integer(values.type):
        raise ValueError(f"{file}: column {column!r} must hold integers, found {values.type}")
    if values.null_count:
        raise ValueError(f"{file}: column {column!r} has null entries inside its lists")
    offsets = col.offsets.to_numpy().astype(np.int64)
    # a writable copy: arrow buffers are read-only and torch.from_numpy warns on those
    return np.array(values.to_numpy(), dtype=np.int64), offsets - offsets[0]  # flatten() starts at row 0


def load_sequences(path: PathLike) -> SequenceData:
    """Read and validate a sequences parquet (a file, or a folder holding sequences.parquet)."""
    import pyarrow.parquet as pq

    path = Path(path)
    file = path / SEQUENCES if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no sequences parquet at {file}")
    meta_path = file.parent / META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}

    table = pq.read_table(file)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{file}: missing required column(s) {', '.join(map(repr, missing))}; "
                         f"required columns are {', '.join(map(repr, REQUIRED_COLUMNS))} "
                         f"(found {table.column_names})")
    q, q_off = _flatten(table, "questions", file)
    r, r_off = _flatten(table, "responses", file)
    if not np.array_equal(q_off, r_off):
        bad = int(np.flatnonzero(np.diff(q_off) != np.diff(r_off))[0])
        raise ValueError(f"{file}: row {bad} has {q_off[bad + 1] - q_off[bad]} questions but "
                         f"{r_off[bad + 1] - r_off[bad]} responses; each row needs one response per question")
    if len(q) and q.min() < 1:
        raise ValueError(f"{file}: question ids must be >= 1 (0 is reserved for padding), found {q.min()}")
    if len(r) and r.min() < 0:
        raise ValueError(f"{file}: responses must be >= 0, found {r.min()}")
    if not len(q):
        raise ValueError(f"{file}: no responses (the table is empty)")
    n_questions = int(meta.get("n_questions", q.max()))
    distinct = len(np.unique(q))
    if n_questions > max(10 * distinct, 100_000):
        # the model keeps one embedding row per id up to the largest: 10^9 ids would be a 32 GB table
        raise ValueError(f"{file}: question ids are sparse ({distinct} distinct, largest {n_questions}); renumber them "
                         f"1..{distinct} (the model has one embedding row per id up to the largest)")
    n_cats = int(meta.get("n_cats", r.max() + 1 if len(r) else 0))
    if len(q) and q.max() > n_questions:
        raise ValueError(f"{file}: question id {q.max()} exceeds n_questions={n_questions} from {meta_path}")
    if len(r) and r.max() >= n_cats:
        raise ValueError(f"{file}: response {r.max()} out of range 0..{n_cats - 1} (n_cats={n_cats} from {meta_path})")
    if n_cats < 2:
        raise ValueError(f"{file}: need at least 2 response categories, found {n_cats}")
    cuts = q_off[1:-1]
    return SequenceData(np.split(q, cuts), np.split(r, cuts), n_questions, n_cats)


# ---- splits and batching --------------------------------------------------------------------------

def kfold_indices(n: int, n_folds: int, fold: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of ``fold`` in a seeded k-fold split of range(n); each sorted."""
    if not 0 <= fold < n_folds:
        raise ValueError(f"fold must be in 0..{n_folds - 1}, got {fold}")
    if n < n_folds:
        raise ValueError(f"cannot split {n} sequences into {n_folds} folds")
    parts = np.array_split(np.random.default_rng(seed).permutation(n), n_folds)
    test = np.sort(parts[fold])
    train = np.sort(np.concatenate([p for i, p in enumerate(parts) if i != fold]))
    return train, test


class SequenceDataset(torch.utils.data.Dataset):
    """(questions, responses) LongTensors of one student, optionally over a subset of students."""

    def __init__(self, data: SequenceData, indices: Optional[Sequence[int]] = None):
        self.data = data
        self.indices = np.arange(len(data)) if indices is None else np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.indices[i]
        return torch.from_numpy(self.data.questions[j]), torch.from_numpy(self.data.responses[j])


def collate_padded(batch: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: question 0 (padding id), response 0, mask False."""
    lengths = torch.tensor([len(q) for q, _ in batch])
    B, T = len(batch), int(lengths.max())
    questions = torch.zeros(B, T, dtype=torch.long)
    responses = torch.zeros(B, T, dtype=torch.long)
    for i, (q, r) in enumerate(batch):  # row copies into one preallocated buffer
        questions[i, : len(q)] = q
        responses[i, : len(r)] = r
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return {"questions": questions, "responses": responses, "mask": mask}
