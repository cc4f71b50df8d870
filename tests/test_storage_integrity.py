"""Manifests guard their own integrity (issue 19, A4, B8, C9): a checksum of their content, a
lineage (run, previous checkpoint), row counts checked against the files, bounded parsing, and
corrupt manifests shown as such everywhere while GC goes on."""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

import abs
from abs.cli import main
from abs.runtime.cleanup import BackgroundGc, GcRequest
from recovery import check, choose_checkpoint
from storage import CorruptManifestError, Lineage, Manifest, SnapshotStore, StoragePaths
from storage.manifest import MAX_JSON_DEPTH, manifest_checksum

from manifest_docs import chain_entries, ref_field, set_ref

JOB = {"job_name": "wc", "max_parallelism": 8}


def delta(rows: list[tuple[int, int]]) -> pa.Table:
    return pa.table({"key": pa.array([k for k, _ in rows], pa.int64()), "value": pa.array([v for _, v in rows], pa.int64())})


def build(root: Path, n: int = 3, run_id: str | None = None) -> SnapshotStore:
    """Checkpoints 1..n of a job with one keyed state and a source offset, each following the last."""
    store = SnapshotStore.open(str(root))
    store.init_job(JOB)
    run = run_id or uuid.uuid4().hex
    chain: list = []
    prev = None
    for cid in range(1, n + 1):
        chain = store.write_key_group(cid, "count", "n", 3, chain, delta([(cid, cid * 10), (100 + cid, 1)]))
        prev = store.commit(Manifest(checkpoint_id=cid, job_name="wc", max_parallelism=8,
                                     keyed={"count": {"n": {3: list(chain)}}},
                                     source_offsets={"src": {"0": cid * 1000}},
                                     lineage=Lineage.following(run, prev)))
    return SnapshotStore.open(str(root))  # a fresh store: nothing cached


def manifest_file(root: Path, cid: int) -> Path:
    return root / StoragePaths.manifest(cid)


def edit(root: Path, cid: int, change, *, rechecksum: bool = False) -> None:
    path = manifest_file(root, cid)
    doc = json.loads(path.read_text())
    change(doc)
    if rechecksum:  # what a tool that rewrites manifests consistently would do
        doc["checksum"] = manifest_checksum(doc, doc["checksum_algorithm"])
    path.write_text(json.dumps(doc, indent=1))


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ====================================================================== checksum (A4)
def test_a_committed_manifest_carries_a_checksum_of_its_content_and_a_lineage(tmp_path):
    store = build(tmp_path, 3, run_id="r" * 32)
    docs = [json.loads(manifest_file(tmp_path, c).read_text()) for c in (1, 2, 3)]
    assert all(d["format_version"] == 8 and d["checksum_algorithm"] == "xxh3_128" for d in docs)
    assert all(d["checksum"] == manifest_checksum(d) for d in docs)
    assert docs[0]["lineage"] == {"run_id": "r" * 32, "previous": None}
    assert docs[2]["lineage"]["previous"] == {"checkpoint_id": 2, "checksum": docs[1]["checksum"]}
    m3 = store.read_manifest(3)
    assert m3.checksum == docs[2]["checksum"] and m3.lineage == Lineage("r" * 32, 2, docs[1]["checksum"])
    assert store.verify().ok


def test_an_edited_source_offset_is_detected_by_read_restore_and_verify(tmp_path, capsys):
    build(tmp_path, 3)
    edit(tmp_path, 3, lambda d: d["source_offsets"]["src"].update({"0": 1}))  # still valid JSON, wrong offset
    store = SnapshotStore.open(str(tmp_path))
    with pytest.raises(CorruptManifestError, match=r"checkpoint 3: manifest .*content does not match its xxh3_128 "
                                                   r"checksum.*edited or damaged"):
        store.read_manifest(3)
    # restore: "latest" falls back past it, an explicit request fails naming it
    assert store.list_checkpoints() == [1, 2]
    assert choose_checkpoint(store, "latest")[0] == 2
    with pytest.raises(CorruptManifestError, match="checkpoint 3"):
        choose_checkpoint(store, 3)
    report = store.verify()
    assert [(p.kind, p.checkpoints) for p in report.problems] == [("manifest", (3,))]
    assert "checksum" in report.problems[0].message and report.latest_intact == 2
    # and the CLI shows it as corrupt everywhere
    code, out, _ = cli(capsys, "ls", str(tmp_path))
    row = [line for line in out.splitlines() if line.startswith("3 ")]
    assert code == 0 and row and "corrupt: checksum mismatch (edited or damaged)" in row[0]
    code, _, err = cli(capsys, "show", str(tmp_path), "3")
    assert code == 1 and "checkpoint 3" in err and "checksum" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli(capsys, "show", str(tmp_path))
    assert code == 0 and "checkpoint 2 " in out and "note: checkpoint 3: manifest is corrupt (checksum mismatch" in err
    code, out, _ = cli(capsys, "check", str(tmp_path))
    assert "checkpoint 3" in out and "checksum" in out
    report = check(None, store)
    assert report.checkpoint_id == 2 and any(p.subject == "checkpoint 3" and not p.fatal for p in report.problems)


def test_an_edited_rows_field_is_caught_by_the_checksum_and_if_rechecksummed_by_verify(tmp_path):
    build(tmp_path, 2)
    rows_5 = lambda d: set_ref(d, chain_entries(d, "count", "n", 3)[-1], rows=5)  # noqa: E731
    edit(tmp_path, 2, rows_5)
    with pytest.raises(CorruptManifestError, match="checkpoint 2: .*checksum"):
        SnapshotStore.open(str(tmp_path)).read_manifest(2)
    edit(tmp_path, 2, rows_5, rechecksum=True)
    store = SnapshotStore.open(str(tmp_path))
    path = store.read_manifest(2).keyed["count"]["n"][3][-1].path
    report = store.verify()
    assert [(p.kind, p.checkpoints, p.path) for p in report.problems] == [("rows", (2,), path)]
    assert "holds 2 rows, the manifest says 5" in str(report.problems[0]) and str(report.problems[0]).startswith("checkpoint 2:")
    cid, warnings = choose_checkpoint(store, "latest")
    assert cid == 1 and "checkpoint 2 skipped" in warnings[0] and "rows" in warnings[0]


def test_a_manifest_copied_from_another_run_of_the_job_is_not_of_this_lineage(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    store_a = build(a, 3)
    build(b, 2)
    # checkpoint 3 of run A, with its files, copied into root B (which has 1 and 2 of its own)
    for ref in store_a.read_manifest(3).files().values():
        (b / ref.path).parent.mkdir(parents=True, exist_ok=True)
        (b / ref.path).write_bytes((a / ref.path).read_bytes())
    manifest_file(b, 3).write_bytes(manifest_file(a, 3).read_bytes())
    store_b = SnapshotStore.open(str(b))
    assert store_b.read_manifest(3).checksum  # intact as a file: only its lineage gives it away
    report = store_b.verify()
    assert [(p.kind, p.checkpoints) for p in report.problems] == [("lineage", (3,))]
    assert re.search(r"checkpoint 3: not of this root's lineage: it records that it follows checkpoint 2 .* "
                     r"copied from another run", str(report.problems[0]))
    assert not store_b.verify(3).ok and store_b.verify(2).ok
    cid, warnings = choose_checkpoint(store_b, "latest")
    assert cid == 2 and "checkpoint 3 skipped" in warnings[0] and "lineage" in warnings[0]


def test_a_restored_run_continues_the_lineage_of_the_checkpoint_it_restored(tmp_path):
    def flow() -> abs.Dataflow:
        f = abs.Dataflow("lineage")
        f.source("src", abs.GeneratorSource(2_000, num_keys=10, num_splits=2, batch_size=100)).key_by("key").process(
            "count", lambda ctx, row: None, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
        return f

    root = str(tmp_path / "snap")
    abs.run(flow(), parallelism=1, storage=root, checkpoint=abs.CheckpointConfig())
    first = SnapshotStore.open(root)
    last = first.read_manifest(first.latest_checkpoint())
    abs.run(flow(), parallelism=1, storage=root, restore="latest", checkpoint=abs.CheckpointConfig())
    store = SnapshotStore.open(root)
    newest = store.read_manifest(store.latest_checkpoint())
    assert newest.lineage.previous_id == last.checkpoint_id and newest.lineage.previous_checksum == last.checksum
    assert newest.lineage.run_id != last.lineage.run_id and store.verify().ok


def test_a_format_4_manifest_without_a_checksum_still_reads(tmp_path):
    build(tmp_path, 2)

    def downgrade(d: dict) -> None:  # format 4: references spelled out, no checksum, no lineage
        old = dataclasses.replace(Manifest.from_dict(d), format_version=4, lineage=None).to_dict()
        d.clear()
        d.update(old)

    edit(tmp_path, 2, downgrade)
    store = SnapshotStore.open(str(tmp_path))
    m = store.read_manifest(2)
    assert m.format_version == 4 and m.checksum is None and m.lineage is None and store.verify().ok
    edit(tmp_path, 1, lambda d: (d.pop("checksum"), d.pop("checksum_algorithm")))
    with pytest.raises(CorruptManifestError, match="checkpoint 1: .*format 8 manifest without its checksum"):
        SnapshotStore.open(str(tmp_path)).read_manifest(1)


# ====================================================================== hostile input (C9)
@pytest.mark.parametrize("where", ["manifest", "job"])
@pytest.mark.parametrize("shape", ["deep-array", "deep-object"])
def test_deeply_nested_json_gives_a_one_line_error_in_every_command(tmp_path, capsys, where, shape):
    build(tmp_path, 2)
    deep = "[" * 100_000 + "]" * 100_000 if shape == "deep-array" else '{"a":' * 5_000 + "1" + "}" * 5_000
    if where == "manifest":
        manifest_file(tmp_path, 2).write_text('{"format_version": 5, "stats": ' + deep + "}")
    else:
        (tmp_path / "_job.json").write_text(deep)
    with pytest.raises(CorruptManifestError, match=f"nest deeper than {MAX_JSON_DEPTH} levels"):
        store = SnapshotStore.open(str(tmp_path))
        store.read_manifest(2) if where == "manifest" else store.read_job()
    for argv in (["ls"], ["show"], ["show", "2"], ["verify"], ["check"], ["gc", "--retain", "1", "--dry-run"]):
        code, out, err = cli(capsys, argv[0], str(tmp_path), *argv[1:])
        assert "Traceback" not in err and "RecursionError" not in err + out, argv
        if err:
            assert len(err.strip().splitlines()) <= 2, (argv, err)


@pytest.mark.parametrize("field,value", [
    ("bytes", 10 ** 30), ("rows", 2 ** 63), ("offset", 2 ** 64), ("checkpoint_id", 10 ** 40), ("key_group", 10 ** 20),
    ("bytes", "9" * 5000),  # more digits than Python converts by default
])
def test_huge_integers_in_a_manifest_are_refused(tmp_path, field, value):
    build(tmp_path, 1)
    path = manifest_file(tmp_path, 1)
    doc = json.loads(path.read_text())
    entry = chain_entries(doc, "count", "n", 3)[0]
    if field == "checkpoint_id":  # named by the file's name
        set_ref(doc, entry, path=ref_field(doc, entry, "path").replace("/00000001-", f"/{value}-"))
    elif field == "key_group":  # named by the chain's key
        doc["keyed"]["count"]["n"] = {str(value): doc["keyed"]["count"]["n"]["3"]}
    else:
        set_ref(doc, entry, **{field: value if isinstance(value, int) else 123456789})
    doc["checksum"] = manifest_checksum(doc, doc["checksum_algorithm"])
    text = json.dumps(doc)
    if not isinstance(value, int):  # written by hand: the checksum cannot cover it, the parser stops first
        text = text.replace("123456789", value)
    path.write_text(text)
    with pytest.raises(CorruptManifestError, match="checkpoint 1") as err:
        SnapshotStore.open(str(tmp_path)).read_manifest(1)
    assert len(str(err.value)) < 600 and "\n" not in str(err.value)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e400"])
def test_a_number_json_does_not_allow_is_refused(tmp_path, number):
    build(tmp_path, 1)
    path = manifest_file(tmp_path, 1)
    path.write_text(path.read_text().replace('"stats": {', f'"stats": {{"x": {number}, ', 1))
    with pytest.raises(CorruptManifestError, match="checkpoint 1: .*holds a number JSON does not allow"):
        SnapshotStore.open(str(tmp_path)).read_manifest(1)


def test_huge_max_parallelism_in_job_json_is_refused(tmp_path):
    build(tmp_path, 1)
    (tmp_path / "_job.json").write_text(json.dumps({"job_name": "wc", "max_parallelism": 10 ** 30, "format_version": 5}))
    with pytest.raises(CorruptManifestError, match="_job.json: max_parallelism is out of range"):
        SnapshotStore.open(str(tmp_path)).read_job()


def test_an_oversized_manifest_is_refused_without_reading_it(tmp_path):
    build(tmp_path, 2)
    with open(manifest_file(tmp_path, 2), "r+b") as f:
        f.truncate(300 << 20)  # sparse: costs no disk; reading it would cost 300 MiB of memory
    store = SnapshotStore.open(str(tmp_path))
    with pytest.raises(CorruptManifestError, match=r"chk-00000002.json: 314572800 bytes, more than the \d+ it may have"):
        store.read_manifest(2)
    assert store.list_checkpoints() == [1] and dict(store.list_manifests())[2].reason.startswith("larger than")


# ====================================================================== corrupt manifests and GC (B8)
def test_a_corrupt_manifest_protects_nothing_and_gc_keeps_every_file_of_retained_checkpoints(tmp_path):
    build(tmp_path, 4)
    manifest_file(tmp_path, 2).write_text("{not json")
    store = SnapshotStore.open(str(tmp_path))
    needed = {p for c in (3, 4) for p in store.read_manifest(c).paths()}
    plan = store.gc(retain=2)
    assert plan.retained == (3, 4) and plan.corrupt == ((2, "does not parse as JSON"),)
    # older than every retained checkpoint: the corrupt manifest goes, with what only it could need
    assert StoragePaths.manifest(2) in plan.delete_manifests
    left = set(store.list_files())
    assert needed <= left and StoragePaths.manifest(2) not in left and store.verify().ok


def test_background_gc_goes_on_past_a_corrupt_manifest_and_reports_it_once(tmp_path, capfd):
    store = build(tmp_path, 2)
    manifest_file(tmp_path, 3).write_text('{"format_version": 5')  # newest: stays while newer than the retained
    gc = BackgroundGc()
    chain = store.read_manifest(2).keyed["count"]["n"][3]
    for cid in range(4, 10):
        chain = store.write_key_group(cid, "count", "n", 3, chain, delta([(cid, cid)]))
        store.commit(Manifest(checkpoint_id=cid, job_name="wc", max_parallelism=8,
                              keyed={"count": {"n": {3: list(chain)}}}))
        gc.run_now(GcRequest(store, 1, (), cid))
    assert gc.close(60)
    err = capfd.readouterr().err
    assert err.count("checkpoint 3: manifest is corrupt") == 1 and "garbage collection goes on" in err
    files = store.list_files()
    # storage does not grow: only the newest checkpoint's manifest and chain are left
    assert sorted(p for p in files if p.startswith("checkpoints/")) == [StoragePaths.manifest(9)]
    assert {p for p in files if p.startswith("state/")} == store.read_manifest(9).paths()


# ====================================================================== the checksum, for any content
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON_LEAF = st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=8)
def _json_containers(inner):
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)


JSON = st.recursive(JSON_LEAF, _json_containers, max_leaves=12)


def leaves(doc, path=()):
    """Paths to every leaf value of a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from leaves(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from leaves(v, path + (i,))
    else:
        yield path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offsets=st.dictionaries(st.text(min_size=1, max_size=6), JSON, max_size=3), stats=st.dictionaries(
    st.text(max_size=6), JSON, max_size=3), created=st.floats(0, 4e9), pick=st.integers(0, 10 ** 6))
def test_any_manifest_round_trips_its_checksum_and_any_changed_value_is_detected(offsets, stats, created, pick):
    m = Manifest(checkpoint_id=7, job_name="j\u00e9", max_parallelism=8, created_at=created,
                 source_offsets={"src": offsets}, sink_transactions={"sink": stats}, stats=stats,
                 lineage=Lineage("a" * 32, 6, "b" * 32))
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m and back.checksum == json.loads(text)["checksum"]
    doc = json.loads(text)
    paths = [p for p in leaves(doc) if p[0] not in ("checksum", "checksum_algorithm", "format_version")]
    path = paths[pick % len(paths)]
    target = doc
    for part in path[:-1]:
        target = target[part]
    old = target[path[-1]]
    target[path[-1]] = "changed" if old != "changed" else "changed again"
    with pytest.raises(CorruptManifestError, match="checksum|lineage|is not|invalid|refus|kind|created_at"):
        Manifest.from_json(json.dumps(doc))


def test_rows_are_counted_from_the_batch_headers_without_decoding_and_a_broken_stream_fails():
    import numpy as np

    from storage.format import encode_shared, encode_table, prepare_table
    from storage.verify import count_rows

    for n in (0, 1, 70_000):
        table = pa.table({"key": pa.array([f"k{i}" for i in range(n)]), "value": pa.array(np.arange(n))})
        streams = [encode_table(table, "base").data, encode_shared([prepare_table(table, "base")] * 3).data]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:  # format 1: an IPC file
            writer.write_table(table, max_chunksize=1000)
        assert [count_rows(d) for d in streams] == [n, 3 * n]
        assert count_rows(sink.getvalue().to_pybytes()) == n
        assert count_rows(memoryview(streams[0])) == n
    for broken in (b"", b"\xff\xff\xff\xff" + bytes(4), b"not an Arrow stream at all"):
        with pytest.raises((ValueError, pa.ArrowException)):
            count_rows(broken)
