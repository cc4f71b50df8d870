"""Retention GC off the driver's loop (abs.runtime.cleanup): requests return at once,
coalesce while one runs, plan as of the checkpoint that asked, and a finished job has
applied its retention."""
from __future__ import annotations

import threading

import pyarrow as pa
import pytest

import abs
from abs.runtime.cleanup import BackgroundGc, GcRequest
from pacing import PacedSource
from storage import Manifest, SnapshotStore


class GatedStore:
    """A real store whose ``gc`` waits for a gate and records its arguments."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.gate = threading.Event()
        self.started = threading.Event()
        self.calls: list[int] = []

        self.active = 0
        self.most_active = 0
        self.lock = threading.Lock()

    def gc(self, retain, in_flight=(), *, as_of=None):
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            self.started.set()
            assert self.gate.wait(10)
            self.calls.append(as_of)
            return self.store.gc(retain, in_flight=in_flight, as_of=as_of)
        finally:
            with self.lock:
                self.active -= 1


def table(keys):
    return pa.table({"key": pa.array(keys, pa.int64()), "value": pa.array(keys, pa.int64())})


def commit(store, cid):
    chain = store.write_key_group(cid, "op", "s", 0, [], table([cid]))
    store.commit(Manifest(checkpoint_id=cid, job_name="j", max_parallelism=8, keyed={"op": {"s": {0: chain}}}))


def test_requests_return_at_once_coalesce_and_drain_waits(tmp_path):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": 8})
    for cid in (1, 2, 3, 4):
        commit(store, cid)
    gated = GatedStore(store)
    gc = BackgroundGc()
    gc.submit(GcRequest(gated, 1, (), 2))
    assert gated.started.wait(10)  # running, blocked at the gate: the caller was not
    gc.submit(GcRequest(gated, 1, (), 3))
    gc.submit(GcRequest(gated, 1, (), 4))  # replaces the waiting request for 3
    assert not gc.drain(timeout=0.2)
    gated.gate.set()
    assert gc.drain(timeout=10)
    assert gated.calls == [2, 4]
    assert store.list_checkpoints() == [4]
    assert gc.close(timeout=10)
    gc.submit(GcRequest(gated, 1, (), 4))  # after close: ignored
    assert gc.drain(timeout=1) and gated.calls == [2, 4]


def test_a_request_submitted_beside_run_now_waits_for_it(tmp_path):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": 8})
    for cid in (1, 2, 3):
        commit(store, cid)
    gated = GatedStore(store)
    gc = BackgroundGc()
    inline = threading.Thread(target=gc.run_now, args=(GcRequest(gated, 2, (), 2),))
    inline.start()
    assert gated.started.wait(10)  # run_now is inside its GC, blocked at the gate
    gc.submit(GcRequest(gated, 1, (), 3))
    assert not gc.drain(timeout=0.2)
    gated.gate.set()
    inline.join(10)
    assert gc.drain(timeout=10)
    assert gated.calls == [2, 3] and gated.most_active == 1
    assert store.list_checkpoints() == [3]
    assert gc.close(timeout=10)


def test_a_failing_gc_warns_and_the_next_request_runs(tmp_path, capsys):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": 8})
    commit(store, 1)
    commit(store, 2)
    gc = BackgroundGc()
    gc.submit(GcRequest(store, 0, (), 2))  # retain 0 is refused by the store
    assert gc.drain(timeout=10)
    assert "garbage collection after checkpoint 2 failed" in capsys.readouterr().err
    assert store.list_checkpoints() == [1, 2]
    gc.run_now(GcRequest(store, 1, (), 2))
    assert store.list_checkpoints() == [2]
    assert gc.close(timeout=10)


@pytest.mark.integration
def test_a_finished_job_has_applied_its_retention(tmp_path):
    def count(ctx, row):
        ctx.state.n.update((ctx.state.n.value() or 0) + 1)

    flow = abs.Dataflow("retention")
    # each source reader emits at most 700 of its 3,000 records per completed checkpoint
    src = PacedSource(abs.GeneratorSource(6_000, num_keys=50, num_splits=2, batch_size=100), 700)
    flow.source("src", src).key_by("key").process("count", count, state=[abs.ValueState("n", pa.int64())])
    # every delete takes 20 ms (only the driver's GC deletes): a GC still runs when the
    # workers are done, and run() must wait for it
    result = abs.run(flow, parallelism=2, storage=f"faulty://{tmp_path}",
                     storage_options={"target_protocol": "file", "faults": [
                         {"op": "delete", "action": "delay", "seconds": 0.02, "times": None}]},
                     checkpoint=abs.CheckpointConfig(interval=0.2, retained=1))
    assert len(result.completed_checkpoints) >= 3
    store = SnapshotStore.open(str(tmp_path))
    assert store.list_checkpoints() == [result.completed_checkpoints[-1].checkpoint_id]
    assert store.plan_gc(1).empty  # nothing left behind for a later GC


@pytest.mark.integration
def test_jobs_leave_no_gc_thread_behind(tmp_path):
    flow = abs.Dataflow("threads")
    src = PacedSource(abs.GeneratorSource(2_000, num_keys=20, num_splits=1, batch_size=100), 700)  # 3 steps
    flow.source("src", src).key_by("key").process("count", lambda ctx, row: ctx.state.n.update(1),
                                                  state=[abs.ValueState("n", pa.int64())])
    before = [t for t in threading.enumerate() if t.name == "abs-gc"]
    for i in range(2):
        result = abs.run(flow, parallelism=1, storage=str(tmp_path / str(i)),
                         checkpoint=abs.CheckpointConfig(interval=0.1, retained=1))
        assert len(result.completed_checkpoints) >= 2
    assert [t for t in threading.enumerate() if t.name == "abs-gc"] == before
