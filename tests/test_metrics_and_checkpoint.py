import subprocess
import time

import numpy as np
import pytest
import torch

from raysys.checkpoint import CheckpointError, CheckpointStore
from raysys.metrics import PHASES, PhaseTimer, StabilityMonitor, Throughput
from raysys.train.config import OptimConfig
from raysys.train.data import ShardSampler
from raysys.train.optim import lr_factor


def test_phase_timer_measures_each_phase():
    t = PhaseTimer()
    for step in range(3):
        t.start_step(step)
        with t.phase("forward"):
            time.sleep(0.02)
        with t.phase("backward"):
            time.sleep(0.01)
        time.sleep(0.005)  # unaccounted -> "other"
        t.end_step()
    s = t.summary()
    assert 18 < s["forward_ms"] < 60 and 8 < s["backward_ms"] < 40 and s["other_ms"] >= 4
    assert abs(sum(s[p + "_ms"] for p in PHASES) - s["step_ms"]) < 1.0
    assert "| forward |" in t.table()


def test_phase_timer_every_k():
    t = PhaseTimer(every=2)
    for step in range(4):
        t.start_step(step)
        with t.phase("forward"):
            pass
        t.end_step()
    assert t.steps == 2


def test_stability_monitor():
    m = StabilityMonitor(spike_factor=3.0)
    for _ in range(20):
        m.observe(1.0, 0.5)
    m.observe(10.0, 1.0)
    m.observe(float("nan"), float("inf"))
    out = m.metrics()
    assert out["stability/loss_spikes"] == 1 and out["stability/nonfinite_loss"] == 1
    assert out["stability/nonfinite_grad"] == 1 and out["stability/grad_norm_max"] == 1.0 and m.diverged


def test_grad_norm_statistics_are_of_updates_when_a_loss_covers_several():
    """mpn_dqn observes one mean TD loss per log line of many updates: its grad-norm mean was a mean
    of the lines' maxima. The statistics are of the latest 200 updates, and survive a resume."""
    m = StabilityMonitor()
    for line in range(3):
        m.observe(1.0, None)
        m.observe_grad_norms([1.0, 1.0, 1.0, 5.0, float("nan")])
    out = m.metrics()
    assert out["stability/grad_norm_mean"] == 2.0 and out["stability/grad_norm_max"] == 5.0
    assert out["stability/nonfinite_grad"] == 3 and out["stability/nonfinite_loss"] == 0
    m.observe_grad_norms([0.5] * 300)
    assert m.metrics()["stability/grad_norm_mean"] == 0.5
    again = StabilityMonitor()
    again.load_state_dict(m.state_dict())
    assert again.metrics() == m.metrics()


def test_loss_spikes_are_counted_within_a_window_not_since_the_start():
    # Rare real spikes over a long run: the total grows, the burst (most within 50 losses) does not.
    rare = StabilityMonitor()
    for i in range(1000):
        rare.observe(10.0 if i % 100 == 99 else 1.0, 1.0)
    assert rare.metrics()["stability/loss_spikes_total"] == 10 and rare.metrics()["stability/loss_spikes"] == 1
    # An oscillating run: spikes close together.
    burst = StabilityMonitor()
    for i in range(60):
        burst.observe(10.0 if i >= 30 and i % 4 == 0 else 1.0, 1.0)
    assert burst.metrics()["stability/loss_spikes"] >= 4
    # A classifier converged from 0.69 to ~0.03: batches at 0.12-0.14 are 4x its median but noise; a loss
    # back near where it started is a blow-up.
    import random

    rng = random.Random(0)
    converged = StabilityMonitor()
    for i in range(300):
        converged.observe(0.69 if i < 60 else (rng.choice([0.12, 0.116, 0.142]) if i % 5 == 0 else 0.02), 1.0)
    assert converged.metrics()["stability/loss_spikes"] == 0
    for _ in range(4):
        converged.observe(0.6, 1.0)
    assert converged.metrics()["stability/loss_spikes"] == 4
    # A resumed run counts on from where it stopped.
    again = StabilityMonitor()
    again.load_state_dict(burst.state_dict())
    for m in (again, burst):
        m.observe(10.0, 1.0)
    assert again.metrics() == burst.metrics()


def test_throughput_window():
    t = Throughput(window=2)
    t.update(1.0, 10, 100)
    t.update(1.0, 30, 300)
    t.update(1.0, 30, 300)
    r = t.rates(world_size=2)
    assert r["perf/samples_per_s"] == 60 and r["perf/tokens_per_s"] == 600 and t.total_samples == 70
    assert t.window_sums() == (60, 2.0)  # what a loop of its own (hackmatrix_ppo's chunks) takes its rate from


def test_shard_sampler_partitions_and_resumes():
    n, world = 10, 3
    shards = [list(ShardSampler(n, r, world, seed=1)) for r in range(world)]
    assert all(len(s) == 4 for s in shards)  # padded to equal length
    assert set(sum(shards, [])) == set(range(n))
    s = ShardSampler(n, 0, 1, seed=1)
    s.set_epoch(2)
    full = list(s)
    s.set_epoch(2, start=4)
    assert list(s) == full[4:] and len(s) == n - 4
    s.set_epoch(3)
    assert list(s) != full


def test_lr_schedules():
    c = OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(c, 0, 100) == pytest.approx(0.1) and lr_factor(c, 9, 100) == pytest.approx(1.0)
    assert lr_factor(c, 99, 100) == pytest.approx(0.1, abs=1e-3)
    r = OptimConfig(schedule="cosine_warm_restarts", restart_period=10)
    assert lr_factor(r, 10, 100) == pytest.approx(1.0) and lr_factor(r, 5, 100) == pytest.approx(0.5)
    assert lr_factor(OptimConfig(schedule="linear"), 50, 100) == pytest.approx(0.5)


def _store(tmp_path, **kw):
    return CheckpointStore(tmp_path / "run", kw.pop("workload", "w"), kw.pop("identity", {"model": {"h": 4}}), keep=2)


def test_checkpoint_atomic_keep_and_roundtrip(tmp_path):
    s = _store(tmp_path)
    for step in (1, 2, 3):
        s.save({"w": torch.full((2,), float(step)), "step": step}, step)
    assert [p.name for p in s.complete()] == ["step_000000002", "step_000000003"]
    state, meta = s.load()
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((2,), 3.0)) and meta["workload"] == "w"
    # an interrupted write leaves only a hidden temp folder, which is never taken for a checkpoint
    (s.root / ".tmp-step_000000009-dead").mkdir()
    assert s.latest().name == "step_000000003"


def test_a_checkpoint_pruning_cannot_do_is_said_and_done_at_the_next_save(tmp_path, monkeypatch, caplog):
    """Removing an older checkpoint is a clean-up: a storage that fails it (not answering) leaves the new
    checkpoint saved and the training going, with a warning, and the next save removes it; a checkpoint
    listed but never pulled into this working copy (a resumed remote run) is no error either."""
    s = _store(tmp_path)
    s.save({"step": 1}, 1)
    s.save({"step": 2}, 2)
    real = s.ended

    def down(path):
        raise OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 28, Timeout was reached")

    monkeypatch.setattr(s, "ended", down)
    assert s.save({"step": 3}, 3).name == "step_000000003"
    assert "could not remove an older checkpoint" in caplog.text and "the next save tries again" in caplog.text
    assert [p.name for p in s.complete()] == ["step_000000001", "step_000000002", "step_000000003"]
    monkeypatch.setattr(s, "ended", real)
    listed = s.complete
    monkeypatch.setattr(s, "complete", lambda: [s.root / "step_000000000", *listed()])  # on the storage only
    s.save({"step": 4}, 4)
    monkeypatch.setattr(s, "complete", listed)
    assert [p.name for p in s.complete()] == ["step_000000003", "step_000000004"]


def test_corrupt_checkpoint_clear_error_and_untouched(tmp_path):
    s = _store(tmp_path)
    s.save({"x": torch.ones(3)}, 1)
    path = s.save({"x": torch.ones(3)}, 2)
    (path / "state.pt").write_bytes(b"garbage" * 10)
    before = sorted(p.name for p in path.iterdir()), (path / "state.pt").read_bytes()
    with pytest.raises(CheckpointError, match="corrupt") as err:
        s.load()
    assert (sorted(p.name for p in path.iterdir()), (path / "state.pt").read_bytes()) == before
    assert (s.root / "step_000000001").is_dir()  # the earlier checkpoint survives
    # the line says how to go on from the earlier one, and doing so works
    hint = str(err.value).split("move it aside first: ")[1]
    assert hint == f"mv {path} {path}.corrupt" and "to resume from step_000000001" in str(err.value)
    subprocess.run(hint.split(), check=True)
    state, meta = s.load()
    assert meta["step"] == 1 and (s.root / "step_000000002.corrupt" / "state.pt").is_file()


@pytest.mark.parametrize("damage", [b"", b"PK\x03\x04"])  # an empty file (a bare EOFError), a cut zip
def test_an_empty_or_cut_state_file_is_one_clear_refusal(tmp_path, damage):
    s = _store(tmp_path)
    s.save({"x": torch.ones(3)}, 1)
    path = s.save({"x": torch.ones(3)}, 2)
    (path / "state.pt").write_bytes(damage)
    with pytest.raises(CheckpointError, match=r"step_000000002 is corrupt or unsafe to load \(\w+: \S") as err:
        s.load()
    assert "to resume from step_000000001" in str(err.value) and "\n" not in str(err.value)


def test_an_unreadable_meta_json_says_how_to_resume_from_the_one_before(tmp_path):
    s = _store(tmp_path)
    s.save({"x": torch.ones(3)}, 1)
    path = s.save({"x": torch.ones(3)}, 2)
    (path / "meta.json").write_text("")
    with pytest.raises(CheckpointError, match="unreadable meta.json .* to resume from step_000000001, move it aside"):
        s.load()


def test_foreign_and_mismatched_checkpoints_refused(tmp_path):
    _store(tmp_path).save({"x": torch.ones(1)}, 1)
    with pytest.raises(CheckpointError, match="belongs to workload 'w'"):
        _store(tmp_path, workload="other").load()
    with pytest.raises(CheckpointError, match="model.h: checkpoint=4 now=8"):
        _store(tmp_path, identity={"model": {"h": 8}}).load()


class Evil:
    """Stands in for any class a malicious checkpoint could ask the unpickler to build."""


def test_checkpoint_refuses_pickled_objects(tmp_path):
    s = _store(tmp_path)
    path = s.save({"x": torch.ones(1)}, 1)
    torch.save({"obj": Evil()}, path / "state.pt")  # weights_only loading must refuse arbitrary classes
    with pytest.raises(CheckpointError, match="unsafe|corrupt") as err:
        s.load()
    assert "weights_only=False" not in str(err.value)  # torch's advice to load it anyway is not passed on


def test_a_numpy_state_is_saved_and_loaded_without_torch(tmp_path):
    """A JAX workload's state (numpy or JAX arrays and plain values) is state.npz, written and read in a
    process that never imports torch; dtypes (uint32, bool, bfloat16), nesting, int keys and Python values
    come back. A state no form could load back is refused at its first save, not on resume."""
    import subprocess
    import sys

    script = f"""
import sys
import ml_dtypes, numpy as np
import jax, jax.numpy as jnp
from raysys.checkpoint import CheckpointStore
s = CheckpointStore({str(tmp_path)!r}, "w", {{"model": {{"h": 4}}}})
state = {{"params": [np.arange(3, dtype=ml_dtypes.bfloat16), np.array([1, 2**32 - 1], np.uint32)],
          "flags": np.array([True, False]), "step": 7, "ratio": 0.5, "name": "run", "none": None,
          "pair": (np.float32(1.5), [2, 3]), "nested": {{"empty": []}}, "by_int": {{0: np.zeros(2), 1.5: None}},
          "jax": [jnp.arange(3, dtype=jnp.bfloat16), jax.random.PRNGKey(3)]}}
for step in (1, 2, 3):
    s.save(state, step)
loaded, meta = s.load()
assert [p.name for p in s.complete()] == ["step_000000002", "step_000000003"]
assert sorted(p.name for p in s.latest().iterdir()) == ["meta.json", "state.npz"] and "torch" not in meta
assert loaded["params"][0].dtype == ml_dtypes.bfloat16 and loaded["params"][0].tolist() == [0, 1, 2]
assert loaded["params"][1].dtype == np.uint32 and loaded["params"][1].tolist() == [1, 2**32 - 1]
assert loaded["flags"].dtype == np.bool_ and loaded["flags"].tolist() == [True, False]
assert (loaded["step"], loaded["ratio"], loaded["name"], loaded["none"]) == (7, 0.5, "run", None)
assert isinstance(loaded["pair"], tuple) and float(loaded["pair"][0]) == 1.5 and loaded["pair"][1] == [2, 3]
assert loaded["nested"] == {{"empty": []}}
assert loaded["by_int"][0].tolist() == [0, 0] and loaded["by_int"][1.5] is None
assert loaded["jax"][0].dtype == ml_dtypes.bfloat16 and loaded["jax"][0].tolist() == [0, 1, 2]
assert loaded["jax"][1].tolist() == np.asarray(jax.random.PRNGKey(3)).tolist()
try:
    s.save({{"key": jax.random.key(0)}}, 4)  # a typed key: no form raysys could load back
    raise AssertionError("saved")
except TypeError as e:
    assert "jax.random.key_data" in str(e), e
assert s.latest().name == "step_000000003"
print("torch imported:", "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch imported: False" in out.stdout


def test_a_state_with_tensors_stays_torch_and_a_corrupt_npz_is_refused(tmp_path):
    s = _store(tmp_path)
    mixed = s.save({"w": torch.ones(2), "n": np.zeros(2)}, 1)  # any tensor: the torch form
    assert sorted(p.name for p in mixed.iterdir()) == ["meta.json", "state.pt"]
    path = s.save({"n": np.zeros(2)}, 2)
    (path / "state.npz").write_bytes(b"PK\x03\x04 not really a zip")
    before = (path / "state.npz").read_bytes()
    with pytest.raises(CheckpointError, match="corrupt"):
        s.load()
    assert (path / "state.npz").read_bytes() == before and (s.root / "step_000000001").is_dir()


def test_a_resumed_runs_logger_keeps_the_values_an_earlier_process_logged(tmp_path):
    """A run killed after logging past its last checkpoint trains those steps again on --resume:
    MLflow keeps one value per metric and step, the first one."""
    from mlflow.tracking import MlflowClient

    from raysys.tracking import MLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    first = MLflowLogger(uri, run_id)
    for step in range(1, 6):
        first.log_metrics({"train/loss": float(step), "eval/acc": 0.5} if step == 3 else {"train/loss": float(step)}, step)
    again = MLflowLogger(uri, run_id)  # the resumed process, from a checkpoint at step 2
    for step in range(3, 8):
        again.log_metrics({"train/loss": 10.0 + step, "eval/acc": 0.9}, step)
    loss = {m.step: [] for m in client.get_metric_history(run_id, "train/loss")}
    for m in client.get_metric_history(run_id, "train/loss"):
        loss[m.step].append(m.value)
    assert loss == {1: [1.0], 2: [2.0], 3: [3.0], 4: [4.0], 5: [5.0], 6: [16.0], 7: [17.0]}
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/acc")) == [
        (3, 0.5), (4, 0.9), (5, 0.9), (6, 0.9), (7, 0.9)]


def test_a_param_a_resume_changes_is_said_in_a_tag_not_lost(tmp_path):
    """MLflow keeps a param's first value; a resume with another value (a sweep's --tolerance) says so."""
    from mlflow.tracking import MlflowClient

    from raysys.tracking import PARAMS_CHANGED_TAG, MLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    MLflowLogger(uri, run_id).log_params({"sweep.tolerance": 0.02, "sweep.max_concurrent": 2})
    MLflowLogger(uri, run_id).log_params({"sweep.tolerance": 0.02, "sweep.max_concurrent": 2})
    assert PARAMS_CHANGED_TAG not in client.get_run(run_id).data.tags  # the same values: nothing to say
    for tolerance in (0.05, 0.05, 0.1):
        MLflowLogger(uri, run_id).log_params({"sweep.tolerance": tolerance, "sweep.max_concurrent": 2, "new": 1})
    run = client.get_run(run_id).data
    assert run.params == {"sweep.tolerance": "0.02", "sweep.max_concurrent": "2", "new": "1"}
    assert run.tags[PARAMS_CHANGED_TAG].splitlines() == ["sweep.tolerance: 0.02 -> 0.05", "sweep.tolerance: 0.02 -> 0.1"]


def test_buffered_artifacts_are_sent_from_the_run_folder_of_the_process_that_sends_them(tmp_path):
    """A run on remote storage works in a temporary copy of its folder, gone when its process ends; the
    records it buffered through an outage are sent by a later process from another copy. An artifact
    record names its file within the run folder, so it is found there; a file gone for good is
    dropped, and what waited behind it is still sent (before, it blocked the buffer for ever)."""
    import shutil

    from mlflow.tracking import MlflowClient

    from conftest import free_port
    from raysys.tracking import MLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    first_copy = tmp_path / "copy-1"
    first_copy.mkdir()
    (first_copy / "breakdown.md").write_text("| phase |")
    (first_copy / "gone.md").write_text("x")
    down = MLflowLogger(f"http://127.0.0.1:{free_port()}", run_id, buffer=first_copy / "tracking-buffer.jsonl")
    down.log_artifact(first_copy / "breakdown.md")  # the server is down: buffered
    down.log_artifact(first_copy / "gone.md")
    down.set_tags({"after": "yes"})
    assert down.pending == 3
    second_copy = tmp_path / "copy-2"
    shutil.copytree(first_copy, second_copy)
    shutil.rmtree(first_copy)  # the first process's copy is gone
    (second_copy / "gone.md").unlink()
    later = MLflowLogger(uri, run_id, buffer=second_copy / "tracking-buffer.jsonl")
    assert later.flush() and later.pending == 0
    assert [a.path for a in client.list_artifacts(run_id)] == ["breakdown.md"]
    assert client.get_run(run_id).data.tags["after"] == "yes"


def test_a_hung_tracking_server_is_looked_at_once_per_retry_not_called(tmp_path):
    """A server that takes connections and answers nothing: with records waiting, a retry that is due asks it
    one quick question (/health, 2 s) and, without an answer, buffers. Before, it sent the buffer's records,
    each holding the training loop for MLflow's timeout and retry (~20 s)."""
    import socket
    import threading

    from raysys.tracking import MLflowLogger

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    taken = []

    def accept():
        while True:
            try:
                conn, _ = hung.accept()
            except OSError:
                return
            taken.append(conn)  # kept open, never answered

    threading.Thread(target=accept, daemon=True).start()
    logger = MLflowLogger(f"http://127.0.0.1:{hung.getsockname()[1]}", "run", buffer=tmp_path / "tracking-buffer.jsonl")
    (tmp_path / "tracking-buffer.jsonl").write_text('{"kind": "metrics", "data": {"a": 1.0}, "step": 1}\n')
    logger._recorded = {}  # the steps MLflow holds are read once per process: not what this is about
    try:
        logger.log_metrics({"a": 2.0}, 2)  # a retry is due (the first): one look, no call
        assert logger.pending == 2 and len(taken) == 1
    finally:
        hung.close()
        for conn in taken:
            conn.close()


def test_a_full_disk_leaves_no_half_record_in_the_tracking_buffer_and_a_cut_one_blocks_nothing(tmp_path):
    """A record the buffer cannot take whole (the disk fills mid-write: here a file-size limit) is taken
    back out, and the error names the buffer; a record an older raysys left cut short (or a line edited in by
    hand) is dropped when the buffer is sent, not held in front of the rest for ever."""
    import subprocess
    import sys
    import textwrap

    from mlflow.tracking import MlflowClient

    from raysys import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.start_run(uri, "disk", "r")
    buffer = tmp_path / "run" / tracking.BUFFER_FILE
    buffer.parent.mkdir()
    first = '{"kind": "metrics", "data": {"loss": 1.0}, "step": 1}\n'
    buffer.write_text(first)
    child = textwrap.dedent(f"""
        import errno, resource, signal
        from raysys.tracking import MLflowLogger
        logger = MLflowLogger({uri!r}, {run_id!r}, buffer={str(buffer)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG
        limit = {len(first) + 30}
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            logger._append({{"kind": "metrics", "data": {{"loss": 0.5, "pad": "x" * 200}}, "step": 2}}, 0.0)
        except OSError as e:
            print(errno.errorcode[e.errno], e.filename)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["EFBIG", str(buffer)], out.stderr
    assert buffer.read_text() == first  # the 30 bytes that fitted were taken back out
    with open(buffer, "a") as f:  # what an older raysys left: a record cut by the full disk, then one more
        f.write('{"kind": "metrics", "data": {"lo\n[1, 2]\n{"foo": 1}\n'  # cut, and lines no raysys wrote
                '{"kind": "metrics", "data": {"loss": 0.25}, "step": 3}\n')
    logger = tracking.MLflowLogger(uri, run_id, buffer=buffer)
    assert logger.flush() and not buffer.exists()
    hist = MlflowClient(uri).get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in hist] == [(1, 1.0), (3, 0.25)]


@pytest.mark.slow  # ~30 s; test_faults.py::test_tracking_outage_mid_run_loses_nothing checks an outage by default
def test_the_end_of_a_run_sends_what_waited_once_the_server_is_back(tmp_path):
    """An outage that ends before the run does: the run's close tries the buffer at once, whatever the
    backoff of the last failed try, so the run ends FINISHED with every metric instead of waiting for a
    --resume."""
    from mlflow.tracking import MlflowClient

    from conftest import MlflowServer
    from raysys.tracking import MLflowLogger

    server = MlflowServer(tmp_path / "srv").start()
    try:
        client = MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("e")).info.run_id
        logger = MLflowLogger(server.url, run_id, buffer=tmp_path / "run" / "tracking-buffer.jsonl")
        logger.log_metrics({"train/loss": 1.0}, 1)
        server.stop()  # the outage
        logger.log_metrics({"train/loss": 0.5}, 2)
        assert logger.pending == 1
        server.start()  # back, well within the 30 s before the next try
        logger.log_metrics({"train/loss": 0.25}, 3)  # still within the backoff: waits behind the first
        assert logger.end("FINISHED") and logger.pending == 0
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.25)]
        assert client.get_run(run_id).info.status == "FINISHED"
    finally:
        server.stop()


def test_a_run_whose_final_quality_is_not_finite_failed():
    """Too few non-finite losses in a row for the loop to stop itself, but a NaN model at the end: the
    run is FAILED (diverged), not a success with `eval/mse nan`; a quality a loop need not report
    (a Task's, evaluated at its end) is not asked for."""
    from raysys import lifecycle
    from raysys.train.launcher import _Outcome

    lifecycle.reset()
    o = _Outcome()
    o.check({"step": 10, "eval/mse": float("nan"), "stability/nonfinite_loss": 8}, quality="eval/mse", required=False)
    assert o.failure == "diverged: its final eval/mse is nan"
    o.check({"step": 10, "eval/mse": float("inf")}, quality="eval/mse")
    assert o.failure == "diverged: its final eval/mse is inf"
    o.check({"step": 10, "eval/mse": 0.5}, quality="eval/mse", required=False)
    assert o.failure == ""
    o.check({"step": 10}, quality="eval/mse", required=False)
    assert o.failure == ""
    o.check({"step": 10}, quality="eval/mse")
    assert o.failure.startswith("no quality: ")


def test_a_datasets_digest_is_of_its_content(tmp_path, monkeypatch):
    """MLflow's dataset digest: the same data restored from a copy (a new mtime) is the same dataset; an edit
    that keeps the size is another. Past DIGEST_WHOLE_BYTES a folder is read in part, its ends and sizes."""
    import os
    import shutil

    from raysys import tracking

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("x,y\n1,2\n" * 1000)
    first = tracking.dir_digest(data)
    shutil.copy(data / "a.csv", tmp_path / "a.bak")
    (data / "a.csv").write_text("x,y\n1,3\n" * 1000)  # the same size
    edited = tracking.dir_digest(data)
    shutil.copy(tmp_path / "a.bak", data / "a.csv")
    os.utime(data / "a.csv", (1, 1))
    assert edited != first and tracking.dir_digest(data) == first
    monkeypatch.setattr(tracking, "DIGEST_WHOLE_BYTES", 100)
    (data / "b.bin").write_bytes(bytes(3 * 2**20))
    big = tracking.dir_digest(data)
    with open(data / "b.bin", "r+b") as f:
        f.seek(3 * 2**20 - 1)
        f.write(b"\x01")  # its last MiB: read
    assert tracking.dir_digest(data) != big
