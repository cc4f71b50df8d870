"""The on-disk format is readable with pyarrow + json alone, as storage/FORMAT.md promises."""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re

import hashlib

import numpy as np
import pyarrow as pa
import pytest

import storage.format
from storage import (
    FORMAT_VERSION,
    CompactionPolicy,
    CorruptFileError,
    CorruptManifestError,
    FileRef,
    InvalidPathError,
    Manifest,
    SnapshotStore,
    StoragePaths,
)
from storage.format import WRITE_CHECKSUM_ALGORITHM, checksum_hex

FORMAT_MD = pathlib.Path(__file__).resolve().parents[1] / "storage" / "FORMAT.md"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def build(root: str) -> tuple[SnapshotStore, Manifest]:
    store = SnapshotStore.open(root, policy=CompactionPolicy(max_delta_ratio=100.0))
    store.init_job({"job_name": "wc", "max_parallelism": 128})
    rows = lambda keys, values, ops: pa.table({"key": keys, "value": values, "op": pa.array(ops, pa.int8())})  # noqa: E731
    chain = store.write_key_group(40, "count", "n", 37, [], rows([1, 2, 3], [10, 20, 30], [0, 0, 0]))
    chain = store.write_key_group(41, "count", "n", 37, chain, rows([1, 2, 4], [0, 21, 40], [1, 0, 0]))
    chain = store.write_key_group(42, "count", "n", 37, chain, rows([4, 1], [41, 11], [0, 0]))
    assert [r.kind for r in chain] == ["base", "delta", "delta"]
    # key group 38: a base, a values image over it (format 4), a delta on top
    other = store.write_key_group(40, "count", "n", 38, [], rows([7, 5, 6], [70, 50, 60], [0, 0, 0]), complete=True)
    other = store.write_key_group(41, "count", "n", 38, other, rows([6, 7, 5], [61, 71, 51], [0, 0, 0]), complete=True,
                                  over_base=other[0])
    other = store.write_key_group(42, "count", "n", 38, other, rows([8, 6], [80, 0], [0, 1]))
    assert [r.kind for r in other] == ["base", "delta", "delta"] and other[0].checkpoint_id == 40
    return store, store.commit(Manifest(checkpoint_id=42, job_name="wc", max_parallelism=128,
                                        keyed={"count": {"n": {37: chain, 38: other}}}))


def test_the_documented_pyarrow_example_resolves_a_key_group_like_the_store(tmp_path):
    root = str(tmp_path / "ckpt")
    store, manifest = build(root)
    code = re.search(r"```python\n(.*?)```", FORMAT_MD.read_text(), re.S).group(1)
    # 12 lines until format 7's reference tables took a helper of 4, and format 8's byte-stream split columns another 4
    assert len(code.strip().splitlines()) <= 20
    for kg, rows in [(37, [(1, 11), (2, 21), (3, 30), (4, 41)]), (38, [(5, 51), (7, 71), (8, 80)])]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("/data/ckpt", root).replace('"n", 37', f'"n", {kg}'), {})  # noqa: S102 - our own documentation
        expected = store.read_key_group(manifest, "count", "n", kg)
        assert out.getvalue().strip() == str(expected.sort_by("key").to_pylist())
        assert sorted(expected.to_pylist(), key=lambda r: r["key"]) == [{"key": k, "value": v} for k, v in rows]


def test_files_are_zstd_compressed_arrow_ipc_streams_and_manifests_plain_json(tmp_path):
    root = tmp_path / "ckpt"
    store, manifest = build(str(root))
    chain37, chain38 = manifest.chains("count", "n")[37], manifest.chains("count", "n")[38]
    for ref in manifest.files().values():
        data = (root / ref.path).read_bytes()
        assert data[:4] == b"\xff\xff\xff\xff" and ZSTD_MAGIC in data  # a stream message, not the ARROW1 file magic
        assert ref.checksum_algorithm == WRITE_CHECKSUM_ALGORITHM and ref.checksum == checksum_hex(data, ref.checksum_algorithm)
        table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
        assert b"abs.file_kind" not in (table.schema.metadata or {})
        if "key" not in table.column_names:  # the values image of key group 38: values in its base's key order
            assert ref.checkpoint_id == 41 and table.column_names == ["value"]
            # format 8: stored byte-stream split, the bytes of each position of the 8 in a run
            assert table.schema.field("value").type == pa.binary(8)
            assert table.schema.field("value").metadata == {b"abs.byte_stream_split": b"int64"}
            planes = np.frombuffer(table["value"].chunk(0).buffers()[1], np.uint8).reshape(8, 3)
            assert np.ascontiguousarray(planes.T).view("<i8").ravel().tolist() == [51, 61, 71]
            assert table.schema.metadata[b"abs.keys_digest"].startswith(WRITE_CHECKSUM_ALGORITHM.encode() + b":")
            continue
        assert table.column("key").to_pylist() == sorted(table.column("key").to_pylist())
        if ref.kind == "base":
            assert "op" not in table.column_names
        elif ref in (chain37[1], chain38[2]):  # the deltas with a delete keep op; all-upsert deltas omit it
            assert table.column("op").to_pylist() == ([1, 0, 0] if ref == chain37[1] else [1, 0])
        else:
            assert "op" not in table.column_names
    doc = json.loads((root / StoragePaths.manifest(42)).read_text())
    assert doc["format_version"] == FORMAT_VERSION == 8
    assert set(doc) >= {"checksum", "checksum_algorithm", "checkpoint_id", "kind", "job_name", "max_parallelism", "created_at",
                        "files", "ranges", "keyed", "operator_state", "operator_state_rules", "channel_logs",
                        "source_offsets", "sink_transactions", "stats"}
    # every file and range named once; references index them
    assert sorted(doc["files"]) == sorted(manifest.paths()) and len(doc["ranges"]) == len(manifest.files())
    assert all(rng[5] == WRITE_CHECKSUM_ALGORITHM for rng in doc["ranges"])
    assert all(isinstance(entry, list) and all(type(i) is int for i in entry)
               for kg in ("37", "38") for entry in doc["keyed"]["count"]["n"][kg])
    job = json.loads((root / "_job.json").read_text())
    assert job == {"format_version": 8, "job_name": "wc", "max_parallelism": 128}


def test_xxhash_is_installed_so_new_files_get_xxh3_checksums():
    # xxhash is an optional dependency; without it the writer falls back to BLAKE2b-256
    pytest.importorskip("xxhash")
    assert WRITE_CHECKSUM_ALGORITHM == "xxh3_128"
    assert checksum_hex(b"abc", "xxh3_128") == "06b05ab6733a618578af5f94892f3950"  # xxHash 0.8 reference value


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b_256", "xxh3_128"])
def test_every_checksum_algorithm_verifies_and_detects_a_flipped_byte(tmp_path, monkeypatch, algorithm):
    if algorithm == "xxh3_128":
        pytest.importorskip("xxhash")
    monkeypatch.setattr(storage.format, "WRITE_CHECKSUM_ALGORITHM", algorithm)
    root = tmp_path / "ckpt"
    store, manifest = build(str(root))
    refs = manifest.chains("count", "n")[37]
    assert {r.checksum_algorithm for r in refs} == {algorithm}
    assert len(refs[0].checksum) == {"sha256": 64, "blake2b_256": 64, "xxh3_128": 32}[algorithm]
    assert store.verify(42).ok
    monkeypatch.undo()  # reading does not depend on what the writer would use now
    fresh = SnapshotStore.open(str(root))
    assert fresh.read_key_group(fresh.read_manifest(42), "count", "n", 37).num_rows == 4
    data = bytearray((root / refs[1].path).read_bytes())
    data[len(data) // 2] ^= 0x01
    (root / refs[1].path).write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=f"fails its {algorithm} checksum"):
        fresh.read_key_group(fresh.read_manifest(42), "count", "n", 37)
    assert [p.kind for p in fresh.verify(42).problems] == ["checksum"]


def test_a_file_reference_with_an_unknown_algorithm_or_a_digest_of_the_wrong_length_is_refused():
    path = StoragePaths.state_file(1, "count", "n", 0, "base").replace(StoragePaths.state_file(1, "count", "n", 0, "base").rsplit("-", 1)[1], "0" * 32 + ".arrow")
    FileRef(path=path, kind="base", checkpoint_id=1, rows=1, bytes=1, checksum="a" * 32, checksum_algorithm="xxh3_128")
    with pytest.raises(InvalidPathError, match="not a xxh3_128 hex digest"):
        FileRef(path=path, kind="base", checkpoint_id=1, rows=1, bytes=1, checksum="a" * 64, checksum_algorithm="xxh3_128")
    with pytest.raises(InvalidPathError, match="checksum algorithm 'md5'"):
        FileRef(path=path, kind="base", checkpoint_id=1, rows=1, bytes=1, checksum="a" * 32, checksum_algorithm="md5")
    with pytest.raises(CorruptManifestError):
        Manifest.from_dict({"format_version": 2, "checkpoint_id": 1, "job_name": "j", "max_parallelism": 1, "keyed": {
            "count": {"n": {"0": [{"path": path, "kind": "base", "checkpoint_id": 1, "rows": 1, "bytes": 1,
                                   "checksum": "a" * 32, "checksum_algorithm": "crc32"}]}}}})


# ------------------------------------------------------------------------------------ version 1
def write_v1_file(path: pathlib.Path, table: pa.Table, kind: str) -> dict:
    """A file as format 1 wrote it: IPC file format, zstd, abs.file_kind, SHA-256 in the manifest."""
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"abs.file_kind": kind.encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"bytes": len(data), "rows": table.num_rows, "checksum": hashlib.sha256(data).hexdigest()}


def build_v1_root(root: pathlib.Path) -> None:
    """A root written by format 1 code: unsorted base, a delta with a delete, v1 manifest and _job.json."""
    meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
    refs = []
    for cid, kind, table in [
        (1, "base", pa.table({"key": [30, 10, 20], "value": [3, 1, 2]})),
        (2, "delta", pa.table({"key": [20, 40, 10], "value": [0, 4, 11], "op": pa.array([1, 0, 0], pa.int8())})),
    ]:
        rel = StoragePaths.state_file(cid, "count", "n", 5, kind)
        refs.append({"path": rel, "kind": kind, "checkpoint_id": cid,
                     **write_v1_file(root / rel, table.replace_schema_metadata(meta), kind)})
    manifest = {"format_version": 1, "checkpoint_id": 2, "kind": "checkpoint", "job_name": "wc",
                "max_parallelism": 8, "created_at": 1.0, "keyed": {"count": {"n": {"5": refs}}},
                "operator_state": {}, "operator_state_rules": {}, "channel_logs": [], "source_offsets": {},
                "sink_transactions": {}, "stats": {}}
    (root / "checkpoints").mkdir(parents=True)
    (root / StoragePaths.manifest(2)).write_text(json.dumps(manifest))
    (root / "_job.json").write_text(json.dumps({"format_version": 1, "job_name": "wc", "max_parallelism": 8}))


def test_a_version_1_root_is_read_verified_and_continued(tmp_path):
    root = tmp_path / "v1"
    build_v1_root(root)
    store = SnapshotStore.open(str(root), policy=CompactionPolicy(max_delta_ratio=100.0))
    store.init_job({"job_name": "wc", "max_parallelism": 8})  # the same job, an older format: accepted
    m2 = store.read_manifest(2)
    assert m2.format_version == 1 and all(r.checksum_algorithm == "sha256" for r in m2.iter_refs())
    assert store.verify(2).ok
    state = store.read_key_group(m2, "count", "n", 5)
    assert sorted(state.to_pylist(), key=lambda r: r["key"]) == [
        {"key": 10, "value": 11}, {"key": 30, "value": 3}, {"key": 40, "value": 4}]
    assert state.schema.metadata == {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
    # continue the chain with a version 2 delta on top of the version 1 files
    chain = store.write_key_group(3, "count", "n", 5, m2.chains("count", "n")[5],
                                  pa.table({"key": [50, 30], "value": [5, 33]}).replace_schema_metadata(state.schema.metadata))
    m3 = store.commit(Manifest(checkpoint_id=3, job_name="wc", max_parallelism=8, keyed={"count": {"n": {5: chain}}}))
    assert m3.format_version == 8 and [r.checksum_algorithm for r in chain] == ["sha256", "sha256", WRITE_CHECKSUM_ALGORITHM]
    again = SnapshotStore.open(str(root))
    assert again.verify().ok
    assert as_sorted(again.read_key_group(again.read_manifest(3), "count", "n", 5)) == [
        (10, 11), (30, 33), (40, 4), (50, 5)]
    # the documented example reads the mixed chain too (v1 IPC files, v2 IPC stream)
    code = re.search(r"```python\n(.*?)```", FORMAT_MD.read_text(), re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("/data/ckpt", str(root)).replace("chk-00000042", "chk-00000003")  # noqa: S102
             .replace('"count", "n", 37', '"count", "n", 5'), {})
    assert out.getvalue().strip() == str([{"key": k, "value": v} for k, v in [(10, 11), (30, 33), (40, 4), (50, 5)]])


def as_sorted(table: pa.Table) -> list[tuple]:
    return sorted(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))


def test_older_code_would_refuse_a_version_8_manifest_by_its_version():
    doc = Manifest(checkpoint_id=1, job_name="j", max_parallelism=1).to_dict()
    assert doc["format_version"] == 8  # version 1 to 7 readers raise UnsupportedFormatError on > their own
