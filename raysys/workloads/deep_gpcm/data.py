"""Deep-GPCM data: the synthetic_OC generator, reading a user's sequences with validation, k-fold
splits, batching.

In memory a dataset is a row per student: question ids 1..Q (0 is reserved for padding) and responses
(ordered categories 0..K-1). synthetic_OC is written as one parquet table with list columns
``questions`` and ``responses``; ``load_sequences`` also reads a row per response, CSV/JSONL, and the
original's three-line text files. ``meta.json`` next to the data, when present, gives Q and K;
otherwise they are inferred from the data.
"""

from __future__ import annotations

import inspect
import json
import os
import re
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
    df, irt = generate_synthetic_oc(**args)  # before the folder: a refused or failed generation leaves none
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / SEQUENCES, lambda p: df.to_parquet(p, index=False))

    def save_npz(p: str) -> None:
        with open(p, "wb") as f:  # a file object: np.savez would append ".npz" to a bare temp name
            np.savez(f, **irt)

    _atomic_write(out / IRT_PARAMS, save_npz)
    meta = {"name": "synthetic_OC", "n_questions": args["n_questions"], "n_cats": args["n_cats"],
            "n_students": args["n_students"], "generator": args}
    _atomic_write(meta_path, lambda p: Path(p).write_text(json.dumps(meta, indent=2)))
    return out


def synthetic_sequences(out_dir: PathLike, options: Optional["ReadOptions"] = None, **kwargs) -> "SequenceData":
    """synthetic_OC made with ``kwargs`` (``write_synthetic_oc``), read. One folder serves every generator
    setting, so another process that makes it with other settings (a sweep's trial, another terminal)
    could replace its files between this one's write and read: both happen under one lock, and what is read
    is what was asked for."""
    from filelock import FileLock

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        write_synthetic_oc(out, **kwargs)
        return load_sequences(out, options)


# ---- loading and validation ---------------------------------------------------------------------

LONG_COLUMNS = {
    "student": ("student_id", "user_id", "student", "user", "learner_id"),
    "question": ("question_id", "item_id", "problem_id", "question", "item", "skill_id"),
    "response": ("response", "score", "category", "correct"),
}
"""Names a one-row-per-response table's columns may have, tried in order (``ReadOptions`` overrides)."""


@dataclass
class ReadOptions:
    """How to read a user's file beyond its format (``data.*`` keys of the workload's config)."""

    student_column: Optional[str] = None
    question_column: Optional[str] = None
    response_column: Optional[str] = None
    order_column: Optional[str] = None
    """One row per response: the column that orders a student's rows (None: the file's order)."""
    id_base: Optional[int] = None
    """Smallest question id: 1, or 0 (shifted to 1..Q, since 0 pads); None: 0 when some id is 0."""
    response_base: Optional[int] = None
    """Smallest response category: 0, or 1 (a 1..K scale, shifted to 0..K-1); None: 1 when no response is 0."""


@dataclass
class SequenceData:
    """Per-student int64 arrays (ids 1..n_questions, responses 0..n_cats-1)."""

    questions: list[np.ndarray]
    responses: list[np.ndarray]
    n_questions: int
    n_cats: int
    notes: tuple[str, ...] = ()
    """What the reader decided for the user (ids shifted or renumbered); the workload says it once."""

    def __len__(self) -> int:
        return len(self.questions)


Flat = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(question ids, responses, row offsets): every student's sequence back to back."""


def _ints(values, what: str, file: Path) -> np.ndarray:
    """Whole numbers as int64 (integral floats and booleans too, as pandas and CSV readers leave them)."""
    a = np.asarray(values)
    if a.dtype == bool:
        return a.astype(np.int64)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            raise ValueError(f"{file}: {what} must be whole numbers, found {a[bad][0]}")
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        if not a.size:  # a header and no rows: a CSV reader cannot type an empty column
            raise ValueError(f"{file}: no responses (the table has no rows)")
        flat = a.ravel()
        i = next((j for j, v in enumerate(flat) if not _whole(v)), None)  # the first that is not one, not the first
        if i is None:  # numbers stored as text ('8'), as a list of strings holds them
            return np.array([round(float(v)) for v in flat], dtype=np.int64).reshape(a.shape)
        raise ValueError(f"{file}: {what} must be whole numbers, found {flat[i]!r} (value {i + 1} of the column)")
    return a.astype(np.int64)


def _whole(v) -> bool:
    """Whether one value of an untyped column reads as a whole number ('2', 2, 2.0)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return np.isfinite(f) and f == round(f)


def _list_column(table, column: str, file: Path) -> tuple[np.ndarray, np.ndarray]:
    """A column of integer lists (or of "1,2,3" texts, as a CSV holds them) as (values, row offsets)."""
    import pyarrow as pa

    col = table.column(column).combine_chunks()
    if col.null_count:
        raise ValueError(f"{file}: column {column!r} has {col.null_count} empty (null) row(s)")
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        rows = []
        for i, text in enumerate(col.to_pylist()):
            try:
                rows.append([int(x) for x in re.split(r"[\s,;]+", text.strip(" []")) if x])
            except ValueError:
                raise ValueError(f"{file}: row {i + 1}: column {column!r} is not a list of integers: {text[:60]!r}") from None
        col = pa.array(rows, pa.list_(pa.int64()))
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"{file}: column {column!r} must hold lists of integers, found type {col.type}")
    values = col.flatten()
    if values.null_count:
        raise ValueError(f"{file}: column {column!r} has null entries inside its lists")
    offsets = col.offsets.to_numpy().astype(np.int64)
    return _ints(values.to_numpy(zero_copy_only=False), f"column {column!r}", file), offsets - offsets[0]


def _pick(table, role: str, given: Optional[str], file: Path) -> str:
    if given is not None:
        if given not in table.column_names:
            raise ValueError(f"{file}: no column {given!r} (data.{role}_column); has: {', '.join(table.column_names)}")
        return given
    for name in LONG_COLUMNS[role]:
        if name in table.column_names:
            return name
    raise ValueError(f"{file}: needs list columns 'questions' and 'responses' (a row per student), or a row per "
                     f"response with a {role} column ({' / '.join(LONG_COLUMNS[role])}, or set data.{role}_column); "
                     f"has: {', '.join(table.column_names)}")


def _from_table(table, file: Path, opt: ReadOptions) -> Flat:
    if all(c in table.column_names for c in REQUIRED_COLUMNS) and opt.question_column is None:
        q, q_off = _list_column(table, "questions", file)
        r, r_off = _list_column(table, "responses", file)
        if not np.array_equal(q_off, r_off):
            bad = int(np.flatnonzero(np.diff(q_off) != np.diff(r_off))[0])
            raise ValueError(f"{file}: row {bad + 1} has {q_off[bad + 1] - q_off[bad]} questions but "
                             f"{r_off[bad + 1] - r_off[bad]} responses; each row needs one response per question")
        return q, r, q_off
    present = [c for c in REQUIRED_COLUMNS if c in table.column_names]
    if present and opt.question_column is None:
        missing = [c for c in REQUIRED_COLUMNS if c not in present]
        raise ValueError(f"{file}: missing required column(s) {', '.join(map(repr, missing))}: a row per student needs "
                         f"both {' and '.join(map(repr, REQUIRED_COLUMNS))} (found {table.column_names})")
    # one row per response: students in sorted id order (a shuffled file gives the same folds), each
    # student's rows in the file's order or by the order column
    names = {role: _pick(table, role, getattr(opt, f"{role}_column"), file) for role in LONG_COLUMNS}
    cols = {role: table.column(n) for role, n in names.items()}
    for role, c in cols.items():
        if c.null_count:
            raise ValueError(f"{file}: column {names[role]!r} has {c.null_count} empty (null) value(s)")
    students = pd.factorize(cols["student"].to_numpy(zero_copy_only=False), sort=True)[0]
    q = np.asarray(cols["question"].to_numpy(zero_copy_only=False))
    # names, not numbers, stay text here: load_sequences numbers them over all of a dataset's files
    q = _ints(q, f"column {names['question']!r}", file) if q.dtype.kind in "iufb" else q.astype(str)
    r = _ints(cols["response"].to_numpy(zero_copy_only=False), f"column {names['response']!r}", file)
    if opt.order_column is not None:
        if opt.order_column not in table.column_names:
            raise ValueError(f"{file}: no column {opt.order_column!r} (data.order_column); "
                             f"has: {', '.join(table.column_names)}")
        order = np.lexsort((table.column(opt.order_column).to_numpy(zero_copy_only=False), students))
    else:
        order = np.argsort(students, kind="stable")
    counts = np.bincount(students)
    return q[order], r[order], np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _is_three_line(file: Path) -> bool:
    """The original's and DKVMN's text layout: per student a length line, then question ids, then responses."""
    if file.suffix.lower() == ".txt":
        return True
    if file.suffix.lower() != ".csv":
        return False
    with open(file, errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    return re.fullmatch(r"\s*\d+\s*,?\s*", first) is not None


def _from_lines(file: Path) -> Flat:
    lines = [(i + 1, line.strip()) for i, line in enumerate(file.read_text(errors="replace").splitlines())]
    lines = [(n, line) for n, line in lines if line]
    if len(lines) % 3:
        raise ValueError(f"{file}: {len(lines)} non-empty lines; this layout needs 3 per student "
                         "(length, question ids, responses)")
    qs, rs, lengths = [], [], []
    for k in range(0, len(lines), 3):
        (n0, head), (n1, ql), (n2, rl) = lines[k:k + 3]
        try:
            length = int(head.strip(","))
            q = [int(x) for x in re.split(r"[\s,]+", ql.strip(" ,")) if x]
            r = [float(x) for x in re.split(r"[\s,]+", rl.strip(" ,")) if x]
        except ValueError as e:
            raise ValueError(f"{file}: lines {n0}-{n2}: not a length and two lists of integers ({e})") from None
        if not length == len(q) == len(r):
            raise ValueError(f"{file}: line {n0} says {length} responses, lines {n1}-{n2} hold {len(q)} question ids "
                             f"and {len(r)} responses")
        qs += q
        rs += r
        lengths.append(length)
    return (np.array(qs, np.int64), _ints(np.array(rs, np.float64), "responses", file),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def _source_files(path: Path) -> list[Path]:
    """A file; or a folder with sequences.parquet, or the original's <name>_train / <name>_test split files
    (pooled: raysys makes its own k folds)."""
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"no sequences file at {path}")
        return [path]
    if (path / SEQUENCES).is_file():
        return [path / SEQUENCES]
    splits = [f for f in path.iterdir() if f.is_file() and re.search(r"_(train|test)$", f.stem, re.IGNORECASE)]
    if not splits:
        raise FileNotFoundError(f"{path}: a data folder needs {SEQUENCES}, or <name>_train / <name>_test files")
    return sorted(splits, key=lambda f: (not f.stem.lower().endswith("_train"), f.name))


def _unseen_runs(seen: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The runs [a, b) of 0..n-1 that the sorted distinct ``seen`` values leave out: a response of 2**62 makes
    one run, not a list (or a bincount) of 2**62 categories."""
    starts = [0] + [int(v) + 1 for v in seen]
    ends = [int(v) for v in seen] + [int(n)]
    return [(a, b) for a, b in zip(starts, ends) if b > a]


def _read_meta(path: Path) -> dict:
    """The dataset's meta.json beside it: an object whose n_questions and n_cats, where given, are whole numbers;
    anything else is a ValueError naming the file and the key (a dataset card's metadata.json, say)."""
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: a JSON {type(meta).__name__}, not an object such as {{\"n_cats\": 4}}")
    for key in ("n_questions", "n_cats"):
        if key not in meta:
            continue
        v = meta[key]
        whole = (isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()) or \
            (isinstance(v, str) and v.strip().isdigit())
        if not whole or int(float(v)) < 1:
            raise ValueError(f"{path}: {key} must be a whole number >= 1, got {v!r}")
        meta[key] = int(float(v))
    return meta

def load_sequences(path: PathLike, options: Optional[ReadOptions] = None) -> SequenceData:
    """Read and validate a user's sequences, in any of these layouts:

    - a row per student with list columns ``questions`` and ``responses`` (parquet, JSONL/JSON, or CSV
      holding "1,2,3" texts); a folder holding ``sequences.parquet`` (what synthetic_OC writes);
    - a row per response (parquet/JSONL/JSON/CSV/TSV) with student, question and response columns,
      named as in ``LONG_COLUMNS`` or by ``options``;
    - the original's and DKVMN's text layout (.txt, or .csv starting with a bare number), three lines
      per student; a folder of its ``<name>_train`` / ``<name>_test`` files.

    ``meta.json`` or the original's ``metadata.json`` beside the data may give n_questions and n_cats.
    """
    from raysys.tables import read_table

    opt = options or ReadOptions()
    path = Path(path)
    files = _source_files(path)
    label = files[0] if len(files) == 1 else path
    notes: list[str] = []
    parts = [_from_lines(f) if _is_three_line(f) else _from_table(read_table(f), f, opt) for f in files]
    q = np.concatenate([p[0] for p in parts])
    if q.dtype.kind not in "iu":  # question names: numbered 1..Q in sorted order, the same in every file
        names, q = np.unique(q.astype(str), return_inverse=True)
        q = q.astype(np.int64) + 1
        notes.append(f"question ids are names: numbered 1..{len(names)} in sorted order")
    r = np.concatenate([p[1] for p in parts])
    starts = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])  # where each file's responses begin
    off = np.concatenate([[0]] + [p[2][1:] + start for p, start in zip(parts, starts)]).astype(np.int64)
    meta_path = next((m for m in (files[0].parent / META, files[0].parent / "metadata.json") if m.is_file()), None)
    meta = _read_meta(meta_path) if meta_path else {}
    if not len(q):
        raise ValueError(f"{label}: no responses (the table is empty)")
    if q.min() < 0:
        raise ValueError(f"{label}: question ids must be >= 0, found {q.min()}")
    base = opt.id_base if opt.id_base is not None else (0 if q.min() == 0 else 1)
    if base == 1 and q.min() < 1:
        raise ValueError(f"{label}: question ids must be >= 1 with data.id_base=1 (0 is reserved for padding), "
                         f"found {q.min()}")
    if base == 0:
        q = q + 1
        if opt.id_base is None:
            notes.append("question ids start at 0: read as 0..Q-1 and shifted to 1..Q (0 pads; "
                         "set data.id_base=1 to refuse a 0 instead)")
    if len(r) and r.min() < 0:
        raise ValueError(f"{label}: responses must be >= 0, found {r.min()}")
    # a 1..K scale (Likert) read as 0..K would train a category 0 that never occurs
    rbase = opt.response_base if opt.response_base is not None else int(
        r.min() >= 1 and ("n_cats" not in meta or int(meta["n_cats"]) == r.max()))
    if rbase == 1:
        if r.min() < 1:
            raise ValueError(f"{label}: responses must be >= 1 with data.response_base=1, found {r.min()}")
        r = r - 1
        if opt.response_base is None:
            notes.append("responses start at 1: read as 1..K and shifted to 0..K-1 (set data.response_base=0 to "
                         "keep a category 0 that never occurs)")
    n_questions = int(meta.get("n_questions", q.max()))
    distinct = len(np.unique(q))
    if n_questions > max(10 * distinct, 100_000):
        # the model keeps one embedding row per id up to the largest: 10^9 ids would be a 32 GB table
        raise ValueError(f"{label}: question ids are sparse ({distinct} distinct, largest {n_questions}); renumber them "
                         f"1..{distinct} (the model has one embedding row per id up to the largest)")
    if "n_questions" not in meta and n_questions >= 1000 and n_questions > 10 * distinct:
        # not refused (a subset of a large bank keeps its ids), but the model's size follows the largest id
        notes.append(f"{distinct} distinct question ids, the largest {n_questions}: the model holds {n_questions} "
                     f"embedding rows and a {n_questions}-question input layer (renumber the ids 1..{distinct} for "
                     "a model of the questions seen)")
    n_cats = int(meta.get("n_cats", r.max() + 1))
    if q.max() > n_questions:
        raise ValueError(f"{label}: question id {q.max()} exceeds n_questions={n_questions} from {meta_path}")
    if r.max() >= n_cats:
        raise ValueError(f"{label}: response {r.max()} out of range 0..{n_cats - 1} (n_cats={n_cats} from {meta_path})")
    if n_cats < 2:
        raise ValueError(f"{label}: need at least 2 response categories, found {n_cats}")
    if "n_cats" not in meta:  # K is the data's, not data.n_cats (the generator's): said, so a stray value shows
        notes.append(f"{n_cats} response categories 0..{n_cats - 1}, from its largest response (a meta.json beside "
                     "it with n_cats fixes K)")
    seen, counts = np.unique(r, return_counts=True)
    runs = _unseen_runs(seen, n_cats)
    hole = max(runs, key=lambda ab: ab[1] - ab[0], default=(0, 0))  # the first of the longest
    if hole[1] - hole[0] >= 2 and "n_cats" not in meta:  # not a scale: a missing-value code, a typo, an offset
        shift = rbase  # the file's own numbers, in the message
        lo, hi = hole[0] + shift, hole[1] - 1 + shift
        if hole[0] == 0:
            raise ValueError(f"{label}: responses start at {r.min() + shift}, so categories {lo}..{hi} never appear: "
                             "number them from 0 (or 1, with data.response_base=1), or give n_cats in a meta.json "
                             "beside the data to keep the empty ones")
        above = seen >= hole[1]
        stray, rows = seen[above], int(counts[above].sum())
        raise ValueError(f"{label}: response{'s' if len(stray) > 1 else ''} "
                         f"{', '.join(str(int(v) + shift) for v in stray[:5])}{', ...' if len(stray) > 5 else ''} "
                         f"({rows} of {len(r)} rows) {'lie' if rows > 1 else 'lies'} above categories {lo}..{hi}, which never appear: a "
                         "missing-value code or a typo? Remove those rows, or give n_cats in a meta.json beside the "
                         "data to keep them as categories")
    if runs:
        unseen = [v for a, b in runs[:8] for v in range(a, min(b, a + 8))][:8]
        many = sum(b - a for a, b in runs) > len(unseen)
        shown = ", ".join(map(str, unseen)) + (", ..." if many else "")
        one = len(unseen) == 1 and not many
        notes.append(f"categor{'y' if one else 'ies'} {shown} never appear{'s' if one else ''}"
                     " (responses are read as 0..K-1: a scale that starts at 1 leaves 0 empty, and one stray value "
                     "adds categories)")
    lengths = np.diff(off)
    if np.any(lengths == 0):
        raise ValueError(f"{label}: row {int(np.flatnonzero(lengths == 0)[0]) + 1} has no responses")
    cuts = off[1:-1]
    return SequenceData(np.split(q, cuts), np.split(r, cuts), n_questions, n_cats, tuple(notes))


def digest(seqs: SequenceData) -> str:
    """Short sha256 of the sequences as read (ids, responses, Q and K): equal for the same data wherever
    its file is, so a checkpoint records what it trained on, not where that was."""
    import hashlib

    h = hashlib.sha256(json.dumps([seqs.n_questions, seqs.n_cats, len(seqs)]).encode())
    h.update(np.array([len(q) for q in seqs.questions], "<i8").tobytes())
    for part in (seqs.questions, seqs.responses):
        h.update(np.concatenate(part).astype("<i8").tobytes())
    return h.hexdigest()[:16]


# ---- splits and batching --------------------------------------------------------------------------

def kfold_indices(n: int, n_folds: int, fold: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of ``fold`` in a seeded k-fold split of range(n); each sorted."""
    if not 0 <= fold < n_folds:
        raise ValueError(f"fold must be in 0..{n_folds - 1}, got {fold}")
    if n < n_folds:
        raise ValueError(f"cannot split {n} sequences into {n_folds} folds (data.n_folds): give more, or fewer folds")
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
