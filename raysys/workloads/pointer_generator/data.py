"""Text data for the summarizer: a corpus (synthetic, or the user's parquet/JSONL/CSV), a SentencePiece
tokenizer trained on its training split, and tokenized splits as parquet.

Layout of a prepared data folder (written once; reused while its settings match ``meta.json``)::

    spm.model, spm.vocab      SentencePiece model trained on the training split
    train.parquet, eval.parquet
        src_ids, tgt_ids      list<int32> token ids (truncated to the configured lengths, + EOS)
        note, summary         the raw texts (references for ROUGE)
        entities              list<string>: what a summary must copy (synthetic data; for user data the
                              reference's words with a digit that also occur in the note)
    meta.json                 settings, sizes, truncation counts

:class:`TokenizedSplit` reads a split with pyarrow and keeps the list columns as their flat value
and offset arrays (zero-copy views of the Arrow buffers): an item is two slices, so no epoch copies
the table and loader workers share the memory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

PAD, UNK, BOS, EOS = 0, 1, 2, 3  # SentencePiece ids, fixed at training time below


def _spm():
    import sentencepiece as spm

    return spm


@functools.lru_cache(maxsize=8)
def tokenizer(model_file: str):
    return _spm().SentencePieceProcessor(model_file=model_file)


def _digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


# ---- reading a user's corpus ------------------------------------------------------------------------

def read_texts(path: str, source: str, target: str, min_rows: int = 2) -> list[dict]:
    """Rows of ``{note, summary}`` from a parquet, JSONL/JSON or CSV/TSV file; one clear ``ValueError`` (shown as a one-line
    data error) for an unreadable file, a missing column, or empty/non-text values."""
    from raysys.tables import column_values, read_table

    table = read_table(path, text_columns=(source, target))
    missing = [c for c in (source, target) if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(table.column_names)}); "
                        "set data.source_column / data.target_column")
    rows = []
    for i, (s, t) in enumerate(zip(column_values(table, source, path), column_values(table, target, path))):
        for name, v in ((source, s), (target, t)):
            if not isinstance(v, str):
                raise ValueError(f"{path}: row {i + 1}: column {name} is {type(v).__name__}, not text")
            if not v.strip():
                raise ValueError(f"{path}: row {i + 1}: column {name} is empty")
        rows.append({"note": s, "summary": t})
    if len(rows) < min_rows:
        raise ValueError(f"{path}: {len(rows)} row(s); need at least {min_rows}"
                         + (" (one to train on, one to evaluate)" if min_rows == 2 else ""))
    return rows


def guess_entities(note: str, summary: str) -> list[str]:
    """Entities of a user's reference: its words with a digit that the note contains verbatim."""
    words = {w.strip(".,;:()") for w in summary.split()}
    return sorted(w for w in words if any(ch.isdigit() for ch in w) and w in note)


# ---- the words ROUGE counts ----------------------------------------------------------------------------

# Scripts written without spaces between words (Chinese, Japanese): each character is a word, as ROUGE for
# them counts; Korean puts spaces between words, so its words stay whole
_CJK = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF))


class RougeTokenizer:
    """rouge_score's own tokenizer on English (lower case; runs of a-z and 0-9; Porter stems of words of more
    than 3 characters), for the world's scripts: rouge_score's keeps a-z and 0-9 only, so Greek, Cyrillic or
    Chinese summaries had no words and scored 0 however good they were. A word is a run of letters and digits
    with their combining marks (Devanagari's vowel signs, accents written apart); Chinese and Japanese count
    by character. On ASCII text it gives rouge_score's tokens."""

    def __init__(self, use_stemmer: bool = True):
        from nltk.stem import porter

        self.stemmer = porter.PorterStemmer() if use_stemmer else None

    def tokenize(self, text: str) -> list[str]:
        import unicodedata

        words, word = [], []
        for ch in text.lower():
            if any(lo <= ord(ch) <= hi for lo, hi in _CJK):
                words += ["".join(word), ch] if word else [ch]
                word = []
            elif ch.isalnum() or (word and unicodedata.category(ch).startswith("M")):
                word.append(ch)
            elif word:
                words.append("".join(word))
                word = []
        if word:
            words.append("".join(word))
        if self.stemmer is None:
            return words
        return [self.stemmer.stem(w) if len(w) > 3 and w.isascii() else w for w in words]


# ---- preparing ----------------------------------------------------------------------------------------

def prepare(cfg: Any) -> Path:
    """Make (or reuse) the tokenized data folder for ``cfg.data``; return it. Idempotent and safe
    to call from several processes at once (built in a temp folder, then renamed into place)."""
    d = cfg.data
    # a user's files by what they hold, not where they lie or when they were written: a file written again
    # with other text of the same size and time (cp -p, rsync -t, tar -x) is other data, prepared afresh
    settings = {"files": files_digest(d.path, d.eval_path) if d.path else None,
                "source": d.source_column, "target": d.target_column, "n_train": d.n_train, "n_eval": d.n_eval,
                "eval_fraction": d.eval_fraction, "seed": d.seed, "vocab_size": d.vocab_size,
                "max_src_len": d.max_src_len, "max_tgt_len": d.max_tgt_len}
    out = Path(d.data_dir) / _digest(settings)
    if (out / "meta.json").is_file():
        return out
    train, evals = _splits(d)
    # a first preparation that fails leaves no empty data folders behind: those it made are removed
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        vocab = _train_tokenizer([r["note"] for r in train] + [r["summary"] for r in train], tmp / "spm", d.vocab_size)
        sp = tokenizer(str(tmp / "spm.model"))
        meta = {"settings": settings, "vocab_size": vocab, "splits": {}}
        for name, rows in (("train", train), ("eval", evals)):
            meta["splits"][name] = _write_split(rows, sp, tmp / f"{name}.parquet", d.max_src_len, d.max_tgt_len)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        tokenizer.cache_clear()
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only where it is empty: another process's data stays
        raise
    return out


def files_digest(*paths: Optional[str]) -> str:
    """sha256 of the bytes of the given files (None skipped): what they hold, not where they lie. A path
    that is no file is the same one-line ValueError as reading it would be."""
    h = hashlib.sha256()
    for p in paths:
        if p and not Path(p).is_file():
            raise ValueError(f"{p}: {'a folder, not a table file' if Path(p).is_dir() else 'no such file'}")
        if p:
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        h.update(b"\0")  # train-only and train+eval files never hash alike
    return h.hexdigest()[:16]


def _splits(d: Any) -> tuple[list[dict], list[dict]]:
    if d.path is None:
        from raysys.workloads.pointer_generator.corpus import generate

        rows = list(generate(d.n_train + d.n_eval, d.seed))
        return rows[: d.n_train], rows[d.n_train:]
    rows = read_texts(d.path, d.source_column, d.target_column)
    for r in rows:
        r["entities"] = guess_entities(r["note"], r["summary"])
    if d.eval_path:
        evals = read_texts(d.eval_path, d.source_column, d.target_column, min_rows=1)
        for r in evals:
            r["entities"] = guess_entities(r["note"], r["summary"])
        return rows, evals
    # rows of one note stay on one side: a duplicate held out would score the model on what it trained on
    # (without duplicates, each group is one row and the split is the plain permutation of the rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["note"], []).append(r)
    grouped = list(groups.values())
    order = np.random.default_rng(d.seed).permutation(len(grouped))
    n_eval = max(1, int(round(d.eval_fraction * len(grouped))))
    if n_eval >= len(grouped):
        distinct = f" ({len(grouped)} distinct notes)" if len(grouped) < len(rows) else ""
        raise ValueError(f"{d.path}: {len(rows)} rows{distinct} leave none to train on once data.eval_fraction="
                         f"{d.eval_fraction} holds out {n_eval} for evaluation")
    return ([r for i in order[n_eval:] for r in grouped[i]], [r for i in order[:n_eval] for r in grouped[i]])


def _train_tokenizer(texts: list[str], prefix: Path, vocab_size: int) -> int:
    """Unigram SentencePiece with digits split (numbers are copied digit by digit, so any value can
    be copied) and byte fallback (no <unk> for rare characters). ``vocab_size`` is a ceiling: a
    small corpus gets the vocabulary it supports (hard_vocab_limit off)."""
    spm = _spm()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for t in texts:
            f.write(t.replace("\n", " ") + "\n")
    try:
        # every sentence is used (no sampling) and one thread: the same corpus gives the same model
        spm.SentencePieceTrainer.train(
            input=f.name, model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
            character_coverage=1.0, split_digits=True, byte_fallback=True, hard_vocab_limit=False,
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, num_threads=1, input_sentence_size=0,
            shuffle_input_sentence=False, minloglevel=2, user_defined_symbols=["\\n"])
    except RuntimeError as e:  # e.g. a vocabulary smaller than the corpus's characters need
        # SentencePiece's own advice names its command-line flags (--character_coverage): raysys's knob is vocab_size
        why = str(e).splitlines()[0].split(". Please")[0].split(" Increase vocab_size")[0].rstrip(". ")
        raise ValueError(f"SentencePiece could not train a {vocab_size}-piece tokenizer ({why}); raise "
                         "data.vocab_size (every character of the corpus needs a piece)") from None
    finally:
        os.unlink(f.name)
    return _spm().SentencePieceProcessor(model_file=f"{prefix}.model").get_piece_size()


def encode(sp, text: str) -> list[int]:
    # sentence breaks survive tokenization as a piece of their own (ROUGE-Lsum splits on them)
    return sp.encode(text.replace("\n", " \\n "))


def decode(sp, ids: list[int]) -> str:
    return re.sub(r"\s*\\n\s*", "\n", sp.decode([int(i) for i in ids if i > EOS])).strip()


def _write_split(rows: list[dict], sp, path: Path, max_src: int, max_tgt: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src, tgt, cut_src, cut_tgt = [], [], 0, 0
    for r in rows:
        s, t = encode(sp, r["note"]), encode(sp, r["summary"])
        cut_src += len(s) > max_src - 1
        cut_tgt += len(t) > max_tgt - 1
        src.append(s[: max_src - 1] + [EOS])
        # a summary cut short gets no EOS at the cut (as the original's batcher): the model would learn to end
        # a summary mid-sentence there
        tgt.append(t + [EOS] if len(t) <= max_tgt - 1 else t[:max_tgt])
    table = pa.table({"src_ids": pa.array(src, pa.list_(pa.int32())), "tgt_ids": pa.array(tgt, pa.list_(pa.int32())),
                      "note": [r["note"] for r in rows], "summary": [r["summary"] for r in rows],
                      "entities": pa.array([r.get("entities", []) for r in rows], pa.list_(pa.string()))})
    pq.write_table(table, path)
    lens = [len(s) for s in src]
    words = RougeTokenizer(use_stemmer=False)  # the words ROUGE counts
    return {"rows": len(rows), "truncated_src": cut_src, "truncated_tgt": cut_tgt,
            "one_word_summaries": sum(len(words.tokenize(r["summary"])) < 2 for r in rows),
            "mean_src_len": float(np.mean(lens)), "mean_tgt_len": float(np.mean([len(t) for t in tgt]))}


# ---- reading a prepared split -------------------------------------------------------------------------

class TokenizedSplit:
    """A split as flat int32 value/offset arrays over the Arrow buffers (no per-epoch copies).
    ``lengths`` (source tokens per row) lets the loader bucket batches by length."""

    def __init__(self, path: Path, limit: Optional[int] = None, with_text: bool = False):
        import pyarrow.parquet as pq

        cols = ["src_ids", "tgt_ids"] + (["summary", "entities", "note"] if with_text else [])
        table = pq.read_table(path, columns=cols)
        if limit is not None:
            table = table.slice(0, limit)
        self.n = table.num_rows
        self._src = self._flat(table.column("src_ids"))
        self._tgt = self._flat(table.column("tgt_ids"))
        self.lengths = np.diff(self._src[1])
        self.text = {c: table.column(c).to_pylist() for c in cols[2:]}

    @staticmethod
    def _flat(col) -> tuple[np.ndarray, np.ndarray]:
        arr = col.combine_chunks()
        values = arr.values.to_numpy(zero_copy_only=True)
        offsets = arr.offsets.to_numpy(zero_copy_only=True)
        return values, offsets

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        (sv, so), (tv, to) = self._src, self._tgt
        item = {"src": sv[so[i]:so[i + 1]], "tgt": tv[to[i]:to[i + 1]], "index": i}
        for c, values in self.text.items():
            item[c] = values[i]
        return item
