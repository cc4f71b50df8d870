"""The fault-injecting file system, and the store under torn, lost, failed and slow I/O."""
from __future__ import annotations

import fsspec
import pyarrow as pa
import pytest

from storage import (
    CheckpointExistsError,
    CorruptFileError,
    Manifest,
    MissingFileError,
    SnapshotStore,
    StorageUnavailableError,
)
from storage.testing import Fault, FaultyFileSystem, InjectedFaultError


@pytest.fixture
def inner():
    return fsspec.filesystem("memory")


def prefix(memory_root: str) -> str:
    return memory_root.removeprefix("memory://")


# ---------------------------------------------------------------------- the wrapper itself
def test_faults_fire_on_the_nth_matching_operation_of_their_type(inner, memory_root):
    root = prefix(memory_root)
    fs = FaultyFileSystem(inner, faults=[Fault(op="write", nth=2, action="fail", path_glob="*/state/*")])
    fs.pipe_file(f"{root}/other/a", b"1")           # write 1, does not match the glob
    fs.pipe_file(f"{root}/state/a", b"1")           # matching write 1
    with pytest.raises(InjectedFaultError):
        fs.pipe_file(f"{root}/state/b", b"1")       # matching write 2: fails
    fs.pipe_file(f"{root}/state/c", b"1")           # times=1: only once
    assert fs.counts["write"] == 4
    assert [(i.op, i.path, i.count) for i in fs.injected] == [("write", f"{root}/state/b", 3)]
    assert not inner.exists(f"{root}/state/b") and inner.exists(f"{root}/state/c")


def test_tear_writes_a_prefix_and_raises_or_reports_success(inner, memory_root):
    root = prefix(memory_root)
    fs = FaultyFileSystem(inner, faults=[Fault(op="write", nth=1, action="tear", keep_fraction=0.25),
                                         Fault(op="write", nth=2, action="tear_silent", keep_fraction=0.5)])
    with pytest.raises(OSError):
        fs.pipe_file(f"{root}/a", b"x" * 100)
    fs.pipe_file(f"{root}/b", b"y" * 100)
    assert inner.cat_file(f"{root}/a") == b"x" * 25 and inner.cat_file(f"{root}/b") == b"y" * 50


def test_lose_pretends_success_for_writes_renames_and_deletes(inner, memory_root):
    root = prefix(memory_root)
    inner.pipe_file(f"{root}/keep", b"k")
    fs = FaultyFileSystem(inner, faults=[Fault(op=op, action="lose") for op in ("write", "rename", "delete")])
    fs.pipe_file(f"{root}/lost", b"1")
    fs.mv(f"{root}/keep", f"{root}/moved")
    fs.rm_file(f"{root}/keep")
    assert not inner.exists(f"{root}/lost") and not inner.exists(f"{root}/moved") and inner.exists(f"{root}/keep")
    assert fs.counts == {"write": 1, "rename": 1, "delete": 1}


def test_read_faults_fail_short_read_or_hide_the_file(inner, memory_root):
    root = prefix(memory_root)
    inner.pipe_file(f"{root}/f", b"0123456789")
    fs = FaultyFileSystem(inner, faults=[Fault(op="read", nth=1, action="fail"),
                                         Fault(op="read", nth=2, action="tear_silent", keep_fraction=0.3),
                                         Fault(op="read", nth=3, action="lose")])
    with pytest.raises(OSError):
        fs.cat_file(f"{root}/f")
    assert fs.cat_file(f"{root}/f") == b"012"
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{root}/f")
    with fs.open(f"{root}/f", "rb") as f:  # open() counts as a read too
        assert f.read() == b"0123456789"
    assert fs.counts["read"] == 4


def test_delay_uses_the_injected_sleep_and_times_none_repeats_forever(inner, memory_root):
    root = prefix(memory_root)
    slept: list[float] = []
    fs = FaultyFileSystem(inner, faults=[Fault(op="write", nth=2, action="delay", seconds=3.5, times=None)],
                          sleep=slept.append)
    for i in range(4):
        with fs.open(f"{root}/f{i}", "wb") as f:  # open() for writing counts on close
            f.write(b"x")
    assert slept == [3.5, 3.5, 3.5] and all(inner.exists(f"{root}/f{i}") for i in range(4))


@pytest.mark.parametrize("fault", [
    dict(op="read", action="tear"), dict(op="delete", action="tear"), dict(op="write", nth=0),
    dict(op="list"), dict(op="write", keep_fraction=1.0),
])
def test_invalid_fault_schedules_are_refused(fault):
    with pytest.raises(ValueError):
        Fault(**fault)


def test_wrapper_instances_never_share_counters(inner):
    a, b = FaultyFileSystem(inner), FaultyFileSystem(inner)
    assert a is not b and a.counts is not b.counts


# ---------------------------------------------------------------------- the store under faults
def delta(keys: list[int]) -> pa.Table:
    return pa.table({"key": keys, "value": [f"v{k}" * 10 for k in keys], "op": pa.array([0] * len(keys), pa.int8())})


def commit(store: SnapshotStore, cid: int, chains: dict) -> Manifest:
    return store.commit(Manifest(checkpoint_id=cid, job_name="j", max_parallelism=8, keyed={"op": {"s": chains}}))


@pytest.fixture
def faulty(inner, memory_root):
    fs = FaultyFileSystem(inner)
    store = SnapshotStore.open(memory_root, fs=fs)
    store.init_job({"job_name": "j", "max_parallelism": 8})
    return fs, store


@pytest.mark.parametrize("action, kind", [("tear_silent", "size"), ("lose", "missing")])
def test_silently_torn_or_lost_state_writes_are_found_by_verify_and_refused_on_read(faulty, action, kind):
    fs, store = faulty
    fs.add_fault(Fault(op="write", nth=2, action=action, path_glob="*/state/*"))
    chains = {kg: store.write_key_group(1, "op", "s", kg, [], delta(list(range(kg * 10, kg * 10 + 10)))) for kg in range(3)}
    m = commit(store, 1, chains)  # the writer believed every upload succeeded
    report = store.verify(1)
    assert [(p.kind, p.path, p.checkpoints) for p in report.problems] == [(kind, chains[1][0].path, (1,))]
    assert store.read_key_group(m, "op", "s", 0).num_rows == 10
    with pytest.raises(MissingFileError if kind == "missing" else CorruptFileError, match=chains[1][0].path):
        store.read_key_group(m, "op", "s", 1)


def test_a_failed_upload_leaves_no_checkpoint_and_its_partial_file_is_collected_later(faulty):
    fs, store = faulty
    base = store.write_key_group(1, "op", "s", 0, [], delta([1, 2]))
    commit(store, 1, {0: base})
    fs.add_fault(Fault(op="write", nth=1, action="tear", path_glob="*/kg-0001/*"))
    with pytest.raises(StorageUnavailableError, match="writing state/op/s/kg-0001/00000002-base-.*injected tear"):
        store.write_key_group(2, "op", "s", 1, [], delta([3]))
    assert store.list_checkpoints() == [1] and store.next_checkpoint_id() == 3
    torn = [p for p in store.list_files() if "/kg-0001/" in p]
    assert len(torn) == 1
    chain = store.write_key_group(3, "op", "s", 0, base, delta([5]))
    commit(store, 3, {0: chain})
    assert torn[0] in store.gc(retain=1).delete_files and store.verify().ok


@pytest.mark.parametrize("fault", [
    Fault(op="write", action="fail", path_glob="*/checkpoints/*"),
    Fault(op="write", action="tear", path_glob="*/checkpoints/*"),
    Fault(op="rename", action="fail"),
    Fault(op="rename", action="lose"),
])
def test_a_failed_manifest_commit_leaves_no_complete_checkpoint(faulty, fault):
    fs, store = faulty
    chain = store.write_key_group(1, "op", "s", 0, [], delta([1]))
    fs.add_fault(fault)
    with pytest.raises(StorageUnavailableError, match="committing checkpoints/chk-00000001.json|lost the rename"):
        commit(store, 1, {0: chain})
    fresh = SnapshotStore.open(store.url, fs=fs)
    assert fresh.list_checkpoints() == [] and fresh.next_checkpoint_id() == 2
    assert not [p for p in fresh.list_files() if p.startswith("checkpoints/")]  # the temporary was cleaned up
    fs.clear_faults()
    chain2 = fresh.write_key_group(2, "op", "s", 0, [], delta([1]))
    commit(fresh, 2, {0: chain2})
    assert fresh.list_checkpoints() == [2]


def test_a_torn_manifest_is_not_a_complete_checkpoint_and_verify_reports_it(faulty):
    fs, store = faulty
    chain = store.write_key_group(1, "op", "s", 0, [], delta([1]))
    commit(store, 1, {0: chain})
    fs.add_fault(Fault(op="write", action="tear_silent", path_glob="*/checkpoints/*"))
    commit(store, 2, {0: chain})  # the file system lied: half a manifest was renamed into place
    fresh = SnapshotStore.open(store.url, fs=fs)
    assert fresh.list_checkpoints() == [1]
    assert [(p.kind, p.checkpoints) for p in fresh.verify().problems] == [("manifest", (2,))]


def test_read_failures_name_the_root_and_short_reads_are_refused(faulty):
    fs, store = faulty
    chain = store.write_key_group(1, "op", "s", 0, [], delta([1, 2, 3]))
    m = commit(store, 1, {0: chain})
    fs.add_fault(Fault(op="read", action="fail", path_glob="*/state/*"))
    with pytest.raises(StorageUnavailableError, match=f"{store.url}: reading {chain[0].path} failed"):
        store.read_key_group(m, "op", "s", 0)
    fs.add_fault(Fault(op="read", action="tear_silent", path_glob="*/state/*"))  # counts from now on
    with pytest.raises(CorruptFileError, match="torn or altered"):
        store.read_key_group(m, "op", "s", 0)
    assert store.read_key_group(m, "op", "s", 0).num_rows == 3


def test_a_gc_that_dies_half_way_is_finished_by_the_next_run(faulty):
    fs, store = faulty
    for cid in range(1, 5):
        chains = {kg: store.write_key_group(cid, "op", "s", kg, [], delta([cid, kg])) for kg in range(3)}
        commit(store, cid, chains)
    fs.add_fault(Fault(op="delete", nth=4, action="fail"))
    with pytest.raises(StorageUnavailableError, match="deleting"):
        store.gc(retain=1)
    assert store.list_checkpoints() == [1, 2, 3, 4]  # manifests go last: none deleted yet
    assert store.verify(4).ok
    plan = store.gc(retain=1)
    assert plan.dropped == (1, 2, 3)
    assert store.list_checkpoints() == [4] and store.verify().ok
    assert store.gc(retain=1).empty


def test_restoring_one_key_group_reads_only_its_files(faulty):
    fs, store = faulty
    chains = {kg: store.write_key_group(1, "op", "s", kg, [], delta([kg])) for kg in range(8)}
    m = commit(store, 1, chains)
    reader = SnapshotStore.open(store.url, fs=fs)
    manifest = reader.read_manifest(1)
    reads_before = fs.counts["read"]
    for kg in (2, 3):
        reader.read_key_group(manifest, "op", "s", kg)
    assert fs.counts["read"] - reads_before == 2
    assert m.keyed == manifest.keyed


@pytest.mark.s3
def test_the_wrapper_works_over_s3_and_commit_stays_a_conditional_put(s3_server, s3_root):
    inner = s3_server.filesystem()
    fs = FaultyFileSystem(inner, faults=[Fault(op="write", action="tear_silent", path_glob="*/kg-0001/*")])
    store = SnapshotStore.open(s3_root, fs=fs)
    store.init_job({"job_name": "j", "max_parallelism": 8})
    chains = {kg: store.write_key_group(1, "op", "s", kg, [], delta([kg, kg + 10])) for kg in range(2)}
    commit(store, 1, chains)
    assert [(p.kind, p.path) for p in store.verify().problems] == [("size", chains[1][0].path)]
    assert fs.counts["rename"] == 0  # object stores commit with one PUT, never a rename
    with pytest.raises(CheckpointExistsError, match="already has a manifest"):
        commit(store, 1, chains)
