"""Savepoints pin what they copy (issue 19, A1): pins that every GC honours (the pure planner,
another process's GC), savepoints that never leave a partial destination, and savepoints of a
running job that checkpoints every 0.1 s with retained=1."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest

import abs
from pacing import PacedSource
from storage import CheckpointNotFoundError, FileRef, Manifest, MissingFileError, SnapshotStore, StoragePaths, plan_gc
from storage.pins import PinRecord
from storage.savepoint import remove_incomplete_savepoints

T = "0" * 32
JOB = {"job_name": "wc", "max_parallelism": 8}


def ref(cid: int, kind: str = "base", kg: int = 0) -> FileRef:
    return FileRef(path=StoragePaths.state_file(cid, "op", "s", kg, kind, f"{cid:032x}"), kind=kind,  # type: ignore[arg-type]
                   checkpoint_id=cid, rows=1, bytes=10, checksum="a" * 32, checksum_algorithm="xxh3_128")


def manifest(cid: int, chain: list[FileRef]) -> Manifest:
    return Manifest(checkpoint_id=cid, job_name="wc", max_parallelism=8, keyed={"op": {"s": {0: chain}}})


def pin(first: int, last: int | None, expires_at: float = 100.0) -> PinRecord:
    return PinRecord(first, last, 0.0, expires_at, "test", StoragePaths.pin(f"{first:032x}"))


# ====================================================================== the planner
def test_a_pinned_checkpoint_keeps_its_manifest_and_every_file_it_references_beyond_retention():
    # checkpoint 2 builds on 1's base; 3 is a new base; retain=1 would drop 1 and 2
    b1, d2, b3 = ref(1), ref(2, "delta"), ref(3)
    manifests = {1: manifest(1, [b1]), 2: manifest(2, [b1, d2]), 3: manifest(3, [b3])}
    listing = {r.path: 10 for r in (b1, d2, b3)} | {StoragePaths.manifest(c): 1 for c in manifests}
    unpinned = plan_gc(listing, manifests, retain=1)
    assert set(unpinned.delete_files) == {b1.path, d2.path} and unpinned.dropped == (1, 2)
    p = pin(2, 2)
    listing[p.path] = 50
    plan = plan_gc(listing, manifests, retain=1, pins=[p], now=10.0)
    assert plan.retained == (2, 3) and plan.held == (2,) and plan.dropped == (1,)
    assert plan.delete_files == () and plan.delete_manifests == (StoragePaths.manifest(1),)
    assert plan.pins == (p.path,) and p.path not in plan.delete_files + plan.delete_pins
    assert "held by 1 pin(s): checkpoints [2]" in plan.summary()


def test_a_pin_from_an_id_on_holds_later_checkpoints_and_their_files_in_flight():
    b1, b2, b3, in_flight = ref(1), ref(2), ref(3), ref(4)
    manifests = {1: manifest(1, [b1]), 2: manifest(2, [b2]), 3: manifest(3, [b3])}
    listing = {r.path: 10 for r in (b1, b2, b3, in_flight)}
    # as the job's GC plans it: as of checkpoint 3, but the savepoint's checkpoint 2 must stay
    plan = plan_gc(listing, manifests, retain=1, pins=[pin(2, None)], now=10.0, protect_newer_than=1)
    assert plan.retained == (2, 3) and plan.delete_files == (b1.path,)
    assert in_flight.path in plan.protected


def test_an_expired_pin_holds_nothing_and_is_deleted():
    b1, b2 = ref(1), ref(2)
    manifests = {1: manifest(1, [b1]), 2: manifest(2, [b2])}
    p = pin(1, 1, expires_at=5.0)
    listing = {b1.path: 10, b2.path: 10, p.path: 50}
    plan = plan_gc(listing, manifests, retain=1, pins=[p], now=6.0)
    assert plan.dropped == (1,) and plan.delete_files == (b1.path,) and plan.delete_pins == (p.path,)
    assert plan_gc(listing, manifests, retain=1, pins=[p], now=4.0).dropped == ()


# ====================================================================== stores and processes
def commit_chain(store: SnapshotStore, cid: int, prev: list[FileRef]) -> list[FileRef]:
    table = pa.table({"key": pa.array([cid, 1000 + cid], pa.int64()), "value": pa.array([cid, cid], pa.int64())})
    chain = store.write_key_group(cid, "count", "n", 3, prev, table)
    store.commit(Manifest(checkpoint_id=cid, job_name="wc", max_parallelism=8, keyed={"count": {"n": {3: list(chain)}}}))
    return chain


PINNER = """
import sys, time
from storage import SnapshotStore
lease = SnapshotStore.open(sys.argv[1]).pin(int(sys.argv[2]), int(sys.argv[2]), ttl=3600, holder="test process")
print(lease.record.path, flush=True)
time.sleep(3600)
"""


def test_a_pin_of_another_process_is_honoured_by_gc_until_it_expires_even_after_kill_9(tmp_path):
    root = str(tmp_path)
    store = SnapshotStore.open(root)
    store.init_job(JOB)
    chain = commit_chain(store, 1, [])
    files_of_1 = store.read_manifest(1).paths()
    proc = subprocess.Popen([sys.executable, "-c", PINNER, root, "1"], stdout=subprocess.PIPE, text=True)
    try:
        pin_path = proc.stdout.readline().strip()  # the pin exists once the path is printed
        assert pin_path.startswith("pins/pin-")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for cid in (2, 3):
        chain = commit_chain(store, cid, chain[:0])  # new bases: nothing of 1 is needed any more
        plan = store.gc(retain=1)
        assert 1 in plan.retained and plan.held == (1,)
    assert files_of_1 <= set(store.list_files()) and store.verify(1).ok
    # the holder died: an hour later the pin has expired, and the next GC removes both
    later = SnapshotStore.open(root, clock=lambda: time.time() + 7200)
    plan = later.gc(retain=1)
    assert plan.dropped == (1,) and plan.delete_pins == (pin_path,)
    assert not files_of_1 & set(later.list_files()) and pin_path not in later.list_files()


def test_a_lease_renews_and_releases(tmp_path):
    now = [1000.0]
    store = SnapshotStore.open(str(tmp_path), clock=lambda: now[0])
    store.init_job(JOB)
    with store.pin(5, None, ttl=30, holder="renewal") as lease:
        first = lease.record
        lease.renew()
        assert lease.record == first  # plenty of time left
        now[0] += 25
        lease.renew()
        assert lease.record.path != first.path and lease.record.expires_at == now[0] + 30
        assert [p.path for p in store.pins()] == [lease.record.path]
        lease.retarget(7, 7)
        assert [(p.first, p.last) for p in store.pins()] == [(7, 7)]
    assert store.pins() == [] and not [p for p in store.list_files() if p.startswith("pins/")]


def test_a_failed_savepoint_leaves_nothing_that_looks_like_a_savepoint(tmp_path):
    src = SnapshotStore.open(str(tmp_path / "src"))
    src.init_job(JOB)
    chain = commit_chain(src, 1, [])
    for cid in (2, 3):
        chain = commit_chain(src, cid, chain)
    (tmp_path / "src" / chain[-1].path).unlink()  # a file of checkpoint 3 is lost
    dest = str(tmp_path / "dest")
    with pytest.raises(MissingFileError, match="checkpoint 3"):
        src.savepoint(3, dest)
    # no manifest, no data file, no marker, no pin: an empty root of the job
    left = SnapshotStore.open(dest).list_files()
    assert set(left) == {"_job.json"}, left
    assert src.pins() == []
    # a savepoint of an intact checkpoint into the same destination works
    sp = src.savepoint(2, dest)
    assert SnapshotStore.open(dest).list_checkpoints() == [sp.checkpoint_id] and SnapshotStore.open(dest).verify().ok


def test_a_killed_savepoint_copy_is_marked_incomplete_and_cleaned_by_the_next_one(tmp_path):
    src = SnapshotStore.open(str(tmp_path / "src"))
    src.init_job(JOB)
    chain = commit_chain(src, 1, [])
    commit_chain(src, 2, chain)
    dest_url = str(tmp_path / "dest")
    dest = SnapshotStore.open(dest_url)
    dest.init_job(JOB)
    # what a copy killed with kill -9 leaves: the marker and some files of its id, no manifest
    leftover = dest.write_key_group(2, "count", "n", 3, [], pa.table({"key": pa.array([1], pa.int64()),
                                                                       "value": pa.array([1], pa.int64())}))
    dest._io.put(StoragePaths.savepoint_incomplete(2), b"copy in progress\n")
    assert dest.list_checkpoints() == []  # never read as a savepoint
    sp = src.savepoint(2, dest_url)
    files = SnapshotStore.open(dest_url).list_files()
    assert leftover[0].path not in files and not [p for p in files if p.endswith(".incomplete")]
    assert SnapshotStore.open(dest_url).list_checkpoints() == [sp.checkpoint_id] and SnapshotStore.open(dest_url).verify().ok
    assert remove_incomplete_savepoints(SnapshotStore.open(dest_url)) == []


def test_a_savepoint_of_a_checkpoint_gc_removed_says_so_and_leaves_nothing(tmp_path):
    src = SnapshotStore.open(str(tmp_path / "src"))
    src.init_job(JOB)
    commit_chain(src, 1, [])
    commit_chain(src, 2, [])
    src.gc(retain=1)
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 1 does not exist"):
        src.savepoint(1, str(tmp_path / "dest"))
    assert src.pins() == []


# ====================================================================== a running job
NUM_KEYS = 97
TOTAL = 30_000  # paced and held (see counting_flow): more input is not needed to outlast the savepoints


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def counting_flow(held_at: str | None = None) -> abs.Dataflow:
    flow = abs.Dataflow("sp-counts")
    src: abs.Source = abs.GeneratorSource(TOTAL, num_keys=NUM_KEYS, num_splits=4, batch_size=100)
    if held_at is not None:
        # each source reader emits at most 1,000 of its 15,000 records per completed checkpoint
        # and stops at 12,000 until the file ``held_at`` exists (the test never creates it):
        # still running, and checkpointing all the while, when the test takes its savepoints
        src = PacedSource(src, 1_000, hold=12_000, gate=held_at)
    flow.source("src", src).key_by("key").process("count", count_fn,
                                                  state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    return flow


def state_of(store: SnapshotStore, cid: int) -> dict:
    m = store.read_manifest(cid)
    out: dict = {}
    for kg in m.keyed.get("count", {}).get("n", {}):
        t = store.read_key_group(m, "count", "n", kg)
        out.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    return out


def test_savepoints_of_a_job_checkpointing_every_100ms_with_retained_1_restore_exactly(tmp_path):
    job = abs.submit(counting_flow(held_at=str(tmp_path / "never-opened")), parallelism=2, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.1, retained=1))
    savepoints = []
    try:
        deadline = time.monotonic() + 120
        while job.metrics()["completed_checkpoints"] < 3 and job.status in ("CREATED", "RUNNING") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert job.metrics()["completed_checkpoints"] >= 3 and job.status == "RUNNING", job.status
        for i in range(3):
            savepoints.append(job.savepoint(str(tmp_path / f"sp{i}")))
    finally:
        job.cancel()
    expected = collections.Counter((np.arange(TOTAL) % NUM_KEYS).tolist())
    seen = []
    for path in savepoints:
        store = SnapshotStore.open(path)
        (sp_id,) = store.list_checkpoints()
        assert store.read_manifest(sp_id).kind == "savepoint" and store.verify().ok
        at_savepoint = state_of(store, sp_id)
        seen.append(sum(at_savepoint.values()))
        # restored, the job counts every record exactly once: each key's output continues from
        # the savepoint's count to the total, with no gap and no repeat
        result = abs.run(counting_flow(), parallelism=3, restore=path, storage=str(tmp_path / f"r-{sp_id}"),
                         checkpoint=abs.CheckpointConfig())
        assert result.restored_from == sp_id
        per_key: dict = collections.defaultdict(list)
        out = result.collected("out")
        for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist()):
            per_key[k].append(c)
        for k, n in expected.items():
            assert sorted(per_key.get(k, [])) == list(range(at_savepoint.get(k, 0) + 1, n + 1)), f"key {k} of {path}"
    assert seen == sorted(seen)  # later savepoints hold more of the stream
    assert not [p for p in SnapshotStore.open(str(tmp_path / "root")).list_files() if p.startswith("pins/")]


# ====================================================================== every backend
@pytest.fixture(params=["memory", "local", "s3"])
def any_root(request, tmp_path):
    if request.param == "memory":
        return request.getfixturevalue("memory_root"), None
    if request.param == "local":
        return str(tmp_path / "root"), None
    server = request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_root"), server.storage_options


def test_a_pin_through_one_store_is_honoured_by_the_gc_of_another_on_every_backend(any_root):
    url, options = any_root
    writer = SnapshotStore.open(url, options)
    writer.init_job(JOB)
    commit_chain(writer, 1, [])
    with SnapshotStore.open(url, options).pin(1, 1, holder="backend test") as lease:
        commit_chain(writer, 2, [])
        other = SnapshotStore.open(url, options)
        plan = other.gc(retain=1)
        assert plan.retained == (1, 2) and plan.pins == (lease.record.path,) and other.verify(1).ok
    plan = SnapshotStore.open(url, options).gc(retain=1)
    assert plan.dropped == (1,) and SnapshotStore.open(url, options).list_checkpoints() == [2]
    assert not [p for p in SnapshotStore.open(url, options).list_files() if p.startswith("pins/")]


def test_a_source_that_cannot_be_pinned_is_copied_with_a_warning(memory_root):
    import fsspec

    from storage.testing import Fault, FaultyFileSystem

    fs = FaultyFileSystem(fsspec.filesystem("memory"), [Fault(op="write", path_glob="*/pins/*", times=None)])
    src = SnapshotStore.open(memory_root + "/src", fs=fs)  # e.g. read-only credentials
    src.init_job(JOB)
    commit_chain(src, 1, [])
    with pytest.warns(RuntimeWarning, match="cannot pin checkpoint 1 while copying it"):
        sp = src.savepoint(1, memory_root + "/dest", fs=fsspec.filesystem("memory"))
    assert SnapshotStore.open(memory_root + "/dest").list_checkpoints() == [sp.checkpoint_id]


def test_a_write_failing_in_the_middle_of_a_copy_leaves_no_partial_savepoint(memory_root):
    import fsspec

    from storage import StorageUnavailableError
    from storage.testing import Fault, FaultyFileSystem

    src = SnapshotStore.open(memory_root + "/src")
    src.init_job(JOB)
    keyed: dict = {"count": {}}
    for state in ("n", "m"):
        for kg in range(4):
            table = pa.table({"key": pa.array([kg], pa.int64()), "value": pa.array([kg], pa.int64())})
            keyed["count"].setdefault(state, {})[kg] = list(src.write_key_group(1, "count", state, kg, [], table))
    src.commit(Manifest(checkpoint_id=1, job_name="wc", max_parallelism=8, keyed=keyed))
    dest_url = memory_root + "/dest"
    # the copy writes a packed file per state: the second one fails, after the first was written
    broken = FaultyFileSystem(fsspec.filesystem("memory"), [Fault(op="write", nth=2, path_glob="*/state/*")])
    with pytest.raises(StorageUnavailableError):
        src.savepoint(1, dest_url, fs=broken)
    assert broken.injected and set(SnapshotStore.open(dest_url).list_files()) == {"_job.json"}
    sp = src.savepoint(1, dest_url)  # again, into the same destination
    dest = SnapshotStore.open(dest_url)
    assert dest.list_checkpoints() == [sp.checkpoint_id] and dest.verify().ok and dest.pins() == []


def test_a_pin_taken_while_gc_plans_is_honoured_before_anything_is_deleted(tmp_path):
    root = str(tmp_path)
    store = SnapshotStore.open(root)
    store.init_job(JOB)
    commit_chain(store, 1, [])
    commit_chain(store, 2, [])
    files_of_1 = store.read_manifest(1).paths()
    plan_once = store.plan_gc
    leases = []

    def plan_then_pin(*args, **kwargs):
        plan = plan_once(*args, **kwargs)
        if not leases:  # another process pins checkpoint 1 right after this plan was made
            leases.append(SnapshotStore.open(root).pin(1, 1, holder="late pin"))
        return plan

    store.plan_gc = plan_then_pin  # type: ignore[method-assign]
    plan = store.gc(retain=1)
    assert plan.held == (1,) and files_of_1 <= set(store.list_files()) and store.verify(1).ok
    leases[0].release()
