"""Unaligned checkpoints (``CheckpointConfig(mode="unaligned")``) and the alignment timeout:
the gate's capture of the records a barrier overtakes, the aligner giving an alignment up,
exact jobs under backpressure whose checkpoints hold channel state, a real SIGKILL and a
restore that replays it (also into another parallelism, re-routed by key group)."""
from __future__ import annotations

import collections
import threading
import time

import pyarrow as pa
import pytest

import abs
from abs.alignment import BarrierAligner, TriggerSnapshot
from abs.errors import AlignmentError, ConfigError, ReconfigurationError
from abs.faults import Fault
from abs.runtime.channels import EOS, Announcement, Barrier, CaptureComplete, InputGate, decode, encode
from storage import SnapshotStore

TOTAL, KEYS = 6000, 60


def batch(*values: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, pa.int64())], names=["x"])


def rows(batches) -> list[int]:
    return [v for b in batches for v in b.column(0).to_pylist()]


# ---------------------------------------------------------------------- the gate
def test_the_gate_captures_what_the_barrier_overtook():
    gate = InputGate(2, capacity=2)
    gate.put(0, batch(1))
    gate.put(0, batch(2))
    assert gate.take(frozenset(), 0) == (0, batch(1))  # taken before the snapshot: not channel state
    gate.put_priority(0, Announcement(Barrier(7), 3))  # the barrier is element 3 of channel 0
    got = gate.take(frozenset(), 0)
    assert got == (0, Announcement(Barrier(7), 3))  # ahead of the queued batch
    gate.put(0, batch(3))  # element 2: the last in front of the barrier
    gate.start_capture(7, [0, 1], {0: 3})
    assert gate.finish_capture(7) is None  # channel 1's barrier position is unknown
    gate.put(1, batch(10))
    gate.put(1, batch(11))
    gate.end_capture(7, 1, 1)  # its barrier is element 1: only batch 10 is in front
    assert gate.take(frozenset(), 0) == (-1, CaptureComplete(7))
    assert rows(gate.finish_capture(7)) == [2, 3, 10]  # channel 0's elements 1, 2; channel 1's element 0
    assert not gate.capturing(7)


def test_a_channel_that_ends_before_its_barrier_completes_the_capture():
    gate = InputGate(1)
    gate.start_capture(3, [0], {})
    gate.put(0, batch(5))
    gate.put(0, EOS)
    assert gate.take(frozenset(), 0) == (-1, CaptureComplete(3))
    assert rows(gate.finish_capture(3)) == [5]


def test_an_announced_channel_takes_elements_past_its_capacity():
    gate = InputGate(1, capacity=1)
    gate.put(0, batch(1))
    gate.put_priority(0, Announcement(Barrier(1), 3))
    done = threading.Event()

    def put_three():
        for v in (2, 3):
            gate.put(0, batch(v))
        done.set()
        gate.put(0, batch(4))  # element 3 is the barrier's place: waits for room again

    t = threading.Thread(target=put_three, daemon=True)
    t.start()
    assert done.wait(10), "elements in front of an announced barrier waited for room"
    assert gate.buffered() == [3]
    assert gate.take(frozenset(), 0)[1] == Announcement(Barrier(1), 3)
    assert t.is_alive()
    for v in (1, 2, 3):  # under its capacity again: the next element gets in
        assert gate.take(frozenset(), 0) == (0, batch(v))
    t.join(10)
    assert not t.is_alive() and gate.buffered() == [1]


def test_announcements_survive_the_wire():
    ann = Announcement(Barrier(12, 9), 4567)
    assert decode(encode(ann)) == ann


def test_the_aligner_gives_an_alignment_up():
    a = BarrierAligner(3)
    a.on_barrier(0, 5)
    assert a.give_up(5) == {0} and a.blocked == frozenset() and a.is_closed(5)
    assert a.on_barrier(1, 5) == ()  # late barriers of it are ignored
    assert a.give_up(6) == frozenset() and a.is_closed(6)  # heard of by announcements only
    a.on_barrier(0, 7)
    with pytest.raises(AlignmentError):
        a.give_up(8)
    assert a.on_barrier(1, 7) == () and a.on_barrier(2, 7) == (TriggerSnapshot(7),)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="alignment_timeout must be"):
        abs.CheckpointConfig(alignment_timeout=-1)
    with pytest.raises(ConfigError, match="applies to mode='aligned'"):
        abs.CheckpointConfig(mode="unaligned", alignment_timeout=1.0)
    assert abs.CheckpointConfig(mode="unaligned").priority_barriers
    assert not abs.CheckpointConfig().priority_barriers


# ---------------------------------------------------------------------- whole jobs
def count(ctx, r):
    n = (ctx.state.n.value() or 0) + 1
    ctx.state.n.update(n)
    ctx.emit({"key": ctx.key, "n": n})


def slow(b: pa.RecordBatch) -> pa.RecordBatch:
    time.sleep(0.0005 * b.num_rows)  # 2000 rows/s per subtask: half of what the source sends
    return b


def backpressured(rate: float = 2000) -> abs.Dataflow:
    flow = abs.Dataflow("backpressure")
    src = abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=4, batch_size=32, rate=rate)
    flow.source("src", src).key_by("key").process("count", count, state=[abs.ValueState("n", pa.int64())]) \
        .rebalance().map_batches(slow, uid="slow").sink("out", abs.CollectSink())
    return flow


def check_counts(table: pa.Table) -> None:
    per_key = collections.defaultdict(list)
    for k, n in zip(table.column("key").to_pylist(), table.column("n").to_pylist()):
        per_key[k].append(n)
    assert len(per_key) == KEYS
    for k, ns in per_key.items():
        assert sorted(ns) == list(range(1, TOTAL // KEYS + 1)), f"key {k}: {len(ns)} counts, {len(set(ns))} distinct"


def with_channel_state(root: str) -> list:
    store = SnapshotStore.open(root)
    return [m for m in (store.read_manifest(c) for c in store.list_checkpoints()) if m.channel_logs]


@pytest.mark.parametrize("config", [dict(mode="unaligned"), dict(alignment_timeout=0.0)],
                         ids=["unaligned", "aligned-with-timeout-0"])
def test_backpressured_jobs_are_exact_and_their_checkpoints_hold_channel_state(tmp_path, config):
    root = str(tmp_path)
    result = abs.run(backpressured(), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.2, retained=1000, **config))
    assert result.status == "FINISHED"
    check_counts(result.collected("out"))
    held = with_channel_state(root)
    assert held, "no checkpoint overtook a record"
    m = held[0]
    assert m.stats["channel_records"] == sum(r.rows for r in m.channel_logs) > 0
    assert m.stats["channel_bytes"] == sum(r.bytes for r in m.channel_logs)
    assert SnapshotStore.open(root).verify(m.checkpoint_id).ok
    last = SnapshotStore.open(root).read_manifest(SnapshotStore.open(root).latest_checkpoint())
    assert last.stats["channel_records"] == 0  # the final checkpoint: nothing left in flight


@pytest.mark.parametrize("then", [None, "during_replay", "during_log_upload"])
def test_a_kill_after_a_checkpoint_with_channel_state_restores_exactly(tmp_path, then):
    """Worker 1 is SIGKILLed right after the 4th checkpoint is committed; the restore replays
    its channel state before any input, and every count is there exactly once. ``then``: a
    worker is SIGKILLed again in the restored attempt, while it replays the channel state or
    while it stores the next one."""
    root = str(tmp_path)
    faults = (Fault("after_commit", "task1#1", nth=4),) + ((Fault(then, "*", nth=1, attempt=1),) if then else ())
    result = abs.run(backpressured(), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.2, retained=1000, mode="unaligned"),
                     restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
                     runtime=abs.RuntimeOptions(faults=faults))
    assert result.status == "FINISHED" and len(result.restarts) == (2 if then else 1), result.restarts
    restored = SnapshotStore.open(root).read_manifest(result.restarts[0]["restored_from"])
    assert restored.stats["channel_records"] > 0, "the restored checkpoint overtook nothing"
    check_counts(result.collected("out"))


def test_channel_state_is_rerouted_by_key_group_into_another_parallelism(tmp_path):
    """Canceled after a checkpoint whose channel state holds records for the keyed operator,
    restored at parallelism 3: each record goes to its key group's new owner, once."""
    root = str(tmp_path)
    job = abs.submit(backpressured(rate=1500), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=None, retained=1000, mode="unaligned"))
    keyed = None
    for _ in range(300):
        cid = job.trigger_checkpoint()
        m = SnapshotStore.open(root).read_manifest(cid)
        if any(r.location().task.startswith("count#") for r in m.channel_logs):
            keyed = m
            break
    first = job.cancel()
    assert keyed is not None, "no checkpoint overtook a record on its way to the keyed operator"
    second = abs.run(backpressured(), parallelism=3, storage=root, restore=keyed.checkpoint_id,
                     checkpoint=abs.CheckpointConfig(interval=0.2, mode="unaligned"))
    assert second.status == "FINISHED"
    # (the first run may have committed no output yet: an empty table without columns)
    check_counts(pa.concat_tables([t for t in (first.collected("out"), second.collected("out")) if t.num_columns]))


def test_unaligned_jobs_refuse_loops_and_live_reconfiguration(tmp_path):
    job = abs.submit(backpressured(), parallelism=2, storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=0.2, mode="unaligned"))
    try:
        with pytest.raises(ReconfigurationError, match="unaligned checkpoints"):
            job.rescale(3)
    finally:
        job.cancel()
    flow = abs.Dataflow("loop")
    flow.source("s", abs.GeneratorSource(10)).iterate(
        "it", lambda loop: (loop.filter(lambda r: False, uid="never").rebalance(), loop.map(lambda r: r, uid="out"))
    ).sink("o", abs.CollectSink())
    with pytest.raises(ConfigError, match="do not snapshot loops yet"):
        abs.run(flow, storage=str(tmp_path / "l"), checkpoint=abs.CheckpointConfig(mode="unaligned"))
