"""The pointer-generator summarizer (seed 002) as a raysys workload: config, presets, the TorchTask.

The original trained a 22M-parameter pointer-generator on clinical notes at batch 1 x gradient
accumulation 16, computing the whole output distribution at every decoder step, and decoded one
example at a time. ``model.path=naive`` is that; ``model.path=optimized`` computes the same loss
(a test checks it) with bucketed batches, a packed encoder, only the recurrence in the time loop,
and batched beam search (identical summaries). See ``model.py`` and ``beam.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Mapping, Optional

import torch

from raysys.config import at_least, require
from raysys.train.config import LaunchConfig, LoaderConfig, OptimConfig, TrainConfig
from raysys.workloads.pointer_generator.data import RougeTokenizer
from raysys.workload import Workload


@dataclass
class DataConfig:
    path: Optional[str] = None
    """Your corpus: a parquet, JSONL/JSON or CSV/TSV file with a note and a summary text column. None generates the
    synthetic clinical-note corpus (raysys/workloads/pointer_generator/corpus.py)."""
    eval_path: Optional[str] = None
    """A separate evaluation file (same columns); None holds out ``eval_fraction`` of ``path``."""
    source_column: str = "note"
    """Column of the text to summarise."""
    target_column: str = "summary"
    """Column of the reference summary."""
    eval_fraction: float = 0.1
    """Share of ``path`` held out for evaluation when there is no ``eval_path``."""
    n_train: int = 4000
    """Synthetic corpus: training notes."""
    n_eval: int = 200
    """Synthetic corpus: held-out notes."""
    seed: int = 0
    """Seed of the synthetic corpus, the split and the tokenizer."""
    vocab_size: int = 16000
    """SentencePiece vocabulary (a ceiling: a small corpus gets what it supports). The original: 16k."""
    max_src_len: int = 768
    """Source tokens kept (longer notes are truncated and counted). The original: 128 x 6 = 768."""
    max_tgt_len: int = 192
    """Summary tokens kept. The original: 192."""
    eval_examples: int = 50
    """Held-out notes summarised by beam search at each evaluation (ROUGE subset). The original: 50."""
    data_dir: str = "raysys_data/pointer_generator"
    """Where prepared data is written (a folder per distinct setting, reused)."""
    prepared_dir: Optional[str] = None
    """Set by raysys: the tokenized data folder this run uses."""
    digest: Optional[str] = None
    """Set by raysys: what your corpus files hold (sha256 of their bytes), so a resume on other data is refused
    wherever the files lie; None for the synthetic corpus (its settings say what it is)."""

    def validate(self) -> None:
        at_least(self, "data.", 1, "n_train", "n_eval", "eval_examples")
        at_least(self, "data.", 8, "max_src_len", "max_tgt_len")
        require(self.vocab_size >= 300, f"data.vocab_size must be >= 300, got {self.vocab_size}")
        require(0 < self.eval_fraction < 1, f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        require(self.source_column != self.target_column, "data.source_column and data.target_column must differ")


_SAID: set[str] = set()  # prepared folders whose truncation this process has reported

LOCAL_KEYS = ("data.path", "data.eval_path", "data.data_dir", "data.prepared_dir", "data.eval_examples",
              "model.beam", "model.min_len", "model.max_len", "model.length_penalty", "model.block_trigrams")
"""Where the data is on this machine, how much of it is evaluated and how its summaries are decoded: left out
of the checkpoint's identity (its ``digest`` says what the files hold; the weights are the same whatever the
beam), so a run resumes from another folder or machine, or evaluates with another beam."""


def digest_of_files(cfg: PointerGeneratorConfig) -> dict:
    """``data.digest`` before ``prepare``: a resume whose files now hold other text is refused at once, not after
    the tokenizer was trained on them."""
    from raysys.workloads.pointer_generator import data

    return {"data.digest": data.files_digest(cfg.data.path, cfg.data.eval_path)} if cfg.data.path else {}


@dataclass
class ModelConfig:
    path: Literal["naive", "optimized"] = "optimized"
    """naive: the original's per-example encoder, full distribution every decoder step, per-example
    beam search. optimized: the same function, batched (see model.py)."""
    emb_dim: int = 128
    """Token embedding width. The original: 128."""
    hidden: int = 256
    """LSTM hidden size (the encoder's is per direction). The original: 256."""
    layers: int = 2
    """LSTM layers of the encoder and of the decoder. The original: 2."""
    dropout: float = 0.3
    """Dropout of embeddings, between LSTM layers and before the output layer. The original: 0.3."""
    attention: Literal["additive", "dot"] = "additive"
    """additive: Bahdanau (the original). dot: scaled dot-product, context through
    F.scaled_dot_product_attention (flash attention on a GPU) -- the seed's proposal."""
    copy: bool = True
    """The copy mechanism. False forces p_gen = 1: a plain attentional seq2seq (the ablation)."""
    beam: int = 4
    """Beam width of evaluation decoding. The original: 4."""
    min_len: int = 20
    """Fewest summary tokens before EOS may end a hypothesis."""
    max_len: int = 192
    """Most summary tokens decoded."""
    length_penalty: float = 1.0
    """Finished hypotheses are ranked by log-probability / length ** length_penalty."""
    block_trigrams: bool = True
    """Forbid a token that would repeat a trigram of the hypothesis."""

    def validate(self) -> None:
        at_least(self, "model.", 1, "emb_dim", "hidden", "layers", "beam", "max_len")
        at_least(self, "model.", 0, "min_len")
        require(0 <= self.dropout < 1, f"model.dropout must be in [0, 1), got {self.dropout}")
        require(self.min_len < self.max_len, f"model.min_len ({self.min_len}) must be < model.max_len ({self.max_len})")


@dataclass
class PointerGeneratorConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=10, batch_size=16, log_every_steps=10))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        name="adam", lr=3e-4, weight_decay=1e-4, clip_grad_norm=1.0, schedule="linear", warmup_steps=1000))
    loader: LoaderConfig = field(default_factory=lambda: LoaderConfig(bucket_batches=16))
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def validate(self) -> None:
        # each step keeps beam x min(2 x beam, vocabulary) candidates per note: a beam past the vocabulary finds
        # nothing more, and a huge one is killed for memory at the first evaluation, after the run exists
        require(self.model.beam <= self.data.vocab_size, f"model.beam ({self.model.beam}) must be <= "
                f"data.vocab_size ({self.data.vocab_size}): a wider beam finds no other summary")


# ---- presets ----------------------------------------------------------------------------------------

def original() -> PointerGeneratorConfig:
    """The seed's configuration: batch 1 x accumulation 16, the naive path, no bucketing."""
    cfg = PointerGeneratorConfig()
    cfg.model.path = "naive"
    cfg.train.batch_size, cfg.train.grad_accum = 1, 16
    cfg.loader.bucket_batches = 0
    return cfg


def default() -> PointerGeneratorConfig:
    """The same model and loss on the optimized path: batches of 16, bucketed by length."""
    return PointerGeneratorConfig()


def small() -> PointerGeneratorConfig:
    """A model and corpus sized for a CPU: minutes per epoch, not hours (the learning preset's base)."""
    cfg = default()
    cfg.data.vocab_size, cfg.data.max_src_len, cfg.data.max_tgt_len = 2000, 512, 128
    cfg.data.data_dir = "raysys_data/pointer_generator_small"
    cfg.model.emb_dim, cfg.model.hidden, cfg.model.layers, cfg.model.dropout = 64, 128, 1, 0.1
    cfg.model.max_len = 128
    cfg.optim.lr, cfg.optim.warmup_steps = 2e-3, 50
    return cfg


def learn() -> PointerGeneratorConfig:
    """The documented quality run (docs/benchmarks.md): the small model, 400 optimizer steps of 16
    notes, evaluated once at the end (ROUGE on 50 held-out notes against the lead-3 baseline)."""
    cfg = small()
    cfg.data.n_train = 2000
    cfg.train.epochs, cfg.train.max_steps, cfg.train.eval_every_epochs = 4, 400, 4
    return cfg


def quick() -> PointerGeneratorConfig:
    """Seconds: a few hundred synthetic notes, a tiny model, 1 epoch (smoke tests, demos)."""
    cfg = small()
    cfg.data.n_train, cfg.data.n_eval, cfg.data.eval_examples, cfg.data.vocab_size = 300, 40, 8, 600
    cfg.data.data_dir = "raysys_data/pointer_generator_quick"
    cfg.model.emb_dim, cfg.model.hidden = 32, 64
    cfg.model.min_len, cfg.model.max_len = 5, 48
    cfg.train.epochs, cfg.train.log_every_steps = 1, 2
    cfg.optim.warmup_steps = 4  # its ~19 steps reach the full learning rate (small's 50 would never end)
    return cfg


PRESETS = {"default": default, "original": original, "small": small, "learn": learn, "quick": quick}


# ---- the task ---------------------------------------------------------------------------------------

def _sentences(text: str) -> str:
    """One sentence per line (ROUGE-Lsum's convention)."""
    return "\n".join(s for s in re.split(r"(?<=[.;:])\s+|\n", text) if s.strip())


def copies(summary: str, entity: str) -> bool:
    """Whether ``summary`` holds ``entity`` as whole words: "10 mg" is not copied inside "110 mg"."""
    return re.search(rf"(?<!\w){re.escape(entity)}(?!\w)", summary) is not None


class SummarizationTask:
    quality_metric = "rouge2"
    token_name = "target tokens"

    def __init__(self):
        self._cfg = None
        self._scorer = None
        self._lead: Optional[dict] = None

    def param_groups(self, model, cfg):
        """Every parameter in one group, p_gen's layer too where ``model.copy=false`` freezes it (DDP then waits
        for no gradient of it): the optimizer's layout is the same for both, so checkpoints of either load."""
        return model.parameters()

    def prepare(self, cfg: PointerGeneratorConfig) -> PointerGeneratorConfig:
        from raysys.workloads.pointer_generator import data

        out = data.prepare(cfg)
        meta = json.loads((out / "meta.json").read_text())
        cfg.data.prepared_dir = str(out.resolve())
        cfg.data.digest = meta["settings"]["files"]  # the files' bytes, which also name the prepared folder
        if str(out.resolve()) in _SAID:  # prepare runs again in the loop: its notes are said once
            return cfg
        _SAID.add(str(out.resolve()))
        train = meta["splits"]["train"]
        if train.get("one_word_summaries", 0) * 2 > train["rows"]:
            print(f"[pointer_generator] note: {train['one_word_summaries']} of {train['rows']} training summaries are "
                  "one word: ROUGE-2, this workload's quality (eval/quality), has no word pairs to score there and "
                  "stays near 0 however right they are; judge such data by eval/rouge1 (a sweep: objectives.quality: "
                  "eval/rouge1)")
        for name, split in meta["splits"].items():
            if split["truncated_src"] or split["truncated_tgt"]:
                print(f"[pointer_generator] {name}: {split['truncated_src']} of {split['rows']} notes truncated to "
                      f"{cfg.data.max_src_len} tokens, {split['truncated_tgt']} summaries to {cfg.data.max_tgt_len}")
        return cfg

    def _dir(self, cfg) -> Path:
        if not cfg.data.prepared_dir:
            self.prepare(cfg)
        return Path(cfg.data.prepared_dir)

    def datasets(self, cfg: PointerGeneratorConfig):
        from raysys.workloads.pointer_generator.data import TokenizedSplit

        self._cfg = cfg
        d = self._dir(cfg)
        return TokenizedSplit(d / "train.parquet"), TokenizedSplit(d / "eval.parquet", cfg.data.eval_examples, with_text=True)

    def collate(self, items: list) -> dict:
        B = len(items)
        S, T = max(len(it["src"]) for it in items), max(len(it["tgt"]) for it in items)
        src, tgt = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
        for i, it in enumerate(items):
            src[i, : len(it["src"])] = torch.from_numpy(it["src"].astype("int64"))
            tgt[i, : len(it["tgt"])] = torch.from_numpy(it["tgt"].astype("int64"))
        out = {"src": src, "src_len": torch.tensor([len(it["src"]) for it in items]), "tgt": tgt,
               "n_tokens": sum(len(it["tgt"]) for it in items)}  # counted here, on the host: no device sync
        for k in ("summary", "entities", "note"):
            if k in items[0]:
                out[k] = [it[k] for it in items]
        return out

    def build_model(self, cfg: PointerGeneratorConfig) -> torch.nn.Module:
        from raysys.workloads.pointer_generator.model import PointerGenerator

        vocab = json.loads((self._dir(cfg) / "meta.json").read_text())["vocab_size"]
        m = cfg.model
        return PointerGenerator(vocab, m.emb_dim, m.hidden, m.layers, m.dropout, m.attention, m.copy, m.path)

    def loss(self, model, batch):
        total, _ = model(batch["src"], batch["src_len"], batch["tgt"])
        return total / max(1, batch["n_tokens"]), {"samples": len(batch["src"]), "tokens": batch["n_tokens"]}

    def summarize(self, model, batch) -> list[str]:
        from raysys.workloads.pointer_generator import beam as bs
        from raysys.workloads.pointer_generator.data import decode, tokenizer

        m = self._cfg.model
        search = bs.per_example if m.path == "naive" else bs.beam_search
        ids = search(model, batch["src"], batch["src_len"], beam=m.beam, min_len=m.min_len, max_len=m.max_len,
                     length_penalty=m.length_penalty, block_trigrams=m.block_trigrams)
        sp = tokenizer(str(Path(self._cfg.data.prepared_dir) / "spm.model"))
        return [decode(sp, x) for x in ids]

    def _rouge(self, preds: list[str], refs: list[str]) -> dict[str, float]:
        if self._scorer is None:
            from rouge_score import rouge_scorer

            self._scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], tokenizer=RougeTokenizer())
        sums = {"rouge1": 0.0, "rouge2": 0.0, "rougeLsum": 0.0}
        for p, r in zip(preds, refs):
            for k, v in self._scorer.score(_sentences(r), _sentences(p)).items():
                sums[k] += v.fmeasure
        return {k: v / max(1, len(preds)) for k, v in sums.items()}

    def evaluate(self, model, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        preds, refs, notes, copied, total = [], [], [], 0, 0
        for b in batches:
            out = self.summarize(model, b)
            preds += out
            refs += b["summary"]
            notes += b["note"]
            for text, ents in zip(out, b["entities"]):
                copied += sum(copies(text, e) for e in ents)
                total += len(ents)
        metrics = self._rouge(preds, refs)
        if total:  # references with no entity to copy (a user's text without numbers): no figure, not a 0
            metrics["entity_copy"] = copied / total
        metrics["rouge_mean"] = (metrics["rouge1"] + metrics["rouge2"] + metrics["rougeLsum"]) / 3
        if self._lead is None:  # the lead-3 baseline: the note's first three sentences, scored once
            lead = ["\n".join(_sentences(n).splitlines()[:3]) for n in notes]
            self._lead = {f"lead3_{k}": v for k, v in self._rouge(lead, refs).items()}
        metrics.update(self._lead)
        return metrics


def _bench(quick: bool = False, overrides: Optional[dict] = None) -> dict:
    from raysys.workloads.pointer_generator.bench import run_bench

    return run_bench(quick=quick, overrides=overrides)


def _dataset(cfg: PointerGeneratorConfig) -> dict:
    """The prepared (tokenized) corpus; its meta.json says where it came from and how many rows."""
    d = cfg.data
    meta = json.loads((Path(d.prepared_dir) / "meta.json").read_text()) if d.prepared_dir else {}
    name = Path(d.path).stem if d.path else "synthetic_clinical_notes"
    profile = {f"{k}_rows": v["rows"] for k, v in meta.get("splits", {}).items()} | {"vocab_size": meta.get("vocab_size")}
    return {"name": name, "source": d.prepared_dir or str(d.path), "profile": profile}


WORKLOAD = Workload(
    name="pointer_generator",
    description="Pointer-generator summarizer of clinical notes: copy attention, batched beam search, ROUGE",
    config_cls=PointerGeneratorConfig,
    presets=PRESETS,
    bench=_bench,
    task=SummarizationTask(),
    throughput_metric="perf/tokens_per_s",
    path_key="model.path",
    dataset=_dataset,
    # a checkpoint's token rows mean its data's tokenizer: a resume on other data (another corpus, seed,
    # vocabulary or truncation) is refused; where the files lie and how many notes are evaluated are not the data
    extra={"identity_sections": ("model", "data"), "local_keys": LOCAL_KEYS, "digest_before_prepare": digest_of_files},
)
