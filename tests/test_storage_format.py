"""The on-disk format is readable with pyarrow + json alone, as storage/FORMAT.md promises."""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re

import pyarrow as pa

from storage import CompactionPolicy, FORMAT_VERSION, Manifest, SnapshotStore, StoragePaths

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
    return store, store.commit(Manifest(checkpoint_id=42, job_name="wc", max_parallelism=128,
                                        keyed={"count": {"n": {37: chain}}}))


def test_the_documented_pyarrow_example_resolves_a_key_group_like_the_store(tmp_path):
    root = str(tmp_path / "ckpt")
    store, manifest = build(root)
    code = re.search(r"```python\n(.*?)```", FORMAT_MD.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("/data/ckpt", root), {})  # noqa: S102 - our own documentation
    expected = store.read_key_group(manifest, "count", "n", 37)
    assert out.getvalue().strip() == str(expected.sort_by("key").to_pylist())
    assert sorted(expected.to_pylist(), key=lambda r: r["key"]) == [
        {"key": 1, "value": 11}, {"key": 2, "value": 21}, {"key": 3, "value": 30}, {"key": 4, "value": 41}]


def test_files_are_zstd_compressed_arrow_ipc_files_and_manifests_plain_json(tmp_path):
    root = tmp_path / "ckpt"
    store, manifest = build(str(root))
    for ref in manifest.files().values():
        data = (root / ref.path).read_bytes()
        assert data[:6] == b"ARROW1" and ZSTD_MAGIC in data
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        assert table.schema.metadata[b"abs.file_kind"] == ref.kind.encode()
        if ref.kind == "base":
            assert "op" not in table.column_names
        elif ref.checkpoint_id == 41:  # the delta with a delete keeps op; all-upsert deltas omit it
            assert table.column("op").to_pylist() == [1, 0, 0]
        else:
            assert "op" not in table.column_names
    doc = json.loads((root / StoragePaths.manifest(42)).read_text())
    assert doc["format_version"] == FORMAT_VERSION == 1
    assert set(doc) >= {"checkpoint_id", "kind", "job_name", "max_parallelism", "created_at", "keyed",
                        "operator_state", "operator_state_rules", "channel_logs", "source_offsets",
                        "sink_transactions", "stats"}
    job = json.loads((root / "_job.json").read_text())
    assert job == {"format_version": 1, "job_name": "wc", "max_parallelism": 128}
