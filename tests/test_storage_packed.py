"""Packed files (format 3): the new files of many key groups of one state written back to back
into one file, each key group referenced as a range of it. Run on memory://, local disk and S3."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from typing import Any

import fsspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import storage
from storage import (
    FORMAT_VERSION,
    CompactionPolicy,
    CorruptFileError,
    CorruptManifestError,
    FileRef,
    Manifest,
    MissingFileError,
    SnapshotStore,
    StoragePaths,
)
from storage.format import checksum_hex
from storage.manifest import manifest_problems
from storage.store import KeyGroupWrite
from test_storage_store import LocalRoot, MemoryRoot, S3Root, StoreFixtures, as_dict, delta  # the shared store fixtures and helpers

OP = "count"
JOB = {"job_name": "wordcount", "max_parallelism": 16}


def rows_of(kg: int, version: int = 0, n: int = 12) -> dict[int, str]:
    """Distinct, incompressible-enough content per key group (ranges of a few hundred bytes)."""
    return {kg * 1000 + i: uuid.uuid5(uuid.NAMESPACE_OID, f"{kg}-{version}-{i}").hex for i in range(n)}


def upserts(rows: dict[int, str]) -> pa.Table:
    return delta([(k, v, 0) for k, v in sorted(rows.items())])


def commit(store: SnapshotStore, cid: int, keyed: dict[str, dict[int, list[FileRef]]], **kw: Any) -> Manifest:
    return store.commit(Manifest(checkpoint_id=cid, job_name=JOB["job_name"], max_parallelism=JOB["max_parallelism"],
                                 keyed={OP: {st_: dict(chains) for st_, chains in keyed.items()}}, **kw))


def file_of(problem: storage.Problem) -> str:
    """The physical file a verify problem is about (a range's problem may name ``path#kg-NNNN``)."""
    return (problem.path or "").split("#")[0]


def names_key_group(problem: storage.Problem, kg: int) -> bool:
    return (problem.path or "").endswith(f"#kg-{kg:04d}") or f"key group {kg}" in problem.message


class PackedContract(StoreFixtures):
    """Every backend must pass these. Subclasses provide the ``root`` and ``options`` fixtures.
    Written with ``share_below = 0``: every key group's file a stream of its own, as in format
    5 (shared ranges of format 6: tests/test_storage_shared.py)."""

    @pytest.fixture
    def store(self, root, open_store) -> SnapshotStore:
        s = open_store(root)
        s.init_job(JOB)
        s.share_below = 0
        return s

    # ----------------------------------------------------------------- helpers
    def truncate(self, store: SnapshotStore, path: str, size: int) -> None:
        self.damage(store, path, store._io.get(path)[:size])

    @staticmethod
    def write_bases(store: SnapshotStore, cid: int, kgs, state: str = "n", version: int = 0) -> dict[int, list[FileRef]]:
        kgs = list(kgs)
        chains = store.write_key_groups(cid, [KeyGroupWrite(OP, state, kg, [], upserts(rows_of(kg, version))) for kg in kgs])
        return dict(zip(kgs, chains))

    # ----------------------------------------------------------------- writing
    def test_the_new_files_of_a_state_are_contiguous_ranges_of_one_packed_file(self, store):
        jobs = [KeyGroupWrite(OP, "n", kg, [], upserts(rows_of(kg))) for kg in (5, 1, 3, 0)]
        jobs.append((OP, "m", 2, [], upserts(rows_of(2))))  # a plain tuple; the only new file of "m"
        chains = store.write_key_groups(1, jobs)
        assert len(chains) == 5 and all(len(chain) == 1 for chain in chains)
        for (op, st_, kg, *_), chain in zip(jobs, chains):  # job order, whatever the pack order
            loc = chain[0].location()
            assert (loc.operator, loc.state, loc.key_group, chain[0].kind) == (op, st_, kg, "base")
        packed = sorted((chain[0] for chain in chains[:4]), key=lambda r: r.key_group)
        path = packed[0].path
        assert all(r.packed and r.path == path and r.checkpoint_id == 1 for r in packed)
        assert StoragePaths.parse(path).category == "packed"
        assert path.startswith(StoragePaths.packed_dir(OP, "n") + "/00000001-")
        # key group order, back to back, nothing around them
        assert [r.key_group for r in packed] == [0, 1, 3, 5]
        assert [r.offset for r in packed] == [sum(p.bytes for p in packed[:i]) for i in range(4)]
        raw = store._io.get(path)
        assert len(raw) == sum(r.bytes for r in packed) == store.list_files()[path]
        for ref in packed:
            part = raw[ref.offset:ref.offset + ref.bytes]
            assert checksum_hex(part, ref.checksum_algorithm) == ref.checksum
            assert as_dict(pa.ipc.open_stream(part).read_all()) == rows_of(ref.key_group)  # a complete stream
            assert store.read_bytes(ref) == part
            assert as_dict(store.read_file(ref)) == rows_of(ref.key_group) and store.read_file(ref).num_rows == ref.rows
        single = chains[4][0]
        assert not single.packed and single.offset is None and single.key_group is None
        assert single.path.startswith(StoragePaths.key_group_dir(OP, "m", 2) + "/") and single.id == single.path
        # ids tell the ranges apart; paths and stats count the packed file once
        assert [r.id for r in packed] == [f"{path}#kg-{kg:04d}" for kg in (0, 1, 3, 5)]
        m = store.commit(Manifest(checkpoint_id=1, job_name="wordcount", max_parallelism=16,
                                  keyed={OP: {"n": {r.key_group: [r] for r in packed}, "m": {2: [single]}}}))
        assert set(m.files()) == {r.id for r in packed} | {single.path}
        assert m.paths() == {path, single.path}
        assert m.stats["files"] == m.stats["files_written"] == 2 and m.stats["key_groups"] == 5
        assert m.stats["bytes_written"] == sum(r.bytes for r in packed) + single.bytes
        fresh = SnapshotStore.open(store.url, fs=store.fs)
        m = fresh.read_manifest(1)
        for kg in (0, 1, 3, 5):
            assert as_dict(fresh.read_key_group(m, OP, "n", kg)) == rows_of(kg)
            assert m.keyed[OP]["n"][kg][0].location().key_group == kg
        assert as_dict(fresh.read_key_group(m, OP, "m", 2)) == rows_of(2)
        assert fresh.verify().ok

    def test_pack_limit_closes_a_pack_once_it_holds_that_many_bytes(self, store):
        one = len(store._io.get(self.write_bases(store, 1, [0])[0][0].path))
        limit = store.pack_limit = int(2.5 * one)  # every pack closes after its third file
        chains = self.write_bases(store, 2, range(8))
        refs = [chains[kg][0] for kg in range(8)]
        expected, pack, size = [], [], 0
        for ref in refs:  # the rule, from the sizes actually written
            pack.append(ref.key_group)
            size += ref.bytes
            if size >= limit:
                expected.append(pack)
                pack, size = [], 0
        expected += [pack] if pack else []
        assert len(expected) >= 3  # the limit really split the state
        got = {}
        for ref in refs:
            got.setdefault(ref.path, []).append(ref.key_group)
        assert sorted(got.values()) == expected
        for group in expected:
            group_refs = [chains[kg][0] for kg in group]
            if len(group) == 1:
                continue  # a pack of one file may be a file of its own
            assert all(r.packed for r in group_refs)
            assert store.list_files()[group_refs[0].path] == sum(r.bytes for r in group_refs)
        m = commit(store, 2, {"n": chains})
        assert all(as_dict(store.read_key_group(m, OP, "n", kg)) == rows_of(kg) for kg in range(8))
        store.pack_limit = 1
        chains = self.write_bases(store, 3, range(3), version=1)
        assert not any(ref.packed for chain in chains.values() for ref in chain)

    def test_write_key_groups_decides_every_chain_as_write_key_group_does(self, store, root, open_store):
        policy = CompactionPolicy(max_chain_length=3, max_delta_ratio=1.5)
        single = open_store(root.rstrip("/") + "-single", policy=policy)
        single.init_job(JOB)
        single.share_below = 0  # as the packed store: sizes of a stream per key group
        store.policy = policy
        kgs = [(st_, kg) for st_ in ("n", "m") for kg in range(6 if st_ == "n" else 2)]
        models = {sk: rows_of(sk[1]) for sk in kgs}
        calls: dict[str, list[tuple[str, int]]] = {"packed": [], "single": []}

        def image_of(who: str, sk: tuple[str, int], table: pa.Table | None):
            def image():
                calls[who].append(sk)
                return table
            return image

        rounds = [
            {sk: ("delta", upserts(models[sk])) for sk in kgs},  # first writes: bases
            {("n", 0): ("delta", delta([(0, "zero", 0)])), ("n", 1): ("delta", delta([(1000, "", 1)])),
             ("n", 4): ("complete", None), ("n", 5): ("delta", delta([])), ("m", 1): ("delta", delta([(7, "x", 0)]))},
            {("n", 0): ("image", upserts(rows_of(100, n=40))),  # the ratio compacts, from the image
             ("n", 1): ("image_none", upserts(rows_of(101, n=40))),  # no image: compacts by reading the chain
             ("n", 2): ("delta", delta([(2000, "", 1)])), ("n", 3): ("delta", delta([(3001, "y", 0)])),
             ("m", 0): ("delta", delta([(1, "m", 0)]))},
            {("n", 0): ("delta", delta([(0, "again", 0)])), ("n", 2): ("delta", delta([(2001, "", 1)])),
             ("n", 3): ("delta", delta([(3002, "", 1)])), ("n", 4): ("delta", delta([(4003, "z", 0)]))},
            {("n", 2): ("delta", delta([(2002, "w", 0)])), ("n", 3): ("image", delta([(3003, "v", 0)])),  # length
             ("m", 1): ("complete", None)},
        ]
        chains: dict[str, dict] = {"packed": {}, "single": {}}
        seen: dict[str, set[FileRef]] = {"packed": set(), "single": set()}
        for cid, changes in enumerate(rounds, start=1):
            order = sorted(changes, key=lambda sk: ((sk[1] * 7 + cid) % 5, sk))  # not key group order
            for sk in order:
                mode, table = changes[sk]
                rows = [] if table is None else zip(*(table.column(c).to_pylist() for c in ("key", "value", "op")))
                for k, v, op in rows:
                    models[sk].pop(k, None) if op else models[sk].__setitem__(k, v)
            for who, s in (("packed", store), ("single", single)):
                jobs = []
                for sk in order:
                    mode, table = changes[sk]
                    complete = mode == "complete"
                    image = image_of(who, sk, upserts(models[sk]) if mode == "image" else None) \
                        if mode.startswith("image") else None
                    jobs.append(KeyGroupWrite(OP, sk[0], sk[1], chains[who].get(sk, []),
                                              upserts(models[sk]) if complete else table, complete, image))
                if who == "packed":
                    new = s.write_key_groups(cid, jobs)
                else:
                    new = [s.write_key_group(cid, j.operator, j.state, j.key_group, j.prev_chain, j.delta,
                                             complete=j.complete, image=j.image) for j in jobs]
                chains[who].update(zip(order, new))
                seen[who].update(r for chain in new for r in chain)
            assert sorted(calls["packed"]) == sorted(calls["single"])  # S3 plans concurrently
            for sk in order:
                a, b = chains["packed"][sk], chains["single"][sk]
                # same decision: kinds, writers, rows; and the same bytes (a range is what a file would hold)
                assert [(r.kind, r.checkpoint_id, r.rows, r.bytes, r.checksum) for r in a] == \
                    [(r.kind, r.checkpoint_id, r.rows, r.bytes, r.checksum) for r in b]
                assert not any(r.packed for r in b)
                assert store.read_chain(a).equals(single.read_chain(b))
                assert as_dict(store.read_chain(a)) == models[sk]
        assert calls["packed"]  # the image path was taken
        assert {(r.kind, r.packed) for r in seen["packed"]} == {("base", True), ("delta", True), ("base", False),
                                                                ("delta", False)}
        assert not any(r.packed for r in seen["single"])

    # ----------------------------------------------------------------- damage
    def test_a_torn_packed_file_fails_exactly_the_ranges_past_the_cut(self, store):
        chains = self.write_bases(store, 1, range(4))
        m = commit(store, 1, {"n": chains})
        refs = [chains[kg][0] for kg in range(4)]
        path = refs[0].path
        assert all(r.packed and r.path == path for r in refs)
        assert store.verify(1).ok
        self.truncate(store, path, refs[1].offset + refs[1].bytes // 2)  # mid key group 1
        assert as_dict(store.read_key_group(m, OP, "n", 0)) == rows_of(0)
        for kg in (1, 2, 3):
            with pytest.raises(CorruptFileError) as err:
                store.read_key_group(m, OP, "n", kg)
            message = str(err.value)
            assert path in message and f"key group {kg}" in message
            assert str(refs[kg].offset) in message and str(refs[kg].offset + refs[kg].bytes) in message
        report = store.verify(1)
        assert not report.ok and report.broken == (1,)
        assert {(p.kind, file_of(p)) for p in report.problems} == {("size", path)}
        assert not any(names_key_group(p, 0) for p in report.problems)

    def test_a_flipped_byte_fails_only_its_key_group(self, store):
        chains = self.write_bases(store, 1, range(4))
        m = commit(store, 1, {"n": chains})
        refs = [chains[kg][0] for kg in range(4)]
        path = refs[2].path
        data = bytearray(store._io.get(path))
        data[refs[2].offset + refs[2].bytes // 2] ^= 0xFF
        self.damage(store, path, bytes(data))
        for kg in (0, 1, 3):
            assert as_dict(store.read_key_group(m, OP, "n", kg)) == rows_of(kg)
        with pytest.raises(CorruptFileError, match=rf"fails its {refs[2].checksum_algorithm} checksum") as err:
            store.read_key_group(m, OP, "n", 2)
        assert path in str(err.value) and "key group 2" in str(err.value)
        assert not isinstance(err.value, MissingFileError)
        report = store.verify(1)
        assert not report.ok and report.broken == (1,)
        assert {(p.kind, file_of(p)) for p in report.problems} == {("checksum", path)}
        assert all(names_key_group(p, 2) for p in report.problems)
        assert not any(names_key_group(p, kg) for p in report.problems for kg in (0, 1, 3))

    def test_a_deleted_packed_file_is_missing_for_every_key_group_in_it(self, store):
        chains = self.write_bases(store, 1, range(3))
        lone = store.write_key_groups(1, [KeyGroupWrite(OP, "m", 0, [], upserts(rows_of(9)))])[0]
        m = commit(store, 1, {"n": chains, "m": {0: lone}})
        path = chains[0][0].path
        self.damage(store, path, None)
        for kg in range(3):
            with pytest.raises(MissingFileError, match=rf"{path} is missing"):
                store.read_key_group(m, OP, "n", kg)
        assert as_dict(store.read_key_group(m, OP, "m", 0)) == rows_of(9)  # the state's own file
        report = store.verify(1)
        assert not report.ok and report.broken == (1,)
        assert {(p.kind, file_of(p)) for p in report.problems} == {("missing", path)}

    # ----------------------------------------------------------------- gc
    def test_gc_keeps_a_packed_file_whole_while_a_retained_checkpoint_needs_one_range(self, store):
        store.policy = CompactionPolicy(max_chain_length=10, max_delta_ratio=1000.0)
        models = {kg: rows_of(kg) for kg in range(4)}
        chains = self.write_bases(store, 1, range(4))
        first = chains[0][0].path
        commit(store, 1, {"n": chains})
        # 2: key groups 1-3 get new bases (full images): only key group 0 still reads the first pack
        models.update({kg: rows_of(kg, 2) for kg in (1, 2, 3)})
        new = store.write_key_groups(2, [KeyGroupWrite(OP, "n", kg, chains[kg], upserts(models[kg]), True)
                                         for kg in (1, 2, 3)])
        chains.update(zip((1, 2, 3), new))
        second = chains[1][0].path
        assert second != first and all(chains[kg][0].path == second for kg in (1, 2, 3))
        commit(store, 2, {"n": chains})
        # 3: deltas of key groups 1 and 2, packed: chains mix two packed files
        for kg in (1, 2):
            models[kg][kg * 1000 + 99] = "new"
        new = store.write_key_groups(3, [KeyGroupWrite(OP, "n", kg, chains[kg], delta([(kg * 1000 + 99, "new", 0)]))
                                         for kg in (1, 2)])
        chains.update(zip((1, 2), new))
        third = chains[1][1].path
        assert [r.kind for r in chains[1]] == ["base", "delta"] and chains[2][1].path == third
        commit(store, 3, {"n": chains})
        snapshot3 = copy.deepcopy(models)

        plan = store.gc(retain=2)
        assert plan.retained == (2, 3) and plan.dropped == (1,)
        assert not any(p.startswith("state/") for p in plan.delete_files)
        listing = store.list_files()
        assert {first, second, third} <= set(listing)
        # kept: the three packs whole; referenced: all of them but the first pack's unused ranges
        assert plan.packed_bytes_kept == sum(listing[p] for p in (first, second, third))
        assert plan.packed_bytes_live == plan.packed_bytes_kept - (listing[first] - chains[0][0].bytes)
        for cid in (2, 3):
            assert store.verify(cid).ok  # checkpoint 3 references only the first range of the first pack
        m3 = store.read_manifest(3)
        assert all(as_dict(store.read_key_group(m3, OP, "n", kg)) == snapshot3[kg] for kg in range(4))

        # 4: key group 0 moves off the first pack; checkpoint 3 still needs it
        models[0] = rows_of(0, 4)
        chains[0] = store.write_key_groups(4, [KeyGroupWrite(OP, "n", 0, chains[0], upserts(models[0]), True)])[0]
        commit(store, 4, {"n": chains})
        plan = store.gc(retain=2)
        assert plan.retained == (3, 4) and first not in plan.delete_files and first in store.list_files()
        assert all(as_dict(store.read_key_group(m3, OP, "n", kg)) == snapshot3[kg] for kg in range(4))

        # 5: no retained checkpoint references the first pack any more: it goes, the others stay
        models[3][3999] = "late"
        chains[3] = store.write_key_groups(5, [KeyGroupWrite(OP, "n", 3, chains[3], delta([(3999, "late", 0)]))])[0]
        commit(store, 5, {"n": chains})
        plan = store.gc(retain=2)
        assert plan.retained == (4, 5) and first in plan.delete_files
        files = store.list_files()
        assert first not in files and {second, third} <= set(files)
        m5 = store.read_manifest(5)
        assert all(as_dict(store.read_key_group(m5, OP, "n", kg)) == models[kg] for kg in range(4))
        assert store.verify().ok

    def test_gc_protects_a_packed_file_of_a_checkpoint_in_flight_until_a_newer_one_completes(self, store):
        chains = self.write_bases(store, 1, range(3))
        commit(store, 1, {"n": chains})
        pending = store.write_key_groups(2, [KeyGroupWrite(OP, "n", kg, [], upserts(rows_of(kg, 2))) for kg in range(3)])
        path = pending[0][0].path
        assert pending[0][0].packed
        assert path in store.gc(retain=1).protected and path in store.list_files()
        commit(store, 3, {"n": chains})
        assert path not in store.gc(retain=1, in_flight=pending[1]).delete_files  # declared: kept
        assert path in store.list_files()
        assert path in store.gc(retain=1).delete_files
        assert path not in store.list_files() and chains[0][0].path in store.list_files()

    # ----------------------------------------------------------------- savepoints
    def test_a_savepoint_of_a_packed_checkpoint_reads_back_equal_and_needs_nothing_of_the_source(
            self, store, root, open_store):
        store.policy = CompactionPolicy(max_chain_length=10, max_delta_ratio=1000.0)
        chains = self.write_bases(store, 1, range(5))
        commit(store, 1, {"n": chains})
        new = store.write_key_groups(2, [KeyGroupWrite(OP, "n", kg, chains[kg], delta([(kg * 1000, "", 1), (kg, "x", 0)]))
                                         for kg in (1, 3, 4)] + [KeyGroupWrite(OP, "m", 0, [], upserts(rows_of(7)))])
        chains.update(zip((1, 3, 4), new[:3]))
        chains[0] = store.write_key_group(2, OP, "n", 0, chains[0], delta([(0, "own file", 0)]))
        source = commit(store, 2, {"n": chains, "m": {0: new[3]}})
        assert any(len({r.packed for r in chain}) == 2 for chain in chains.values())  # mixed chains
        expected = {(st_, kg): store.read_key_group(source, OP, st_, kg)
                    for st_, by_kg in source.keyed[OP].items() for kg in by_kg}

        dest_url = root.rstrip("/") + "-savepoint"
        sp = store.savepoint(2, dest_url)
        assert all(ref.checkpoint_id == sp.checkpoint_id for ref in sp.iter_refs())
        assert not sp.paths() & source.paths()
        for ref in store.list_files():  # wipe the source root entirely
            store._io.delete(ref)
        dest = open_store(dest_url)
        m = dest.read_manifest(sp.checkpoint_id)
        assert m.paths() <= set(dest.list_files())
        assert {(st_, kg) for st_, by_kg in m.keyed[OP].items() for kg in by_kg} == set(expected)
        for (st_, kg), table in expected.items():
            assert dest.read_key_group(m, OP, st_, kg).sort_by("key").equals(table.sort_by("key"))
        assert dest.verify().ok

    def test_a_savepoint_in_the_same_root_references_none_of_the_checkpoints_packed_files(self, store):
        chains = self.write_bases(store, 1, range(4))
        source = commit(store, 1, {"n": chains})
        sp = store.savepoint(1, store.url)
        assert sp.checkpoint_id == 2 and all(ref.checkpoint_id == 2 for ref in sp.iter_refs())
        assert not sp.paths() & source.paths()
        for kg in range(4):
            assert as_dict(store.read_key_group(store.read_manifest(2), OP, "n", kg)) == rows_of(kg)
        for cid in (3, 4):
            commit(store, cid, {"n": self.write_bases(store, cid, range(2), version=cid)})
        store.gc(retain=1)
        assert chains[0][0].path not in store.list_files() and store.verify(2).ok


class TestMemoryPacked(MemoryRoot, PackedContract):
    pass


class TestLocalPacked(LocalRoot, PackedContract):
    def truncate(self, store: SnapshotStore, path: str, size: int) -> None:
        os.truncate(os.path.join(store._io.root, path), size)  # cut on disk, in place


@pytest.mark.s3
class TestS3Packed(S3Root, PackedContract):
    pass

# ====================================================================== manifest JSON
def _refs() -> tuple[FileRef, FileRef]:
    base = FileRef(path=StoragePaths.state_file(2, OP, "n", 3, "base"), kind="base", checkpoint_id=2, rows=5,
                   bytes=300, checksum="a" * 32, checksum_algorithm="xxh3_128")
    rng = FileRef(path=StoragePaths.packed_file(4, OP, "n"), kind="delta", checkpoint_id=4, rows=2, bytes=120,
                  checksum="b" * 32, checksum_algorithm="xxh3_128", offset=4096, key_group=3)
    return base, rng


def _manifest_doc(**kw: Any) -> dict[str, Any]:
    base, rng = _refs()
    # a format 4 document: no checksum of its own, so that the cases below test the references
    # (format 5 manifests with the same defects: tests/test_storage_integrity.py)
    return Manifest(checkpoint_id=4, job_name="wordcount", max_parallelism=16, keyed={OP: {"n": {3: [base, rng]}}},
                    format_version=4, **kw).to_dict()


def test_the_format_version_is_8():
    assert FORMAT_VERSION == storage.FORMAT_VERSION == 8
    assert Manifest(checkpoint_id=4, job_name="j", max_parallelism=1).to_dict()["format_version"] == 8


def test_a_range_reference_round_trips_through_manifest_json():
    base, rng = _refs()
    assert rng.packed and not base.packed
    assert rng.id == f"{rng.path}#kg-0003" and base.id == base.path
    assert rng.location().key_group == 3 and rng.location().state == "n" and rng.location().operator == OP
    manifest = Manifest(checkpoint_id=4, job_name="wordcount", max_parallelism=16, keyed={OP: {"n": {3: [base, rng]}}})
    assert manifest_problems(manifest) == []
    doc = json.loads(manifest.to_json())
    assert doc["files"] == [base.path, rng.path] and doc["keyed"][OP]["n"]["3"] == [[0], [1]]
    assert doc["ranges"] == [[0, "base", 0, 300, 5, "xxh3_128", "a" * 32], [1, "delta", 4096, 120, 2, "xxh3_128", "b" * 32]]
    legacy = json.loads(dataclasses.replace(manifest, format_version=6).to_json())  # format 6: spelled out
    assert (legacy["keyed"][OP]["n"]["3"][1]["offset"], legacy["keyed"][OP]["n"]["3"][1]["key_group"]) == (4096, 3)
    assert "offset" not in legacy["keyed"][OP]["n"]["3"][0] and "key_group" not in legacy["keyed"][OP]["n"]["3"][0]
    assert Manifest.from_json(json.dumps(legacy)) == dataclasses.replace(manifest, format_version=6)
    back = Manifest.from_json(manifest.to_json())
    assert back == manifest and back.keyed[OP]["n"][3][1].offset == 4096 and back.keyed[OP]["n"][3][1].key_group == 3
    assert set(back.files()) == {base.path, rng.id} and back.paths() == {base.path, rng.path}


def _range(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["keyed"][OP]["n"]["3"][1]


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda d: _range(d).pop("key_group"), id="offset-without-key-group"),
    pytest.param(lambda d: _range(d).pop("offset"), id="key-group-without-offset"),
    pytest.param(lambda d: _range(d).update(offset=-1), id="negative-offset"),
    pytest.param(lambda d: _range(d).update(key_group=-3), id="negative-key-group"),
    pytest.param(lambda d: _range(d).update(offset="4096"), id="offset-not-an-int"),
    pytest.param(lambda d: _range(d).update(offset=True), id="offset-a-bool"),
    pytest.param(lambda d: (_range(d).pop("offset"), _range(d).pop("key_group")), id="packed-path-without-offset"),
    pytest.param(lambda d: d["keyed"][OP]["n"]["3"][0].update(offset=0, key_group=3), id="single-file-with-offset"),
    pytest.param(lambda d: d.update(format_version=2), id="format-2-with-a-range"),
    pytest.param(lambda d: d.update(format_version=1), id="format-1-with-a-range"),
])
def test_malformed_range_references_are_refused_on_parse(mutate):
    doc = _manifest_doc()
    Manifest.from_json(json.dumps(doc))  # intact: parses
    mutate(doc)
    with pytest.raises(CorruptManifestError, match="chk-00000004.json"):
        Manifest.from_json(json.dumps(doc), source="checkpoints/chk-00000004.json")


def test_a_format_2_manifest_without_ranges_still_parses():
    doc = _manifest_doc()
    doc["keyed"][OP]["n"]["3"] = doc["keyed"][OP]["n"]["3"][:1]
    doc["format_version"] = 2
    manifest = Manifest.from_json(json.dumps(doc))
    assert manifest.format_version == 2 and not any(r.packed for r in manifest.iter_refs())


def test_a_range_in_another_key_groups_chain_is_refused_at_commit(memory_root):
    store = SnapshotStore.open(memory_root)
    store.init_job(JOB)
    chains = store.write_key_groups(1, [KeyGroupWrite(OP, "n", kg, [], upserts(rows_of(kg))) for kg in range(2)])
    with pytest.raises(CorruptManifestError, match="refusing to commit"):
        commit(store, 1, {"n": {0: chains[1], 1: chains[0]}})
    with pytest.raises(storage.InvalidChainError):
        store.write_key_group(2, OP, "n", 0, chains[1], delta([(1, "x", 0)]))
    other_state = [KeyGroupWrite(OP, "m", 0, chains[0], delta([(1, "x", 0)]))]
    with pytest.raises(storage.InvalidChainError):
        store.write_key_groups(2, other_state)
    assert store.list_checkpoints() == []


# ====================================================================== model-based
STATES = ("a", "b")
MAX_PARALLELISM = 8
CHANGE = st.tuples(st.integers(0, 15), st.sampled_from([0, 0, 1]), st.integers(-50, 50))  # key, op, value
MODES = st.sampled_from(["delta", "delta", "complete", "image", "image_none"])


@st.composite
def packed_histories(draw):
    states = STATES[: draw(st.integers(1, 2))]
    policy = CompactionPolicy(max_chain_length=draw(st.integers(1, 4)),
                              max_delta_ratio=draw(st.sampled_from([0.05, 1.0, 1000.0, 1000.0])))
    step = st.fixed_dictionaries({
        "batch": st.sampled_from([True, True, False]),
        "share_below": st.sampled_from([0, 16 << 10]),
        "pack_limit": st.sampled_from([1, 300, 700, 2000, 64 << 20]),
        "changes": st.dictionaries(st.tuples(st.sampled_from(states), st.integers(0, 4)),
                                   st.tuples(st.lists(CHANGE, max_size=6), MODES), min_size=1, max_size=6),
    })
    return policy, draw(st.lists(step, min_size=1, max_size=8)), draw(st.integers(2, 3))


def _image(model: dict[int, int]) -> pa.Table:
    keys = sorted(model)
    return pa.table({"key": pa.array(keys, pa.int64()), "value": pa.array([model[k] for k in keys], pa.int64()),
                     "op": pa.array([0] * len(keys), pa.int8())})


def _ops(ops: list[tuple[int, int, int]]) -> pa.Table:
    return pa.table({"key": pa.array([k for k, _, _ in ops], pa.int64()), "value": pa.array([v for *_, v in ops], pa.int64()),
                     "op": pa.array([o for _, o, _ in ops], pa.int8())})


def _check_packing(store: SnapshotStore, cid: int, jobs: list[KeyGroupWrite], chains: list[list[FileRef]],
                   batch: bool, pack_limit: int, share_below: int) -> None:
    """The new files of each state: ranges in key group order, one packed file per pack, a pack
    closed once it holds pack_limit bytes, a lone new file in a file of its own. With shared
    ranges: the distinct ranges of a packed file back to back, each key group's rows within its range."""
    listing = store.list_files()
    by_state: dict[str, list[FileRef]] = {}
    for job, chain in zip(jobs, chains):
        if not chain:
            continue
        assert chain[0].kind == "base" and all(r.kind == "delta" for r in chain[1:])
        assert len(chain) <= store.policy.max_chain_length
        assert all(r.location().key_group == job.key_group and r.location().state == job.state for r in chain)
        if chain[-1].checkpoint_id == cid:
            by_state.setdefault(job.state, []).append(chain[-1])
    for state, new in by_state.items() if batch else ():
        new.sort(key=lambda r: r.location().key_group)
        if len(new) == 1:
            assert not new[0].packed
        units: list[list[FileRef]] = []
        for ref in new:  # consecutive in key group order
            if units and ref.packed and units[-1][-1].packed and units[-1][-1].path == ref.path:
                units[-1].append(ref)
            else:
                units.append([ref])
        assert len({u[0].path for u in units}) == len(units)  # a pack is not split
        if share_below:
            for unit in units:
                ranges = sorted({r.range_id: r for r in unit}.values(), key=lambda r: r.offset or 0)
                if unit[0].packed:
                    assert [r.offset for r in ranges] == [sum(r.read_size for r in ranges[:j]) for j in range(len(ranges))]
                    assert listing[unit[0].path] == sum(r.read_size for r in ranges)
                for r in ranges:
                    members = sorted((m for m in unit if m.range_id == r.range_id), key=lambda m: m.row_offset or 0)
                    if r.shared:
                        assert len(members) > 1
                        assert [m.row_offset for m in members] == [sum(m.rows for m in members[:j]) for j in range(len(members))]
                        assert sum(m.rows for m in members) == r.range_rows
                        assert sum(m.bytes for m in members) == r.range_bytes
            continue
        for i, unit in enumerate(units):
            total = sum(r.bytes for r in unit)
            if i < len(units) - 1:
                assert total >= pack_limit
            assert total - unit[-1].bytes < pack_limit
            if unit[0].packed:
                assert unit[0].path.startswith(StoragePaths.packed_dir(OP, state) + "/")
                assert [r.offset for r in unit] == [sum(r.bytes for r in unit[:j]) for j in range(len(unit))]
                assert listing[unit[0].path] == total


def _read_all(store: SnapshotStore, cid: int, model: dict[tuple[str, int], dict[int, int]]) -> None:
    manifest = store.read_manifest(cid)
    assert {(st_, kg) for st_, by_kg in manifest.keyed.get(OP, {}).items() for kg in by_kg} == set(model)
    for (st_, kg), expected in model.items():
        assert as_dict(store.read_key_group(manifest, OP, st_, kg)) == expected, (cid, st_, kg)


def _run_history(url: str, policy: CompactionPolicy, steps: list[dict], retain: int) -> None:
    store = SnapshotStore.open(url, policy=policy)
    store.init_job({"job_name": "wordcount", "max_parallelism": MAX_PARALLELISM})
    models: dict[tuple[str, int], dict[int, int]] = {}
    chains: dict[tuple[str, int], list[FileRef]] = {}
    snapshots: dict[int, dict[tuple[str, int], dict[int, int]]] = {}
    for cid, step in enumerate(steps, start=1):
        store.pack_limit = step["pack_limit"]
        store.share_below = step["share_below"]
        jobs = []
        for (st_, kg), (ops, mode) in step["changes"].items():
            model = models.setdefault((st_, kg), {})
            for key, op, value in ops:
                model.pop(key, None) if op else model.__setitem__(key, value)
            complete = mode == "complete"  # an empty full image ends the key group's chain
            image = {"image": lambda m=dict(model): _image(m), "image_none": lambda: None}.get(mode)
            jobs.append(KeyGroupWrite(OP, st_, kg, chains.get((st_, kg), []),
                                      _image(model) if complete else _ops(ops), complete, image))
        if step["batch"]:
            new = store.write_key_groups(cid, jobs)
        else:
            new = [store.write_key_group(cid, j.operator, j.state, j.key_group, j.prev_chain, j.delta,
                                         complete=j.complete, image=j.image) for j in jobs]
            assert not any(r.packed for chain in new for r in chain if r.checkpoint_id == cid)
        _check_packing(store, cid, jobs, new, step["batch"], step["pack_limit"], step["share_below"])
        for j, chain in zip(jobs, new):
            if chain:
                chains[(j.state, j.key_group)] = chain
            else:  # only an empty full image drops a key group
                assert j.complete and not models.pop((j.state, j.key_group))
                chains.pop((j.state, j.key_group), None)
        keyed: dict[str, dict[int, list[FileRef]]] = {}
        for (st_, kg), chain in chains.items():
            keyed.setdefault(st_, {})[kg] = chain
        store.commit(Manifest(checkpoint_id=cid, job_name="wordcount", max_parallelism=MAX_PARALLELISM, keyed={OP: keyed}))
        snapshots[cid] = copy.deepcopy(models)
        plan = store.gc(retain=retain)
        for kept in {plan.retained[0], cid}:  # the oldest retained and the newest checkpoint
            _read_all(store, kept, snapshots[kept])
        if any(len({r.packed for r in chain}) == 2 for chain in chains.values()):
            event("a chain mixes packed ranges and files of their own")
        if any(r.packed and r.kind == "delta" for chain in chains.values() for r in chain):
            event("a packed delta")
        if step["batch"] and len({r.path for chain in new for r in chain if r.packed and r.checkpoint_id == cid}) > 1:
            event("several packed files in one call")
    fresh = SnapshotStore.open(url, policy=policy)
    plan = fresh.plan_gc(retain=retain)
    assert plan.empty
    for cid in plan.retained:
        _read_all(fresh, cid, snapshots[cid])
    report = fresh.verify()
    assert report.ok, report.lines()


@pytest.mark.parametrize("backend", ["memory", "local"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=packed_histories())
def test_packed_and_single_writes_read_back_as_the_model_in_every_retained_checkpoint(backend, history):
    policy, steps, retain = history
    if backend == "memory":
        name = f"/packed-{uuid.uuid4().hex}"
        try:
            _run_history(f"memory://{name}", policy, steps, retain)
        finally:
            fs = fsspec.filesystem("memory")
            if fs.exists(name):
                fs.rm(name, recursive=True)
    else:
        directory = tempfile.mkdtemp(prefix="packed-")
        try:
            _run_history(os.path.join(directory, "root"), policy, steps, retain)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
