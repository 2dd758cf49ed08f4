"""The pointer-generator summarizer: one function on both paths, identical batched beam search,
bucketed batches, user data checked before anything exists, and a run on a user's JSONL."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raysys.config import apply_overrides
from raysys.train.data import ShardSampler
from raysys.workloads.pointer_generator.beam import beam_search, per_example
from raysys.workloads.pointer_generator.corpus import generate
from raysys.workloads.pointer_generator.model import EOS
from raysys.workloads.pointer_generator.workload import SummarizationTask, copies, quick


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    task = SummarizationTask()
    cfg = apply_overrides(quick(), {"data.data_dir": str(tmp_path_factory.mktemp("pg") / "data")})
    cfg = task.prepare(cfg)
    train, evals = task.datasets(cfg)
    return task, cfg, train, evals


def test_the_corpus_is_deterministic_and_summaries_copy_its_entities():
    a, b = list(generate(20, 7)), list(generate(20, 7))
    assert a == b and a != list(generate(20, 8))
    for ex in a:
        assert ex["entities"] and all(copies(ex["note"], e) and copies(ex["summary"], e) for e in ex["entities"])


def test_rouge_scores_every_script_and_english_as_rouge_score_does():
    """Audit BF F7: rouge_score's tokenizer keeps a-z and 0-9 only, so a Greek, Cyrillic or Chinese corpus
    scored ROUGE 0 whatever the model wrote. Its words are now those of any script (a CJK character each),
    and English text gets rouge_score's own tokens, stems included."""
    import random
    import string

    from rouge_score import rouge_scorer, tokenizers

    from raysys.workloads.pointer_generator.workload import RougeTokenizer

    ours, theirs = RougeTokenizer(), tokenizers.DefaultTokenizer(use_stemmer=True)
    rnd = random.Random(0)
    texts = [t for ex in generate(50, 2) for t in (ex["note"], ex["summary"])]
    texts += ["".join(rnd.choice(string.printable) for _ in range(rnd.randint(0, 60))) for _ in range(500)]
    assert all(ours.tokenize(t) == theirs.tokenize(t) for t in texts)
    assert ours.tokenize("Η Αθήνα έχει 25 βαθμούς") == ["η", "αθήνα", "έχει", "25", "βαθμούς"]
    assert ours.tokenize("東京は晴れ") == ["東", "京", "は", "晴", "れ"]
    assert ours.tokenize("서울의 날씨는 맑음") == ["서울의", "날씨는", "맑음"]  # Korean spaces its words
    assert ours.tokenize("हिंदी भाषा") == ["हिंदी", "भाषा"]  # vowel signs (combining marks) stay in their words
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2"], tokenizer=ours)
    for same in ("Η θερμοκρασία στην Αθήνα", "Погода в Москве хорошая", "東京の天気は晴れです"):
        assert scorer.score(same, same)["rouge2"].fmeasure == 1.0, same
    assert 0 < scorer.score("Погода в Москве хорошая", "Погода в Риме плохая")["rouge1"].fmeasure < 1


def test_an_entity_counts_as_copied_only_as_whole_words():
    assert copies("start 10 mg daily", "10 mg") and copies("dose: 10 mg.", "10 mg") and copies("10", "10")
    assert not copies("start 110 mg daily", "10 mg") and not copies("100 units", "10")
    assert copies("seen 2024-03-05 (admit)", "2024-03-05") and not copies("x2024-03-05", "2024-03-05")
    assert copies("on metoprolol-XL", "metoprolol-XL") and not copies("on metoprololXL", "metoprolol")


@pytest.mark.parametrize("attention, copy, layers", [("additive", True, 2), ("dot", True, 2), ("additive", False, 1)])
def test_both_paths_compute_the_same_loss(prepared, attention, copy, layers):
    task, cfg, train, _ = prepared
    cfg = apply_overrides(cfg, {"model.attention": attention, "model.copy": copy, "model.layers": layers})
    torch.manual_seed(0)
    model = task.build_model(cfg).eval()
    batch = task.collate([train[i] for i in range(6)])  # different lengths, padded
    assert len(set(batch["src_len"].tolist())) > 1
    losses = {}
    for path in ("naive", "optimized"):
        model.path = path
        total, n = model(batch["src"], batch["src_len"], batch["tgt"])
        losses[path] = float(total / n)
    assert abs(losses["naive"] - losses["optimized"]) <= 1e-4, losses
    # and the gradients agree: the optimized path is the same function, not an approximation
    grads = {}
    for path in ("naive", "optimized"):
        model.zero_grad()
        model.path = path
        total, n = model(batch["src"], batch["src_len"], batch["tgt"])
        (total / n).backward()
        grads[path] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert torch.allclose(grads["naive"], grads["optimized"], atol=1e-5, rtol=1e-3)


def test_bf16_autocast_runs_on_a_cpu_and_both_paths_agree(prepared):
    """oneDNN's LSTM rejects bf16 on CPUs without bf16 units; the model falls back to ATen's kernel."""
    task, cfg, train, _ = prepared
    torch.manual_seed(0)
    model = task.build_model(apply_overrides(cfg, {"model.layers": 2})).eval()
    batch = task.collate([train[i] for i in range(4)])
    losses, grads = {}, {}
    for path in ("naive", "optimized"):
        model.path = path
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, n = model(batch["src"], batch["src_len"], batch["tgt"])
        (total / n).backward()  # the optimized backward mixes bf16 step outputs with fp32 encodings
        losses[path] = float(total / n)
        grads[path] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert abs(losses["naive"] - losses["optimized"]) <= 1e-3, losses
    assert torch.isfinite(grads["optimized"]).all()
    cos = F.cosine_similarity(grads["naive"], grads["optimized"], dim=0)
    assert cos > 0.99, float(cos)  # bf16 rounds differently along the two paths: the same direction


@pytest.mark.parametrize("eos_bias", [0.0, 2.0])
def test_batched_beam_search_gives_the_per_example_summaries(prepared, eos_bias):
    """eos_bias 2 makes the untrained model end its summaries at different steps, so examples leave the
    batched search one by one (and its source positions shrink) while the others go on."""
    task, cfg, _, evals = prepared
    torch.manual_seed(1)
    model = task.build_model(cfg).eval()
    with torch.no_grad():
        model.out.bias[EOS] += eos_bias
    batch = task.collate([evals[i] for i in range(6)])
    kw = dict(beam=4, min_len=3, max_len=30)
    # the same scores both ways: the original's tanh, and the exp form the batched search uses by default
    one = per_example(model, batch["src"], batch["src_len"], **kw)
    assert one == beam_search(model, batch["src"], batch["src_len"], exp_scores=False, **kw)
    one = per_example(model, batch["src"], batch["src_len"], exp_scores=True, **kw)
    many = beam_search(model, batch["src"], batch["src_len"], **kw)
    assert one == many and all(3 <= len(x) <= 30 for x in many)
    if eos_bias:
        assert len({len(x) for x in many}) > 2, [len(x) for x in many]
    for seq in many:  # trigram blocking: no trigram twice
        grams = [tuple(seq[i:i + 3]) for i in range(len(seq) - 2)]
        assert len(grams) == len(set(grams))


@pytest.mark.parametrize("attention,exp_scores", [("additive", True), ("additive", False), ("dot", False)])
def test_an_example_scores_the_same_alone_or_in_a_batch(prepared, attention, exp_scores):
    """Bit for bit, not just the same argmax: every probability row the batched search scores for an
    example equals the one its per-example search scores, at every step while all examples are live,
    for sources of different lengths (so each is padded differently in the batch). Before source
    blocks (model.chunked_context) and p_gen's sigmoid in float64, most examples differed in the last
    bit and a near-tie could flip a summary."""
    task, cfg, notes, _ = prepared
    torch.manual_seed(2)
    # the small preset's widths: with these the one-bmm context differed alone and batched
    model = task.build_model(apply_overrides(cfg, {"model.attention": attention, "model.hidden": 128,
                                                  "model.emb_dim": 64})).eval()
    batch = task.collate([notes[i] for i in range(40)])
    assert len(set(batch["src_len"].tolist())) > 20
    rows, original = [], model.final_probs
    model.final_probs = lambda *a, **k: rows.append(original(*a, **k).clone()) or rows[-1]
    steps = 6  # < min_len below: no example leaves the batch, so row block i is example i
    kw = dict(beam=4, min_len=steps + 1, max_len=steps, exp_scores=exp_scores)
    beam_search(model, batch["src"], batch["src_len"], **kw)
    batched = rows[:]
    for i in range(40):
        rows.clear()
        n = int(batch["src_len"][i])
        beam_search(model, batch["src"][i:i + 1, :n], batch["src_len"][i:i + 1], **kw)
        for t in range(steps):
            assert torch.equal(rows[t], batched[t][4 * i:4 * i + 4]), (i, t)


def test_bucketing_groups_similar_lengths_and_is_a_pure_function_of_the_epoch():
    lengths = np.random.default_rng(0).integers(10, 500, size=200)
    s = ShardSampler(200, seed=3, lengths=lengths, bucket=64)
    s.set_epoch(2)
    order = list(s)
    assert sorted(order) == list(range(200))
    s.set_epoch(2, start=37)
    assert list(s) == order[37:]  # resuming mid-epoch sees exactly the rest
    plain = ShardSampler(200, seed=3)
    plain.set_epoch(2)
    spread = lambda o: np.mean([np.ptp(lengths[o[i:i + 16]]) for i in range(0, 192, 16)])  # noqa: E731
    assert spread(order) < spread(list(plain)) / 2


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "raysys", "train", "pointer_generator", "--workers", "0", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("case, needle", [
    ("missing_column", "missing column(s) summary"),
    ("corrupt", "not readable as parquet"),
    ("empty_text", "is empty"),
    ("folder", "a folder, not a table file"),
    ("all_held_out", "2 rows leave none to train on once data.eval_fraction=0.9 holds out 2 for evaluation"),
    # more characters than pieces (a CJK corpus): its data folder was left, and the advice was SentencePiece's flag
    ("too_many_characters", "could not train a 300-piece tokenizer"),
])
def test_bad_user_data_is_one_line_and_creates_nothing(tmp_path, case, needle):
    rows = [{"note": ex["note"], "summary": ex["summary"]} for ex in generate(6, 0)]
    if case == "missing_column":
        _write_jsonl(tmp_path / "d.jsonl", [{"note": r["note"], "abstract": r["summary"]} for r in rows])
        path = "d.jsonl"
    elif case == "corrupt":
        (tmp_path / "d.parquet").write_bytes(b"PAR1 this is not parquet")
        path = "d.parquet"
    elif case == "folder":
        (tmp_path / "corpus").mkdir()
        path = "corpus"
    elif case == "too_many_characters":
        _write_jsonl(tmp_path / "d.jsonl", [{"note": "".join(chr(0x4E00 + (7 * i + j) % 600) for j in range(40)),
                                             "summary": chr(0x4E00 + i)} for i in range(30)])
        path = "d.jsonl --set data.vocab_size=300"
    elif case == "all_held_out":
        _write_jsonl(tmp_path / "d.jsonl", rows[:2])
        path = "d.jsonl --set data.eval_fraction=0.9"
    else:
        rows[3]["summary"] = "   "
        _write_jsonl(tmp_path / "d.jsonl", rows)
        path = "d.jsonl"
    proc = _cli(tmp_path, "--preset", "quick", *f"--set data.path={path}".split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("raysys:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "character_coverage" not in lines[0]  # a SentencePiece flag raysys has no knob for
    assert not (tmp_path / "raysys_runs").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "raysys_data").exists()


@pytest.mark.parametrize("name", ["d.jsonl", "d.csv", "d.json"])
def test_text_that_is_not_utf8_names_its_file_and_row(tmp_path, name):
    """Audit N: a JSONL file's stray latin-1 byte was a bare "'utf-8' codec can't decode" line naming no
    file; a CSV's blamed its valid first row for being "bytes, not text". Audit AQ: one JSON array's was
    replaced by U+FFFD unsaid, and trained on."""
    from raysys.workloads.pointer_generator.data import read_texts

    rows = [{"note": f"note {i}, caf\u00e9 au lait", "summary": f"summary {i}"} for i in range(5)]
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n")
    else:
        path.write_text("note,summary\n" + "".join(f'"{r["note"]}",{r["summary"]}\n' for r in rows))
    assert read_texts(str(path), "note", "summary") == rows  # UTF-8, accents included
    path.write_bytes(path.read_bytes().replace(b"note 3, caf\xc3\xa9", b"note 3, caf\xe9"))  # latin-1's e-acute
    said = (r"line 5 is not UTF-8 text \(byte 0xe9 at offset \d+\)" if name.endswith(".json")
            else r"row 4: column note is not UTF-8 text \(byte 0xe9 at position 11\)")
    with pytest.raises(ValueError, match=rf"{name}: {said}"):
        read_texts(str(path), "note", "summary")


def test_a_jsonl_line_pyarrow_cannot_read_is_named_as_an_editor_counts():
    """pyarrow counts rows from 0: the 3rd line was "row 2" next to raysys's own messages' 1-based rows."""
    import tempfile

    from raysys.tables import read_table

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "d.jsonl"
        path.write_text('{"note": "a", "summary": "b"}\n{"note": "c", "summary": "d"}\n{not json\n')
        with pytest.raises(ValueError, match=r"not readable as JSONL \(ArrowInvalid: .* in row 3\)"):
            read_table(path)


def test_a_corpus_reads_the_same_from_every_table_format(tmp_path):
    """parquet, JSON lines, one JSON array, CSV and TSV of the same notes give the same rows, texts with
    commas, quotes, tabs and line breaks included, and summaries of digits alone; an unknown suffix's error
    lists the known ones."""
    import pandas as pd

    from raysys.workloads.pointer_generator.data import read_texts

    rows = [{"note": ex["note"], "summary": ex["summary"]} for ex in generate(8, 1)]
    rows[0]["note"] = 'BP 120/80, "stable";\tseen twice\nthen discharged'
    for r in rows:  # summaries that are numbers: text all the same (a CSV has no types to say so)
        r["summary"] = str(len(r["note"]))
    df = pd.DataFrame(rows)
    df.to_parquet(tmp_path / "c.parquet")
    df.to_json(tmp_path / "c.jsonl", orient="records", lines=True)
    df.to_json(tmp_path / "c.json", orient="records")
    df.to_csv(tmp_path / "c.csv", index=False)
    df.to_csv(tmp_path / "c.tsv", sep="\t", index=False)
    for name in ("c.parquet", "c.jsonl", "c.json", "c.csv", "c.tsv"):
        assert read_texts(str(tmp_path / name), "note", "summary") == rows, name
    (tmp_path / "c.xlsx").write_bytes(b"not a table")
    with pytest.raises(ValueError, match="not readable as parquet .*known suffixes: .csv, .json, .jsonl"):
        read_texts(str(tmp_path / "c.xlsx"), "note", "summary")


def test_a_users_jsonl_trains_evaluates_and_reports_truncation(tmp_path):
    """Relative paths, as the README writes them, read the same files in a Ray Train worker (which Ray
    starts in a folder of its own) as in the driver."""
    rows = [{"text": ex["note"], "abstract": ex["summary"]} for ex in generate(120, 5)]
    _write_jsonl(tmp_path / "notes.jsonl", rows)
    proc = _cli(tmp_path, "--preset", "quick", "--name", "mine", "--set", "data.path=notes.jsonl",
                "--set", "data.source_column=text", "--set", "data.target_column=abstract",
                "--set", "data.max_src_len=256", "--set", "data.eval_examples=4", "--set", "train.max_steps=3",
                "--set", "model.max_len=24", "--workers", "1")
    assert proc.returncode == 0
    assert "notes truncated to 256 tokens" in proc.stdout
    final = json.loads((tmp_path / "raysys_runs" / "mine" / "final_metrics.json").read_text())
    for k in ("eval/rouge2", "eval/rouge1", "eval/rougeLsum", "eval/entity_copy", "eval/lead3_rouge2", "eval/quality"):
        assert k in final and 0.0 <= final[k] <= 1.0, k
    assert final["eval/lead3_rouge2"] > 0.01  # the baseline is computed from real texts
    assert len(list((tmp_path / "raysys_data").glob("*/*/meta.json"))) == 1  # prepared once, here


def test_an_evaluation_file_written_again_is_prepared_again(tmp_path):
    from raysys.workloads.pointer_generator import data

    rows = [{"note": ex["note"], "summary": ex["summary"]} for ex in generate(40, 3)]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    _write_jsonl(tmp_path / "eval.jsonl", rows[:6])
    cfg = apply_overrides(quick(), {"data.data_dir": str(tmp_path / "d"), "data.path": str(tmp_path / "train.jsonl"),
                                    "data.eval_path": str(tmp_path / "eval.jsonl")})
    first = data.prepare(cfg)
    _write_jsonl(tmp_path / "eval.jsonl", rows[-30:])  # another evaluation set, same file name
    second = data.prepare(cfg)
    assert first != second
    rows_of = lambda out: json.loads((out / "meta.json").read_text())["splits"]["eval"]["rows"]
    assert (rows_of(first), rows_of(second)) == (6, 30)
    # audit BF F6: other text of the same size, written with the same time (cp -p, rsync -t, tar -x), is
    # other data too; the same bytes in another folder are the same data
    import os
    import shutil

    text = (tmp_path / "train.jsonl").read_text()
    swapped = text.replace("a", "\u0062").replace("b", "a").replace("\u0062", "b")  # same length, other words
    assert swapped != text and len(swapped.encode()) == len(text.encode())
    st = os.stat(tmp_path / "train.jsonl")
    (tmp_path / "train.jsonl").write_text(swapped)
    os.utime(tmp_path / "train.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns))
    third = data.prepare(cfg)
    assert third not in (first, second)
    (tmp_path / "copy").mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        shutil.copy(tmp_path / name, tmp_path / "copy" / name)
    elsewhere = apply_overrides(cfg, {"data.path": str(tmp_path / "copy" / "train.jsonl"),
                                      "data.eval_path": str(tmp_path / "copy" / "eval.jsonl")})
    assert data.prepare(elsewhere) == third


def test_one_word_summaries_are_said_and_a_corpus_too_small_for_the_bench_is_one_line(tmp_path, monkeypatch, capsys):
    """Audit BF: one-word summaries leave ROUGE-2, the quality, with no word pair to score (said when the data
    is prepared), and give no entity_copy figure when nothing is there to copy; the bench's timed steps take
    48 notes, which a small corpus lacks (it was an IndexError)."""
    from raysys.config import ConfigError
    from raysys.workloads.pointer_generator.bench import run_bench
    from raysys.workloads.pointer_generator.workload import SummarizationTask

    words = ["alpha", "delta", "theta", "omega", "sigma", "kappa"]
    rows = [{"note": f"Item {i}. The key word is {words[i % 6]}. Nothing else matters here.",
             "summary": words[i % 6]} for i in range(40)]
    _write_jsonl(tmp_path / "one.jsonl", rows)
    monkeypatch.chdir(tmp_path)
    cfg = SummarizationTask().prepare(apply_overrides(quick(), {"data.path": "one.jsonl", "data.vocab_size": 400}))
    out = capsys.readouterr().out
    assert "of 36 training summaries are one word: ROUGE-2, this workload's quality (eval/quality), has no word" in out
    task = SummarizationTask()
    task._cfg, task._scorer, task._lead = cfg, None, None
    task.summarize = lambda model, b: b["summary"]  # perfect summaries
    batch = {"summary": ["alpha", "delta"], "note": ["a", "b"], "entities": [[], []]}
    metrics = task.evaluate(None, [batch])
    assert metrics["rouge1"] == 1.0 and "entity_copy" not in metrics
    with pytest.raises(ConfigError, match=r"^data.path: 36 training notes; the bench needs at least 48 "):
        run_bench(quick=True, overrides={"data.path": "one.jsonl", "data.vocab_size": 400})


@pytest.mark.slow  # ~1.5 min: two Ray Train workers
def test_two_ray_train_workers_train_with_ddp(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "raysys", "train", "pointer_generator", "--preset", "quick",
                           "--workers", "2", "--name", "ddp", "--set", "data.max_src_len=256", "--set",
                           "data.max_tgt_len=64", "--set", "train.max_steps=4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    final = json.loads((tmp_path / "raysys_runs" / "ddp" / "final_metrics.json").read_text())
    assert final["world_size"] == 2 and final["step"] == 4 and "eval/rouge2" in final


def test_additive_scores_without_tanh_are_the_tanh_scores_and_gradients(prepared):
    """The additive scores through e^{2k} e^{2q} (``AdditiveScores``: the optimized training step and the
    batched search) equal v^T tanh(k + q), with the same gradients, also far out in tanh's tails; beyond
    the formula's float range (|x| > 40) ``exp_keys`` declines and the tanh is computed instead."""
    task, cfg, _, _ = prepared
    torch.manual_seed(0)
    model = task.build_model(cfg).eval()
    B, K, S, H = 3, 4, 11, cfg.model.hidden
    enc = torch.randn(B, S, 2 * H)
    mask = torch.arange(S)[None] < torch.tensor([11, 7, 1])[:, None]
    for scale in (1.0, 8.0, 60.0):
        keys = scale * torch.randn(B, S, H)
        for group in (K, 1):  # beams sharing an encoding, and one state per example (training)
            s = torch.tanh(3 * torch.randn(B * group, H))  # decoder states: LSTM outputs, in (-1, 1)
            ekeys = model.exp_keys(keys)
            assert (ekeys is None) == (scale > 40 / 4), scale  # randn * 60 exceeds 40 somewhere
            outs = []
            for ek in (None, ekeys):
                k, st = keys.clone().requires_grad_(), s.clone().requires_grad_()
                model.zero_grad()
                ctx, attn = model.attend(st, enc, k, mask, group=group, ekeys=ek)
                (ctx.sin().sum() + attn.square().sum()).backward()
                outs.append([ctx, attn, k.grad, st.grad, model.v.weight.grad.clone(), model.W_s.weight.grad.clone()])
            for w, g in zip(*outs):
                assert torch.allclose(w, g, atol=1e-5, rtol=1e-4), (scale, group, float((w - g).abs().max()))
    # far beyond the range of W_s: queries could overflow e^{2q}, so the tanh again
    with torch.no_grad():
        model.W_s.weight.mul_(100)
    assert model.exp_keys(torch.randn(B, S, H)) is None


@pytest.mark.slow  # ~30 s; test_train_deep_gpcm.py checks the same rule by default
def test_a_resume_on_other_data_is_refused_but_not_from_a_copy_elsewhere(tmp_path):
    """The checkpoint's token rows mean its corpus's tokenizer: a resume on another corpus (a file's bytes
    or the synthetic corpus's seed) is refused in one line; the same corpus copied to another folder, and
    another number of evaluated notes, resume, as does one with other decoding knobs (audit AQ F5: the whole
    model section was the identity, and a resume that evaluates with another beam was refused)."""
    import shutil

    rows = [{"note": ex["note"], "summary": ex["summary"]} for ex in generate(60, 2)]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        _write_jsonl(tmp_path / d / "notes.jsonl", rows)
    common = ["--preset", "quick", "--name", "r", "--storage-path", str(tmp_path / "runs"), "--tracking-uri",
              f"sqlite:///{tmp_path / 'mlflow.db'}", "--set", "data.path=notes.jsonl", "--set", "data.eval_examples=2"]
    assert _cli(tmp_path / "a", *common, "--set", "train.max_steps=2").returncode == 0
    assert _cli(tmp_path / "b", *common, "--resume", "--set", "train.max_steps=3", "--set",
                "data.eval_examples=3", "--set", "model.beam=2", "--set", "model.length_penalty=0.5").returncode == 0
    _write_jsonl(tmp_path / "b" / "notes.jsonl", rows[::-1])  # other bytes under the same name
    prepared = sorted(p.parent.name for p in (tmp_path / "b").rglob("meta.json"))
    proc = _cli(tmp_path / "b", *common, "--resume", "--set", "train.max_steps=4")
    assert proc.returncode == 2 and "different config: data.digest" in proc.stderr
    # refused before prepare: no tokenizer was trained on the other text (it was, then the resume was refused)
    assert sorted(p.parent.name for p in (tmp_path / "b").rglob("meta.json")) == prepared
    proc = _cli(tmp_path / "a", *common, "--resume", "--set", "train.max_steps=4", "--set", "data.seed=1")
    assert proc.returncode == 2 and "data.seed" in proc.stderr
    shutil.rmtree(tmp_path / "b")


def test_a_users_duplicate_notes_stay_on_one_side_of_the_split(tmp_path):
    """A corpus with repeated notes: every copy is held out or trained on together (a held-out copy of a
    training note inflated ROUGE); a corpus without repeats splits as the plain permutation of its rows."""
    import csv

    from raysys.workloads.pointer_generator.data import _splits

    def write(name, notes):
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["note", "summary"])
            w.writerows([(n, f"summary of {n}") for n in notes])
        return str(path)

    d = quick().data
    d.eval_fraction, d.seed = 0.25, 3
    d.path = write("dups.csv", [f"note number {i % 12}" for i in range(40)])  # 12 notes, each 3 or 4 times
    train, held = _splits(d)
    assert len(train) + len(held) == 40 and not {r["note"] for r in train} & {r["note"] for r in held}
    assert len({r["note"] for r in held}) == 3  # a quarter of the 12 distinct notes
    d.path = write("plain.csv", [f"note number {i}" for i in range(40)])
    train, held = _splits(d)
    order = np.random.default_rng(3).permutation(40)
    assert [r["note"] for r in held] == [f"note number {i}" for i in order[:10]]
    assert [r["note"] for r in train] == [f"note number {i}" for i in order[10:]]


def test_a_beam_wider_than_the_vocabulary_is_refused_by_the_config():
    """A beam of 100,000 passed validation, trained, and was killed for memory at the first evaluation, its
    run left behind (audit AQ); a beam past the vocabulary finds no other summary."""
    from raysys import workload as registry
    from raysys.config import ConfigError, apply_overrides

    quick = registry.get("pointer_generator").config("quick")
    assert apply_overrides(quick, {"model.beam": quick.data.vocab_size}).model.beam == quick.data.vocab_size
    with pytest.raises(ConfigError, match=r"model.beam \(100000\) must be <= data.vocab_size \(600\)"):
        apply_overrides(quick, {"model.beam": 100000})


def test_the_ablation_without_copy_freezes_p_gen_and_keeps_the_optimizers_layout():
    """model.copy=false never reads p_gen: its layer had no gradient, so --workers 2 failed at step 1 after the
    run existed (audit AQ). It is frozen now, and the optimizer still holds every parameter in one group, so
    checkpoints of the ablation made before still resume."""
    from raysys.train.optim import task_optimizer
    from raysys.workloads.pointer_generator.model import PointerGenerator
    from raysys.workloads.pointer_generator.workload import SummarizationTask, quick

    sizes = {}
    for copy in (True, False):
        model = PointerGenerator(300, emb_dim=8, hidden=8, layers=1, copy=copy)
        assert all(p.requires_grad == copy for p in model.gen.parameters())
        opt = task_optimizer(SummarizationTask(), quick(), model, "pointer_generator")
        sizes[copy] = [len(g["params"]) for g in opt.param_groups]
        src = torch.randint(4, 300, (2, 7))
        total, _ = model(src, torch.tensor([7, 7]), src[:, :4])
        total.backward()  # every trainable parameter has a gradient: what DDP waits for
        assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    assert sizes[True] == sizes[False] == [len(list(PointerGenerator(300, 8, 8, 1).parameters()))]


def test_a_summary_cut_short_gets_no_end_token_at_the_cut(tmp_path):
    """A cut target ended in EOS at the cut, teaching the model to end a summary mid-sentence (audit AQ F7);
    as the original's batcher, only a whole summary ends in EOS."""
    import pyarrow.parquet as pq

    from raysys.workloads.pointer_generator.data import _write_split

    class Words:  # a tokenizer of one id per word
        def encode(self, text):
            return [10 + i for i, _ in enumerate(text.split())]

    rows = [{"note": "a b c", "summary": "one two"}, {"note": "a b c", "summary": "one two three four five six"}]
    meta = _write_split(rows, Words(), tmp_path / "s.parquet", max_src=8, max_tgt=4)
    tgt = pq.read_table(tmp_path / "s.parquet").column("tgt_ids").to_pylist()
    assert tgt == [[10, 11, EOS], [10, 11, 12, 13]] and meta["truncated_tgt"] == 1
