"""Deep-GPCM data: the synthetic_OC generator, the user's layouts and their validation, splits, batching."""

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from raysys.workloads.deep_gpcm.data import (ReadOptions, SequenceData, SequenceDataset, collate_padded, digest,
                                             generate_synthetic_oc, gpcm_probs, kfold_indices, load_sequences,
                                             write_synthetic_oc)

SMALL = dict(n_students=60, n_questions=25, n_cats=4, min_len=10, max_len=30, seed=3)


@pytest.fixture(scope="module")
def oc():
    return generate_synthetic_oc()  # the real default: 800 students, 400 questions, K=4


def test_generator_is_deterministic_and_seeded():
    a, irt_a = generate_synthetic_oc(**SMALL)
    b, irt_b = generate_synthetic_oc(**SMALL)
    c, _ = generate_synthetic_oc(**{**SMALL, "seed": 4})
    pd.testing.assert_frame_equal(a, b)
    for k in irt_a:
        np.testing.assert_array_equal(irt_a[k], irt_b[k])
    assert a["responses"].tolist() != c["responses"].tolist()


def test_generator_shapes_and_ranges(oc):
    df, irt = oc
    assert len(df) == 800 and list(df.columns) == ["student_id", "questions", "responses"]
    lengths = df["questions"].map(len).to_numpy()
    assert lengths.min() >= 100 and lengths.max() < 400 and lengths.max() - lengths.min() > 200
    assert (df["responses"].map(len).to_numpy() == lengths).all()
    q = np.concatenate(df["questions"].to_list())
    r = np.concatenate(df["responses"].to_list())
    assert q.min() == 1 and q.max() == 400  # 1-based: 0 stays free for padding
    assert set(np.unique(r)) == {0, 1, 2, 3}
    assert irt["theta"].shape == (800,) and irt["alpha"].shape == (400,) and irt["betas"].shape == (400, 3)
    assert (irt["alpha"] > 0).all() and (np.diff(irt["betas"], axis=1) >= 0).all()  # thresholds sorted


def test_responses_follow_the_gpcm(oc):
    df, irt = oc
    # abler students answer in higher categories
    mean_resp = df["responses"].map(np.mean).to_numpy()
    assert np.corrcoef(mean_resp, irt["theta"])[0, 1] > 0.7
    # and the category frequencies match the model's probabilities of the drawn (student, question)s
    s = np.repeat(np.arange(len(df)), df["questions"].map(len).to_numpy())
    q = np.concatenate(df["questions"].to_list()) - 1
    r = np.concatenate(df["responses"].to_list())
    expected = gpcm_probs(irt["theta"][s], irt["alpha"][q], irt["betas"][q]).mean(0)
    observed = np.bincount(r, minlength=4) / len(r)
    np.testing.assert_allclose(observed, expected, atol=0.005)  # ~190k draws: sd ~0.001


def test_gpcm_probs_formula():
    theta, alpha, betas = np.array([0.3]), np.array([1.7]), np.array([[-0.5, 0.1, 0.9]])
    z = np.array([0.0, 1.7 * 0.8, 1.7 * 0.8 + 1.7 * 0.2, 1.7 * 0.8 + 1.7 * 0.2 - 1.7 * 0.6])
    np.testing.assert_allclose(gpcm_probs(theta, alpha, betas)[0], np.exp(z) / np.exp(z).sum())


def test_write_round_trip_and_reuse(tmp_path):
    out = write_synthetic_oc(tmp_path / "oc", **SMALL)
    assert {p.name for p in out.iterdir()} == {"sequences.parquet", "irt_params.npz", "meta.json"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_questions"] == 25 and meta["n_cats"] == 4 and meta["generator"]["seed"] == 3
    df, irt = generate_synthetic_oc(**SMALL)
    for source in (out, out / "sequences.parquet"):  # folder or file
        data = load_sequences(source)
        assert (data.n_questions, data.n_cats, len(data)) == (25, 4, 60)
        for i in (0, 59):
            np.testing.assert_array_equal(data.questions[i], df["questions"][i])
            np.testing.assert_array_equal(data.responses[i], df["responses"][i])
    np.testing.assert_array_equal(np.load(out / "irt_params.npz")["betas"], irt["betas"])

    stamp = (out / "sequences.parquet").stat().st_mtime_ns
    write_synthetic_oc(out, **SMALL)  # same arguments: nothing rewritten
    assert (out / "sequences.parquet").stat().st_mtime_ns == stamp
    write_synthetic_oc(out, **{**SMALL, "seed": 5})  # different arguments: regenerated
    assert json.loads((out / "meta.json").read_text())["generator"]["seed"] == 5
    assert not list(out.glob("*.tmp"))


def test_a_task_reads_the_synthetic_data_its_config_asks_for_whatever_the_folder_held(tmp_path, monkeypatch):
    """Audit BF F5: one folder serves every generator setting; a process that regenerated it with other settings
    between another's write and read made that one train on the other's data. The task now writes and reads
    under one lock, and its cached sequences are keyed by the settings too (one task object, two configs)."""
    from raysys.config import apply_overrides
    from raysys.workloads.deep_gpcm.workload import DeepGPCMTask, quick

    monkeypatch.chdir(tmp_path)
    task = DeepGPCMTask()
    sizes = []
    for n in (30, 40, 30):
        cfg = task.prepare(apply_overrides(quick(), {"data.n_questions": n, "data.data_dir": "oc"}))
        sizes.append(task._data(cfg).n_questions)
        write_synthetic_oc(tmp_path / "oc", **SMALL)  # another process's settings, between this one's runs
        assert task._data(cfg).n_questions == n  # its cache holds what it asked for
        task._cache = None  # read afresh: the folder holds another's data now
        assert task._data(cfg).n_questions == n
    assert sizes == [30, 40, 30]
    assert (tmp_path / ".oc.lock").exists()


def test_load_infers_sizes_without_meta(tmp_path):
    f = tmp_path / "seqs.parquet"
    pd.DataFrame({"questions": [[1, 7, 3], [2, 2]], "responses": [[0, 2, 1], [1, 0]]}).to_parquet(f)
    data = load_sequences(f)
    assert (data.n_questions, data.n_cats) == (7, 3)
    assert data.questions[1].dtype == np.int64 and data.questions[1].tolist() == [2, 2]
    # the same numbers stored as text (lists of strings): read as the numbers they are, not refused
    # with "must be whole numbers, found '1'"
    pd.DataFrame({"questions": [["1", "7", "3"], ["2", "2"]], "responses": [[0, 2, 1], [1, 0]]}).to_parquet(f)
    again = load_sequences(f)
    assert (again.n_questions, again.n_cats) == (7, 3) and again.questions[0].tolist() == [1, 7, 3]


def test_missing_column_error_names_it(tmp_path):
    f = tmp_path / "seqs.parquet"
    pd.DataFrame({"questions": [[1, 2]], "answers": [[0, 1]]}).to_parquet(f)
    with pytest.raises(ValueError) as err:
        load_sequences(f)
    msg = str(err.value)
    assert "'responses'" in msg and str(f) in msg and "'questions'" in msg and "answers" in msg


@pytest.mark.parametrize("questions,responses,fragment", [
    ([[1, 0, 2]], [[0, 1, 1]], ">= 1 with data.id_base=1"),  # 0 is the padding id
    ([[1, 2, 3]], [[0, 1]], "row 1 has 3 questions but 2 responses"),
    ([[1, 2]], [[0, -1]], ">= 0"),
    ([[1, 2], []], [[0, 1], []], "row 2 has no responses"),
])
def test_invalid_values_are_rejected(tmp_path, questions, responses, fragment):
    f = tmp_path / "seqs.parquet"
    pd.DataFrame({"questions": questions, "responses": responses}).to_parquet(f)
    with pytest.raises(ValueError, match=fragment):
        load_sequences(f, ReadOptions(id_base=1))


def test_the_data_s_categories_are_said_and_gaps_among_them_shown(tmp_path):
    """K comes from the data's largest response, not data.n_cats (the generator's): said, and a category
    that never appears is named. Audit N: one stray 99 (a missing-value code, a typo) made K=100 and a run
    that learned nothing, exit 0; a hole of two or more categories is now refused in one line, a 1..K
    scale (Likert) is shifted to 0..K-1, and a meta.json's n_cats keeps what the user declared."""
    f = tmp_path / "seqs.parquet"

    def load(responses, **opt):
        pd.DataFrame({"questions": [[1, 2, 3][:len(r)] for r in responses], "responses": responses}).to_parquet(f)
        return load_sequences(f, ReadOptions(**opt))

    seqs = load([[0, 1, 3], [3, 3, 1]])  # category 2 unseen in a small sample: said, not refused
    assert seqs.n_cats == 4 and any("4 response categories 0..3, from its largest response" in n for n in seqs.notes)
    assert any(n.startswith("category 2 never appears") for n in seqs.notes)
    with pytest.raises(ValueError, match=r"response 99 \(1 of 6 rows\) lies above categories 4..98, which never "
                                         r"appear: a missing-value code or a typo\?"):
        load([[0, 1, 3], [2, 99, 1]])
    with pytest.raises(ValueError, match=r"responses 9, 10 \(2 of 6 rows\) lie above categories 4..8"):
        load([[0, 1, 3], [9, 10, 2]])
    # audit AR F5: numpy's "array is too big" (a bincount of 2**62 categories), without the file or the value
    with pytest.raises(ValueError, match=rf"seqs.parquet: response {2 ** 62} \(1 of 6 rows\) lies above categories "
                                         rf"4..{2 ** 62 - 1}"):
        load([[0, 1, 3], [2, 2 ** 62, 1]])
    likert = load([[1, 2, 4], [3, 4, 1]])  # a 1..4 scale
    assert likert.n_cats == 4 and [r.tolist() for r in likert.responses] == [[0, 1, 3], [2, 3, 0]]
    assert any(n.startswith("responses start at 1: read as 1..K and shifted to 0..K-1") for n in likert.notes)
    assert load([[1, 2, 4], [3, 4, 1]], response_base=0).n_cats == 5  # as they are: category 0 empty
    with pytest.raises(ValueError, match="responses start at 3, so categories 1..2 never appear"):
        load([[3, 4, 5], [5, 4, 3]])  # after the 1..K shift, 0 and 1 are still empty
    with pytest.raises(ValueError, match=">= 1 with data.response_base=1"):
        load([[0, 1, 2]], response_base=1)
    (tmp_path / "meta.json").write_text(json.dumps({"n_cats": 10}))  # declared: kept, whatever is unseen
    seqs = load([[0, 9]])
    assert seqs.n_cats == 10 and not any("from its largest response" in n for n in seqs.notes)
    assert "categories 1, 2, 3, 4, 5, 6, 7, 8 never appear" in " ".join(seqs.notes)
    (tmp_path / "meta.json").write_text(json.dumps({"n_cats": 100}))
    assert "categories 1, 2, 3, 4, 5, 6, 7, 8, ... never appear" in " ".join(load([[0, 9]]).notes)


def test_a_few_ids_far_apart_are_read_with_a_note_of_the_models_size(tmp_path):
    """Audit AR F6: one stray id (90000 among 21 questions) made the model 90000 questions wide, ~4000x
    larger and ~100x slower, without a word. Not refused (a subset of a large bank keeps its ids): said."""
    f = tmp_path / "seqs.parquet"
    pd.DataFrame({"questions": [[1, 2, 3], [4, 90000, 5]], "responses": [[0, 1, 1], [1, 0, 1]]}).to_parquet(f)
    seqs = load_sequences(f, ReadOptions())
    assert seqs.n_questions == 90000
    assert any(n.startswith("6 distinct question ids, the largest 90000: the model holds 90000 embedding rows")
               for n in seqs.notes), seqs.notes
    pd.DataFrame({"questions": [[1, 2, 3], [4, 6, 5]], "responses": [[0, 1, 1], [1, 0, 1]]}).to_parquet(f)
    assert not any("distinct question ids" in n for n in load_sequences(f, ReadOptions()).notes)


def _same(a, b) -> None:
    assert (a.n_questions, a.n_cats, len(a)) == (b.n_questions, b.n_cats, len(b))
    for x, y in zip(a.questions + a.responses, b.questions + b.responses):
        assert x.dtype == np.int64 and x.tolist() == y.tolist()


def test_every_layout_of_the_same_data_reads_the_same(tmp_path):
    """One dataset written the ways users hold knowledge-tracing data reads back identically: a row per
    student (parquet, JSONL, CSV of "1,2,3" texts), a row per response (CSV shuffled with an order column,
    TSV with its own column names and question names), the original's 0-based three-line text, and the
    original's folder of _train/_test splits with its metadata.json."""
    ref = load_sequences(write_synthetic_oc(tmp_path / "oc", **SMALL))
    df = pd.DataFrame({"questions": [q.tolist() for q in ref.questions], "responses": [r.tolist() for r in ref.responses]})
    meta = {"n_questions": ref.n_questions, "n_cats": ref.n_cats}
    layouts = tmp_path / "layouts"
    layouts.mkdir()
    (layouts / "meta.json").write_text(json.dumps(meta))
    df.to_parquet(layouts / "wide.parquet")
    df.to_json(layouts / "wide.jsonl", orient="records", lines=True)
    df.assign(questions=[",".join(map(str, q)) for q in df.questions],
              responses=[" ".join(map(str, r)) for r in df.responses]).to_csv(layouts / "wide.csv", index=False)
    long = pd.DataFrame([{"user_id": f"s{i:03d}", "item_id": q, "score": float(r), "t": t}
                         for i, (qs, rs) in enumerate(zip(ref.questions, ref.responses))
                         for t, (q, r) in enumerate(zip(qs, rs))])
    long.sample(frac=1.0, random_state=0).to_csv(layouts / "long.csv", index=False)
    for name in ("wide.parquet", "wide.jsonl", "wide.csv"):
        _same(load_sequences(layouts / name), ref)
    _same(load_sequences(layouts / "long.csv", ReadOptions(order_column="t")), ref)

    named = long.rename(columns={"user_id": "learner", "item_id": "skill", "score": "grade"})
    named["skill"] = [f"q{q:04d}" for q in named.skill]  # names, numbered 1..Q in sorted order
    named.to_csv(layouts / "named.tsv", sep="\t", index=False)
    got = load_sequences(layouts / "named.tsv", ReadOptions("learner", "skill", "grade"))
    _same(got, ref)
    assert any("names" in n for n in got.notes)
    split = tmp_path / "named_split"  # names numbered over both files alike, though each holds only some
    split.mkdir()
    (split / "meta.json").write_text(json.dumps(meta))
    first = named.learner < "s040"
    named[first].drop(columns="t").to_csv(split / "kt_train.csv", index=False)
    named[~first].drop(columns="t").to_csv(split / "kt_test.csv", index=False)
    _same(load_sequences(split, ReadOptions("learner", "skill", "grade")), ref)

    original = tmp_path / "synthetic_OC"  # the original project's layout: 0-based ids, 3 lines per student
    original.mkdir()
    (original / "metadata.json").write_text(json.dumps(meta | {"dataset_name": "synthetic_OC"}))

    def lines(rows) -> str:
        return "".join(f"{len(q)}\n{','.join(str(x - 1) for x in q)}\n{','.join(map(str, r))}\n" for q, r in rows)

    rows = list(zip(ref.questions, ref.responses))
    (original / "synthetic_oc_test.txt").write_text(lines(rows[40:]))
    (original / "synthetic_oc_train.txt").write_text(lines(rows[:40]))
    (original / "notes.txt").write_text("not data")
    got = load_sequences(original)
    _same(got, ref)
    assert any("start at 0" in n for n in got.notes)
    _same(load_sequences(original / "synthetic_oc_train.txt"),
          SequenceData(ref.questions[:40], ref.responses[:40], ref.n_questions, ref.n_cats))
    (layouts / "dkvmn.csv").write_text(lines(rows).replace("\n", ",\n"))  # DKVMN's .csv: trailing commas
    _same(load_sequences(layouts / "dkvmn.csv"), ref)


def test_the_digest_is_of_the_data_not_its_file(tmp_path):
    """What a checkpoint records of a user's data: equal for the same sequences in any file or layout,
    different for one changed response."""
    ref = load_sequences(write_synthetic_oc(tmp_path / "oc", **SMALL))
    df = pd.DataFrame({"questions": [q.tolist() for q in ref.questions], "responses": [r.tolist() for r in ref.responses]})
    (tmp_path / "meta.json").write_text(json.dumps({"n_questions": ref.n_questions, "n_cats": ref.n_cats}))
    df.to_json(tmp_path / "elsewhere.jsonl", orient="records", lines=True)
    assert digest(load_sequences(tmp_path / "elsewhere.jsonl")) == digest(ref)
    first = df.at[0, "responses"]
    df.at[0, "responses"] = [(first[0] + 1) % 4, *first[1:]]
    df.to_parquet(tmp_path / "fixed.parquet")
    assert digest(load_sequences(tmp_path / "fixed.parquet")) != digest(ref)


@pytest.mark.parametrize("text, fragment", [
    ("3\n1,2,3\n0,1,1\n2\n1,2\n", "5 non-empty lines"),
    ("3\n1,2,3\n0,1\n", "line 1 says 3 responses, lines 2-3 hold 3 question ids and 2 responses"),
    ("3\n1,x,3\n0,1,1\n", "lines 1-3: not a length and two lists of integers"),
    ("3\n1,2,3\n0,0.5,1\n", "responses must be whole numbers, found 0.5"),  # partial credit is not a category
])
def test_bad_three_line_files_name_the_lines(tmp_path, text, fragment):
    f = tmp_path / "d.txt"
    f.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        load_sequences(f)


def test_bad_response_tables_name_the_column(tmp_path):
    f = tmp_path / "d.csv"
    pd.DataFrame({"student_id": [1, 1], "question_id": [3, 4], "response": [0.5, 1.0]}).to_csv(f, index=False)
    with pytest.raises(ValueError, match="'response' must be whole numbers, found 0.5"):
        load_sequences(f)
    pd.DataFrame({"student_id": [1, 1], "question_id": [3, 4], "response": ["high", "low"]}).to_csv(f, index=False)
    with pytest.raises(ValueError, match="'response' must be whole numbers, found 'high' \\(value 1 of the column\\)"):
        load_sequences(f)
    f.write_text("student_id,question_id,response\ns1,1,2\ns1,2,1\ns2,3,abc\n")  # the bad one, not the first
    with pytest.raises(ValueError, match="'response' must be whole numbers, found 'abc' \\(value 3 of the column\\)"):
        load_sequences(f)
    f.write_text("student_id,question_id,response\n")  # a header only: no rows (was "must be whole numbers")
    with pytest.raises(ValueError, match="no responses \\(the table has no rows\\)"):
        load_sequences(f)
    pd.DataFrame({"learner": [1, 1], "question_id": [3, 4], "response": [0, 1]}).to_csv(f, index=False)
    with pytest.raises(ValueError, match="student column .*data.student_column.*has: learner, question_id"):
        load_sequences(f)
    with pytest.raises(ValueError, match="no column 'when' \\(data.order_column\\)"):
        load_sequences(f, ReadOptions(student_column="learner", order_column="when"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="needs sequences.parquet, or <name>_train"):
        load_sequences(tmp_path / "empty")


def test_out_of_range_response_against_meta(tmp_path):
    out = write_synthetic_oc(tmp_path, **SMALL)
    df = pd.read_parquet(out / "sequences.parquet")
    df.at[0, "responses"] = [4] * len(df.at[0, "questions"])  # K = 4 in meta.json
    df.to_parquet(out / "sequences.parquet")
    with pytest.raises(ValueError, match="out of range 0..3"):
        load_sequences(out)


@pytest.mark.parametrize("meta, fragment", [
    ("[1, 2]", "meta.json: a JSON list, not an object"),
    ("{oops", "meta.json: not valid JSON"),
    ('{"n_cats": "abc"}', "meta.json: n_cats must be a whole number >= 1, got 'abc'"),
])
def test_a_meta_json_beside_the_data_that_is_not_one_names_the_file(tmp_path, meta, fragment):
    out = write_synthetic_oc(tmp_path, **SMALL)
    (out / "meta.json").write_text(meta)
    with pytest.raises(ValueError, match=re.escape(str(out / fragment))):
        load_sequences(out)


def test_kfold_partitions_indices():
    n, k = 803, 5
    tests = []
    for fold in range(k):
        train, test = kfold_indices(n, k, fold, seed=42)
        assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == n
        assert abs(len(test) - n / k) < 1
        tests.append(test)
    np.testing.assert_array_equal(np.sort(np.concatenate(tests)), np.arange(n))  # each index tested once
    np.testing.assert_array_equal(kfold_indices(n, k, 2, 42)[1], kfold_indices(n, k, 2, 42)[1])
    assert not np.array_equal(kfold_indices(n, k, 2, 42)[1], kfold_indices(n, k, 2, 7)[1])
    with pytest.raises(ValueError):
        kfold_indices(n, k, 5, 42)


def test_dataset_and_collate(tmp_path):
    data = load_sequences(write_synthetic_oc(tmp_path, **SMALL))
    ds = SequenceDataset(data, [4, 9, 2])
    assert len(ds) == 3
    q, r = ds[1]
    assert q.dtype == torch.long and r.dtype == torch.long
    assert q.tolist() == data.questions[9].tolist() and r.tolist() == data.responses[9].tolist()

    items = [ds[i] for i in range(3)]
    batch = collate_padded(items)
    lengths = [len(x[0]) for x in items]
    assert batch["questions"].shape == (3, max(lengths)) and batch["mask"].dtype == torch.bool
    assert batch["mask"].sum(1).tolist() == lengths
    for i, (q, r) in enumerate(items):
        assert batch["questions"][i, : len(q)].tolist() == q.tolist()
        assert batch["responses"][i, : len(r)].tolist() == r.tolist()
        assert (batch["questions"][i, len(q):] == 0).all() and (batch["responses"][i, len(r):] == 0).all()
    assert ((batch["questions"] > 0) == batch["mask"]).all()  # padding id exactly where masked
