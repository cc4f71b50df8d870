"""Shared ranges (format 6): the small files of one kind and schema that a checkpoint writes
into a packed file share one Arrow stream, each key group's rows located by the manifest."""
from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest

from storage import CompactionPolicy, CorruptFileError, CorruptManifestError, FileRef, Manifest, SnapshotStore, StoragePaths
from storage.manifest_refs import RANGE_FIELDS
from storage.store import KeyGroupWrite

OP, M = "count", 16
META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}


def table(keys: list[str], values: list[int], ops: list[int] | None = None) -> pa.Table:
    cols = {"key": pa.array(keys, pa.string()), "value": pa.array(values, pa.int64())}
    if ops is not None:
        cols["op"] = pa.array(ops, pa.int8())
    return pa.table(cols).replace_schema_metadata(META)


def base_rows(kg: int, n: int = 1200) -> dict[str, int]:
    return {f"k{kg}-{i}": i * 7 for i in range(n)}


def as_dict(t: pa.Table) -> dict:
    return dict(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))


def history(store: SnapshotStore) -> tuple[dict[int, dict[str, int]], Manifest, Manifest]:
    """Checkpoint 1: a base per key group; checkpoint 2: a few changed keys (and a delete) in each."""
    models = {kg: base_rows(kg) for kg in range(M)}
    chains = dict(enumerate(store.write_key_groups(1, [
        KeyGroupWrite(OP, "n", kg, [], table(list(m), list(m.values())), complete=True) for kg, m in models.items()])))
    m1 = store.commit(Manifest(checkpoint_id=1, job_name="j", max_parallelism=M, keyed={OP: {"n": chains}}))
    jobs = []
    for kg, model in models.items():
        keys = [f"k{kg}-{i}" for i in (3, 50, 51)] + [f"new{kg}"]
        ops = [0, 0, 1, 0]
        jobs.append(KeyGroupWrite(OP, "n", kg, chains[kg], table(keys, [-1, -2, 0, kg], ops)))
        model.update({keys[0]: -1, keys[1]: -2, keys[3]: kg})
        del model[keys[2]]
    chains = dict(enumerate(store.write_key_groups(2, jobs)))
    m2 = store.commit(Manifest(checkpoint_id=2, job_name="j", max_parallelism=M, keyed={OP: {"n": chains}}))
    return models, m1, m2


@pytest.fixture
def store(memory_root) -> SnapshotStore:
    s = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=1.0))
    s.init_job({"job_name": "j", "max_parallelism": M})
    return s


def test_small_deltas_share_one_stream_and_read_back(store, memory_root):
    models, m1, m2 = history(store)
    deltas = [m2.chains(OP, "n")[kg][-1] for kg in range(M)]
    assert all(r.shared and r.kind == "delta" and r.checkpoint_id == 2 for r in deltas)
    assert len({r.range_id for r in deltas}) == 1 and deltas[0].range_rows == 4 * M
    assert [r.row_offset for r in deltas] == [4 * kg for kg in range(M)]
    bases = [m1.chains(OP, "n")[kg][0] for kg in range(M)]
    assert len({r.range_id for r in bases}) == M and not any(r.shared for r in bases)  # too big to share
    # the chain grows: a delta's share of the stream, not the stream, is its size
    assert all(len(m2.chains(OP, "n")[kg]) == 2 for kg in range(M))
    # a key group's bytes are its share of the range: the shares add up to the range
    assert sum(r.bytes for r in deltas) == deltas[0].range_bytes == deltas[0].read_size
    assert m2.stats["bytes_written"] == deltas[0].range_bytes == store.list_files()[deltas[0].path]
    assert m2.stats["delta_bytes"] == deltas[0].range_bytes and m2.stats["restore_files"] == M + 1
    assert m2.stats["restore_bytes"] == m2.stats["full_size"]
    fresh = SnapshotStore.open(memory_root)
    for kg, model in models.items():
        assert as_dict(fresh.read_key_group(m2, OP, "n", kg)) == model
        assert as_dict(pa.Table.from_batches(list(fresh.iter_key_group(m2, OP, "n", kg)))) == model
    assert fresh.verify().ok


def test_sharing_makes_the_delta_of_few_changes_per_key_group_several_times_smaller(memory_root):
    written = {}
    for share in (0, 16 << 10):
        s = SnapshotStore.open(f"{memory_root}-{share}")
        s.init_job({"job_name": "j", "max_parallelism": M})
        s.share_below = share
        written[share] = history(s)[2].stats["bytes_written"]
    assert written[16 << 10] * 3 < written[0]


def test_a_flipped_byte_in_a_shared_range_fails_every_key_group_in_it_and_is_reported_once(store):
    _, _, m2 = history(store)
    ref = m2.chains(OP, "n")[5][-1]
    data = bytearray(store._io.get(ref.path))
    data[ref.offset + ref.bytes // 2] ^= 0xFF
    store.fs.pipe_file(f"{store._io.root}/{ref.path}", bytes(data))
    fresh = SnapshotStore.open(store.url)
    for kg in (0, 5, M - 1):
        with pytest.raises(CorruptFileError, match="checksum"):
            fresh.read_key_group(m2, OP, "n", kg)
    report = fresh.verify(2)
    assert not report.ok and [(p.kind, p.checkpoints, p.path) for p in report.problems] == [("checksum", (2,), ref.path)]
    where = f"bytes [{ref.offset}, {ref.offset + ref.range_bytes})"
    assert str(report.problems[0]).startswith(f"checkpoint 2: {ref.path}: ")
    assert str(report.problems[0]).endswith(f"corrupt shared range of key groups 0-{M - 1} ({where})")
    assert report.lines()[-1].endswith(": 1 problem(s) in checkpoints [2]; no checked checkpoint is intact")
    assert fresh.verify(1).ok
    # check (abs-snapshot check) passes verify's problems on: once per damaged range too
    import recovery

    checked = recovery.check(None, fresh, checkpoint_id=2)
    assert [p.subject for p in checked.problems if p.kind == "file"] == [ref.path]


def test_a_torn_shared_range_is_reported_once_naming_its_key_groups(store):
    _, _, m2 = history(store)
    ref = m2.chains(OP, "n")[5][-1]
    store.fs.pipe_file(f"{store._io.root}/{ref.path}", store._io.get(ref.path)[:ref.offset + ref.range_bytes // 2])
    problems = SnapshotStore.open(store.url).verify(2).problems
    assert [(p.kind, p.path) for p in problems] == [("size", ref.path)]
    assert f"key groups 0-{M - 1}'s range ends at {ref.offset + ref.range_bytes}" in problems[0].message


def test_a_shared_range_of_another_row_count_is_corrupt(store):
    _, _, m2 = history(store)
    doc = json.loads(m2.to_json())
    for i in {refs[-1][0] for refs in doc["keyed"][OP]["n"].values()}:  # the ranges of the deltas
        doc["ranges"][i][RANGE_FIELDS.index("rows")] += 1
    doc["checkpoint_id"] = 3
    doc.pop("checksum"), doc.pop("checksum_algorithm")
    bad = Manifest.from_dict(doc)
    with pytest.raises(CorruptFileError, match="shared range of 64 rows, the manifest says 65"):
        SnapshotStore.open(store.url).read_key_group(bad, OP, "n", 3)


def _shared_ref(**kw) -> dict:
    ref = dict(path=StoragePaths.packed_file(2, OP, "n"), kind="delta", checkpoint_id=2, rows=3, bytes=500,
               checksum="b" * 32, checksum_algorithm="xxh3_128", offset=0, key_group=3, row_offset=4, range_rows=10,
               range_bytes=1500)
    ref.update(kw)
    return {k: v for k, v in ref.items() if v is not None}


@pytest.mark.parametrize("kw", [
    pytest.param({"range_rows": None}, id="row-offset-without-range-rows"),
    pytest.param({"range_bytes": None}, id="without-range-bytes"),
    pytest.param({"bytes": 1501}, id="a-share-larger-than-the-range"),
    pytest.param({"row_offset": None}, id="range-rows-without-row-offset"),
    pytest.param({"row_offset": 8}, id="rows-past-the-range"),
    pytest.param({"row_offset": -1}, id="negative-row-offset"),
    pytest.param({"range_rows": True}, id="range-rows-a-bool"),
])
def test_malformed_shared_references_are_refused(kw):
    assert FileRef.from_dict(_shared_ref()).read_size == 1500
    with pytest.raises(Exception, match="refusing the reference|not an integer"):
        FileRef.from_dict(_shared_ref(**kw))


def test_a_manifest_older_than_format_6_with_a_shared_range_is_refused():
    base = dict(_shared_ref(), path=StoragePaths.state_file(1, OP, "n", 3, "base"), kind="base", checkpoint_id=1)
    for k in ("offset", "key_group", "row_offset", "range_rows", "range_bytes"):
        base.pop(k)
    doc = {"format_version": 5, "checkpoint_id": 2, "job_name": "j", "max_parallelism": M,
           "keyed": {OP: {"n": {"3": [base, _shared_ref()]}}}}
    Manifest.from_dict(dict(doc, format_version=6))
    with pytest.raises(CorruptManifestError, match="format 6"):
        Manifest.from_dict(doc)


def test_the_documented_example_reads_a_key_group_of_a_shared_range(tmp_path):
    import contextlib
    import io
    import pathlib
    import re

    root = tmp_path / "root"
    store = SnapshotStore.open(str(root))
    store.init_job({"job_name": "j", "max_parallelism": M})
    models, _, m2 = history(store)
    assert m2.chains(OP, "n")[6][-1].shared
    md = pathlib.Path(__file__).resolve().parents[1] / "storage" / "FORMAT.md"
    code = re.search(r"```python\n(.*?)```", md.read_text(), re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("/data/ckpt", str(root)).replace("chk-00000042", "chk-00000002")  # noqa: S102
             .replace('"count", "n", 37', '"count", "n", 6'), {})
    assert out.getvalue().strip() == str([{"key": k, "value": v} for k, v in sorted(models[6].items())])


def test_tiny_deltas_over_small_shared_bases_grow_chains_instead_of_compacting(store):
    """A delta is weighed by its size in a shared stream, without a stream's fixed cost (as
    the shared base is weighed by its share): a few rows over a base of 50 append, as they
    would over a base of a stream of its own."""
    models = {kg: {f"k{kg}-{i}": i for i in range(50)} for kg in range(M)}
    chains = dict(enumerate(store.write_key_groups(1, [
        KeyGroupWrite(OP, "n", kg, [], table(list(m), list(m.values())), complete=True) for kg, m in models.items()])))
    assert all(chain[0].shared for chain in chains.values())
    for cid in range(2, 6):
        jobs = []
        for kg, model in models.items():
            keys = [f"k{kg}-{cid}", f"k{kg}-{cid + 10}"]
            model.update({k: -cid for k in keys})
            jobs.append(KeyGroupWrite(OP, "n", kg, chains[kg], table(keys, [-cid, -cid])))
        chains.update(enumerate(store.write_key_groups(cid, jobs)))
    assert all(len(chain) == 5 for chain in chains.values())
    m = store.commit(Manifest(checkpoint_id=5, job_name="j", max_parallelism=M, keyed={OP: {"n": chains}}))
    for kg, model in models.items():
        assert as_dict(store.read_key_group(m, OP, "n", kg)) == model


@pytest.mark.s3
def test_shared_ranges_on_an_object_store_read_back_and_verify(s3_server, s3_root):
    """Ranged GETs of shared ranges, fetched concurrently within a chain."""
    url, options = f"{s3_root}/jobs/shared", dict(s3_server.storage_options)
    store = SnapshotStore.open(url, options)
    store.init_job({"job_name": "j", "max_parallelism": M})
    models, _, m2 = history(store)
    assert all(m2.chains(OP, "n")[kg][-1].shared for kg in range(M))
    fresh = SnapshotStore.open(url, options)
    for kg, model in models.items():
        assert as_dict(fresh.read_key_group(m2, OP, "n", kg)) == model
    assert fresh.verify().ok


def test_threads_reading_key_groups_of_one_shared_range_at_once_fetch_and_decode_it_once(store, memory_root):
    from abs.runtime.operators import read_ahead

    models, _m1, m2 = history(store)
    fresh = SnapshotStore.open(memory_root)
    reader = fresh._reader
    shared_path = m2.chains(OP, "n")[0][-1].path
    fetched: list = []
    again = threading.Event()
    real = reader.io.get_range

    def counted(path, offset, size):
        if path == shared_path:
            fetched.append(offset)
            if len(fetched) == 1:
                again.wait(0.5)  # the first fetch lingers: a second one would come meanwhile
            else:
                again.set()
        return real(path, offset, size)

    object.__setattr__(reader.io, "get_range", counted)
    items = [("n", kg, m2.chains(OP, "n")[kg]) for kg in range(M)]
    got = {item[1]: as_dict(table) for item, table in read_ahead(fresh.read_chain, items, 8)}
    assert got == models
    assert len(fetched) == 1  # the delta range of every key group: fetched once


def test_small_files_past_the_high_level_limit_are_compressed_at_the_fast_level(store, memory_root, monkeypatch):
    import storage.store_write as store_write

    levels = []
    real = store_write.encode_shared
    monkeypatch.setattr(store_write, "encode_shared", lambda tables, **kw: levels.append(kw.get("level")) or real(tables, **kw))
    models = {kg: {f"k{kg}-{i}": i for i in range(100)} for kg in range(M)}  # each key group a small base
    writes = [KeyGroupWrite(OP, "n", kg, [], table(list(m), list(m.values())), complete=True) for kg, m in models.items()]
    small = sum(w.delta.nbytes for w in writes)
    for checkpoint_id, limit in ((1, small * 2), (2, small // 2)):
        monkeypatch.setattr(store_write, "HIGH_LEVEL_LIMIT", limit)
        chains = dict(enumerate(store.write_key_groups(checkpoint_id, writes)))
        manifest = store.commit(Manifest(checkpoint_id=checkpoint_id, job_name="j", max_parallelism=M,
                                         keyed={OP: {"n": chains}}))
        assert all(chains[kg][-1].shared for kg in range(M))
        fresh = SnapshotStore.open(memory_root)
        for kg, model in models.items():
            assert as_dict(fresh.read_key_group(manifest, OP, "n", kg)) == model
    assert levels == [None, store_write.FAST_LEVEL]  # the high level, then the fast one
    assert SnapshotStore.open(memory_root).verify().ok
