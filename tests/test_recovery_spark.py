"""Offline rewrites with Spark (recovery/spark.py, recovery/rewrite.py, ``abs-snapshot
savepoint --spark`` / ``rekey``) against the shared local Spark session.

Two kinds of snapshot roots:

- a *synthetic* root written with :class:`SnapshotStore` (16 key groups, three checkpoints of
  bases and deltas with upserts and deletes, a key group emptied by deletes; typed int keys,
  string keys with pickled values, pickled tuple keys, and a state whose key groups hold keys
  of different Arrow types; operator state, channel logs, offsets, sink transactions), whose
  resolved state is also kept as a plain-Python model;
- a *job* root written by real jobs (a run, then a restore that adds deltas with deletes),
  used to show that re-keying 128 -> 256 key groups and restoring at another parallelism gives
  the same final state as an uninterrupted run.
"""
from __future__ import annotations

import collections
import hashlib
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import abs
import recovery
import recovery.spark as rspark
from abs.cli import main
from abs.keygroups import key_group
from recovery.rewrite import (
    DestinationNotEmptyError,
    ExecutorStorageError,
    MaxParallelismError,
    RewriteError,
    rekey_local,
)
from storage import CompactionPolicy, Manifest, SnapshotStore
from storage.errors import CheckpointNotFoundError, CorruptFileError
from storage.format import is_pickled, sort_by_key

pytestmark = pytest.mark.integration

# ============================================================================ the synthetic root
M = 16
DELETE = object()
META = b"abs.key_encoding", b"abs.value_encoding", b"abs.state_kind"
# (operator, state) -> (keys pickled?, value Arrow type or None = pickled)
STATES: dict[tuple[str, str], tuple[bool, pa.DataType | None]] = {
    ("count", "n"): (False, pa.int64()),
    ("words", "info"): (False, None),
    ("pairs", "seen"): (True, pa.int64()),
    ("mixed", "v"): (False, pa.int64()),
}
JOB: dict[str, Any] = {
    "name": "synth",
    "max_parallelism": M,
    "operators": [
        {"uid": "src", "kind": "source"},
        {"uid": "count", "kind": "process", "state": [{"kind": "value", "name": "n", "type": "int64"}]},
        {"uid": "words", "kind": "process", "state": [{"kind": "value", "name": "info", "type": None}]},
        {"uid": "pairs", "kind": "process", "state": [{"kind": "value", "name": "seen", "type": "int64"}]},
        {"uid": "mixed", "kind": "process", "state": [{"kind": "value", "name": "v", "type": "int64"}]},
        {"uid": "out", "kind": "sink"},
    ],
}
EMPTIED_KG = key_group(3, M)  # every key of this key group of count/n is deleted at checkpoint 3


def _first(n: int, kg: int, make) -> list:
    out, i = [], 0
    while len(out) < n:
        if key_group(make(i), M) == kg:
            out.append(make(i))
        i += 1
    return out


# old key groups 1 and 9 hold int keys, 5 holds string keys: under 4 key groups all three
# become key group 1 (h % 4 == (h % 16) % 4), which must then hold pickled keys
MIXED_INTS = _first(6, 1, lambda i: i) + _first(6, 9, lambda i: i)
MIXED_STRS = _first(6, 5, lambda i: f"m{i}")


def _changes(cid: int) -> dict[tuple[str, str], dict[Any, Any]]:
    if cid == 1:
        return {
            ("count", "n"): {k: k * 10 for k in range(200)},
            ("words", "info"): {f"w{i}": {"n": i, "tags": ("a", i)} for i in range(120)},
            ("pairs", "seen"): {(i % 13, f"p{i}"): i for i in range(60)},
            ("mixed", "v"): {**{k: k for k in MIXED_INTS}, **{s: len(s) for s in MIXED_STRS}},
        }
    if cid == 2:
        return {
            ("count", "n"): {**{k: -k for k in range(0, 200, 7)}, **{k: DELETE for k in range(1, 200, 11)},
                             **{k: k for k in range(200, 220)}},
            ("words", "info"): {**{f"w{i}": DELETE for i in range(0, 120, 5)}, "new": [1, 2, 3]},
            ("pairs", "seen"): {**{(i % 13, f"p{i}"): DELETE for i in range(0, 60, 4)}, (99, "late"): -1},
            ("mixed", "v"): {MIXED_INTS[0]: DELETE, MIXED_STRS[0]: DELETE},
        }
    emptied = [k for k in range(220) if key_group(k, M) == EMPTIED_KG]
    return {
        ("count", "n"): {**{k: k * 1000 for k in range(100, 111)}, **{k: DELETE for k in emptied}},
        ("words", "info"): {f"w{i}": {"n": -i} for i in range(1, 120, 9)},
        ("pairs", "seen"): {(i % 13, f"p{i}"): i * 2 for i in range(1, 60, 6)},
    }


def _delta(changes: dict[Any, Any], key_pickled: bool, vtype: pa.DataType | None) -> pa.Table:
    keys = list(changes)
    values = [None if changes[k] is DELETE else changes[k] for k in keys]
    ops = [1 if changes[k] is DELETE else 0 for k in keys]
    key_arr = pa.array([pickle.dumps(k, 5) for k in keys], pa.binary()) if key_pickled else pa.array(keys)
    if vtype is None:
        value_arr = pa.array([None if v is None else pickle.dumps(v, 5) for v in values], pa.binary())
    else:
        value_arr = pa.array(values, vtype)
    meta = dict(zip(META, (b"pickle" if key_pickled else b"arrow", b"pickle" if vtype is None else b"arrow", b"value")))
    schema = pa.schema([pa.field("key", key_arr.type), pa.field("value", value_arr.type),
                        pa.field("op", pa.int8())], metadata=meta)
    return pa.Table.from_arrays([key_arr, value_arr, pa.array(ops, pa.int8())], schema=schema)


def build_synthetic(root: str) -> dict[tuple[str, str], dict[Any, Any]]:
    """Write checkpoints 1-3; returns the model of the resolved state at checkpoint 3."""
    store = SnapshotStore.open(root, policy=CompactionPolicy(max_chain_length=100, max_delta_ratio=1e9), fsync=False)
    store.init_job(JOB)
    chains: dict[tuple[str, str], dict[int, list]] = {s: {} for s in STATES}
    model: dict[tuple[str, str], dict[Any, Any]] = {s: {} for s in STATES}
    for cid in (1, 2, 3):
        for state, changes in _changes(cid).items():
            by_kg: dict[int, dict[Any, Any]] = collections.defaultdict(dict)
            for k, v in changes.items():
                by_kg[key_group(k, M)][k] = v
                if v is DELETE:
                    model[state].pop(k, None)
                else:
                    model[state][k] = v
            for kg, part in sorted(by_kg.items()):
                chains[state][kg] = store.write_key_group(cid, *state, kg, chains[state].get(kg, []),
                                                          _delta(part, *STATES[state]))
        keyed: dict[str, dict[str, dict[int, list]]] = {}
        for (op, st), by_kg in chains.items():
            keyed.setdefault(op, {})[st] = dict(by_kg)
        opstate = {"src": {i: store.write_operator_state(cid, "src", i, pa.table({"split": [str(i)], "pos": [cid * 10 + i]}))
                           for i in range(2)}}
        logs = [store.write_channel_log(cid, "head#1", pa.table({"x": [cid, cid + 1]}))]
        store.commit(Manifest(checkpoint_id=cid, job_name="synth", max_parallelism=M, keyed=keyed,
                              operator_state=opstate, operator_state_rules={"src": "split"}, channel_logs=logs,
                              source_offsets={"src": {"0": cid * 10, "1": cid * 10 + 1}},
                              sink_transactions={"out": {"0": [{"checkpoint": cid}]}},
                              stats={"parallelism": 2}))
    return model


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[str, dict[tuple[str, str], dict[Any, Any]]]:
    root = str(tmp_path_factory.mktemp("synthetic") / "root")
    return root, build_synthetic(root)


# ============================================================================ reading results
def _decode(table: pa.Table, column: str) -> list[Any]:
    values = table.column(column).to_pylist()
    return [pickle.loads(v) if v is not None else None for v in values] if is_pickled(table.schema, column) else values


def _freeze(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=repr) if isinstance(value, (dict, list)) else value


def resolved_state(store: SnapshotStore, cid: int) -> dict[tuple[str, str], dict[Any, Any]]:
    """Every (operator, state) -> {key: value} at ``cid``, checking that each key is stored in
    the key group the runtime's hash puts it in under the manifest's max_parallelism."""
    manifest = store.read_manifest(cid)
    out: dict[tuple[str, str], dict[Any, Any]] = {}
    for op, states in manifest.keyed.items():
        for st, chains in states.items():
            values = out.setdefault((op, st), {})
            for kg, chain in chains.items():
                table = store.read_chain(chain, checkpoint_id=cid)
                for k, v in zip(_decode(table, "key"), _decode(table, "value")):
                    assert key_group(k, manifest.max_parallelism) == kg, f"{op}/{st}: key {k!r} in key group {kg}"
                    assert k not in values, f"{op}/{st}: key {k!r} twice"
                    values[k] = v
    return out


def assert_unkeyed_copied(source: SnapshotStore, cid: int, saved: Manifest, dest: SnapshotStore) -> None:
    original = source.read_manifest(cid)
    assert saved.source_offsets == original.source_offsets
    assert saved.sink_transactions == original.sink_transactions
    assert saved.operator_state_rules == original.operator_state_rules
    assert {op: sorted(s) for op, s in saved.operator_state.items()} == \
        {op: sorted(s) for op, s in original.operator_state.items()}
    for op, subtasks in original.operator_state.items():
        for i, ref in subtasks.items():
            copy = saved.operator_state[op][i]
            assert copy.checkpoint_id == saved.checkpoint_id and copy.checksum == ref.checksum
            assert dest.read_bytes(copy) == source.read_bytes(ref)
    assert [(r.location().task, r.checksum) for r in saved.channel_logs] == \
        [(r.location().task, r.checksum) for r in original.channel_logs]


def assert_self_contained(dest: SnapshotStore, saved: Manifest) -> None:
    assert saved.kind == "savepoint"
    assert dest.verify().ok
    assert {ref.checkpoint_id for ref in saved.files().values()} == {saved.checkpoint_id}
    assert all(len(chain) == 1 and chain[0].kind == "base"
               for states in saved.keyed.values() for chains in states.values() for chain in chains.values())


# ============================================================================ compact
def test_compact_equals_the_resolved_state_and_the_storage_savepoint(spark, synthetic, tmp_path):
    root, model = synthetic
    source = SnapshotStore.open(root)
    saved = rspark.compact(spark, root, 3, str(tmp_path / "sp"), key_groups_per_task=5)
    dest = SnapshotStore.open(str(tmp_path / "sp"))
    assert (saved.checkpoint_id, saved.max_parallelism) == (3, M)
    assert saved.stats["rewrite"]["engine"] == "spark" and saved.stats["rewrite"]["tasks"] >= 2
    assert_self_contained(dest, saved)
    assert_unkeyed_copied(source, 3, saved, dest)
    reference = source.savepoint(3, str(tmp_path / "reference"))  # storage.savepoint, in-process
    original = source.read_manifest(3)
    for op, states in original.keyed.items():
        for st, chains in states.items():
            assert sorted(saved.chains(op, st)) == sorted(chains)
            for kg in chains:
                got = dest.read_key_group(saved, op, st, kg)
                expected = sort_by_key(source.read_key_group(original, op, st, kg))  # bases are stored sorted
                assert got.equals(expected, check_metadata=True)
                # the same bytes as the in-process savepoint writes
                assert saved.chains(op, st)[kg][0].checksum == reference.chains(op, st)[kg][0].checksum
    assert saved.chains("count", "n")[EMPTIED_KG][0].rows == 0  # all its keys deleted: an empty base ...
    assert reference.chains("count", "n")[EMPTIED_KG][0].rows == 0  # ... in both
    for sp in (saved, reference):  # the key groups of a state packed into one file, as a checkpoint packs them
        for op, states in sp.keyed.items():
            for st, chains in states.items():
                assert len({chain[0].path for chain in chains.values()}) == 1, (op, st)
    state = resolved_state(dest, 3)
    assert {s: {k: _freeze(v) for k, v in d.items()} for s, d in state.items()} == \
        {s: {k: _freeze(v) for k, v in d.items()} for s, d in model.items()}
    assert json.loads((tmp_path / "sp" / "_job.json").read_text())["operators"] == JOB["operators"]
    assert recovery.check(JOB, dest, parallelism=3).ok


def test_compact_writes_the_in_process_savepoints_packs_when_a_state_has_several(spark, synthetic, tmp_path,
                                                                               monkeypatch):
    """With small packs (several per state), each Spark task writes whole packs: the bytes per
    key group still equal those of the in-process savepoint, although 5 key groups per task
    cut the states elsewhere than the packs do."""
    import storage.savepoint

    root, _ = synthetic
    source = SnapshotStore.open(root)
    monkeypatch.setattr(storage.savepoint, "SAVEPOINT_PACK_BYTES", 2000)  # read on the driver only
    packs = storage.savepoint.savepoint_packs(source.read_manifest(3))
    assert len(packs) > 8 and max(len(p) for p in packs) > 1
    saved = rspark.compact(spark, root, 3, str(tmp_path / "sp"), key_groups_per_task=5)
    reference = source.savepoint(3, str(tmp_path / "reference"))
    checksums = {(op, st, kg): c[0].checksum for op, s in saved.keyed.items() for st, ch in s.items() for kg, c in ch.items()}
    assert checksums == {(op, st, kg): c[0].checksum
                         for op, s in reference.keyed.items() for st, ch in s.items() for kg, c in ch.items()}
    files = {c[0].path for s in reference.keyed.values() for ch in s.values() for c in ch.values()}
    assert len(files) == len(packs)  # a file per pack
    assert saved.stats["rewrite"]["tasks"] <= len(packs)
    assert SnapshotStore.open(str(tmp_path / "sp")).verify().ok


def test_compact_respects_deletes_in_deltas(spark, synthetic, tmp_path):
    root, model = synthetic
    source = SnapshotStore.open(root)
    deleted = [k for k in range(1, 200, 11) if k not in model[("count", "n")]]
    chain = source.read_manifest(3).chains("count", "n")[key_group(deleted[0], M)]
    ops = pa.concat_tables([source.read_file(r) for r in chain[1:]], promote_options="default").column("op")
    assert 1 in ops.to_pylist(), "the chain should hold a delete"
    saved = rspark.compact(spark, root, 3, str(tmp_path / "sp"))
    state = resolved_state(SnapshotStore.open(str(tmp_path / "sp")), saved.checkpoint_id)
    assert deleted and not set(deleted) & set(state[("count", "n")])
    assert state[("count", "n")] == model[("count", "n")]
    # an older checkpoint compacts to its own state
    older = rspark.compact(spark, root, 1, str(tmp_path / "sp1"))
    assert resolved_state(SnapshotStore.open(str(tmp_path / "sp1")), older.checkpoint_id)[("count", "n")] == \
        {k: k * 10 for k in range(200)}


# ============================================================================ rekey (synthetic)
@pytest.mark.parametrize("new_m", [4, 40])
def test_rekey_puts_every_key_where_the_runtime_would(spark, synthetic, tmp_path, new_m):
    root, model = synthetic
    source = SnapshotStore.open(root)
    saved = rspark.rekey(spark, root, 3, str(tmp_path / "sp"), max_parallelism=new_m, unpickle=True, key_groups_per_task=6,
                         output_partitions=3)
    dest = SnapshotStore.open(str(tmp_path / "sp"))
    assert (saved.checkpoint_id, saved.max_parallelism) == (3, new_m)
    assert saved.stats["rewrite"]["max_parallelism_from"] == M and saved.stats["rewrite"]["max_parallelism_to"] == new_m
    assert_self_contained(dest, saved)
    assert_unkeyed_copied(source, 3, saved, dest)
    job = json.loads((tmp_path / "sp" / "_job.json").read_text())
    assert job["max_parallelism"] == new_m and job["rekeyed_from"] == {"root": root, "checkpoint_id": 3,
                                                                      "max_parallelism": M}
    state = resolved_state(dest, 3)  # also checks key_group(key, new_m) == stored key group
    assert {s: {k: _freeze(v) for k, v in d.items()} for s, d in state.items()} == \
        {s: {k: _freeze(v) for k, v in d.items()} for s, d in model.items()}
    for (op, st), (key_pickled, _) in STATES.items():
        expected_kgs = {key_group(k, new_m) for k in model[(op, st)]}
        assert set(saved.chains(op, st)) == expected_kgs  # no empty key groups are written
        for kg in expected_kgs:
            table = dest.read_key_group(saved, op, st, kg)
            assert table.schema.metadata[b"abs.state_kind"] == b"value"
            if op != "mixed":
                assert is_pickled(table.schema, "key") == key_pickled
    # a new key group holding int and string keys (from several old ones) stores pickled keys,
    # as the runtime does; one holding keys of one type keeps them typed
    for kg in saved.chains("mixed", "v"):
        types = {type(k) for k in model[("mixed", "v")] if key_group(k, new_m) == kg}
        assert is_pickled(dest.read_key_group(saved, "mixed", "v", kg).schema, "key") == (len(types) > 1), kg
    if new_m == 4:
        assert list(saved.chains("mixed", "v")) == [1]  # old key groups 1, 5 and 9 merged
    # the in-process re-key writes the very same bases
    local = rekey_local(root, 3, str(tmp_path / "local"), max_parallelism=new_m, unpickle=True)
    assert local.stats["rewrite"]["engine"] == "local"
    assert {(op, st, kg): c[0].checksum for op, s in local.keyed.items() for st, ch in s.items() for kg, c in ch.items()} \
        == {(op, st, kg): c[0].checksum for op, s in saved.keyed.items() for st, ch in s.items() for kg, c in ch.items()}
    # restore checks: the job with the new max_parallelism passes, the old one gets the mismatch
    assert recovery.check({**JOB, "max_parallelism": new_m}, dest, parallelism=min(3, new_m)).ok
    old = recovery.check(JOB, dest, parallelism=2)
    assert [p.kind for p in old.fatal] == ["max_parallelism"]
    assert f"max_parallelism {new_m}" in old.fatal[0].message and "re-key" in old.fatal[0].message


def test_rekey_refuses_a_key_stored_in_the_wrong_key_group(spark, tmp_path):
    store = SnapshotStore.open(str(tmp_path / "root"), fsync=False)
    store.init_job(JOB)
    k = 5
    wrong = (key_group(k, M) + 1) % M
    chain = store.write_key_group(1, "count", "n", wrong, [], _delta({k: 1}, False, pa.int64()))
    store.commit(Manifest(checkpoint_id=1, job_name="synth", max_parallelism=M, keyed={"count": {"n": {wrong: chain}}}))
    dest = tmp_path / "sp"
    with pytest.raises(RewriteError, match=rf"key 5 hashes to key group {key_group(k, M)} of max_parallelism {M}"):
        rspark.rekey(spark, store.url, 1, str(dest), max_parallelism=32)
    assert SnapshotStore.open(str(dest)).list_checkpoints() == []  # the commit point was never reached


def test_a_corrupt_file_fails_the_rewrite_with_the_storage_error_and_commits_nothing(spark, synthetic, tmp_path):
    import shutil

    root = str(tmp_path / "root")
    shutil.copytree(synthetic[0], root)
    store = SnapshotStore.open(root)
    victim = store.read_manifest(3).chains("words", "info")[key_group("w1", M)][-1]
    path = Path(root) / victim.path
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    for name, kwargs in (("compact", {}), ("rekey", {"max_parallelism": 32, "unpickle": True})):
        dest = str(tmp_path / name)
        with pytest.raises(CorruptFileError, match=f"{victim.path} fails its"):
            getattr(rspark, name)(spark, root, 3, dest, **kwargs)
        assert SnapshotStore.open(dest).list_checkpoints() == []
        assert not (Path(dest) / "_job.json").exists()


# ============================================================================ bad input
def test_bad_input_is_refused_before_anything_is_written(spark, synthetic, tmp_path, memory_root):
    root, _ = synthetic
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint 9 does not exist .* complete checkpoints: \[1, 2, 3\]"):
        rspark.compact(spark, root, 9, str(tmp_path / "a"))
    for bad in (0, 32769, -1, True, 2.0):
        with pytest.raises(MaxParallelismError, match="between 1 and 32768"):
            rspark.rekey(spark, root, 3, str(tmp_path / "b"), max_parallelism=bad)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("x")
    with pytest.raises(DestinationNotEmptyError, match=r"is not empty \(1 file\(s\), e.g. \['notes.txt'\]\)"):
        rspark.compact(spark, root, 3, str(tmp_path / "c"))
    SnapshotStore.open(root).savepoint(2, str(tmp_path / "d"))  # an existing root of the same job
    with pytest.raises(DestinationNotEmptyError, match=r"is already a snapshot root \(job 'synth', max_parallelism 16, "
                                                       r"checkpoints \[2\]\)"):
        rspark.rekey(spark, root, 3, str(tmp_path / "d"), max_parallelism=8)
    with pytest.raises(DestinationNotEmptyError, match="the destination is the source root"):
        rspark.compact(spark, root, 3, root + "/../root")
    with pytest.raises(ExecutorStorageError, match="memory:// root.*executors cannot"):
        rspark.compact(spark, root, 3, memory_root)
    with pytest.raises(ExecutorStorageError, match="ROOT memory://"):
        rspark.rekey(spark, memory_root, 3, str(tmp_path / "e"), max_parallelism=8)
    assert not list(tmp_path.glob("[abe]/*"))
    assert SnapshotStore.open(str(tmp_path / "d")).list_checkpoints() == [2]


def test_in_process_rekey_works_on_memory_roots(memory_root, synthetic):
    root, model = synthetic
    SnapshotStore.open(root).savepoint(3, memory_root + "/src")  # a memory:// copy of checkpoint 3
    saved = rekey_local(memory_root + "/src", 3, memory_root + "/dest", max_parallelism=7, unpickle=True)
    state = resolved_state(SnapshotStore.open(memory_root + "/dest"), saved.checkpoint_id)
    assert state[("count", "n")] == model[("count", "n")]
    assert state[("mixed", "v")] == model[("mixed", "v")]


# ============================================================================ real jobs
NUM_KEYS = 3_000  # ~23 keys per key group: a delta touching one or two keys stays a delta (no compaction)
N_FIRST, N_SECOND, N_TOTAL = 6_000, 8_000, 14_000


def key_of(indices: Any) -> Any:
    """Records [0, N_FIRST) and [N_SECOND, N_TOTAL) go round all keys; records in between only
    to 120 keys: multiples of 50 (counted 18 or 19 times by then: the count of those at 18 is
    deleted) and multiples of 50 plus 26."""
    middle = (indices >= N_FIRST) & (indices < N_SECOND)
    return np.where(middle, (indices % 120) * 25 + (indices % 2), indices % NUM_KEYS)


def make_batch(indices: Any) -> pa.RecordBatch:
    keys = key_of(indices)
    return pa.RecordBatch.from_arrays(
        [pa.array(keys), pa.array([f"w{k % 37}" for k in keys.tolist()]), pa.array(keys % 23),
         pa.array(indices % 2), pa.array(indices * 0 + 1), pa.array(indices)],
        names=["key", "name", "bucket", "parity", "value", "seq"])


def count_step(key: int, state: int) -> tuple[int, int]:
    """count_fn on one record: (emitted count, new state; 0 = deleted)."""
    c = state + 1
    return c, (0 if key % 5 == 0 and c % 3 == 0 else c)


def label_of(key: int, count: int) -> str:
    return hashlib.sha256(f"{key}:{count}".encode()).hexdigest()


def count_fn(ctx: Any, row: dict) -> None:
    """Running count and a label; keys divisible by 5 forget both (deletes) at every third
    record. (The labels make the bases large enough that a delete stays in a delta instead of
    being compacted into a new base at once.)"""
    n, label = ctx.state.n, ctx.state.label
    c, new = count_step(row["key"], n.value() or 0)
    if new:
        n.update(new)
        label.update(label_of(row["key"], new))
    else:
        n.clear()
        label.clear()
    ctx.emit({"key": ctx.key, "count": c})


def words_fn(ctx: Any, row: dict) -> None:
    """String keys, pickled values; cleared at every seventh record of a word."""
    seen = ctx.state.seen
    n = (seen.value() or {"n": 0})["n"] + 1
    if n % 7 == 0:
        seen.clear()
    else:
        seen.update({"n": n, "tag": ("w", n % 3)})
    ctx.emit({"name": ctx.key, "n": n})


def pairs_fn(ctx: Any, row: dict) -> None:
    """Tuple keys (pickled)."""
    c = ctx.state.c
    c.update((c.value() or 0) + row["value"])
    ctx.emit({"bucket": row["bucket"], "c": c.value()})


def job_flow(count: int, max_parallelism: int = 128) -> abs.Dataflow:
    flow = abs.Dataflow("rekey-job", max_parallelism=max_parallelism)
    src = flow.source("src", abs.GeneratorSource(count, num_keys=NUM_KEYS, num_splits=4, batch_size=1000,
                                                 make_batch=make_batch))
    src.key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64()),
                                                                 abs.ValueState("label", pa.string())]).sink("out", abs.CollectSink())
    src.key_by("name").process("words", words_fn, state=[abs.ValueState("seen")]).sink("words-out", abs.CollectSink())
    src.key_by(["bucket", "parity"]).process("pairs", pairs_fn, state=[abs.ValueState("c", pa.int64())]).sink(
        "pairs-out", abs.CollectSink())
    src.key_by("key").aggregate("agg", {"total": ("value", "sum")}, emit="none").sink("agg-out", abs.CollectSink())
    return flow


def final_state(root: str) -> dict[tuple[str, str], dict[Any, Any]]:
    store = SnapshotStore.open(root)
    latest = store.latest_checkpoint()
    assert latest is not None
    return {s: {k: _freeze(v) for k, v in d.items()} for s, d in resolved_state(store, latest).items()}


def simulate_counts(start: int, stop: int, state: dict[int, int]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """count_fn over records [start, stop) from ``state``: (new state, counts emitted per key)."""
    state = dict(state)
    emitted: dict[int, list[int]] = collections.defaultdict(list)
    for k in key_of(np.arange(start, stop)).tolist():
        c, state[k] = count_step(k, state.get(k, 0))
        emitted[k].append(c)
    return {k: v for k, v in state.items() if v}, emitted


@pytest.fixture(scope="module")
def job_root(tmp_path_factory) -> dict[str, Any]:
    """A root whose latest checkpoint (taken at parallelism 1) has deltas with deletes on top
    of bases (a run of N_FIRST records at parallelism 2, then a restore that reads up to
    N_SECOND), and the final state of an uninterrupted run of N_TOTAL records."""
    base = tmp_path_factory.mktemp("jobs")
    root, whole = str(base / "root"), str(base / "whole")
    checkpoint = abs.CheckpointConfig(interval=5.0, retained=10)
    first = abs.run(job_flow(N_FIRST), parallelism=2, checkpoint=checkpoint, storage=root)
    second = abs.run(job_flow(N_SECOND), parallelism=1, checkpoint=checkpoint, storage=root, restore="latest")
    assert second.restored_from == first.completed_checkpoints[-1].checkpoint_id
    uninterrupted = abs.run(job_flow(N_TOTAL), parallelism=1, checkpoint=checkpoint, storage=whole)
    assert uninterrupted.status == "FINISHED"
    return {"root": root, "checkpoint": second.completed_checkpoints[-1].checkpoint_id, "whole": final_state(whole)}


def test_job_checkpoint_has_deltas_with_deletes_and_compacts_to_its_resolved_state(spark, job_root, tmp_path):
    root, cid = job_root["root"], job_root["checkpoint"]
    source = SnapshotStore.open(root)
    original = source.read_manifest(cid)
    deletes = [ref for ref in original.files().values() if ref.kind == "delta"
               and 1 in source.read_file(ref).to_pydict().get("op", [])]
    assert len(deletes) >= 10, "checkpoint 2 should hold deltas with deletes"
    saved = rspark.compact(spark, root, cid, str(tmp_path / "sp"), key_groups_per_task=40)
    dest = SnapshotStore.open(str(tmp_path / "sp"))
    assert_self_contained(dest, saved)
    assert_unkeyed_copied(source, cid, saved, dest)
    # byte for byte what storage.savepoint writes (whose savepoints restore: test_runtime_integration)
    reference = source.savepoint(cid, str(tmp_path / "reference"))
    for op, states in original.keyed.items():
        for st, chains in states.items():
            assert sorted(saved.chains(op, st)) == sorted(chains)
            for kg in chains:
                assert saved.chains(op, st)[kg][0].checksum == reference.chains(op, st)[kg][0].checksum, f"{op}/{st}/{kg}"
    references = ("files", "ranges", "keyed", "operator_state", "channel_logs")  # the files: compared above
    assert {k: v for k, v in saved.to_dict().items() if k not in (*references, "created_at", "stats")} == \
        {k: v for k, v in reference.to_dict().items() if k not in (*references, "created_at", "stats")}
    flow = job_flow(N_TOTAL)
    plan = recovery.plan_restore(saved, flow.fingerprint(), 3, source_splits={"src": ["0", "1", "2", "3"]})
    assert plan.source_assignment() == recovery.plan_restore(
        reference, flow.fingerprint(), 3, source_splits={"src": ["0", "1", "2", "3"]}).source_assignment()
    state = resolved_state(dest, cid)
    counts = state[("count", "n")]
    assert counts == simulate_counts(0, N_SECOND, {})[0]  # every key's value
    assert state[("count", "label")] == {k: label_of(k, c) for k, c in counts.items()}
    assert 0 < sum(1 for k in range(0, NUM_KEYS, 50) if k not in counts) < NUM_KEYS // 50  # deleted by deltas


def test_rekey_128_to_256_then_restore_gives_the_uninterrupted_final_state(spark, job_root, tmp_path):
    root, cid = job_root["root"], job_root["checkpoint"]
    dest = str(tmp_path / "sp256")
    saved = rspark.rekey(spark, root, cid, dest, max_parallelism=256, unpickle=True, key_groups_per_task=64, output_partitions=4)
    assert saved.max_parallelism == 256 and SnapshotStore.open(dest).verify().ok
    rekeyed = resolved_state(SnapshotStore.open(dest), saved.checkpoint_id)  # every key where the runtime puts it
    at_checkpoint = resolved_state(SnapshotStore.open(root), cid)
    assert rekeyed == at_checkpoint
    assert max(kg for states in saved.keyed.values() for chains in states.values() for kg in chains) >= 128
    # the old job (128 key groups) is refused with the max_parallelism mismatch
    with pytest.raises(recovery.IncompatibleSnapshotError, match=r"max_parallelism 256 .* the job declares 128.*re-key"):
        abs.run(job_flow(N_TOTAL), parallelism=2, restore=dest, storage=str(tmp_path / "old"))
    # the job declaring 256 key groups restores it at another parallelism (2; the checkpoint
    # was taken at 1) and ends where an
    # uninterrupted run ends, for every key of every state
    result = abs.run(job_flow(N_TOTAL, max_parallelism=256), parallelism=2, restore=dest,
                     storage=str(tmp_path / "new"), checkpoint=abs.CheckpointConfig(interval=5.0))
    assert result.restored_from == saved.checkpoint_id and result.status == "FINISHED"
    assert result.records_in["count"] == N_TOTAL - N_SECOND
    final = final_state(str(tmp_path / "new"))  # checks key_group(key, 256) for every key
    assert SnapshotStore.open(str(tmp_path / "new")).read_job()["max_parallelism"] == 256
    assert set(final) == set(job_root["whole"]) and all(final.values())
    for state in final:
        assert final[state] == job_root["whole"][state], state
    expected_state, expected_out = simulate_counts(N_SECOND, N_TOTAL, at_checkpoint[("count", "n")])
    assert final[("count", "n")] == expected_state
    # after the restore, counting continues from the restored counts: nothing lost or counted twice
    out = result.collected("out")
    emitted: dict[int, list[int]] = collections.defaultdict(list)
    for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist()):
        emitted[k].append(c)
    assert {k: sorted(v) for k, v in emitted.items()} == {k: sorted(v) for k, v in expected_out.items()}


# ============================================================================ CLI
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_savepoint_with_spark_and_rekey_with_and_without_spark(spark, synthetic, capsys, tmp_path):
    root, model = synthetic
    sp = str(tmp_path / "sp")
    code, out, err = run_cli(capsys, "savepoint", root, "3", sp, "--spark")
    assert code == 0, err
    assert out.startswith(f"savepoint 3 of checkpoint 3 written to {sp} (") and "with Spark (" in out
    assert SnapshotStore.open(sp).read_manifest(3).stats["rewrite"]["engine"] == "spark"
    assert run_cli(capsys, "verify", sp)[0] == 0
    plain = str(tmp_path / "plain")  # without --spark: the in-process savepoint, as before
    code, out, _ = run_cli(capsys, "savepoint", root, "3", plain)
    assert code == 0 and "rewrite" not in SnapshotStore.open(plain).read_manifest(3).stats
    spark_dest, local_dest = str(tmp_path / "rk-spark"), str(tmp_path / "rk-local")
    code, out, err = run_cli(capsys, "rekey", root, "3", spark_dest, "--max-parallelism", "32", "--spark", "--unpickle")
    assert code == 0, err
    assert out.startswith(f"re-keyed checkpoint 3 of {root} from max_parallelism 16 to 32: savepoint 3 written to "
                          f"{spark_dest} (") and "max_parallelism=32" in out
    code, out, err = run_cli(capsys, "rekey", root, "3", local_dest, "--max-parallelism", "32", "--unpickle")
    assert code == 0 and "with Spark" not in out
    checksums = [{(op, st, kg): c[0].checksum for op, s in SnapshotStore.open(d).read_manifest(3).keyed.items()
                  for st, ch in s.items() for kg, c in ch.items()} for d in (spark_dest, local_dest)]
    assert checksums[0] == checksums[1]
    assert resolved_state(SnapshotStore.open(spark_dest), 3)[("count", "n")] == model[("count", "n")]
    code, out, _ = run_cli(capsys, "check", spark_dest, "-p", "32")
    assert code == 0 and "can be restored at parallelism 32" in out
    # the CLI used the active session and left it running
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is spark and spark.sparkContext.parallelize([1, 2]).count() == 2


def test_cli_bad_input_exits_2_and_names_the_way_out(spark, synthetic, capsys, tmp_path, memory_root, monkeypatch):
    root, _ = synthetic
    cases = [
        (("savepoint", root, "9", str(tmp_path / "a"), "--spark"), "checkpoint 9 does not exist"),
        (("rekey", root, "9", str(tmp_path / "a"), "--max-parallelism", "8"), "checkpoint 9 does not exist"),
        (("rekey", root, "3", str(tmp_path / "a"), "--max-parallelism", "0", "--spark"), "between 1 and 32768"),
        (("rekey", root, "3", str(tmp_path / "a"), "--max-parallelism", "32769"), "between 1 and 32768"),
        (("rekey", root, "3", root, "--max-parallelism", "8", "--spark"), "the destination is the source root"),
        (("savepoint", root, "3", memory_root, "--spark"), "memory:// root"),
        (("rekey", memory_root, "3", str(tmp_path / "a"), "--max-parallelism", "8", "--spark"), "run without --spark"),
        (("rekey", root, "3", str(tmp_path / "a"), "--max-parallelism", "8", "--master", "local[2]"), "add --spark"),
        (("rekey", str(tmp_path / "nothing"), "3", str(tmp_path / "a"), "--max-parallelism", "8"), "holds no snapshots"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err.startswith("abs-snapshot: error: ") and message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()
    SnapshotStore.open(root).savepoint(3, str(tmp_path / "full"))
    code, _, err = run_cli(capsys, "rekey", root, "3", str(tmp_path / "full"), "--max-parallelism", "8", "--spark")
    assert code == 2 and "is already a snapshot root" in err and "new, empty directory" in err
    monkeypatch.setitem(sys.modules, "pyspark", None)  # pyspark not importable
    code, _, err = run_cli(capsys, "savepoint", root, "3", str(tmp_path / "b"), "--spark")
    assert code == 2 and "--spark needs pyspark" in err and "install the project with its 'spark' extra: pip install '.[spark]' in a checkout" in err
    assert "run without --spark" in err


def test_a_spark_rewrite_reports_each_stage_until_all_its_tasks_are_done(spark, synthetic, tmp_path):
    root, _model = synthetic
    events: list = []
    rspark.rekey(spark, root, 3, str(tmp_path / "sp"), max_parallelism=8, unpickle=True, key_groups_per_task=6,
                 output_partitions=3, progress=events.append)
    last: dict = {}
    for e in events:
        assert e.stage.startswith("rekey: Spark stage ") and e.unit == "tasks"
        assert e.done >= last.get(e.stage, (0, 0))[0]  # counts only grow
        last[e.stage] = (e.done, e.total)
    assert len(last) >= 2, last  # the split and the write stage of the shuffle
    assert all(done == total > 0 for done, total in last.values()), last
    assert any(total == 3 for _, total in last.values())  # the write stage: one task per output partition
