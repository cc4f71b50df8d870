"""The store contract, written once and run unchanged on memory://, local disk and S3 (moto)."""
from __future__ import annotations

import json
import pickle
from typing import Any

import fsspec
import pyarrow as pa
import pytest

from storage import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CompactionPolicy,
    CorruptFileError,
    CorruptManifestError,
    FileRef,
    GcRefusedError,
    JobMismatchError,
    Manifest,
    MissingFileError,
    SnapshotStore,
    StorageConfigError,
    StateNotFoundError,
    StoragePaths,
    UnsupportedFormatError,
)

from manifest_docs import chain_entries, set_ref

JOB = {"job_name": "wordcount", "max_parallelism": 16, "operators": ["count"]}


def delta(rows: list[tuple[Any, Any, int]], *, metadata: dict[bytes, bytes] | None = None) -> pa.Table:
    """(key, value, op) rows -> delta table."""
    table = pa.table({
        "key": [r[0] for r in rows],
        "value": [r[1] for r in rows],
        "op": pa.array([r[2] for r in rows], pa.int8()),
    })
    return table.replace_schema_metadata(metadata) if metadata else table


def as_dict(table: pa.Table) -> dict[Any, Any]:
    return dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))


class StoreFixtures:
    """``store`` (with ``_job.json`` written) and ``open_store`` over the ``root`` and ``options``
    fixtures that subclasses provide (also used by tests/test_storage_packed.py)."""

    @pytest.fixture
    def options(self) -> dict[str, Any] | None:
        return None

    @pytest.fixture
    def open_store(self, options):
        def _open(url: str, **kw: Any) -> SnapshotStore:
            return SnapshotStore.open(url, options, **kw)
        return _open

    @pytest.fixture
    def store(self, root, open_store) -> SnapshotStore:
        s = open_store(root)
        s.init_job(JOB)
        return s

    @staticmethod
    def damage(store: SnapshotStore, path: str, data: bytes | None) -> None:
        """Replace (or with None: delete) a file behind the store's back."""
        full = f"{store._io.root}/{path}"
        if data is None:
            store.fs.rm_file(full)
        else:
            store.fs.pipe_file(full, data)


class StoreContract(StoreFixtures):
    """Every backend must pass these. Subclasses provide the ``root`` and ``options`` fixtures."""

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def commit(store: SnapshotStore, cid: int, chains: dict[int, list[FileRef]], **kw: Any) -> Manifest:
        return store.commit(Manifest(checkpoint_id=cid, job_name="wordcount", max_parallelism=16,
                                     keyed={"count": {"n": chains}}, **kw))

    # ----------------------------------------------------------------- writing and reading
    def test_first_write_of_a_key_group_is_a_base_without_deleted_keys(self, store):
        chain = store.write_key_group(1, "count", "n", 3, [], delta([(1, "a", 0), (2, "b", 0), (9, "x", 1), (1, "A", 0)]))
        assert [r.kind for r in chain] == ["base"]
        assert chain[0].checkpoint_id == 1 and chain[0].rows == 2
        table = store.read_file(chain[0])
        assert "op" not in table.column_names
        assert as_dict(store.read_chain(chain)) == {1: "A", 2: "b"}

    def test_deltas_append_to_the_chain_and_the_last_op_per_key_wins(self, store):
        store.policy = CompactionPolicy(max_chain_length=10, max_delta_ratio=100.0)
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0), (2, "b", 0), (3, "c", 0)]))
        chain = store.write_key_group(2, "count", "n", 0, chain, delta([(1, "", 1), (4, "d", 0), (2, "B", 0)]))
        chain = store.write_key_group(3, "count", "n", 0, chain, delta([(1, "z", 0), (4, "", 1), (4, "D", 0)]))
        assert [(r.kind, r.checkpoint_id) for r in chain] == [("base", 1), ("delta", 2), ("delta", 3)]
        assert as_dict(store.read_chain(chain)) == {1: "z", 2: "B", 3: "c", 4: "D"}

    def test_a_chain_longer_than_the_policy_is_compacted_into_a_new_base(self, store):
        store.policy = CompactionPolicy(max_chain_length=3, max_delta_ratio=100.0)
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(k, f"v{k}", 0) for k in range(10)]))
        chain = store.write_key_group(2, "count", "n", 0, chain, delta([(0, "", 1)]))
        chain = store.write_key_group(3, "count", "n", 0, chain, delta([(1, "one", 0)]))
        assert len(chain) == 3
        chain = store.write_key_group(4, "count", "n", 0, chain, delta([(2, "two", 0)]))
        assert [(r.kind, r.checkpoint_id) for r in chain] == [("base", 4)]
        expected = {k: f"v{k}" for k in range(1, 10)} | {1: "one", 2: "two"}
        assert as_dict(store.read_file(chain[0])) == expected

    def test_deltas_bigger_than_the_ratio_trigger_compaction(self, store):
        store.policy = CompactionPolicy(max_chain_length=100, max_delta_ratio=0.5)
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(k, "x" * 50, 0) for k in range(200)]))
        chain = store.write_key_group(2, "count", "n", 0, chain, delta([(k, "y" * 50, 0) for k in range(190)]))
        assert [r.kind for r in chain] == ["base"] and chain[0].checkpoint_id == 2

    def test_an_empty_delta_keeps_the_chain_and_writes_nothing(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        before = store.list_files()
        assert store.write_key_group(2, "count", "n", 0, chain, delta([])) == chain
        assert store.list_files() == before

    def test_pickled_values_and_writer_metadata_survive_deltas_and_compaction(self, store):
        store.policy = CompactionPolicy(max_chain_length=2, max_delta_ratio=100.0)
        meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"pickle", b"abs.state_type": b"value"}
        rows = lambda pairs, op=0: delta([(k, pickle.dumps(v), op) for k, v in pairs], metadata=meta)  # noqa: E731
        chain = store.write_key_group(1, "count", "n", 5, [], rows([("a", {"n": 1}), ("b", [1, 2])]))
        chain = store.write_key_group(2, "count", "n", 5, chain, rows([("a", {"n": 2})]))
        chain = store.write_key_group(3, "count", "n", 5, chain, rows([("b", None)], op=1))
        assert [r.kind for r in chain] == ["base"]
        table = store.read_chain(chain)
        assert table.schema.metadata[b"abs.value_encoding"] == b"pickle"
        assert table.schema.metadata[b"abs.state_type"] == b"value"
        assert {k: pickle.loads(v) for k, v in as_dict(table).items()} == {"a": {"n": 2}}

    def test_operator_state_and_channel_logs_round_trip(self, store):
        ops = pa.table({"split": ["s0", "s1"], "offset": [10, 20]})
        log = pa.table({"record": [b"\x00", b"\x01"]})
        oref = store.write_operator_state(1, "source", 0, ops)
        cref = store.write_channel_log(1, "iterate/head#0", log)
        assert store.read_file(oref).select(["split", "offset"]).equals(ops)
        assert store.read_file(cref).select(["record"]).equals(log)
        assert cref.location().task == "iterate/head#0" and oref.location().subtask == 0

    # ----------------------------------------------------------------- manifests
    def test_commit_makes_a_checkpoint_complete_and_the_manifest_round_trips(self, store):
        assert store.list_checkpoints() == [] and store.latest_checkpoint() is None
        chain = store.write_key_group(1, "count", "n", 2, [], delta([(1, "a", 0)]))
        oref = store.write_operator_state(1, "source", 0, pa.table({"o": [1]}))
        manifest = Manifest(
            checkpoint_id=1, job_name="wordcount", max_parallelism=16, created_at=123.5,
            keyed={"count": {"n": {2: chain}}}, operator_state={"source": {0: oref}},
            operator_state_rules={"source": "split"}, source_offsets={"source": {"split-0": {"pos": 7}}},
            sink_transactions={"sink": {"0": ["pending-1"]}}, stats={"duration_s": 0.5},
        )
        stored = store.commit(manifest)
        assert store.list_checkpoints() == [1] and store.latest_checkpoint() == 1
        fresh = SnapshotStore.open(store.url, fs=store.fs)
        read = fresh.read_manifest(1)
        assert read == stored
        assert read.keyed == manifest.keyed and read.operator_state == manifest.operator_state
        assert read.source_offsets == {"source": {"split-0": {"pos": 7}}}
        assert read.stats["duration_s"] == 0.5
        assert read.stats["bytes_written"] == chain[0].bytes + oref.bytes
        assert read.stats["files"] == 2 and read.stats["max_chain_length"] == 1
        assert read.stats["space_amplification"] == 1.0

    def test_committing_an_existing_id_fails_and_keeps_the_first_manifest(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain}, stats={"first": True})
        with pytest.raises(CheckpointExistsError, match="checkpoint 1 already has a manifest"):
            self.commit(store, 1, {}, stats={"first": False})
        assert SnapshotStore.open(store.url, fs=store.fs).read_manifest(1).stats["first"] is True

    def test_next_checkpoint_id_is_above_every_file_even_without_a_manifest(self, store):
        assert store.next_checkpoint_id() == 1
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        assert store.next_checkpoint_id() == 2
        store.write_key_group(7, "count", "n", 1, [], delta([(2, "b", 0)]))  # crashed attempt 7
        assert store.next_checkpoint_id() == 8
        store.write_channel_log(9, "t", pa.table({"x": [1]}))
        assert store.next_checkpoint_id() == 10
        assert store.list_checkpoints() == [1]

    def test_reading_an_unknown_checkpoint_names_the_complete_ones(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        with pytest.raises(CheckpointNotFoundError, match=r"checkpoint 5 does not exist.*\[1\]"):
            store.read_manifest(5)

    def test_read_key_group_names_missing_operator_state_and_key_group(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        m = self.commit(store, 1, {0: chain})
        assert as_dict(store.read_key_group(m, "count", "n", 0)) == {1: "a"}
        with pytest.raises(StateNotFoundError, match="operator 'nope'"):
            store.read_key_group(m, "nope", "n", 0)
        with pytest.raises(StateNotFoundError, match="no state 'm'"):
            store.read_key_group(m, "count", "m", 0)
        with pytest.raises(StateNotFoundError, match="key group 4"):
            store.read_key_group(m, "count", "n", 4)

    # ----------------------------------------------------------------- job fingerprint
    def test_a_second_job_in_the_same_root_is_refused_naming_both_jobs(self, store, root, open_store):
        other = open_store(root)
        with pytest.raises(JobMismatchError, match=r"'wordcount'.*'fraud'.*use another storage root"):
            other.init_job({"job_name": "fraud", "max_parallelism": 16})
        with pytest.raises(JobMismatchError, match="max_parallelism 32"):
            other.init_job({"job_name": "wordcount", "max_parallelism": 32})
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        with pytest.raises(JobMismatchError):
            store.commit(Manifest(checkpoint_id=1, job_name="fraud", max_parallelism=16, keyed={"count": {"n": {0: chain}}}))
        assert store.list_checkpoints() == []

    def test_the_same_job_with_changed_operators_is_accepted_and_the_first_fingerprint_kept(self, store, root, open_store):
        again = open_store(root)
        again.init_job({"job_name": "wordcount", "max_parallelism": 16, "operators": ["count", "new"]})
        assert again.read_job()["operators"] == ["count"]

    # ----------------------------------------------------------------- bad input
    def test_corrupt_truncated_and_missing_files_are_refused_naming_the_file(self, store):
        chains = {kg: store.write_key_group(1, "count", "n", kg, [], delta([(kg, "v" * 40, 0)])) for kg in range(3)}
        m = self.commit(store, 1, chains)
        flipped = bytearray(store._io.get(chains[0][0].path))
        flipped[len(flipped) // 2] ^= 0xFF
        self.damage(store, chains[0][0].path, bytes(flipped))
        self.damage(store, chains[1][0].path, store._io.get(chains[1][0].path)[:50])
        self.damage(store, chains[2][0].path, None)
        with pytest.raises(CorruptFileError, match=rf"checkpoint 1: file {chains[0][0].path} fails its {chains[0][0].checksum_algorithm} checksum"):
            store.read_key_group(m, "count", "n", 0)
        with pytest.raises(CorruptFileError, match=r"has 50 bytes.*torn"):
            store.read_key_group(m, "count", "n", 1)
        with pytest.raises(MissingFileError, match=rf"{chains[2][0].path} is missing.*restore from an earlier"):
            store.read_key_group(m, "count", "n", 2)
        report = store.verify(1)
        assert not report.ok
        assert {(p.kind, p.path) for p in report.problems} == {
            ("checksum", chains[0][0].path), ("size", chains[1][0].path), ("missing", chains[2][0].path)}
        assert all(p.checkpoints == (1,) for p in report.problems)
        assert "checkpoint 1: " + chains[2][0].path in "\n".join(report.lines())

    def test_the_first_bad_file_in_chain_order_is_reported(self, store):
        # object stores fetch a chain's files concurrently; the error must not depend on timing
        store.policy = CompactionPolicy(max_delta_ratio=1000.0)
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        for cid in (2, 3, 4):
            chain = store.write_key_group(cid, "count", "n", 0, chain, delta([(cid, "b" * cid, 0)]))
        assert [r.kind for r in chain] == ["base", "delta", "delta", "delta"]
        assert as_dict(store.read_chain(chain)) == {1: "a", 2: "bb", 3: "bbb", 4: "bbbb"}
        self.damage(store, chain[3].path, None)
        self.damage(store, chain[2].path, b"x" * chain[2].bytes)
        with pytest.raises(CorruptFileError, match=rf"{chain[2].path} fails its"):
            store.read_chain(chain)
        self.damage(store, chain[1].path, None)
        with pytest.raises(MissingFileError, match=rf"{chain[1].path} is missing"):
            store.read_chain(chain)

    def test_verify_passes_on_intact_checkpoints(self, store):
        first = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: first})
        second = store.write_key_group(2, "count", "n", 0, first, delta([(2, "b", 0)]))
        self.commit(store, 2, {0: second})
        report = store.verify()
        assert report.ok and report.checkpoints == (1, 2)
        assert report.files_checked == len({r.path for r in first + second})
        assert report.lines()[-1].endswith(": OK")

    def _write_manifest_file(self, store: SnapshotStore, cid: int, data: bytes) -> str:
        path = StoragePaths.manifest(cid)
        store.fs.pipe_file(f"{store._io.root}/{path}", data)
        return path

    def test_a_manifest_that_does_not_parse_is_not_complete_and_gc_goes_on_without_trusting_it(self, store):
        # (behaviour change, issue 19 B8: a corrupt manifest used to make every GC refuse)
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        orphan = store.write_key_group(2, "count", "n", 1, [], delta([(1, "a", 0)]))
        path = self._write_manifest_file(store, 3, b'{"format_version": 1, "checkpoint_id": 3, "kee')
        assert store.list_checkpoints() == [1] and store.latest_checkpoint() == 1
        with pytest.raises(CorruptManifestError, match=rf"checkpoint 3: manifest {path}: does not parse"):
            store.read_manifest(3)
        report = store.verify()
        assert [(p.kind, p.checkpoints) for p in report.problems] == [("manifest", (3,))]
        before = store.list_files()
        plan = store.gc(retain=1)
        assert plan.corrupt == ((3, "does not parse as JSON"),) and "checkpoint 3 has a corrupt manifest" in plan.summary()
        # newer than the newest good checkpoint: the orphan may be in flight, the manifest stays for inspection
        assert store.list_files() == before and orphan[0].path in before
        assert "1 unreferenced files newer than checkpoint 1 kept (may be in flight)" in plan.summary()
        chain4 = store.write_key_group(4, "count", "n", 0, chain, delta([(2, "b", 0)]))
        self.commit(store, 4, {0: chain4})
        plan = store.gc(retain=1)
        after = store.list_files()
        # once a retained checkpoint is newer, the corrupt manifest and the garbage go; retained files stay
        assert path not in after and orphan[0].path not in after and plan.retained == (4,)
        assert not plan.protected and "newer than checkpoint" not in plan.summary()  # no clause about nothing
        assert all(ref.path in after for ref in chain4) and store.verify(4).ok

    @pytest.mark.parametrize("bad_path", ["../outside/x.arrow", "/etc/passwd", "state/../../x.arrow", "s3://other/x"])
    def test_a_manifest_naming_files_outside_the_root_is_corrupt(self, store, bad_path):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        doc = self.commit(store, 1, {0: chain}).to_dict()
        doc["checkpoint_id"] = 2
        set_ref(doc, chain_entries(doc, "count", "n", 0)[0], path=bad_path)
        self._write_manifest_file(store, 2, json.dumps(doc).encode())
        with pytest.raises(CorruptManifestError, match="checkpoint 2.*outside the root|checkpoint 2.*refusing"):
            store.read_manifest(2)
        assert store.list_checkpoints() == [1]

    def test_a_newer_format_version_names_the_version_needed(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        doc = self.commit(store, 1, {0: chain}).to_dict()
        doc.update(checkpoint_id=2, format_version=99)
        self._write_manifest_file(store, 2, json.dumps(doc).encode())
        with pytest.raises(UnsupportedFormatError, match="format version 99.*upgrade"):
            store.read_manifest(2)
        assert store.latest_checkpoint() == 2  # complete, just not readable by this version
        with pytest.raises(GcRefusedError):
            store.gc(retain=1)

    # ----------------------------------------------------------------- crash, gc, savepoints
    def test_a_crash_before_commit_leaves_no_checkpoint_and_gc_removes_the_garbage_later(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        # attempt 2 writes its files, then the process dies before commit
        crashed = store.write_key_group(2, "count", "n", 0, chain, delta([(2, "b", 0)]))
        crashed_op = store.write_operator_state(2, "source", 0, pa.table({"o": [1]}))
        garbage = {r.path for r in crashed if r.checkpoint_id == 2} | {crashed_op.path}
        assert store.list_checkpoints() == [1]
        # a GC now must keep them: checkpoint 2 could still be in flight
        plan = store.gc(retain=1)
        assert garbage <= set(plan.protected) and garbage <= set(store.list_files())
        # the restarted job takes id 3, completes it; now the attempt's files are provably garbage
        restarted = SnapshotStore.open(store.url, fs=store.fs)
        assert restarted.next_checkpoint_id() == 3
        chain3 = restarted.write_key_group(3, "count", "n", 0, chain, delta([(3, "c", 0)]))
        self.commit(restarted, 3, {0: chain3})
        plan = restarted.gc(retain=1)
        assert garbage <= set(plan.delete_files)
        assert not garbage & set(store.list_files())
        assert as_dict(restarted.read_key_group(restarted.read_manifest(3), "count", "n", 0)) == {1: "a", 3: "c"}
        assert restarted.verify().ok

    def test_gc_keeps_the_newest_checkpoints_and_every_file_they_reference(self, store):
        store.policy = CompactionPolicy(max_chain_length=10, max_delta_ratio=100.0)
        chain: list[FileRef] = []
        for cid in range(1, 6):
            chain = store.write_key_group(cid, "count", "n", 0, chain, delta([(cid, f"v{cid}", 0)]))
            self.commit(store, cid, {0: chain})
        plan = store.gc(retain=2)
        assert plan.retained == (4, 5) and plan.dropped == (1, 2, 3)
        assert plan.delete_files == ()  # the base of 1 and the deltas of 2, 3 are still referenced
        assert store.list_checkpoints() == [4, 5]
        assert plan.delete_manifests == tuple(StoragePaths.manifest(c) for c in (1, 2, 3))
        assert store.verify().ok
        assert as_dict(store.read_key_group(store.read_manifest(4), "count", "n", 0)) == {c: f"v{c}" for c in range(1, 5)}
        again = store.gc(retain=2)
        assert again.empty

    def test_gc_never_deletes_files_declared_in_flight(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        pending = store.write_key_group(2, "count", "n", 1, [], delta([(2, "b", 0)]))
        chain3 = store.write_key_group(3, "count", "n", 0, chain, delta([(1, "", 1)]))
        self.commit(store, 3, {0: chain3})  # 3 completed while 2 is still pending
        plan = store.gc(retain=1, in_flight=pending)
        assert pending[0].path not in plan.delete_files
        assert pending[0].path in store.list_files()
        assert pending[0].path in store.gc(retain=1, protect_newer_than=1).protected
        # once nobody declares it, checkpoint 3 (complete, newer) proves it garbage
        assert pending[0].path in store.gc(retain=1).delete_files
        assert pending[0].path not in store.list_files()

    def test_gc_dry_run_deletes_nothing(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        chain2 = store.write_key_group(2, "count", "n", 0, [], delta([(1, "b", 0)]))
        self.commit(store, 2, {0: chain2})
        before = store.list_files()
        plan = store.gc(retain=1, dry_run=True)
        assert plan.delete_files == (chain[0].path,)
        assert store.list_files() == before

    def test_a_savepoint_is_self_contained_and_outlives_its_source(self, store, root, open_store):
        store.policy = CompactionPolicy(max_chain_length=10, max_delta_ratio=100.0)
        c0 = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0), (2, "b", 0)]))
        c1 = store.write_key_group(1, "count", "n", 1, [], delta([(3, "c", 0)]))
        oref = store.write_operator_state(1, "source", 0, pa.table({"o": [7]}))
        cref = store.write_channel_log(1, "head", pa.table({"r": [1, 2]}))
        self.commit(store, 1, {0: c0, 1: c1})
        c0 = store.write_key_group(2, "count", "n", 0, c0, delta([(1, "", 1), (4, "d", 0)]))
        self.commit(store, 2, {0: c0, 1: c1}, operator_state={"source": {0: oref}},
                    operator_state_rules={"source": "split"}, channel_logs=[cref], source_offsets={"source": {"s": 1}})
        dest_url = root.rstrip("/") + "-savepoint"
        sp = store.savepoint(2, dest_url)
        assert sp.kind == "savepoint" and sp.pinned and sp.checkpoint_id == 2
        assert all(len(ch) == 1 and ch[0].kind == "base" and ch[0].checkpoint_id == 2
                   for ch in sp.keyed["count"]["n"].values())
        assert len({ch[0].path for ch in sp.keyed["count"]["n"].values()}) == 1  # packed: a file per state
        assert sp.source_offsets == {"source": {"s": 1}} and sp.stats["savepoint_of"]["checkpoint_id"] == 2
        for ref in store.list_files():  # wipe the source root entirely
            store._io.delete(ref)
        dest = open_store(dest_url)
        assert dest.list_checkpoints() == [2] and dest.read_job()["job_name"] == "wordcount"
        m = dest.read_manifest(2)
        assert as_dict(dest.read_key_group(m, "count", "n", 0)) == {2: "b", 4: "d"}
        assert as_dict(dest.read_key_group(m, "count", "n", 1)) == {3: "c"}
        assert dest.read_file(m.operator_state["source"][0]).column("o").to_pylist() == [7]
        assert dest.read_file(m.channel_logs[0]).column("r").to_pylist() == [1, 2]
        assert dest.verify().ok and dest.next_checkpoint_id() == 3

    def test_a_savepoint_in_the_same_root_takes_a_new_id_and_is_pinned_against_gc(self, store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        sp = store.savepoint(1, store.url)
        assert sp.checkpoint_id == 2
        for cid in (3, 4, 5):
            chain = store.write_key_group(cid, "count", "n", 0, [], delta([(cid, "x", 0)]))
            self.commit(store, cid, {0: chain})
        plan = store.gc(retain=1)
        assert plan.retained == (2, 5)
        assert store.list_checkpoints() == [2, 5]
        assert store.verify(2).ok
        store.delete_savepoint(2)
        store.gc(retain=1)
        assert store.list_checkpoints() == [5]
        assert not any(p.startswith("state/") and "/00000002-" in p for p in store.list_files())

    def test_a_savepoint_refuses_a_destination_that_would_mix_its_files_with_others(self, store, root, open_store):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        base = root.rstrip("/")
        other = open_store(base + "-other")
        other._io.put("notes.txt", b"keep me")
        before, others = store.list_files(), other.list_files()
        for dest, why in [(base + "-other", r"is not empty \(1 file\(s\), e\.g\. \['notes\.txt'\]\) and holds no snapshots"),
                          (base + "/state/sp", r"inside the source root's own directory state/"),
                          (base + "/checkpoints", r"inside the source root's own directory checkpoints/")]:
            with pytest.raises(StorageConfigError, match=why):
                store.savepoint(1, dest)
        assert store.list_files() == before and other.list_files() == others  # nothing written anywhere
        # an empty directory, one of the root's own under it (a job's savepoints/), an existing root
        assert store.savepoint(1, base + "/savepoints/sp-1").stats["savepoint_of"]["checkpoint_id"] == 1
        assert store.savepoint(1, base + "-sp").checkpoint_id == 1
        assert store.savepoint(1, base + "-sp").checkpoint_id == 2


class MemoryRoot:
    @pytest.fixture
    def root(self, memory_root):
        return memory_root


class LocalRoot:
    @pytest.fixture
    def root(self, tmp_path):
        return str(tmp_path / "snapshots")


class S3Root:
    @pytest.fixture
    def options(self, s3_server):
        return dict(s3_server.storage_options)

    @pytest.fixture
    def root(self, s3_root):
        return f"{s3_root}/jobs/wordcount"


class TestMemoryStore(MemoryRoot, StoreContract):
    pass


class TestLocalStore(LocalRoot, StoreContract):

    def test_a_file_url_and_a_plain_path_open_the_same_root(self, store, root):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        assert SnapshotStore.open(f"file://{root}").list_checkpoints() == [1]

    def test_no_temporary_file_is_left_after_commit(self, store, root):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        assert sorted(p for p in store.list_files() if p.startswith("checkpoints/")) == ["checkpoints/chk-00000001.json"]


@pytest.mark.s3
class TestS3Store(S3Root, StoreContract):
    def test_commit_is_a_conditional_put_that_refuses_to_overwrite(self, store, s3_server):
        chain = store.write_key_group(1, "count", "n", 0, [], delta([(1, "a", 0)]))
        self.commit(store, 1, {0: chain})
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_server.storage_options)
        with pytest.raises(FileExistsError):
            fs.pipe_file(f"{store._io.root}/{StoragePaths.manifest(1)}", b"{}", mode="create")


def test_dropped_meanwhile_waits_for_a_manifest_a_gc_deletes_after_the_files(tmp_path, monkeypatch):
    """A GC deletes a dropped checkpoint's data files before its manifest: a reader that found a
    file missing while the manifest was still there is told, with patience, that the checkpoint
    was dropped (the manifest is gone at a later look); without patience, or while the manifest
    stays, it is not."""
    store = SnapshotStore.open(str(tmp_path / "root"), fsync=False)
    store.init_job(JOB)
    for cid in (1, 2, 3):
        store.commit(Manifest(checkpoint_id=cid, job_name="wordcount", max_parallelism=16))
    assert store.dropped_meanwhile([1, 2], patience=0.3) == set()  # both stay: looked for again, not dropped

    real = type(store._catalog).paths
    victim: list[int] = []

    def paths(self):  # the GC's last step, a manifest deleted, lands right after a reader's look
        out = real(self)
        while victim:
            (tmp_path / "root" / StoragePaths.manifest(victim.pop())).unlink()
        return out

    monkeypatch.setattr(type(store._catalog), "paths", paths)
    victim.append(1)
    assert store.dropped_meanwhile([1]) == set()  # one look: it was still there
    assert store.dropped_meanwhile([1]) == {1}  # the next look finds it gone
    victim.append(3)
    assert store.dropped_meanwhile([3], patience=30.0) == {3}  # looked for again until it went
