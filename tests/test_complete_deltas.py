"""Complete deltas: a captured delta that holds every live key of its key group is written
as the new base, without reading the previous chain. Marking a delta complete when it is not
would lose keys, so the flag is checked against a model under random operations."""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.keygroups import KeyGroupRange, key_group
from abs.state import KeyedStateBackend, ValueState
from storage import SnapshotStore

M = 8
RANGE = KeyGroupRange(0, 7)


def _obj(v: int) -> tuple:
    return ("v", [v])


# int64 values live in columnar key groups (abs.columns, ColumnDelta); untyped values in
# columns of objects (ColumnDelta, pickled values); string values in dicts (PendingDelta):
# every test runs on all three
BACKENDS = {"columnar": (pa.int64(), int), "objects": (None, _obj), "dict": (pa.string(), str)}
backends = pytest.mark.parametrize("kind", sorted(BACKENDS))


def value_backend(kind: str) -> KeyedStateBackend:
    return KeyedStateBackend("op", [ValueState("v", BACKENDS[kind][0])], M, RANGE)


def put(b: KeyedStateBackend, key: int, value: int | None) -> None:
    b.current_key, b.current_kg = key, key_group(key, M)
    if value is None:
        b.state("v").clear()
    else:
        kind = next(k for k, (t, _) in BACKENDS.items() if t == b._slot("v").arrow_type)
        b.state("v").update(BACKENDS[kind][1](value))


def rows(table: pa.Table) -> dict:
    """key -> value of a delta or image table, pickled values unpickled (deletes: None)."""
    values = table.column("value").to_pylist()
    if table.schema.metadata.get(b"abs.value_encoding") == b"pickle":
        values = [None if v is None else pickle.loads(v) for v in values]
    return dict(zip(table.column("key").to_pylist(), values))


ops = st.lists(st.tuples(st.integers(0, 30), st.one_of(st.none(), st.integers(0, 5))), max_size=60)


@backends
@settings(max_examples=150, deadline=None)
@given(rounds=st.lists(st.tuples(ops, st.booleans()), min_size=1, max_size=5))
def test_a_delta_is_complete_only_when_it_holds_every_live_key(kind, rounds):
    b = value_backend(kind)
    make = BACKENDS[kind][1]
    model: dict = {}
    confirmed: dict = {}
    for cid, (round_ops, confirm) in enumerate(rounds, start=1):
        for key, value in round_ops:
            put(b, key, value)
            if value is None:
                model.pop(key, None)
            else:
                model[key] = make(value)
        deltas = b.capture(cid, lazy=True)["v"]
        state = dict(confirmed)
        for kg, lazy in deltas.items():
            table = lazy.to_table()
            got = rows(table)
            ops_col = table.column("op").to_pylist()
            live_in_kg = {k: v for k, v in model.items() if key_group(k, M) == kg}
            if lazy.complete:
                upserts = {k: v for (k, v), o in zip(got.items(), ops_col) if o == 0}
                assert upserts == live_in_kg, "the upserts of a complete delta are the key group's full image"
                image = lazy.image()
                assert rows(image) == live_in_kg
                assert not any(image.column("op").to_pylist())
                state = {k: v for k, v in state.items() if key_group(k, M) != kg}  # it replaces the chain
            for (k, v), o in zip(got.items(), ops_col):
                if o:
                    state.pop(k, None)
                else:
                    state[k] = v
        assert state == model
        if confirm:
            b.confirm(cid)
            confirmed = dict(model)


@backends
def test_a_key_group_that_mostly_changed_is_captured_as_its_full_image(kind):
    b = value_backend(kind)
    make = BACKENDS[kind][1]
    keys = [k for k in range(200) if key_group(k, M) == 3][:12]
    for k in keys:
        put(b, k, 1)
    b.confirm(b.capture(1, lazy=True) and 1)
    for k in keys:
        put(b, k, 2)  # all twelve change
    (lazy,) = b.capture(2, lazy=True)["v"].values()
    lazy.to_table()
    assert lazy.complete
    b.confirm(2)
    for k in keys[:6]:
        put(b, k, 3)  # half change: a delta
    (lazy,) = b.capture(3, lazy=True)["v"].values()
    t = lazy.to_table()
    assert not lazy.complete and sorted(t.column("key").to_pylist()) == sorted(keys[:6])
    b.confirm(3)
    for k in keys[:9]:
        put(b, k, 4)
    put(b, keys[9], None)  # 3/4 of the keys changed, one of them deleted: the image without it
    (lazy,) = b.capture(4, lazy=True)["v"].values()
    t = lazy.to_table()
    assert lazy.complete
    ops_of = dict(zip(t.column("key").to_pylist(), t.column("op").to_pylist()))
    assert {k for k, o in ops_of.items() if o} <= {keys[9]}  # a delete row for it is harmless in a base
    upserts = {k: v for k, v in rows(t).items() if not ops_of[k]}
    assert upserts == {**{k: make(4) for k in keys[:9]}, keys[10]: make(2), keys[11]: make(2)}
    b.confirm(4)
    for k in keys:
        put(b, k, None)  # every key deleted: a delta of deletes, never an empty "image"
    (lazy,) = b.capture(5, lazy=True)["v"].values()
    t = lazy.to_table()
    assert not lazy.complete and lazy.image() is None and set(t.column("op").to_pylist()) == {1}


def test_a_compacting_store_writes_the_writers_image_instead_of_reading_the_chain(tmp_path):
    from storage import CompactionPolicy

    store = SnapshotStore.open(str(tmp_path), policy=CompactionPolicy(max_chain_length=2))
    store.init_job({"job_name": "j", "max_parallelism": M})
    meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}

    def table(pairs: dict, op: int = 0) -> pa.Table:
        return pa.table({"key": pa.array(list(pairs), pa.int64()), "value": pa.array(list(pairs.values()), pa.int64()),
                         "op": pa.array(np.full(len(pairs), op, np.int8))}, metadata=meta)

    chain = store.write_key_group(1, "op", "v", 0, [], table({1: 1, 2: 1, 3: 1}))
    chain = store.write_key_group(2, "op", "v", 0, chain, table({2: 5}))
    assert len(chain) == 2
    for ref in chain:  # a compaction that read the chain back would fail now
        (tmp_path / ref.path).unlink()
    calls = []
    image = lambda: calls.append(1) or table({1: 1, 2: 5, 4: 7})  # noqa: E731 - 3 deleted, 4 new
    new = store.write_key_group(3, "op", "v", 0, chain, table({3: 0}, op=1), image=image)
    assert calls == [1] and [r.kind for r in new] == ["base"] and new[0].checkpoint_id == 3
    got = store.read_chain(new)
    assert dict(zip(got.column("key").to_pylist(), got.column("value").to_pylist())) == {1: 1, 2: 5, 4: 7}
    # no compaction due: the image is not asked for
    appended = store.write_key_group(4, "op", "v", 0, new, table({4: 8}), image=lambda: calls.append(2))
    assert calls == [1] and [r.kind for r in appended] == ["base", "delta"]


def test_store_writes_a_complete_delta_as_the_new_base_without_reading_the_chain(tmp_path):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": M})
    meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
    base = pa.table({"key": pa.array([1, 2, 3], pa.int64()), "value": pa.array([1, 1, 1], pa.int64())},
                    metadata=meta)
    chain = store.write_key_group(1, "op", "v", 0, [], base)
    full = pa.table({"key": pa.array([3, 1, 2], pa.int64()), "value": pa.array([9, 8, 7], pa.int64()),
                     "op": pa.array(np.zeros(3, np.int8))}, metadata=meta)
    # the old chain's file is gone: a complete delta must not read it
    (tmp_path / chain[0].path).unlink()
    new = store.write_key_group(2, "op", "v", 0, chain, full, complete=True)
    assert [r.kind for r in new] == ["base"] and new[0].checkpoint_id == 2
    got = store.read_chain(new)
    assert dict(zip(got.column("key").to_pylist(), got.column("value").to_pylist())) == {1: 8, 2: 7, 3: 9}


def test_columnar_aggregate_marks_only_fully_changed_key_groups_complete():
    from test_aggregate import batch, feed, make_op

    op = make_op({"s": ("v", "sum")}, emit="none")
    keys = list(range(60))
    feed(op, batch(keys, [1] * len(keys)))
    first = op.backend.capture(1, lazy=True)["s"]
    assert first and all(d.complete for d in first.values())  # every slot changed
    op.backend.confirm(1)
    by_kg: dict[int, list[int]] = {}
    for k in keys:
        by_kg.setdefault(key_group(k, 8), []).append(k)
    full_kg, partial_kg = sorted(by_kg)[:2]
    changed = by_kg[full_kg] + by_kg[partial_kg][:1]
    feed(op, batch(changed, [1] * len(changed)))
    deltas = op.backend.capture(2, lazy=True)["s"]
    assert set(deltas) == {full_kg, partial_kg}
    assert deltas[full_kg].complete and not deltas[partial_kg].complete
    t = deltas[full_kg].to_table()
    assert sorted(t.column("key").to_pylist()) == sorted(by_kg[full_kg])
