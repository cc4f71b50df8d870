"""The snapshot writer process of a worker (abs.runtime.writer): it writes what the uploader
hands it, reports failures without dying, and a worker whose writer was killed goes on
writing its snapshots itself."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abs
from abs.keygroups import KeyGroupRange, key_group
from abs.runtime.messages import WriteJob
from abs.runtime import writer as writer_module
from abs.runtime.writer import (FrameReader, InThreadWriter, SnapshotWriter, WriteFailedError, recv_frame, send_frame,
                               writes_in_process)
from abs.state import ColumnDelta, KeyedStateBackend, ListState, PickledDelta, ValueState
from pacing import PacedSource
from test_state import replay_rounds
from storage import SnapshotStore

M = 8


def column_deltas(values: dict[int, int]) -> dict[int, ColumnDelta]:
    b = KeyedStateBackend("op", [ValueState("v", pa.int64())], M, KeyGroupRange(0, M - 1))
    for k, v in values.items():
        b.current_key, b.current_kg = k, key_group(k, M)
        b.state("v").update(v)
    return b.capture(1, lazy=True)["v"]


def test_frames_carry_arrays_out_of_band_whole_and_in_order():
    """More buffers than one writev takes (1024), empty and 8 MB arrays, odd-sized ones, a
    non-contiguous array (pickled in band), an Arrow table and plain objects all arrive equal
    and 64-byte aligned (numpy arrays under 4 KiB, pickled in band: 16), frame after frame."""
    a, b = multiprocessing.Pipe()
    rng = np.random.default_rng(7)
    cyclic: list = [1]
    cyclic.append(cyclic)
    msgs = [
        ("write", 1, [np.arange(i, dtype=np.int64) for i in range(1500)]),
        ("write", 5, [np.arange(600 + i, dtype=np.int64) for i in range(1100)]),  # 1,100 out of band
        ("open", "s3://b/p", {"key": "k"}),
        ("write", 2, [rng.integers(0, 1 << 62, 1 << 20), np.empty(0, np.float64), np.arange(10)[::3], ["a", (1, 2)],
                      np.arange(7, dtype=np.int8), np.arange(5, dtype=np.int64)]),
        ("write", 3, [pa.table({"key": pa.array([1, 2, 3]), "value": pa.array([b"a", b"bb", None])})]),
        ("write", 4, [cyclic, {"shared": [cyclic, cyclic]}]),  # the ordinary pickler takes over
    ]
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(recv_frame(b) for _ in msgs))
    reader.start()
    for m in msgs:
        send_frame(a, m)
    reader.join(timeout=60)
    assert len(got) == len(msgs)
    for sent, received in zip(msgs, got):
        assert sent[:2] == received[:2]
        if sent[0] == "open":
            assert sent == received
            continue
        assert len(sent[2]) == len(received[2])
        for x, y in zip(sent[2], received[2]):
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y)
                if x.nbytes >= writer_module._IN_BAND:  # out of band
                    assert y.ctypes.data % 64 == 0 or not len(y) or not x.flags.c_contiguous
                else:  # pickled in band: the alignment of a Python allocation, enough for any dtype
                    assert y.ctypes.data % 16 == 0
            elif isinstance(x, pa.Table):
                assert y.equals(x)
                # Arrow's alignment: unaligned buffers make its kernels warn (or fail)
                assert all(b is None or b.address % 64 == 0 for c in y.columns for b in c.chunk(0).buffers())
            elif sent[1] == 4:
                assert repr(x) == repr(y)  # cycles compare by structure
            else:
                assert x == y
    got_cyclic = got[-1][2][0]
    assert got_cyclic[1] is got_cyclic and got[-1][2][1]["shared"][0] is got[-1][2][1]["shared"][1]
    a.close()
    with pytest.raises(EOFError):
        recv_frame(b)


def test_a_frame_reader_reuses_its_block_only_once_nothing_refers_to_it():
    """The arrays of a message are views of the reader's block: a message still alive when
    the next frame comes keeps its values (a fresh block is taken); once dropped, the next
    frame lands in the same memory. Frames bigger than the block, or far smaller, get one
    of their own; every array arrives whole and 64-byte aligned."""
    a, b = multiprocessing.Pipe()
    reader = FrameReader()

    def roundtrip(msg):
        sender = threading.Thread(target=send_frame, args=(a, msg))
        sender.start()
        got = reader.recv(b)
        sender.join(timeout=30)
        return got

    first = roundtrip(("write", 1, [np.arange(100_000, dtype=np.int64)]))
    kept = first[2][0]
    second = roundtrip(("write", 2, [np.full(100_000, 7, dtype=np.int64)]))
    assert np.array_equal(kept, np.arange(100_000)), "a live message was overwritten by the next frame"
    assert kept.ctypes.data != second[2][0].ctypes.data
    address = second[2][0].ctypes.data
    del first, kept, second
    third = roundtrip(("write", 3, [np.full(100_000, 9, dtype=np.int64)]))
    assert third[2][0].ctypes.data == address, "a block nothing refers to was not reused"
    assert np.array_equal(third[2][0], np.full(100_000, 9))
    del third
    big = np.random.default_rng(3).integers(0, 1 << 60, 1 << 20)
    fourth = roundtrip(("write", 4, [big, np.arange(3, dtype=np.int8), np.arange(5)]))
    assert np.array_equal(fourth[2][0], big) and list(fourth[2][2]) == [0, 1, 2, 3, 4]
    assert fourth[2][0].ctypes.data % 64 == 0  # the small ones went in band
    assert len(reader._block) >= big.nbytes  # outgrew the old block: a bigger one
    del fourth
    small = roundtrip(("write", 5, [np.arange(10)]))
    assert list(small[2][0]) == list(range(10))
    assert len(reader._block) < big.nbytes // 4  # the 8 MB block is not kept for a tiny frame
    a.close()
    with pytest.raises(EOFError):
        reader.recv(b)


@pytest.fixture
def writer():
    w = SnapshotWriter.fork()
    assert w is not None and w.alive
    yield w
    w.close()


def test_the_writer_process_writes_column_deltas_and_tables(tmp_path, writer):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": M})
    writer.open(str(tmp_path), None)
    values = {k: k * 10 for k in range(40)}
    deltas = column_deltas(values)
    assert all(isinstance(d, ColumnDelta) for d in deltas.values())
    table = pa.table({"key": pa.array([1, 2], pa.int64()), "value": pa.array(["a", "b"])},
                     metadata={b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"})
    jobs = [WriteJob("op", "v", kg, [], d, False) for kg, d in deltas.items()] + [WriteJob("op", "s", 3, [], table, False)]
    chains = writer.write(1, jobs)
    assert len(chains) == len(jobs) and all(len(c) == 1 and c[0].kind == "base" for c in chains)
    assert 0 < writer.last_cpu < 10  # the writer process's CPU seconds for this write
    got = {}
    for chain in chains[:-1]:
        t = store.read_chain(chain)
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == values
    assert store.read_chain(chains[-1]).column("value").to_pylist() == ["a", "b"]


def values_of(store: SnapshotStore, chains) -> dict:
    """``{key: value}`` of the key groups whose chains are ``chains``."""
    got: dict = {}
    for chain in chains:
        t = store.read_chain(chain)
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    return got


def write_once(where: str, url: str, store: SnapshotStore, checkpoint_id: int, jobs: list) -> list:
    """``jobs`` written by a writer process of their own (``where="process"``) or in this
    thread, as a worker without one writes them; their chains."""
    if where != "process":
        return InThreadWriter(store).write(checkpoint_id, jobs)
    w = SnapshotWriter.fork()
    try:
        w.open(url, None)
        return w.write(checkpoint_id, jobs)
    finally:
        w.close()


@pytest.mark.parametrize("where", ["process", "thread"])
def test_the_writer_writes_the_aggregates_lazy_capture_frozen_at_the_barrier(tmp_path, where):
    """The columnar aggregate's lazy capture (ColumnDelta instances cut from one capture) goes
    to the writer process as it is and is written there, or in the worker's thread: every
    key group's file holds its own keys with the values of the capture."""
    from abs.state import AggregateBackend

    url = str(tmp_path) if where == "process" else f"memory://aggregate-{os.getpid()}"
    store = SnapshotStore.open(url)
    store.init_job({"job_name": "j", "max_parallelism": M})
    b = AggregateBackend(KeyedStateBackend("op", [ValueState("v", pa.int64())], M, KeyGroupRange(0, M - 1)), {"v": 0})
    col = b.columnar
    keys = np.arange(0, 900, 7, dtype=np.int64)
    slots = col.slots_for(keys)
    col.touch(slots)
    col.columns["v"].values[slots] = keys * 3
    col.columns["v"].valid[slots] = True
    deltas = b.capture(1, lazy=True)["v"]
    assert all(isinstance(d, ColumnDelta) for d in deltas.values())
    col.columns["v"].values[slots] = -1  # after the barrier: not in the snapshot
    jobs = [WriteJob("op", "v", kg, [], d, False) for kg, d in deltas.items()]
    chains = write_once(where, url, store, 1, jobs)
    for kg, chain in zip(deltas, chains):
        t = store.read_chain(chain)
        got = t.column("key").to_pylist()
        assert got and {key_group(k, M) for k in got} == {kg}
        assert t.column("value").to_pylist() == [3 * k for k in got]
    assert sum(store.read_chain(c).num_rows for c in chains) == len(keys)


@pytest.mark.parametrize("key_type", ["int", "string"])
@pytest.mark.parametrize("where", ["process", "thread"])
def test_a_large_aggregate_capture_goes_to_the_writer_in_chunks_and_writes_the_same_files(tmp_path, monkeypatch,
                                                                                          where, key_type):
    """A columnar capture is cut a chunk of key groups at a time and each chunk goes to the
    writer process in a frame of its own (the worker cuts the next chunk while the writer
    encodes the last): the chains come back in job order and every key group's file holds
    what one frame would have written, in a packed file per chunk."""
    import abs.state.capture as capture_module
    from abs.state import AggregateBackend

    def write(chunk_rows: int, root: str) -> tuple[list, list]:
        monkeypatch.setattr(capture_module, "CHUNK_ROWS", chunk_rows)
        monkeypatch.setattr(capture_module, "INT_CHUNK_ROWS", chunk_rows)
        url = root if where == "process" else f"memory://chunks-{os.getpid()}-{chunk_rows}"
        store = SnapshotStore.open(url)
        store.init_job({"job_name": "j", "max_parallelism": M})
        b = AggregateBackend(KeyedStateBackend("op", [ValueState("v", pa.int64()), ValueState("w", pa.int32())], M,
                                               KeyGroupRange(0, M - 1)), {"v": 0, "w": 0})
        col = b.columnar
        keys = np.arange(0, 4000, 3, dtype=np.int64)
        if key_type == "int":
            slots = col.slots_for(keys)
        else:
            slots = col.slots_for_var(pa.array([f"key-{k}" for k in keys.tolist()]))
        col.touch(slots)
        col.columns["v"].values[slots] = keys * 3
        col.columns["v"].valid[slots] = keys % 5 > 0  # some nulls
        col.columns["v"].all_valid = False
        col.columns["w"].values[slots] = keys
        col.columns["w"].valid[slots] = True
        col.columns["w"].present[slots] = keys % 7 > 0  # some keys without an entry of state w
        col.columns["w"].all_present = False
        jobs = [WriteJob("op", state, kg, [], d, False) for state, by_kg in b.capture(1, lazy=True).items()
                for kg, d in by_kg.items()]
        chains = write_once(where, url, store, 1, jobs)
        assert len(chains) == len(jobs)
        return [(j.state, j.key_group) for j in jobs], [store.read_chain(c) for c in chains], chains

    slots, whole, whole_chains = write(1 << 30, str(tmp_path / "whole"))
    slots_cut, cut, cut_chains = write(100, str(tmp_path / "cut"))
    assert slots_cut == slots
    assert len({c[0].path for c in whole_chains if c}) == 2  # a packed file per state
    if where == "process":  # the worker's thread writes them at once
        assert len({c[0].path for c in cut_chains if c}) > 2  # ... and per chunk
    for (state, kg), a, b in zip(slots, whole, cut):
        assert a.num_rows and a.equals(b) and a.schema.metadata == b.schema.metadata, (state, kg)


@pytest.mark.parametrize("where", ["process", "thread"])
def test_the_writer_writes_values_images_while_a_key_groups_keys_stay(tmp_path, where):
    """Counters over a fixed key set: from the second checkpoint on, every key group's chain is
    its first base and a values image; a key group with a new key gets a new base. The same
    in the writer process and in a worker's own thread (``memory://`` roots, no writer)."""
    url = str(tmp_path) if where == "process" else f"memory://values-{os.getpid()}"
    store = SnapshotStore.open(url)
    store.init_job({"job_name": "j", "max_parallelism": M})
    if where == "process":
        writer = SnapshotWriter.fork()
        writer.open(url, None)
    else:
        writer = InThreadWriter(SnapshotStore.open(url))
    try:
        _values_images_scenario(store, writer)
    finally:
        if where == "process":
            writer.close()
        else:
            fsspec.filesystem("memory").rm(f"/values-{os.getpid()}", recursive=True)


# enough keys that every key group's table (int64 key and value) exceeds SHARE_BELOW: the
# files of smaller ones share a stream in format 6, where a new base costs less than a values
# image of its own (tests/test_values_images.py)
VI_KEYS = 12_000


def _values_images_scenario(store: SnapshotStore, writer) -> None:
    b = KeyedStateBackend("op", [ValueState("v", pa.int64())], M, KeyGroupRange(0, M - 1))
    values: dict[int, int] = {}

    def checkpoint(cid: int, prev: dict, add: int | None = None, drop: int | None = None) -> dict:
        if drop is not None:
            del values[drop]
            b.current_key, b.current_kg = drop, key_group(drop, M)
            b.state("v").clear()
        for k in [*(k for k in range(VI_KEYS) if k in values or cid == 1), *([add] if add is not None else [])]:
            values[k] = values.get(k, 0) + k + cid
            b.current_key, b.current_kg = k, key_group(k, M)
            b.state("v").update(values[k])
        deltas = b.capture(cid, lazy=True)["v"]
        b.confirm(cid)
        assert all(d.complete for d in deltas.values())
        chains = writer.write(cid, [WriteJob("op", "v", kg, prev.get(kg, []), d, False) for kg, d in deltas.items()])
        new = dict(zip(deltas, chains))
        assert values_of(store, new.values()) == values
        return new

    first = checkpoint(1, {})
    assert all(len(c) == 1 and c[0].kind == "base" for c in first.values())
    second = checkpoint(2, first)
    for kg, chain in second.items():
        assert chain[0] == first[kg][0] and len(chain) == 2 and chain[1].checkpoint_id == 2
        assert store.read_file(chain[1]).column_names == ["value"]  # the values alone
        assert chain[1].bytes < chain[0].bytes
    added = 10 * VI_KEYS
    third = checkpoint(3, second, add=added)
    for kg, chain in third.items():
        if kg == key_group(added, M):  # an insert changed its keys: a new base
            assert len(chain) == 1 and chain[0].checkpoint_id == 3 and chain[0].kind == "base"
        else:
            assert chain[0] == first[kg][0] and len(chain) == 2 and chain[1].checkpoint_id == 3
    # a chain the writer's base does not head (e.g. its checkpoint was aborted): a new base,
    # and the values images continue over that one
    fourth = checkpoint(4, {kg: c for kg, c in first.items() if kg != 0})
    assert len(fourth[0]) == 1 and fourth[0][0].checkpoint_id == 4
    assert all(len(c) == 2 for kg, c in fourth.items() if kg not in (0, key_group(added, M)))
    fifth = checkpoint(5, fourth)
    assert fifth[0][0] == fourth[0][0] and len(fifth[0]) == 2
    # a delete and an insert in one key group: as many keys as its base, but other ones
    gone = next(k for k in range(VI_KEYS) if key_group(k, M) == 1)
    other = next(k for k in range(20 * VI_KEYS, 20 * VI_KEYS + 1000) if key_group(k, M) == 1)
    sixth = checkpoint(6, fifth, add=other, drop=gone)
    assert len(sixth[1]) == 1 and sixth[1][0].checkpoint_id == 6 and sixth[1][0].rows == fifth[1][0].rows


@pytest.mark.parametrize("where", ["process", "thread"])
def test_a_capture_in_which_most_keys_changed_is_written_as_a_values_image(tmp_path, where):
    """A capture of every row (at least abs.columns._COPY_ALL_SHARE changed) in which at least
    VALUES_IMAGE_SHARE of the keys changed, none inserted or deleted, goes as a values image
    over the base; fewer changes, or a new key, go as a delta; every chain reads back exact."""
    from abs.state.capture import VALUES_IMAGE_SHARE

    url = str(tmp_path) if where == "process" else f"memory://partial-{os.getpid()}"
    store = SnapshotStore.open(url)
    store.init_job({"job_name": "j", "max_parallelism": M})
    writer = SnapshotWriter.fork() if where == "process" else InThreadWriter(SnapshotStore.open(url))
    if where == "process":
        writer.open(url, None)
    b = KeyedStateBackend("op", [ValueState("v", pa.int64())], M, KeyGroupRange(0, M - 1))
    values: dict[int, int] = {}

    def checkpoint(cid: int, prev: dict, keys) -> dict:
        for k in keys:
            values[k] = values.get(k, 0) + k + cid
            b.current_key, b.current_kg = k, key_group(k, M)
            b.state("v").update(values[k])
        deltas = b.capture(cid, lazy=True)["v"]
        b.confirm(cid)
        chains = writer.write(cid, [WriteJob("op", "v", kg, prev.get(kg, []), d, False) for kg, d in deltas.items()])
        new = {**prev, **dict(zip(deltas, chains))}
        assert values_of(store, new.values()) == values
        return new

    def columns(ref) -> list[str]:
        return store.read_file(ref).column_names

    try:
        first = checkpoint(1, {}, range(VI_KEYS))
        half = [k for k in range(VI_KEYS) if k % 2]  # 50 %: between VALUES_IMAGE_SHARE and a full image
        assert VALUES_IMAGE_SHARE <= 0.5 < 0.75
        second = checkpoint(2, first, half)
        for kg, chain in second.items():
            assert chain[0] == first[kg][0] and len(chain) == 2 and columns(chain[1]) == ["value"]
        few = [k for k in range(VI_KEYS) if k % 5 == 0]  # 20 %: a delta (or the compaction it calls for)
        assert 0.1 <= 0.2 < VALUES_IMAGE_SHARE
        third = checkpoint(3, second, few)
        for kg, chain in third.items():
            assert chain[-1].checkpoint_id == 3 and "key" in columns(chain[-1])
        fourth = checkpoint(4, third, half)  # a values image over the chain's base
        for kg, chain in fourth.items():
            assert chain[0] == third[kg][0] and len(chain) == 2 and columns(chain[1]) == ["value"]
        added = 10 * VI_KEYS  # a new key: its key group's keys changed, so no values image there
        fifth = checkpoint(5, fourth, [*half, added])
        for kg, chain in fifth.items():
            if kg == key_group(added, M):
                assert chain[-1].checkpoint_id == 5 and "key" in columns(chain[-1])
            else:
                assert chain[0] == fourth[kg][0] and len(chain) == 2 and columns(chain[1]) == ["value"]
    finally:
        if where == "process":
            writer.close()
        else:
            fsspec.filesystem("memory").rm(f"/partial-{os.getpid()}", recursive=True)


@pytest.mark.parametrize("kind", ["value", "list"])
def test_the_writer_process_writes_untyped_deltas_frozen_at_capture(tmp_path, writer, kind):
    """Untyped value states (columns: ColumnDelta) and list states (dicts: PickledDelta)
    freeze their values at the capture; the writer process writes what was frozen."""
    SnapshotStore.open(str(tmp_path)).init_job({"job_name": "j", "max_parallelism": M})
    writer.open(str(tmp_path), None)
    b = KeyedStateBackend("op", [ValueState("u") if kind == "value" else ListState("u")], M, KeyGroupRange(0, M - 1))
    docs = {k: {"k": k, "seen": [k]} for k in range(30)}
    for k, doc in docs.items():
        b.current_key, b.current_kg = k, key_group(k, M)
        b.state("u").update(doc) if kind == "value" else b.state("u").add(doc)
    deltas = b.capture(1, lazy=True)["u"]
    assert all(isinstance(d, ColumnDelta if kind == "value" else PickledDelta) for d in deltas.values())
    for doc in docs.values():
        doc["seen"].append("after the barrier")  # not in the snapshot
    chains = writer.write(1, [WriteJob("op", "u", kg, [], d, False) for kg, d in deltas.items()])
    store = SnapshotStore.open(str(tmp_path))
    got = {}
    for chain in chains:
        t = store.read_chain(chain)
        assert t.schema.metadata[b"abs.value_encoding"] == b"pickle"
        got.update(zip(t.column("key").to_pylist(), map(pickle.loads, t.column("value").to_pylist())))
    expected = {k: {"k": k, "seen": [k]} for k in range(30)}
    assert got == (expected if kind == "value" else {k: [v] for k, v in expected.items()})


def test_a_failing_write_is_reported_and_the_writer_serves_the_next(tmp_path, writer):
    SnapshotStore.open(str(tmp_path)).init_job({"job_name": "j", "max_parallelism": M})
    writer.open(str(tmp_path), None)
    (kg, delta), *_ = column_deltas({1: 1}).items()
    with pytest.raises(RuntimeError, match="key group 99 is outside"):
        writer.write(1, [WriteJob("op", "v", 99, [], delta, False)])
    assert writer.alive
    assert writer.write(1, [WriteJob("op", "v", kg, [], delta, False)])[0][0].kind == "base"


def test_on_an_object_store_the_writer_writes_key_groups_at_once_and_answers_in_job_order(s3_server, s3_root, writer):
    """S3 (a moto server on loopback): the writer's thread pool returns every chain in job
    order, each file holds its own key group's rows, and a failing job in the middle fails
    the write without killing the writer."""
    options = s3_server.storage_options
    store = SnapshotStore.open(s3_root, options)
    store.init_job({"job_name": "j", "max_parallelism": M})
    writer.open(s3_root, options)
    values = {k: k * 3 for k in range(400)}
    deltas = column_deltas(values)
    tables = [pa.table({"key": pa.array([1000 + i], pa.int64()), "value": pa.array([i], pa.int64())},
                       metadata={b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}) for i in range(24)]
    jobs = [WriteJob("op", "v", kg, [], d, False) for kg, d in sorted(deltas.items())]
    jobs += [WriteJob("op", f"t{i}", i % M, [], t, False) for i, t in enumerate(tables)]
    chains = writer.write(1, jobs)
    assert [c[0].location().key_group for c in chains] == [j.key_group for j in jobs]
    assert [c[0].location().state for c in chains] == [j.state for j in jobs]
    got = {}
    for chain in chains[:len(deltas)]:
        t = store.read_chain(chain)
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == values
    assert [store.read_chain(c).column("value").to_pylist() for c in chains[len(deltas):]] == [[i] for i in range(24)]
    bad = jobs[:3] + [WriteJob("op", "v", 99, [], jobs[0].delta, False)] + jobs[3:]
    with pytest.raises(RuntimeError, match="key group 99 is outside"):
        writer.write(2, bad)
    assert writer.alive and len(writer.write(3, jobs[:5])) == 5


@pytest.mark.s3
def test_a_writer_whose_root_does_not_open_declines_naming_why_and_opens_it_later(s3_server, writer, capfd):
    """The object store unreachable (here: the bucket missing) when the writer process opens
    the root: the write is declined naming the storage error, with no traceback on stderr, and
    the writer lives and opens the root at the next write once it is there. The writer
    process died with a raw botocore traceback instead."""
    bucket = f"late-{uuid.uuid4().hex[:12]}"
    url = f"s3://{bucket}/job"
    writer.open(url, s3_server.storage_options)
    (kg, delta), *_ = column_deltas({1: 1}).items()
    with pytest.raises(WriteFailedError, match=r"could not open the storage root: StorageUnavailableError: "
                                           rf"{url}: the bucket does not exist"):
        writer.write(1, [WriteJob("op", "v", kg, [], delta, False)])
    assert writer.alive
    assert "Traceback" not in capfd.readouterr().err
    s3_server.filesystem().mkdir(bucket)
    SnapshotStore.open(url, s3_server.storage_options).init_job({"job_name": "j", "max_parallelism": M})
    assert writer.write(2, [WriteJob("op", "v", kg, [], delta, False)])[0][0].kind == "base"


def test_a_killed_writer_is_reported(tmp_path, writer):
    writer.open(str(tmp_path), None)
    os.kill(writer._process.pid, signal.SIGKILL)
    writer._process.join(timeout=10)
    assert not writer.alive
    (kg, delta), *_ = column_deltas({1: 1}).items()
    with pytest.raises(RuntimeError, match="writer process died"):
        writer.write(1, [WriteJob("op", "v", kg, [], delta, False)])


def test_memory_roots_are_written_in_the_worker():
    assert not writes_in_process("memory://x") and not writes_in_process(None)
    assert writes_in_process("/tmp/x") and writes_in_process("s3://bucket/p")


# ----------------------------------------------------------------------------- in a job

def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def count(ctx, row):
    n = ctx.state.n
    n.update((n.value() or 0) + 1)
    ctx.emit({"key": ctx.key, "n": n.value()})


@pytest.mark.parametrize("root", ["file", "memory"])
def test_checkpoints_report_the_cpu_of_their_asynchronous_part(tmp_path, root):
    url = str(tmp_path) if root == "file" else f"memory://cpu-{os.getpid()}"
    flow = abs.Dataflow("async-cpu")
    flow.source("events", abs.GeneratorSource(20_000, num_keys=5_000, num_splits=2)).key_by("key") \
        .process("count", count, state=[abs.ValueState("n", pa.int64())])
    result = abs.run(flow, parallelism=2, storage=url, checkpoint=abs.CheckpointConfig(interval=0.1))
    assert result.status == "FINISHED" and result.completed_checkpoints
    store = SnapshotStore.open(url)
    for c in result.completed_checkpoints:
        assert c.async_cpu > 0, c  # uploader thread plus, for a file root, the writer process
        assert store.read_manifest(c.checkpoint_id).stats["async_cpu_s"] == pytest.approx(c.async_cpu)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs /proc")
def test_a_job_whose_writers_are_killed_keeps_checkpointing_with_exact_output(tmp_path):
    flow = abs.Dataflow("writer-kill")
    # each source reader emits 3,000 records per completed checkpoint and stops at 6,000
    # until the gate opens: the job is running when its writers are killed, and the rest of
    # its input needs several more checkpoints
    gate = str(tmp_path / "gate")
    src = PacedSource(abs.GeneratorSource(60_000, num_keys=500, num_splits=4), 3_000, hold=6_000, gate=gate)
    sink = abs.CollectSink()
    flow.source("events", src).key_by("key").process("count", count, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", sink)
    handle = abs.submit(flow, parallelism=2, storage=str(tmp_path / "snap"),
                        checkpoint=abs.CheckpointConfig(interval=0.2, retained=2))
    deadline = time.time() + 120  # only bounds a hang
    workers: list[int] = []
    while time.time() < deadline and len(workers) < 2:
        workers = [p for p in children(os.getpid()) if children(p)]
        time.sleep(0.05)
    writers = [w for p in workers for w in children(p)]
    assert len(writers) >= 2, "every worker of a job with a file root has a writer process"
    while time.time() < deadline and handle.metrics()["completed_checkpoints"] < 2:
        time.sleep(0.05)
    assert handle.status == "RUNNING"
    first = handle.trigger_checkpoint()
    for pid in writers:
        os.kill(pid, signal.SIGKILL)
    open(gate, "w").close()
    result = handle.wait(timeout=120)
    assert result.status == "FINISHED", result
    later = [c for c in result.completed_checkpoints if c.checkpoint_id > first]
    assert later, "checkpoints complete after the writers died"
    assert result.restarts == []  # the workers never failed
    rows = result.collected("out").to_pylist()
    final: dict = {}
    for row in rows:
        final[row["key"]] = max(final.get(row["key"], 0), row["n"])
    assert len(rows) == 60_000 and sum(final.values()) == 60_000  # every record once, counts exact
    for pid in writers:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_closing_the_worker_end_stops_the_writer_at_once(tmp_path):
    w = SnapshotWriter.fork()
    w.open(str(tmp_path), None)
    process = w._process
    w.close()
    # close() waits a while for the process and then kills it: exit code 0 means it ended by
    # itself on end-of-file (one that never sees end-of-file is killed: -SIGKILL)
    assert not process.is_alive() and process.exitcode == 0, f"the writer exited with {process.exitcode}"


@pytest.mark.s3
def test_a_job_checkpoints_to_s3_through_its_writers_and_restores(s3_server, s3_root):
    """Workers hand their snapshots to writer processes that open s3fs themselves (forked
    before any thread, so no event loop crosses the fork); the job restores from S3."""
    options = s3_server.storage_options

    def job(events: int) -> abs.Dataflow:
        flow = abs.Dataflow("writer-s3")
        src = abs.GeneratorSource(events, num_keys=300, num_splits=2, rate=4_000)
        flow.source("events", src).key_by("key").process("count", count, state=[abs.ValueState("n", pa.int64())]) \
            .sink("out", abs.CollectSink())
        return flow

    first = abs.run(job(16_000), parallelism=2, storage=s3_root, storage_options=options,
                    checkpoint=abs.CheckpointConfig(interval=0.3, retained=3))
    assert first.status == "FINISHED" and len(first.completed_checkpoints) >= 2
    store = SnapshotStore.open(s3_root, options)
    assert store.verify().ok
    manifest = store.read_manifest(store.latest_checkpoint())
    counts = {}
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        counts.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert sum(counts.values()) == 16_000  # the final checkpoint holds every record's count
    again = abs.run(job(16_000), parallelism=3, storage=s3_root, storage_options=options, restore="latest",
                    checkpoint=abs.CheckpointConfig(interval=0.3, retained=3))
    assert again.status == "FINISHED"
    assert again.collected("out").num_rows == 0  # restored at the end of the input: nothing left to do


# ----------------------------------------------------------------------------- a writer that hangs
@pytest.mark.parametrize("size", [1, 300_000], ids=["reply-awaited", "pipe-full"])
def test_a_writer_that_does_not_answer_in_time_is_killed_and_the_write_says_so(tmp_path, writer, size):
    """Stopped (SIGSTOP), the writer neither reads the frame (a big one fills the pipe and
    blocks the send) nor answers: the write kills it when its timeout is up."""
    from abs.runtime.writer import WriterHungError

    writer.open(str(tmp_path), None)
    (kg, delta), *_ = column_deltas({k: k for k in range(size)}).items()
    os.kill(writer.pid, signal.SIGSTOP)
    with pytest.raises(WriterHungError, match=rf"writer process \(pid {writer.pid}\) did not answer checkpoint 1's "
                                              r"write within 0\.5 s and was killed"):
        writer.write(1, [WriteJob("op", "v", kg, [], delta, False)], timeout=0.5)
    assert not writer.alive and writer._process.exitcode == -signal.SIGKILL


def test_a_writer_that_answers_in_time_is_left_alone(tmp_path, writer):
    writer.open(str(tmp_path), None)
    (kg, delta), *_ = column_deltas({1: 1}).items()
    for cid in (1, 2):
        assert len(writer.write(cid, [WriteJob("op", "v", kg, [], delta, False)], timeout=60)) == 1
    assert writer.alive


def writer_pids(deadline: float, before: set[int]) -> list[int]:
    """The writer processes of the job's two workers (children of this process started after
    ``before`` was taken)."""
    workers: list[int] = []
    while time.time() < deadline and len(workers) < 2:
        workers = [p for p in children(os.getpid()) if p not in before and children(p)]
        time.sleep(0.05)
    return [w for p in workers for w in children(p)]


def release(pids: list[int]) -> None:
    """After a test: no stopped process of ours stays behind (a failed test leaves its job)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def hang_job(tmp_path, timeout: float):
    """A job on storage ``tmp_path/snap`` whose source readers emit 2,000 records per completed
    checkpoint and stop at 4,000 until the file ``tmp_path/gate`` exists: it is running when
    the test stops its writers, and the rest of its input needs several more checkpoints."""
    flow = abs.Dataflow("writer-hang")
    src = PacedSource(abs.GeneratorSource(40_000, num_keys=500, num_splits=4), 2_000, hold=4_000,
                      gate=str(tmp_path / "gate"))
    flow.source("events", src).key_by("key").process("count", count, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", abs.CollectSink())
    return abs.submit(flow, parallelism=2, storage=str(tmp_path / "snap"),
                      checkpoint=abs.CheckpointConfig(interval=0.3, timeout=timeout, retained=2))


def assert_counted_once(result, events: int = 40_000) -> None:
    rows = result.collected("out").to_pylist()
    final: dict = {}
    for row in rows:
        final[row["key"]] = max(final.get(row["key"], 0), row["n"])
    assert len(rows) == events and sum(final.values()) == events  # every record once, counts exact


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs /proc")
def test_a_writer_stopped_for_good_is_killed_and_the_job_finishes_exactly(tmp_path):
    before = set(children(os.getpid()))
    handle = hang_job(tmp_path, timeout=2.0)
    deadline = time.time() + 120
    writers = writer_pids(deadline, before)
    assert len(writers) >= 2, "every worker of a job with a file root has a writer process"
    while time.time() < deadline and handle.metrics()["completed_checkpoints"] < 2:
        time.sleep(0.05)
    assert handle.status == "RUNNING"
    stopped = writers[0]
    os.kill(stopped, signal.SIGSTOP)
    open(tmp_path / "gate", "w").close()
    try:
        result = handle.wait(timeout=120)  # the old runtime waited on the stopped writer for good
    finally:
        release(writers)
    assert result.status == "FINISHED" and result.restarts == [], result
    assert_counted_once(result)
    named = [(cid, why) for cid, why in result.failed_checkpoints if f"pid {stopped}" in why]
    assert named, result.failed_checkpoints
    assert "snapshot writer hung" in named[0][1] and "was killed" in named[0][1]
    assert any(c.checkpoint_id > named[0][0] for c in result.completed_checkpoints), "checkpoints go on after it"
    assert not os.path.exists(f"/proc/{stopped}") or open(f"/proc/{stopped}/stat").read().split()[2] == "Z"
    store = SnapshotStore.open(str(tmp_path / "snap"))  # the checkpoints written past the killed writer hold exact state
    manifest = store.read_manifest(store.latest_checkpoint())
    assert manifest.checkpoint_id > named[0][0] and store.verify().ok
    counts: dict = {}
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        counts.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert sum(counts.values()) == 40_000 and len(counts) == 500


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs /proc")
def test_a_writer_stopped_for_a_while_then_continued_lets_checkpoints_resume(tmp_path):
    before = set(children(os.getpid()))
    handle = hang_job(tmp_path, timeout=4.0)
    deadline = time.time() + 120
    writers = writer_pids(deadline, before)
    assert len(writers) >= 2
    while time.time() < deadline and handle.metrics()["completed_checkpoints"] < 2:
        time.sleep(0.05)
    assert handle.status == "RUNNING"
    for pid in writers:
        os.kill(pid, signal.SIGSTOP)
    open(tmp_path / "gate", "w").close()
    try:
        while time.time() < deadline and handle.metrics()["failed_checkpoints"] < 1:
            time.sleep(0.05)  # the driver's checkpoint timeout reports the stalled checkpoint
    finally:
        release(writers)
    result = handle.wait(timeout=120)
    assert result.status == "FINISHED" and result.restarts == [], result
    first_failed, why = result.failed_checkpoints[0]
    assert "timeout" in why and "missing acks" in why
    assert any(c.checkpoint_id > first_failed for c in result.completed_checkpoints), "checkpoints resume"
    assert_counted_once(result)


def string_backend() -> KeyedStateBackend:
    return KeyedStateBackend("op", [ValueState("v", pa.int64())], M, KeyGroupRange(0, M - 1))


def set_values(b: KeyedStateBackend, values: dict) -> dict:
    for k, v in values.items():
        b.current_key, b.current_kg = k, key_group(k, M)
        b.state("v").update(v)
    return values


def test_full_images_of_unchanged_string_keys_go_to_the_writer_without_their_keys(tmp_path, writer):
    """A key group whose string keys stay sends them once: later full images carry SameKeys and
    the writer writes the keys it kept, sorted; an inserted key sends the key group's keys
    again; after a failed write every key is sent again. Every checkpoint reads back exact."""
    from abs.columns import SameKeys
    from abs.runtime.writer import SentKeys

    SnapshotStore.open(str(tmp_path)).init_job({"job_name": "j", "max_parallelism": M})
    writer.open(str(tmp_path), None)
    store = SnapshotStore.open(str(tmp_path))
    b = string_backend()
    values: dict = {}
    sent: list = []
    real = SentKeys.substitute
    writer._sent.substitute = lambda jobs: sent.append(out := real(writer._sent, jobs)) or out

    def checkpoint(cid: int, bad_kg: int | None = None) -> None:
        deltas = b.capture(cid, lazy=True)["v"]
        jobs = [WriteJob("op", "v", kg, [], d, False) for kg, d in deltas.items()]
        if bad_kg is not None:
            with pytest.raises(RuntimeError, match=f"key group {bad_kg} is outside"):
                writer.write(cid, jobs + [WriteJob("op", "v", bad_kg, [], next(iter(deltas.values())), False)])
            b.abort(cid)
            return
        chains = writer.write(cid, jobs)
        b.confirm(cid)
        got = {}
        for chain in chains:
            t = store.read_chain(chain)
            keys = t.column("key").to_pylist()
            assert keys == sorted(keys)
            got.update(zip(keys, t.column("value").to_pylist()))
        assert got == values

    def same_keys(i: int) -> set:
        return {j.key_group for j in sent[i] if isinstance(j.delta._rows().keys, SameKeys)}

    values.update(set_values(b, {f"key-{i}": i for i in range(300)}))
    checkpoint(1)
    assert not same_keys(0)
    values.update(set_values(b, {k: v + 1 for k, v in values.items()}))
    checkpoint(2)
    assert same_keys(1) == set(range(M))
    added = "key-new"
    values.update(set_values(b, {**{k: v * 2 for k, v in values.items()}, added: -1}))
    checkpoint(3)
    assert same_keys(2) == set(range(M)) - {key_group(added, M)}
    values.update(set_values(b, {k: v + 3 for k, v in values.items()}))
    checkpoint(4, bad_kg=99)  # fails: the worker forgets what it sent
    checkpoint(5)
    assert not same_keys(4)
    values.update(set_values(b, {k: v - 5 for k, v in values.items()}))
    checkpoint(6)
    assert same_keys(5) == set(range(M))


def test_a_writer_without_the_keys_a_full_image_stands_for_refuses_the_write(tmp_path):
    from abs.columns import KeyOrders
    from abs.runtime.writer import SentKeys, _write
    from storage import CheckpointSession, SnapshotStore as Store

    store = Store.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": M})
    b = string_backend()
    sent = SentKeys()
    set_values(b, {f"k{i}": i for i in range(50)})
    first = sent.substitute([WriteJob("op", "v", kg, [], d, False) for kg, d in b.capture(1, lazy=True)["v"].items()])
    b.confirm(1)
    assert _write(store, KeyOrders(), 1, first, CheckpointSession()).chains
    set_values(b, {f"k{i}": -i for i in range(50)})
    second = sent.substitute([WriteJob("op", "v", kg, [], d, False) for kg, d in b.capture(2, lazy=True)["v"].items()])
    reply = _write(store, KeyOrders(), 2, second, CheckpointSession())  # a writer that never saw the keys
    assert "does not hold them" in reply.message


def string_key_batch(idx: np.ndarray) -> pa.RecordBatch:
    """Events ``i``: key ``"s{i % 300}"``, value ``i % 7``."""
    import pyarrow.compute as pc

    key = pc.binary_join_element_wise("s", pa.array(idx % 300).cast(pa.string()), "")
    return pa.RecordBatch.from_arrays([key, pa.array(idx % 7)], names=["key", "value"])


def running_sum(ctx, event):
    total = ctx.state.total
    total.update((total.value() or 0) + event["value"])


@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_job_of_string_keys_checkpoints_through_its_writers_exactly(tmp_path, parallelism):
    """Every key changes between checkpoints and no key is added after the first ones: the
    full images after the first go to the writers without their keys (SameKeys); the last
    checkpoint holds every key once with its exact sum, sorted in each of its files. (The key
    group resolved from a base and a delta of some of its keys lists the base's other keys,
    then the delta's: sorted within each part, not as a whole. A barrier falls between two
    parts of a source batch where the exchange or a slow machine splits it.)"""
    events = 24_000
    flow = abs.Dataflow("writer-strings")
    src = PacedSource(abs.GeneratorSource(events, num_keys=300, num_splits=2, batch_size=1_000,
                                          make_batch=string_key_batch), 3_000)
    flow.source("events", src).key_by("key").process("sum", running_sum, state=[ValueState("total", pa.int64())])
    root = str(tmp_path / "snap")
    result = abs.run(flow, parallelism=parallelism, storage=root, checkpoint=abs.CheckpointConfig(interval=0.05))
    assert result.status == "FINISHED" and len(result.completed_checkpoints) >= 4
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(store.latest_checkpoint())
    got: dict = {}
    for kg in manifest.keyed["sum"]["total"]:
        for ref in store.read_key_group_chain(manifest, "sum", "total", kg):
            part = store.read_file(ref, checkpoint_id=manifest.checkpoint_id)
            if "key" in part.column_names:  # a values image has none: its base's order
                in_file = part.column("key").to_pylist()
                assert in_file == sorted(in_file), f"key group {kg}: {ref} holds keys out of order"
        t = store.read_key_group(manifest, "sum", "total", kg)
        keys = t.column("key").to_pylist()
        assert len(set(keys)) == len(keys) and not set(keys) & set(got)
        got.update(zip(keys, t.column("value").to_pylist()))
    expected: dict = {}
    for i in range(events):
        expected[f"s{i % 300}"] = expected.get(f"s{i % 300}", 0) + i % 7
    assert got == expected


@pytest.mark.parametrize("make_key", [lambda i: f"k{i}", lambda i: f"k{i}".encode(), lambda i: ("k", i)],
                         ids=["str", "bytes", "tuple"])
def test_full_images_standing_for_the_keys_sent_before_write_what_the_keys_would(tmp_path, make_key):
    """str and bytes keys (sent as Arrow arrays, sorted by the writer) and other keys (pickled, in
    the key group's order): a full image with SameKeys writes the same rows as with its keys."""
    from abs.columns import KeyOrders, SameKeys
    from abs.runtime.writer import SentKeys, _write
    from storage import CheckpointSession

    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": M})
    b, sent, orders, session = string_backend(), SentKeys(), KeyOrders(), CheckpointSession()
    for cid in (1, 2, 3):
        values = set_values(b, {make_key(i): i * cid for i in range(60)})
        jobs = sent.substitute([WriteJob("op", "v", kg, [], d, False) for kg, d in b.capture(cid, lazy=True)["v"].items()])
        assert all(isinstance(j.delta._rows().keys, SameKeys) == (cid > 1) for j in jobs)
        # keys sent for the first time: str and bytes as the Arrow array the writer sorts
        as_arrow = cid == 1 and not isinstance(make_key(0), tuple)
        assert all(isinstance(j.delta._rows().keys, pa.Array) == as_arrow for j in jobs)
        jobs = pickle.loads(pickle.dumps(jobs, pickle.HIGHEST_PROTOCOL))  # as the pipe carries them
        chains = _write(store, orders, cid, jobs, session).chains
        b.confirm(cid)
        got: dict = {}
        for chain in chains:
            t = store.read_chain(chain)
            keys = t.column("key").to_pylist()
            if not isinstance(make_key(0), tuple):
                assert keys == sorted(keys)
            else:
                keys = [pickle.loads(k) for k in keys]
            got.update(zip(keys, t.column("value").to_pylist()))
        assert got == values


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([("q", pa.int64()), ("d", pa.float64()), ("i", pa.int32()), ("f", pa.float32()), ("h", pa.int16()),
                        ("b", pa.int8()),  # a type not stored byte-stream split
                        ("q", pa.int32())]),  # values whose dtype is not the type's: the table casts them
       st.lists(st.lists(st.tuples(st.integers(-20, 20), st.one_of(st.none(), st.integers(-9, 9)), st.booleans()),
                         max_size=25), min_size=1, max_size=6),
       st.booleans())
def test_a_column_deltas_values_image_from_its_columns_is_the_one_its_table_gives(kind, rounds, full):
    """The writer makes a ColumnDelta's values image from its sorted keys and values, with the
    keys' digest kept while the key group's keys stay (KeyOrders.derived): over rounds of
    writes, nulls, inserts and deletes it is the table values_image makes of the delta's
    normalized table, metadata and byte-stream split included (or None where that is None),
    for every typed_image delta, and num_rows is the table's row count."""
    from abs.columns import Column, KeyOrders
    from abs.runtime.writer import _values_image
    from storage.tables import normalize_delta
    from storage.values_images import values_image

    typecode, arrow_type = kind
    col, orders = Column(typecode), KeyOrders()
    for epoch in replay_rounds(col, rounds, float if typecode in "df" else None):
        captured = col.capture(epoch - 1, full=full)
        if captured is None:
            continue
        delta = ColumnDelta(captured, arrow_type, "value")
        table = delta.to_table(orders, "s")
        assert delta.num_rows == table.num_rows
        want = values_image(normalize_delta(table, what="test"))
        if not delta.typed_image:  # the write makes it of the table itself
            with pytest.raises(ValueError, match="typed_image"):
                delta.sorted_image(orders, "s")
            continue
        for _ in range(2):  # the second time with what the first kept for these keys
            got = _values_image(delta, orders, "s")
            assert (got is None) == (want is None)
            if want is not None:
                assert got.equals(want, check_metadata=True) and got.schema.equals(want.schema, check_metadata=True)
