"""Restores that fall back past a broken newest checkpoint keep exactly-once output: sinks that
can roll back (FileSink, CollectSink within a run) take back what the skipped checkpoints
committed; a sink that cannot makes the restore refuse unless repeated output is allowed.
And the restore= options say what they do: no silent fresh start, no silent continuation."""
from __future__ import annotations

import collections
import json
import os

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.faults import Fault
from abs.connectors.file_sink import FileSink, read_output
from abs.connectors.sinks import Sink, SinkWriter
from recovery import NoUsableCheckpointError
from storage import SnapshotStore, StoragePaths
from storage.errors import CorruptManifestError
from pacing import PacedSource

pytestmark = pytest.mark.integration

TOTAL, KEYS = 12_000, 120
CHECKPOINTS = abs.CheckpointConfig(interval=0.2, retained=20)


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


class AppendSink(Sink):
    """A user's sink without rollback: each commit appends the epoch's rows to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def create_writer(self, subtask, parallelism, restored_transactions=()):
        return _AppendWriter(f"{self.path}.{subtask}")


class _AppendWriter(SinkWriter):
    def __init__(self, path: str) -> None:
        self.path, self.rows, self.pending = path, [], {}

    def write(self, batch):
        self.rows.extend(batch.to_pylist())

    def pre_commit(self, checkpoint_id):
        self.pending[checkpoint_id], self.rows = self.rows, []
        return checkpoint_id

    def commit(self, checkpoint_id, transactions):
        with open(self.path, "a") as f:
            for t in transactions:
                for row in self.pending.pop(t, []):
                    f.write(json.dumps(row) + "\n")


def flow(out: str, *, append: str | None = None, collect: bool = False, gate: str | None = None) -> abs.Dataflow:
    """``gate``: each source reader stops at a quarter of the input until that file exists."""
    f = abs.Dataflow("fallback")
    src = abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=4, batch_size=100, rate=1_500)
    if gate is not None:
        src = PacedSource(src, TOTAL, hold=TOTAL // 4, gate=gate)
    counts = f.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())])
    counts.sink("out", FileSink(out, format="parquet"))
    if append is not None:
        counts.sink("alerts", AppendSink(append))
    if collect:
        counts.sink("mem", abs.CollectSink())
    return f


def assert_exactly_once(table: pa.Table) -> None:
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    expected = collections.Counter((np.arange(TOTAL) % KEYS).tolist())
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in expected.items()}


def finished_run(tmp_path, **kw) -> tuple[str, str, int]:
    """A fault-free run to the end whose newest checkpoint committed output; returns (root,
    output dir, newest checkpoint id).

    The premise must not depend on timing: with periodic checkpoints, one whose barrier
    reaches the sources after their last record but before the driver hears they are
    exhausted takes the tail of the output, and the final checkpoint then commits none. So
    this run has no periodic checkpoints: the test takes three while the sources wait at a
    gate with most of the input still to come, then opens the gate, and the final checkpoint
    is the only one after it: it commits the tail."""
    root, out, gate = str(tmp_path / "snap"), str(tmp_path / "out"), str(tmp_path / "gate")
    job = abs.submit(flow(out, gate=gate, **kw), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=None, retained=20))
    try:
        for _ in range(3):
            job.trigger_checkpoint()
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED"
    newest = SnapshotStore.open(root).latest_checkpoint()
    # the premise: the newest checkpoint committed output, which a fallback would repeat
    assert newest in FileSink(out).committed_checkpoints()
    return root, out, newest


def damage_manifest(root: str, cid: int, how: str) -> None:
    path = os.path.join(root, StoragePaths.manifest(cid))
    data = open(path, "rb").read()
    if how == "missing":
        os.remove(path)
        return
    if how == "unparsable":
        data = b'{"checkpoint_id": ' + str(cid).encode() + b', "keyed": {oops'
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "bit-flipped":
        mid = len(data) // 2
        data = data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:]
    with open(path, "wb") as f:
        f.write(data)


def corrupt_state_file(root: str, cid: int) -> str:
    store = SnapshotStore.open(root)
    own = [ref for ref in store.read_manifest(cid).files().values() if ref.checkpoint_id == cid]
    assert own, f"checkpoint {cid} wrote no state file"
    path = os.path.join(root, own[0].path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return own[0].path


def delete_state_file(root: str, cid: int) -> str:
    store = SnapshotStore.open(root)
    own = [ref for ref in store.read_manifest(cid).files().values() if ref.checkpoint_id == cid]
    assert own, f"checkpoint {cid} wrote no state file"
    os.remove(os.path.join(root, own[0].path))
    return own[0].path


@pytest.mark.parametrize("how", ["missing", "unparsable", "truncated", "bit-flipped", "state-file",
                                 "state-file-missing"])
def test_fallback_past_a_broken_newest_checkpoint_rolls_the_file_sink_back_to_exact_output(tmp_path, capfd, how):
    root, out, newest = finished_run(tmp_path)
    if how == "state-file":
        corrupt_state_file(root, newest)
    elif how == "state-file-missing":
        path = delete_state_file(root, newest)
    else:
        damage_manifest(root, newest, how)
    capfd.readouterr()
    result = abs.run(flow(out), parallelism=2, checkpoint=CHECKPOINTS, storage=root, restore="latest")
    err = capfd.readouterr().err
    assert result.status == "FINISHED"
    assert result.restored_from == newest - 1
    assert [cid for cid, _ in result.skipped_checkpoints] == [newest]
    assert result.rolled_back == {"out": [newest]}
    assert f"checkpoint {newest} skipped" in err  # every skip is logged with its reason ...
    assert f"restoring checkpoint {newest - 1} of {root} (skipped {newest}: " in err
    if how == "state-file-missing":  # the short reason says what is wrong (it was cut at '(': "file X: file")
        assert f"(skipped {newest}: file {path}: file is missing)" in err
    assert "sink 'out': rolled back" in err and f"committed by checkpoint(s) {newest}, restoring checkpoint" in err
    assert_exactly_once(read_output(out, "parquet"))  # ... and the output equals a fault-free run's
    # ids are never reused, not even the one of a deleted manifest
    assert min(c.checkpoint_id for c in result.completed_checkpoints) > newest


@pytest.mark.parametrize("where", ["into the root", "second savepoint of a directory"])
def test_restoring_a_savepoint_of_an_older_checkpoint_rolls_back_what_that_checkpoint_had_not_committed(
        tmp_path, capfd, where):
    """A savepoint's id can exceed the id of the checkpoint it copied: a copy of an older
    checkpoint into its own root gets the root's next id (and so is its latest), and the later
    of two savepoints in one directory the id after the first. Restoring it restores that older
    checkpoint's state, so the output committed after that checkpoint must be rolled back,
    not only the output above the savepoint's own id (which left it in place: published twice)."""
    root, out, newest = finished_run(tmp_path)
    store = SnapshotStore.open(root)
    older = newest - 1
    if where == "into the root":
        saved = store.savepoint(older, root)
        restore = "latest"
    else:
        restore = str(tmp_path / "sp")
        store.savepoint(newest, restore)
        saved = store.savepoint(older, restore)
    assert saved.checkpoint_id > older  # the premise: the copy's id is above the checkpoint it holds
    capfd.readouterr()
    result = abs.run(flow(out), parallelism=2, checkpoint=CHECKPOINTS, storage=root, restore=restore)
    err = capfd.readouterr().err
    assert result.status == "FINISHED" and result.restored_from == saved.checkpoint_id
    assert result.rolled_back == {"out": [newest]}
    assert f"restoring checkpoint {saved.checkpoint_id} (a savepoint of checkpoint {older}) of " in err
    assert_exactly_once(read_output(out, "parquet"))


def test_rollback_is_idempotent_and_finishes_one_stopped_part_way(tmp_path):
    out = str(tmp_path / "out")
    writers = [FileSink(out).create_writer(s, 2) for s in range(2)]
    for cid in (1, 2, 3):
        for w in writers:
            w.write(pa.record_batch({"x": [cid]}))
            w.commit(cid, [w.pre_commit(cid)])
    sink = FileSink(out)
    assert sink.committed_checkpoints() == [1, 2, 3]
    victim = sorted(n for n in os.listdir(out) if n.startswith("part-00000003"))[0]
    os.remove(os.path.join(out, victim))  # a rollback that died after its first delete
    done = sink.rollback(1)
    assert done.checkpoints == (2, 3) and done.items == 3
    assert sink.rollback(1).items == 0  # a second one finds nothing left
    assert sink.committed_checkpoints() == [1]
    assert sorted(read_output(out).column("x").to_pylist()) == [1, 1]


@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_sink_without_rollback_refuses_a_restore_that_repeats_its_output_unless_allowed(tmp_path, capfd, how):
    append = str(tmp_path / "alerts")
    root, out, newest = finished_run(tmp_path, append=append)
    damage_manifest(root, newest, how)  # a deleted manifest is still seen: the commit record names it
    with pytest.raises(abs.RepeatedOutputError) as info:
        abs.run(flow(out, append=append), parallelism=2, checkpoint=CHECKPOINTS, storage=root, restore="latest")
    message = str(info.value)
    assert "sink 'alerts'" in message and f"checkpoint(s) {newest}" in message
    assert "allow_repeated_output=True" in message and "cannot roll back" in message
    assert FileSink(out).committed_checkpoints()[-1] == newest, "a refused restore changes no output"
    capfd.readouterr()
    result = abs.run(flow(out, append=append), parallelism=2, checkpoint=CHECKPOINTS, storage=root,
                     restore="latest", allow_repeated_output=True)
    err = capfd.readouterr().err
    assert result.restored_from == newest - 1
    assert result.repeated_output == {"alerts": [newest]} and result.rolled_back == {"out": [newest]}
    assert f"sink 'alerts' will publish again the output it committed for checkpoint(s) {newest}" in err
    assert_exactly_once(read_output(out, "parquet"))  # the FileSink still rolls back
    repeated = sum(1 for s in range(2) for _ in open(f"{append}.{s}"))
    assert repeated > TOTAL  # as warned: the alerts of the skipped checkpoint were published again


def test_restart_falling_back_past_a_torn_manifest_rolls_back_collected_rows_and_files(tmp_path, capfd):
    """In one run: the 3rd manifest is torn on write (success reported), a worker is killed right
    after that commit; the restart skips checkpoint 3, restores 2 and neither the CollectSink nor
    the FileSink keeps what checkpoint 3 had published."""
    root, out = str(tmp_path / "snap"), str(tmp_path / "out")
    result = abs.run(
        flow(out, collect=True), parallelism=2, checkpoint=CHECKPOINTS,
        storage=f"faulty://{root}",
        storage_options={"target_protocol": "file", "faults": [
            {"op": "write", "nth": 3, "action": "tear_silent", "path_glob": "*/checkpoints/.chk-*"}]},
        restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
        runtime=abs.RuntimeOptions(faults=[Fault("after_commit", "task0#0", nth=3)]),
    )
    assert result.status == "FINISHED" and len(result.restarts) == 1
    assert result.restarts[0]["restored_from"] == 2
    assert [cid for cid, _ in result.skipped_checkpoints] == [3]
    assert set(result.rolled_back) == {"out", "mem"} and result.rolled_back["mem"] == [3]
    assert_exactly_once(result.collected("mem"))
    assert_exactly_once(read_output(out, "parquet"))


# ----------------------------------------------------------------------------- restore= options (D11)


def small_flow() -> abs.Dataflow:
    f = abs.Dataflow("small")
    src = abs.GeneratorSource(2_000, num_keys=20, num_splits=2, batch_size=200)
    f.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink(
        "mem", abs.CollectSink())
    return f


@pytest.mark.parametrize("restore", ["latest", "latest-if-any", "fresh", 3])
def test_restore_words_without_storage_name_what_to_pass(restore):
    with pytest.raises(abs.ConfigError, match=r"needs storage= .*pass storage="):
        abs.run(small_flow(), restore=restore)


def test_latest_on_an_empty_root_is_an_error_and_latest_if_any_starts_fresh(tmp_path, capfd):
    root = str(tmp_path / "snap")
    with pytest.raises(NoUsableCheckpointError, match=r"holds no checkpoint of job 'small'.*restore='latest-if-any'"):
        abs.run(small_flow(), parallelism=2, storage=root, restore="latest")
    # the refusal leaves the root as it was: no probe file, no claim by a job that never ran
    assert SnapshotStore.open(root).list_files() == {}
    other = abs.Dataflow("other")
    other.source("s", abs.GeneratorSource(10, num_keys=2)).sink("mem", abs.CollectSink())
    assert abs.run(other, parallelism=1, storage=root).status == "FINISHED"  # no JobMismatchError
    root = str(tmp_path / "snap2")
    capfd.readouterr()
    first = abs.run(small_flow(), parallelism=2, storage=root, restore="latest-if-any")
    assert first.restored_from is None and first.status == "FINISHED"
    assert "starting fresh (restore='latest-if-any':" in capfd.readouterr().err
    second = abs.run(small_flow(), parallelism=2, storage=root, restore="latest-if-any")
    assert second.restored_from == first.last_checkpoint
    assert f"restoring checkpoint {first.last_checkpoint} of {root}" in capfd.readouterr().err


def test_no_restore_into_a_root_with_checkpoints_is_refused_and_fresh_continues_the_ids(tmp_path, capfd):
    root = str(tmp_path / "snap")
    first = abs.run(small_flow(), parallelism=2, storage=root)
    latest = first.last_checkpoint
    with pytest.raises(abs.ConfigError) as info:
        abs.run(small_flow(), parallelism=2, storage=root)
    message = str(info.value)
    assert root in message and f"latest id {latest}" in message
    assert "restore='latest'" in message and "restore='fresh'" in message and "another storage root" in message
    capfd.readouterr()
    again = abs.run(small_flow(), parallelism=2, storage=root, restore="fresh")
    assert again.restored_from is None and again.collected("mem").num_rows == 2_000  # empty state, all input again
    assert again.last_checkpoint > latest
    assert f"starting fresh (restore='fresh': {root} holds checkpoints up to {latest}" in capfd.readouterr().err


# ----------------------------------------------------------------------------- pure decisions

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from abs.runtime.restore import SinkView, committed_evidence, id_ranges, plan_output  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(
    target=st.integers(0, 12),
    above=st.sets(st.integers(1, 15)),
    here=st.sets(st.integers(1, 15)),
    kinds=st.lists(st.sampled_from(["rollback", "collect", "none"]), min_size=1, max_size=4),
)
def test_output_plan_never_lets_committed_output_above_the_target_repeat_unannounced(target, above, here, kinds):
    sinks = [SinkView(f"s{i}", k, "T") for i, k in enumerate(kinds)]
    known = committed_evidence([], None, {}, here)
    known.update({i: "seen" for i in above})
    plan = plan_output(target, known, sinks, here)
    expected = {i for i in above | here if i > target}
    for s in sinks:
        dropped = set(plan.drop_collected.get(s.uid, ()))
        repeated = set(plan.repeated.get(s.uid, ()))
        if s.kind == "rollback":
            assert s.uid in plan.rollback and not repeated  # the sink's own record decides
        elif s.kind == "collect":
            assert dropped == {i for i in here if i > target}  # rows this driver holds are dropped
            assert dropped | repeated == expected and not dropped & repeated  # the rest is announced
        else:
            assert repeated == expected and not dropped
    assert (plan.refusal("j", "restoring") is None) == (not plan.repeated)


def test_refusal_names_sink_checkpoints_reasons_and_remedies():
    plan = plan_output(40, {41: "file x: checksum", 42: "manifest missing"}, [SinkView("alerts", "none", "Mail")])
    msg = plan.refusal("fraud", "restoring checkpoint 40 of /r")
    assert msg is not None and msg.startswith("job 'fraud': restoring checkpoint 40 of /r would publish")
    assert "sink 'alerts' already committed output of checkpoint(s) 41-42 (42: manifest missing; 41: file x" in msg
    assert "Mail cannot roll back" in msg and msg.endswith("allow_repeated_output=True to accept the repeated output")
    assert id_ranges([44, 40, 41, 42]) == "40-42, 44"


def test_choose_restore_names_why_each_newer_checkpoint_was_skipped(tmp_path):
    from recovery import choose_restore

    root = str(tmp_path / "snap")
    abs.run(small_flow(), parallelism=1, storage=root, checkpoint=abs.CheckpointConfig())
    store = SnapshotStore.open(root)
    (only,) = store.list_checkpoints()
    bad = os.path.join(root, StoragePaths.manifest(only + 1))
    with open(bad, "wb") as f:
        f.write(b"{garbage")
    choice = choose_restore(SnapshotStore.open(root), "latest", known_committed={only + 2: "the commit record names it"})
    assert choice.checkpoint_id == only
    assert [(s.checkpoint_id, s.reason.split(" (")[0]) for s in choice.skipped] == [
        (only + 2, "manifest missing"), (only + 1, "manifest does not parse as JSON")]
    assert "the commit record names it" in choice.skipped[0].reason
    assert choice.warnings[-1].endswith(f"trying checkpoint {only}")


def test_a_restart_before_the_first_checkpoint_restores_the_savepoint_the_run_started_from(tmp_path, capfd):
    """A run restored from a savepoint (here: another root) crashes before its first checkpoint;
    the restart restores that savepoint again instead of starting from empty state."""
    def job(total: int) -> abs.Dataflow:
        f = abs.Dataflow("small")
        src = abs.GeneratorSource(total, num_keys=20, num_splits=2, batch_size=100)
        f.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink(
            "mem", abs.CollectSink())
        return f

    saved = str(tmp_path / "saved")
    abs.run(job(2_000), parallelism=2, storage=saved)
    capfd.readouterr()
    result = abs.run(job(4_000), parallelism=2, storage=str(tmp_path / "new"), restore=saved,
                     checkpoint=abs.CheckpointConfig(interval=None),  # no checkpoint before the crash
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.0),
                     runtime=abs.RuntimeOptions(faults=[Fault("records", "task1#0", nth=600)]))  # of ~1,000
    assert result.status == "FINISHED" and len(result.restarts) == 1
    assert result.restarts[0]["restored_from"] == result.restored_from is not None
    final = collections.defaultdict(int)
    for row in result.collected("mem").to_pylist():
        final[row["key"]] = max(final[row["key"]], row["count"])
    assert dict(final) == {k: 200 for k in range(20)}  # 4,000 events over 20 keys, counted on from 2,000
    assert capfd.readouterr().err.count(f"restoring checkpoint {result.restored_from} of {saved}") == 2


def test_commit_record_names_the_newest_checkpoint_and_gc_keeps_it(tmp_path):
    root = str(tmp_path / "snap")
    result = abs.run(small_flow(), parallelism=1, storage=root, checkpoint=abs.CheckpointConfig())
    store = SnapshotStore.open(root)
    assert store.recorded_committed() == result.last_checkpoint  # a CollectSink cannot roll back: recorded
    plan = store.plan_gc(1)
    assert StoragePaths.COMMIT_RECORD not in plan.unknown and StoragePaths.COMMIT_RECORD not in plan.delete_files
    with open(os.path.join(root, StoragePaths.COMMIT_RECORD), "wb") as f:
        f.write(b"x" * 10_000)  # oversized: refused unread, as corrupt
    with pytest.raises(CorruptManifestError, match="_committed.json"):
        store.recorded_committed()
