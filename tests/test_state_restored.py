"""Restored columnar key groups (abs.state.restored): kept as arrays until first used, then
exactly what an eager restore gave; checkpoints after a restore carry exactly the changes."""
from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pyarrow as pa
import pytest

from abs.columns import Column
from abs.keygroups import KeyGroupRange, key_group
from abs.state import KeyedStateBackend, ValueState
from abs.state.aggregate_backend import AggregateBackend
from abs.state.handover import export_key_group
from abs.state.handles import PyColumnValueStateHandle
from abs.state.restored import RestoredColumn
from abscore.native import NATIVE

M = 16
RANGE = KeyGroupRange(0, M - 1)
KEYS = {
    "str": [f"k{i}" for i in range(400)],
    "int": list(range(-200, 200)),
    "bytes": [f"b{i}".encode() for i in range(400)],
}
TYPES = [(pa.int64(), lambda i: i * 3 - 500), (pa.float64(), lambda i: i / 4), (pa.uint8(), lambda i: i % 256)]


def backend(arrow_type=pa.int64()):
    return KeyedStateBackend("op", [ValueState("v", arrow_type)], M, RANGE)


def written(keys, arrow_type, make, nulls_every=0):
    """A backend holding ``keys`` (every ``nulls_every``-th value None) and its full capture."""
    b = backend(arrow_type)
    for i, k in enumerate(keys):
        b.put_many("v", key_group(k, M), [k], [None if nulls_every and i % nulls_every == 0 else make(i)])
    return b, b.capture_full(1)["v"]


def restored(full, arrow_type=pa.int64()):
    b = backend(arrow_type)
    for kg, table in full.items():
        b.restore("v", kg, table.drop_columns(["op"]))
    return b


def contents(b):
    return sorted(((k, v) for k, v in b.items("v")), key=repr)


def probed(col):
    """Whether a restored key group answers from its index (not built, not waiting)."""
    return type(col) is RestoredColumn and NATIVE is not None and isinstance(col.image, NATIVE.RestoredIndex)


def kinds(b):
    return {type(b._slot("v").data[kg]) for kg in RANGE}


@pytest.mark.parametrize("key_kind", KEYS)
@pytest.mark.parametrize("arrow_type,make", TYPES, ids=str)
def test_a_restored_key_group_waits_as_arrays_and_is_built_exactly_on_first_use(key_kind, arrow_type, make):
    src, full = written(KEYS[key_kind], arrow_type, make, nulls_every=7)
    b = restored(full, arrow_type)
    assert kinds(b) == {RestoredColumn}
    assert sum(len(b._slot("v").data[kg]) for kg in RANGE) == len(KEYS[key_kind])  # no build for a length
    assert b.capture(2) == {"v": {}}  # restored keys are not dirty: nothing built either
    assert kinds(b) == {RestoredColumn}
    assert contents(b) == contents(src)
    assert kinds(b) == {Column}


def test_the_first_record_builds_only_its_own_key_group_and_later_deltas_are_exact():
    keys = KEYS["str"]
    src, full = written(keys, pa.int64(), lambda i: i)
    b = restored(full)
    h = b.state("v")
    key = keys[5]
    kg = key_group(key, M)
    b.current_key, b.current_kg = key, kg
    assert h.value() == 5
    h.update(h.value() + 100)
    data = b._slot("v").data
    # the C handle probes the key group's keys instead of building it (tests/test_restored_index.py)
    assert probed(data[kg]) if NATIVE is not None else type(data[kg]) is Column
    assert {type(data[g]) for g in RANGE if g != kg} == {RestoredColumn}
    assert not any(probed(data[g]) for g in RANGE if g != kg)
    delta = b.capture(2)["v"]
    assert list(delta) == [kg]
    assert delta[kg].column("key").to_pylist() == [key] and delta[kg].column("value").to_pylist() == [105]
    b.confirm(2)
    # a delete of a key of a key group not used yet: probed (built without the C module),
    # its slot marked dead, and the delta says so
    other = next(k for k in keys if type(data[key_group(k, M)]) is RestoredColumn)
    b.delete_many("v", key_group(other, M), [other])
    assert probed(data[key_group(other, M)]) if NATIVE is not None else type(data[key_group(other, M)]) is Column
    delta = b.capture(3)["v"][key_group(other, M)]
    assert delta.column("key").to_pylist() == [other] and delta.column("op").to_pylist() == [1]
    # a full capture holds every key but the deleted one; it probes the key groups nobody
    # used (builds them without the C module) rather than building them
    full3 = b.capture_full(4)["v"]
    if NATIVE is None:
        assert kinds(b) == {Column}
    else:
        assert all(probed(data[g]) for g in RANGE if type(data[g]) is RestoredColumn)
        assert sum(type(data[g]) is RestoredColumn for g in RANGE) == M  # the one with a delete too
    upserts = {k for t in full3.values() for k, op in zip(t.column("key").to_pylist(), t.column("op").to_pylist())
               if op == 0}
    assert upserts == set(keys) - {other}


def test_bulk_reads_and_writes_build_the_key_group_first():
    keys = KEYS["int"]
    src, full = written(keys, pa.int64(), lambda i: i)
    b = restored(full)
    kg = key_group(keys[0], M)
    ks = [k for k in keys if key_group(k, M) == kg]
    assert b.get_many("v", kg, ks[:2]) == [keys.index(ks[0]), keys.index(ks[1])]
    b2 = restored(full)
    b2.put_many("v", kg, [ks[0]], [-1])
    assert dict(b2.items("v", kg))[ks[0]] == -1
    assert len(dict(b2.items("v", kg))) == len(ks)
    assert b2.fold_many("v", kg, [ks[1]], np.array([10]), "sum").tolist() == [keys.index(ks[1]) + 10]


def test_restoring_into_a_key_group_that_holds_keys_upserts_key_by_key():
    keys = KEYS["str"]
    _, full = written(keys, pa.int64(), lambda i: i)
    b = restored(full)
    kg, table = next(iter(full.items()))
    first = table.column("key")[0].as_py()
    b.restore("v", kg, table.drop_columns(["op"]).set_column(1, "value", pa.array([7] * table.num_rows)))
    assert type(b._slot("v").data[kg]) is Column
    assert dict(b.items("v", kg))[first] == 7 and len(dict(b.items("v", kg))) == table.num_rows


def test_repeated_keys_in_a_restored_table_keep_the_last_value():
    col = Column("q")
    RestoredColumn.keep(col, pa.chunked_array([pa.array(["a", "b", "a"])]), np.array([1, 2, 3]), None)
    assert len(col) == 3  # the rows restored; the build finds the repeat
    assert dict(col.items()) == {"a": 3, "b": 2}
    assert type(col) is Column


def test_keep_refuses_a_column_that_holds_keys():
    col = Column("q")
    col.set("a", 1, 1)
    with pytest.raises(ValueError, match="needs an empty column"):
        RestoredColumn.keep(col, pa.array(["b"]), np.array([2]), None)
    with pytest.raises(ValueError, match="one value per key"):
        RestoredColumn.keep(Column("q"), pa.array(["b"]), np.array([2, 3]), None)


def test_a_write_to_one_part_copies_and_pickles_build_it_first():
    def kept():
        col = Column("q")
        RestoredColumn.keep(col, pa.array(["a", "b"]), np.array([1, 2]), np.array([False, True]))
        return col

    col = kept()
    col.stamps = col.stamps  # reading builds, writing keeps the rest
    assert dict(col.items()) == {"a": 1, "b": None}
    col = kept()
    col.deleted = {}  # not a part of the image: no build
    assert type(col) is RestoredColumn
    for clone in (copy.copy(kept()), copy.deepcopy(kept()), pickle.loads(pickle.dumps(kept()))):
        assert type(clone) is Column and dict(clone.items()) == {"a": 1, "b": None}


def test_threads_using_one_restored_key_group_build_it_once():
    col = Column("q")
    RestoredColumn.keep(col, pa.array([f"k{i}" for i in range(20000)]), np.arange(20000), None)
    start = threading.Barrier(4)
    seen = []

    def use():
        start.wait()
        seen.append(col.get("k19999"))

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [19999] * 4 and len(col.index) == 20000 and len(col.keys) == 20000


def test_handover_exports_a_restored_key_group_whole_or_as_nothing_changed():
    keys = KEYS["str"]
    _, full = written(keys, pa.int64(), lambda i: i)
    b = restored(full)
    kg = key_group(keys[0], M)
    assert export_key_group(b, kg, full=False) == {}
    assert type(b._slot("v").data[kg]) is RestoredColumn
    exported = export_key_group(b, kg, full=True)["v"]
    assert exported.num_rows == full[kg].num_rows
    assert sorted(exported.column("key").to_pylist()) == sorted(full[kg].column("key").to_pylist())


def test_the_aggregate_backend_restores_string_keys_lazily_and_folds_into_them():
    # on the dict path (string keys take the columnar store now; an aggregate that migrated
    # to the dict backend, or that cannot be columnar, restores there)
    keys = KEYS["str"]
    _, full = written(keys, pa.int64(), lambda i: i)
    agg = AggregateBackend(backend(), {"v": 0}, columnar=False)
    for kg, table in full.items():
        agg.restore("v", kg, table.drop_columns(["op"]))
    d = agg.dict_backend
    assert kinds(d) == {RestoredColumn}
    kg = key_group(keys[3], M)
    assert agg.dict_backend.fold_many("v", kg, [keys[3]], np.array([5]), "sum").tolist() == [8]
    delta = agg.capture(2)["v"]
    assert list(delta) == [kg] and delta[kg].column("value").to_pylist() == [8]


def test_the_aggregate_backend_restores_string_keys_into_its_columnar_store():
    keys = KEYS["str"]
    _, full = written(keys, pa.int64(), lambda i: i)
    agg = AggregateBackend(backend(), {"v": 0})
    for kg, table in full.items():
        agg.restore("v", kg, table.drop_columns(["op"]))
    assert agg.columnar is not None, "string keys stay columnar"
    restored_rows = {k: v for kg in full for k, v in agg.items("v", kg)}
    assert restored_rows == {k: i for i, k in enumerate(keys)}


# ----------------------------------------------------------------------------- reading ahead


@pytest.mark.parametrize("readers", [1, 2, 8])
def test_read_ahead_gives_every_table_in_order_and_raises_where_the_serial_read_would(readers):
    from abs.runtime.operators import read_ahead

    items = [("s", kg, [f"file-{kg}"]) for kg in range(40)]
    assert [(item, table) for item, table in read_ahead(lambda chain: chain[0].upper(), items, readers)] == \
        [(item, item[-1][0].upper()) for item in items]
    started = []
    lock = threading.Lock()

    def read(chain):
        with lock:
            started.append(chain[0])
        if chain[0] == "file-5":
            raise OSError("file-5 is gone")
        return chain[0]

    got = []
    with pytest.raises(OSError, match="file-5 is gone"):
        for item, table in read_ahead(read, items, readers):
            got.append(table)
    assert got == [f"file-{kg}" for kg in range(5)]
    assert len(started) <= 6 + 2 * readers  # at most 2 * readers ahead of the caller
