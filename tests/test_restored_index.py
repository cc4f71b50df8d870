"""A restored key group answers a typed ValueState's C handle from an index over its restored
keys, Arrow text or int64 (``abscore._native.RestoredIndex``, the *probed* state of
``abs.state.restored.RestoredColumn``), instead of building a Python key and a dict entry per
key: the same values, the same captures and the same checkpoints as a built key group,
whatever the records do to it."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import abs
from abs.columns import Column
from abs.keygroups import KeyGroupRange, key_group
from abs.state import KeyedStateBackend, ValueState
from abs.state.restored import RestoredColumn
from abscore.native import NATIVE
from storage import SnapshotStore

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the restored index is the C module's")

M = 8
RANGE = KeyGroupRange(0, M - 1)
TEXT = st.text(alphabet=st.sampled_from("ab\u00e9\u4e2d\U0001f600 \x00"), max_size=6)


LAYOUTS = [(24, 1), (31, 30), (0, 1), (7, 1)]
"""``NATIVE.index_layout`` settings each index test runs under: the default (32-bit entries,
a tag of 32 minus the slot bits), 32-bit entries whose slots take 30 bits (a tag of 2 bits:
most probes match a tag, the key compare decides), 64-bit entries (as for key groups of
2**24 keys or more), and the switch between them at 128 keys (127 keys narrow, 128 wide)."""


@contextmanager
def layout(narrow_bits: int, least_bits: int):
    was = NATIVE.index_layout(narrow_bits, least_bits)
    try:
        yield
    finally:
        NATIVE.index_layout(*was)


def index_of(keys: pa.Array):
    b = keys.buffers()
    return NATIVE.text_index(keys, b[1], b[2], keys.offset, len(keys), pa.types.is_binary(keys.type))


# ----------------------------------------------------------------------------- the index itself


@given(st.lists(TEXT, unique=True, max_size=200), st.lists(TEXT, max_size=30), st.integers(0, 5))
@settings(max_examples=150, deadline=None)
def test_the_index_finds_each_key_at_its_row_and_nothing_else(keys, probes, cut):
    for shape in LAYOUTS:
        with layout(*shape):
            _finds_each_text_key(keys, probes, cut)


def _finds_each_text_key(keys, probes, cut):
    arr = pa.array(["-"] * cut + keys, pa.string()).slice(cut)  # an array with an offset
    index = index_of(arr)
    assert len(index) == len(keys) and index.keys is arr
    for i, k in enumerate(keys):
        assert index.find(k) == i
        assert index.find(k.encode()) == -1  # bytes never equal a str
    for p in probes:
        assert index.find(p) == (keys.index(p) if p in keys else -1)
    assert index.find(7) == -2 and index.find(None) == -2  # not text: the caller asks the dict


@given(st.lists(st.binary(max_size=9), unique=True, max_size=100))
@settings(max_examples=60, deadline=None)
def test_the_index_of_bytes_keys(keys):
    for shape in LAYOUTS:
        with layout(*shape):
            index = index_of(pa.array(keys, pa.binary()))
        assert [index.find(k) for k in keys] == list(range(len(keys)))
        assert all(index.find(k.decode("latin-1")) == -1 for k in keys)


I64 = st.integers(-(1 << 63), (1 << 63) - 1)


@given(st.lists(I64, unique=True, max_size=200), st.lists(I64, max_size=30))
@settings(max_examples=150, deadline=None)
def test_the_index_of_int64_keys_finds_each_at_its_row_and_answers_only_for_exact_ints(keys, probes):
    for shape in LAYOUTS:
        with layout(*shape):
            _finds_each_int_key(keys, probes)


def _finds_each_int_key(keys, probes):
    arr = np.array(keys, dtype=np.int64)
    index = NATIVE.int_index(arr)
    assert len(index) == len(keys) and index.keys is arr
    assert [index.find(k) for k in keys] == list(range(len(keys)))
    for p in probes:
        assert index.find(p) == (keys.index(p) if p in keys else -1)
    assert index.find(1 << 63) == -1 and index.find(-(1 << 64)) == -1  # no int64 equals them
    assert index.find(True) == -2 and index.find(1.0) == -2 and index.find("1") == -2  # the dict knows


def test_an_int_index_takes_int64_alone_and_refuses_repeats():
    assert NATIVE.int_index(np.array([3, 1, 3], dtype=np.int64)) is None
    with pytest.raises(TypeError, match="int64"):
        NATIVE.int_index(np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        NATIVE.int_index(np.array([1, 2], dtype=np.int32))
    assert len(NATIVE.int_index(np.empty(0, dtype=np.int64))) == 0


@pytest.mark.parametrize("shape", LAYOUTS)
def test_repeated_keys_give_no_index_and_a_large_index_finds_its_keys(shape):
    with layout(*shape):
        _repeats_and_a_large_index()


def test_an_index_layout_out_of_range_is_refused_and_changes_nothing():
    was = NATIVE.index_layout(24, 1)
    NATIVE.index_layout(*was)
    for bad in ((32, 1), (-1, 1), (24, 0), (24, 32)):
        with pytest.raises(ValueError, match=r"narrow_bits 0 \.\. 31, least_bits 1 \.\. 31"):
            NATIVE.index_layout(*bad)
    assert NATIVE.index_layout(*was) == was


def test_kept_values_of_an_unknown_typecode_or_too_few_are_refused_and_change_nothing():
    index = NATIVE.int_index(np.array([4, 9, 2], dtype=np.int64))
    index.keep_values(np.array([40, 90, 20], dtype=np.int64), "q")
    with pytest.raises(ValueError, match="typecode f is none of bhiqBHIQd"):
        index.keep_values(np.zeros(3, dtype=np.float32), "f")
    with pytest.raises(ValueError, match="hold no 3 values of typecode q"):
        index.keep_values(np.zeros(2, dtype=np.int64), "q")
    assert index.kept_values.tolist() == [40, 90, 20] and index.kept_typecode == "q"  # those kept before
    index.drop_values()
    assert index.kept_values is None


def _repeats_and_a_large_index():
    assert index_of(pa.array(["a", "b", "a"])) is None
    assert index_of(pa.array([""] * 2)) is None
    assert NATIVE.int_index(np.array([5, -1, 5], dtype=np.int64)) is None
    ints = np.arange(-300_000, 300_000, 7, dtype=np.int64)
    index = NATIVE.int_index(ints)
    assert [index.find(k) for k in (-300_000, 6, 299_998)] == [0, 42_858, len(ints) - 1]
    assert index.find(7) == -1
    keys = pa.array([f"key-{i}" for i in range(100_000)])  # built with the GIL released (over 65,536 keys)
    index = index_of(keys)
    assert [index.find(f"key-{i}") for i in (0, 77_777, 99_999)] == [0, 77_777, 99_999]
    assert index.find("key-100000") == -1
    empty = index_of(pa.array([""]))  # no data buffer at all
    assert empty.find("") == 0 and empty.find("x") == -1


KILLS = st.lists(st.tuples(st.sampled_from(["kill", "add", "find"]), st.integers(0, 39)), max_size=80)


@pytest.mark.parametrize("kind", ["str", "int"])
@given(ops=KILLS)
@settings(max_examples=60, deadline=None)
def test_killed_slots_are_found_no_more_and_their_keys_are_added_again(kind, ops):
    """kill() marks a slot dead: find() answers -1 for its key (the added keys looked up
    then), add() takes the key again as a new slot, killed and dead_bits() say which slots
    are dead, restored or added alike. Keys 0-19 restored, 20-39 never; under each layout."""
    make = (lambda i: f"k{i}\u00e9") if kind == "str" else (lambda i: (i - 20) * 1_000_003)
    keys = [make(i) for i in range(40)]
    for shape in LAYOUTS:
        with layout(*shape):
            index = index_of(pa.array(keys[:20])) if kind == "str" else NATIVE.int_index(np.array(keys[:20], np.int64))
            _kills_as_a_model_says(index, keys, ops)


def _kills_as_a_model_says(index, keys, ops):
    slots = list(keys[:20])  # the key of each slot
    where = {k: i for i, k in enumerate(slots)}  # live keys -> slot
    dead: set = set()
    assert index.dead_bits() is None and index.killed == 0
    for op, i in ops:
        key = keys[i]
        if op == "kill" and key in where:
            at = where.pop(key)
            assert index.kill(at) is True and index.kill(at) is False  # a second kill: dead already
            dead.add(at)
        elif op == "add" and key not in where:
            assert index.add(key) is True
            where[key] = len(slots)
            slots.append(key)
        elif op == "add":
            with pytest.raises(KeyError, match="there already"):
                index.add(key)
        assert index.find(key) == where.get(key, -1)
    assert len(index) == len(slots) and index.killed == len(dead) and index.base == 20
    assert [index.find(k) for k in keys] == [where.get(k, -1) for k in keys]
    bits = index.dead_bits()
    assert (bits is None) == (not dead)
    if bits is not None:  # a bit a slot, every slot's, the first of a byte its lowest bit
        assert len(bits) == -(-len(slots) // 8)
        mask = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")
        assert set(np.flatnonzero(mask).tolist()) == dead
    for bad in (-1, len(slots)):
        with pytest.raises(IndexError, match="RestoredIndex.kill"):
            index.kill(bad)


# ----------------------------------------------------------------------------- the key group


def backend():
    return KeyedStateBackend("op", [ValueState("v", pa.int64())], M, RANGE)


def restored(keys, values):
    """A backend holding ``keys`` -> ``values``, checkpointed and restored into a fresh one
    (its key groups waiting as arrays)."""
    src = backend()
    for k, v in zip(keys, values):
        src.put_many("v", key_group(k, M), [k], [v])
    full = src.capture_full(1)["v"]
    b = backend()
    for kg, table in full.items():
        b.restore("v", kg, table.drop_columns(["op"]))
    return b


def probed(col):
    return type(col) is RestoredColumn and isinstance(col.image, NATIVE.RestoredIndex)


def rows(tables):
    return {kg: sorted(zip(*(t.column(c).to_pylist() for c in t.column_names))) for kg, t in tables.items()}


def test_records_probe_the_key_group_new_keys_join_its_index_and_a_delete_keeps_it_probed():
    keys = [f"k{i}" for i in range(300)]
    b = restored(keys, range(300))
    h, data = b.state("v"), b._slot("v").data
    kg = key_group("k7", M)
    b.current_key, b.current_kg = "k7", kg
    h.update(h.value() + 1000)
    assert probed(data[kg]) and h.value() == 1007
    assert rows(b.capture(2)["v"]) == {kg: [("k7", 1007, 0)]}  # (key, value, op): one upsert
    b.confirm(2)
    new = next(f"new{i}" for i in range(100) if key_group(f"new{i}", M) == kg)
    b.current_key = new
    assert h.value() is None and probed(data[kg])  # absent: still probed
    h.update(5)  # a new key: appended, the index takes it
    assert probed(data[kg]) and h.value() == 5 and len(data[kg]) == len(data[kg].image.keys) + 1
    h.update(h.value() + 1)
    b.current_key = "k7"
    h.update(h.value() + 1)
    assert rows(b.capture(3)["v"]) == {kg: sorted([("k7", 1008, 0), (new, 6, 0)])}
    b.confirm(3)
    size = len(data[kg])
    h.clear()  # a delete marks the key's slot dead: still probed
    assert probed(data[kg]) and len(data[kg]) == size - 1 and h.value() is None
    assert rows(b.capture(4)["v"]) == {kg: [("k7", None, 1)]}
    assert dict(b.items("v", kg))[new] == 6 and "k7" not in dict(b.items("v", kg))  # items builds it
    assert type(data[kg]) is Column and len(data[kg]) == size - 1
    assert len(dict(b.items("v"))) == 300 and dict(b.items("v"))[new] == 6


def _has(col, name: str = "stamps") -> bool:
    try:
        object.__getattribute__(col, name)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("first_write", ["restored key", "new key"])
def test_a_key_group_only_read_makes_no_stamps_and_its_first_write_makes_them_all(first_write):
    """Reads probe a key group without making its stamps or copying its values (8 + 8 bytes a
    key: more fresh memory than its index; the values are read from the restored array the
    index keeps); its captures are empty until a write, which copies the values and makes a
    stamp for every slot, the new key's too, and the capture then holds that write alone."""
    keys = [f"k{i}" for i in range(300)]
    b = restored(keys, range(300))
    h, data = b.state("v"), b._slot("v").data
    kg = key_group("k7", M)
    b.current_key, b.current_kg = "k7", kg
    assert h.value() == 7 and probed(data[kg]) and not _has(data[kg]) and not _has(data[kg], "values")
    assert data[kg].image.kept_values is not None
    b.current_key = "k8" if key_group("k8", M) == kg else next(k for k in keys if key_group(k, M) == kg and k != "k7")
    assert h.value() == int(b.current_key[1:]) and not _has(data[kg], "values")  # another read: still the kept ones
    b.current_key = "k7"
    assert b.capture(2)["v"] == {}  # nothing written since the restore
    b.confirm(2)
    if first_write == "new key":
        b.current_key = next(f"new{i}" for i in range(100) if key_group(f"new{i}", M) == kg)
    h.update(1000)
    col = data[kg]
    assert probed(col) and _has(col) and _has(col, "values") and col.image.kept_values is None
    assert len(col.stamps) == len(col.values) == len(col)
    assert rows(b.capture(3)["v"]) == {kg: [(b.current_key, 1000, 0)]}
    b.confirm(3)
    col.build()  # a built column keeps the stamps the probed one made
    assert type(col) is Column and len(col.stamps) == len(col.keys)
    assert b.capture(4)["v"] == {}


VALUE_TYPES = {
    pa.int8(): [-128, 127, 0, 5], pa.int16(): [-32768, 32767, 1, 2], pa.int32(): [-(2**31), 2**31 - 1, 3, 4],
    pa.int64(): [-(2**63), 2**63 - 1, 5, 6], pa.uint8(): [0, 255, 7, 8], pa.uint16(): [0, 65535, 9, 10],
    pa.uint32(): [0, 2**32 - 1, 11, 12], pa.uint64(): [0, 2**64 - 1, 2**63, 13],
    pa.float64(): [-0.0, 1.5, float("inf"), 1e-300],
}


@pytest.mark.parametrize("value_type", VALUE_TYPES, ids=str)
def test_reads_of_the_kept_restored_values_give_what_the_copy_gives_for_every_value_type(value_type):
    """A probed key group's reads before any write come from the restored values its index
    kept (C, by the column's typecode); after a write, from its own copy: the same Python
    values of the same types, extremes included, as a built key group gives."""
    values = VALUE_TYPES[value_type] * 25
    keys = [f"v{i}" for i in range(len(values))]
    src = KeyedStateBackend("op", [ValueState("v", value_type)], M, RANGE)
    for k, v in zip(keys, values):
        src.put_many("v", key_group(k, M), [k], [v])
    full = src.capture_full(1)["v"]
    lazy, eager = (KeyedStateBackend("op", [ValueState("v", value_type)], M, RANGE) for _ in range(2))
    for b in (lazy, eager):
        for kg, table in full.items():
            b.restore("v", kg, table.drop_columns(["op"]))
    for col in eager._slot("v").data:
        if type(col) is RestoredColumn:
            col.build()

    def read_all(b):
        h = b.state("v")
        out = []
        for k in keys:
            b.current_key, b.current_kg = k, key_group(k, M)
            v = h.value()
            out.append((type(v), v))
        return out

    expected = [(type(v), v) for v in values]
    assert read_all(lazy) == read_all(eager) == expected
    assert all(probed(c) and not _has(c, "values") for c in lazy._slot("v").data if len(c))
    h = lazy.state("v")
    lazy.current_key, lazy.current_kg = keys[0], key_group(keys[0], M)
    h.update(h.value())  # a write: this key group copies its values, the others keep reading the kept ones
    assert read_all(lazy) == expected


@pytest.mark.parametrize("kind", ["str", "int", "bytes"])
@pytest.mark.parametrize("share", [1.0, 0.3])
def test_captures_of_restored_and_added_keys_match_a_built_key_group(kind, share):
    """Every restored key of key group 0 and a share of them changed, and three keys added:
    a full image (share 1.0) or the changed rows, keys in slot order, as a built one gives."""
    make = {"str": lambda i: f"s{i}\u00e9", "int": lambda i: i * 1_000_003, "bytes": lambda i: f"b{i}".encode()}[kind]
    pool = [make(i) for i in range(400) if key_group(make(i), M) == 0]
    restored_keys, added = pool[:20], pool[20:23]
    lazy, eager = restored(restored_keys, range(20)), restored(restored_keys, range(20))
    eager._slot("v").data[0].build()
    for b in (lazy, eager):
        h = b.state("v")
        b.current_kg = 0
        for i, key in enumerate(restored_keys[:int(share * 20)] + added):
            b.current_key = key
            h.update((h.value() or 0) + 1000 + i)
    assert probed(lazy._slot("v").data[0]) and type(eager._slot("v").data[0]) is Column
    got, want = lazy.capture(2)["v"], eager.capture(2)["v"]
    assert rows(got) == rows(want) and got[0].num_rows == want[0].num_rows
    assert dict(lazy.items("v")) == dict(eager.items("v"))


def test_full_images_of_a_probed_key_group_send_its_arrow_keys_once(tmp_path):
    """Every restored key changed at each checkpoint: the first full image sends the probed key
    group's Arrow keys, the next ones SameKeys (the very array again), and each writes what the
    keys would (read back sorted and exact through the writer's path)."""
    from abs.columns import KeyOrders, SameKeys
    from abs.runtime.messages import WriteJob
    from abs.runtime.writer import SentKeys, _write
    from storage import CheckpointSession

    keys = [f"key-{i}" for i in range(200)]
    b = restored(keys, range(200))
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": M})
    sent, orders, session = SentKeys(), KeyOrders(), CheckpointSession()
    h, values = b.state("v"), dict(zip(keys, range(200)))
    for cid in (2, 3, 4):
        for k in keys:
            b.current_key, b.current_kg = k, key_group(k, M)
            h.update(h.value() + cid)
            values[k] += cid
        assert all(probed(c) for c in b._slot("v").data)
        jobs = sent.substitute([WriteJob("op", "v", kg, [], d, False) for kg, d in b.capture(cid, lazy=True)["v"].items()])
        assert len(jobs) == M and all(isinstance(j.delta._rows().keys, SameKeys) == (cid > 2) for j in jobs)
        got: dict = {}
        for chain in _write(store, orders, cid, jobs, session).chains:
            t = store.read_chain(chain)
            assert t.column("key").to_pylist() == sorted(t.column("key").to_pylist())
            got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        b.confirm(cid)
        assert got == values


@pytest.mark.parametrize("kind", ["str", "int"])
def test_a_full_capture_of_a_key_group_nobody_used_probes_it_and_repeats_build_it(kind):
    """A savepoint's full image of a restored key group: from its index, without a Python
    object per key; one whose restored rows repeat a key is built (the last value wins)."""
    make = (lambda i: f"k{i}") if kind == "str" else (lambda i: i * 31)
    keys = [make(i) for i in range(50)]
    col = Column("q")
    RestoredColumn.keep(col, pa.array(keys) if kind == "str" else np.array(keys, dtype=np.int64), np.arange(50),
                        np.arange(50) % 9 == 0)
    got = col.capture(1, full=True)
    assert probed(col) and got.complete and got.all_rows and got.changed is None and not got.deleted
    keys_got = got.keys.to_pylist() if isinstance(got.keys, pa.Array) else got.keys.tolist()
    assert keys_got == keys and got.values.tolist() == list(range(50)) and got.nulls.tolist() == [i % 9 == 0 for i in range(50)]
    twice = Column("q")
    RestoredColumn.keep(twice, pa.array([make(1), make(2), make(1)]) if kind == "str"
                        else np.array([make(1), make(2), make(1)], dtype=np.int64), np.array([1, 2, 3]), None)
    got = twice.capture(1, full=True)
    assert type(twice) is Column
    keys_got = got.keys if isinstance(got.keys, list) else list(got.keys)
    assert sorted(zip(keys_got, got.values.tolist())) == sorted([(make(1), 3), (make(2), 2)])


def captured_rows(c):
    """What a Captured holds, whatever its shape: its changed rows (key, value or None) and
    its deletes, sorted, and whether it is the full image."""
    if c is None:
        return None
    keys, values, nulls = c.delta_rows()
    keys = keys.to_pylist() if isinstance(keys, pa.Array) else list(keys.tolist() if isinstance(keys, np.ndarray) else keys)
    values = values.tolist()
    if nulls is not None:
        values = [None if n else v for v, n in zip(values, nulls.tolist())]
    return sorted(zip(keys, values), key=repr), sorted(c.deleted, key=repr), c.complete


KEY_KINDS = {"str": lambda i: f"s{i}\u00e9", "int": lambda i: i * 1_000_003 - 7, "bytes": lambda i: f"b{i}".encode()}


def twins(kind, n=30, nulls_at=(4,)):
    """A probed restored key group of ``n`` keys (value i, None at ``nulls_at``) and the same
    built at once."""
    keys = [KEY_KINDS[kind](i) for i in range(n)]
    arr = np.array(keys, np.int64) if kind == "int" else pa.array(keys, pa.binary() if kind == "bytes" else pa.string())
    mask = np.isin(np.arange(n), list(nulls_at)) if nulls_at else None
    lazy, eager = Column("q"), Column("q")
    for col in (lazy, eager):
        RestoredColumn.keep(col, arr, np.arange(n, dtype=np.int64), mask)
    assert lazy._probe() and probed(lazy)
    eager.build()
    return keys, lazy, eager


@pytest.mark.parametrize("shape", LAYOUTS)
@pytest.mark.parametrize("kind", KEY_KINDS)
def test_deletes_keep_a_key_group_probed_and_it_captures_and_builds_as_a_built_one(kind, shape):
    """Deletes of restored keys, of added keys, of absent ones, a delete then a write again,
    through confirmed and unconfirmed captures: a probed key group marks the slots dead and
    answers the same (the delete's return, len, every capture with its deletes) as the same
    operations on a built one; built at last, it holds the same keys, values, nulls, stamps
    and deletes, its slots dense again."""
    with layout(*shape):
        keys, lazy, eager = twins(kind)
        new = [KEY_KINDS[kind](100 + i) for i in range(4)]

        def both(f):
            got, want = f(lazy), f(eager)
            assert got == want
            assert probed(lazy)
            return got

        def capture(since, full=False):
            return both(lambda c: (captured_rows(c.capture(since, full=full)), len(c)))

        assert both(lambda c: c.delete(keys[3], 2)) is True
        assert both(lambda c: c.delete(keys[3], 2)) is False  # deleted already
        assert both(lambda c: c.delete(new[0], 2)) is False  # never there
        assert both(lambda c: c.delete(keys[4], 2)) is True  # a null
        assert lazy.nulls == set() and len(lazy) == 28
        for i, k in enumerate(new):
            both(lambda c: c.set(k, 1000 + i, 2))
        assert both(lambda c: c.delete(new[1], 2)) is True  # an added key
        both(lambda c: c.set(keys[7], 77, 2))
        assert capture(1)[0][1] == sorted([keys[3], keys[4], new[1]], key=repr)
        capture(1, full=True)
        for c in (lazy, eager):
            c.forget_deletes(2)  # the capture of epoch 2 confirmed
        assert capture(2) == (None, 31)
        both(lambda c: c.set(keys[3], -3, 3))  # deleted, then written again: no delete any more
        both(lambda c: c.set(new[1], None, 3))
        assert both(lambda c: c.delete(keys[9], 3)) is True
        assert both(lambda c: c.delete(new[2], 4)) is True
        assert both(lambda c: c.delete(keys[11], 4)) is True
        both(lambda c: c.set(keys[11], 11, 4))  # deleted and written again before a capture
        assert lazy.deleted == eager.deleted == {keys[9]: 3, new[2]: 4}
        capture(2)
        capture(3)
        capture(4)
        capture(2, full=True)
        for k in keys:  # every live key written: a complete image, its deletes kept
            both(lambda c: c.delete(k, 5) if k == keys[0] else c.set(k, 5, 5) if k in eager.index else None)
        assert capture(4)[0][2] is True
        assert lazy.image.killed == 7  # restored keys 0, 3, 4, 9, 11 and added 1, 2 (3, 11, new 1 added since)
        capture(4, full=True)
        lazy.build()
        assert type(lazy) is Column and lazy.image is None
        assert built_state(lazy) == built_state(eager) and lazy.deleted == eager.deleted
        assert captured_rows(lazy.capture(4)) == captured_rows(eager.capture(4))


@pytest.mark.parametrize("shape", LAYOUTS)
def test_the_c_handle_reads_a_deleted_key_as_absent_and_writes_it_again(shape):
    """Through the typed ValueState's C handle: a cleared key reads None and a write makes it
    a new (added) key of the still probed key group, restored or added alike; a slot value()
    found before the key group is built with deletes (its slots renumbered) is not written
    by the update() of the same key object after the build."""
    with layout(*shape):
        keys = [f"k{i}" for i in range(200)]
        b = restored(keys, range(200))
        h, data = b.state("v"), b._slot("v").data
        kg = key_group("k7", M)
        mine = [k for k in keys if key_group(k, M) == kg]
        want = {k: int(k[1:]) for k in mine}
        b.current_kg = kg

        def at(key):
            b.current_key = key
            return h

        assert at(mine[0]).value() == want[mine[0]] and probed(data[kg])
        at(mine[0]).clear()
        del want[mine[0]]
        assert at(mine[0]).value() is None and probed(data[kg]) and len(data[kg]) == len(want)
        assert at(mine[1]).value() == want[mine[1]]  # its neighbour still there
        at(mine[0]).update(-1)  # written again: an added key
        want[mine[0]] = -1
        assert at(mine[0]).value() == -1 and data[kg].image.find(mine[0]) >= data[kg].image.base
        new = next(f"new{i}" for i in range(200) if key_group(f"new{i}", M) == kg)
        at(new).update(5)
        at(new).clear()
        assert at(new).value() is None and probed(data[kg])
        at(new).update(at(new).value() or 6)
        want[new] = 6
        assert at(new).value() == 6 and probed(data[kg]) and data[kg].image.killed == 2
        last = mine[-1]  # after the dead slots: renumbered by a build
        assert at(last).value() == want[last]
        data[kg].build()  # not through the handle: it is not told
        assert type(data[kg]) is Column
        at(last).update(999)  # the same key object as value() found
        want[last] = 999
        assert dict(b.items("v", kg)) == want


def built_state(col):
    """A built column's keys with their values (None for a null) and stamps, checking its
    parts agree: one slot a key, dense."""
    n = len(col.index)
    assert len(col.keys) == len(col.values) == len(col.stamps) == n
    assert all(col.index[k] == i for i, k in enumerate(col.keys)) and all(0 <= i < n for i in col.nulls)
    return sorted(((k, None if i in col.nulls else col.values[i], col.stamps[i]) for k, i in col.index.items()),
                  key=repr)


OPS = st.lists(st.tuples(st.sampled_from(["rmw", "set", "clear", "drop", "get", "checkpoint", "full", "build"]), st.integers(0, 59),
                         st.integers(-5, 5)), max_size=60)


NAMES = {"str": [f"n{i}\u00e9" if i % 3 else f"n{i}" for i in range(60)],
         "int": [(i - 30) * 1_000_003 ** 2 if i % 4 else i for i in range(60)],
         "bytes": [f"b{i}".encode() for i in range(60)]}


@pytest.mark.parametrize("kind", NAMES)
@given(ops=OPS, nulls_every=st.integers(0, 3), shape=st.sampled_from(LAYOUTS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_probed_key_group_behaves_as_a_built_one_under_any_records(kind, ops, nulls_every, shape):
    """The same records through the C handle on a restored backend (probed) and on the same
    state built at once: the same values read, the same captures, the same final state.
    Keys 0-39 were restored (some with a null value), 40-59 are new (the probed index takes
    them); a checkpoint captures and confirms, a full capture does not confirm; some
    writes store None; a clear (the
    handle's) or a drop (the backend's delete_many) deletes, and leaves a restored key group
    probed; a build builds the restored one (its slots renumbered if it had deletes). The
    same length of each key group after each record. Under each index layout (the probed
    key groups index their keys on first use)."""
    with layout(*shape):
        _probed_as_built(kind, ops, nulls_every)


def _probed_as_built(kind, ops, nulls_every):
    names = NAMES[kind]
    restored_keys = names[:40]
    values = [None if nulls_every and i % (nulls_every + 3) == 0 else i for i in range(40)]
    lazy, eager = restored(restored_keys, values), restored(restored_keys, values)
    for col in eager._slot("v").data:
        if type(col) is RestoredColumn:
            col.build()
    epoch = 2
    for op, k, d in ops:
        key = names[k]
        kg = key_group(key, M)
        outs = []
        was = type(lazy._slot("v").data[kg])
        for b in (lazy, eager):
            h = b.state("v")
            b.current_key, b.current_kg = key, key_group(key, M)
            if op == "rmw":
                v = h.value()
                h.update((v or 0) + d)
                outs.append(v)
            elif op == "set":
                h.update(None if d == 0 else d)
            elif op == "clear":
                h.clear()
            elif op == "drop":
                b.delete_many("v", kg, [key])
            elif op == "build":
                col = b._slot("v").data[kg]
                if type(col) is RestoredColumn:
                    col.build()
            elif op == "get":
                outs.append(h.value())
            elif op == "full":
                outs.append(rows(b.capture_full(epoch)["v"]))
            else:
                outs.append(rows(b.capture(epoch)["v"]))
                b.confirm(epoch)
        if op in ("checkpoint", "full"):
            epoch += 1
        assert outs[:1] == outs[1:], (op, key)
        col = lazy._slot("v").data[kg]
        if op in ("clear", "drop") and was is RestoredColumn:
            assert probed(col), (op, key)  # a delete does not build a restored key group
        assert len(col) == len(eager._slot("v").data[kg]), (op, key)
    assert rows(lazy.capture_full(epoch)["v"]) == rows(eager.capture_full(epoch)["v"])
    assert dict(lazy.items("v")) == dict(eager.items("v"))  # builds every key group


# ----------------------------------------------------------------------------- end to end


def _event(n: int, i: int) -> tuple[int, int]:
    """Event ``i`` of the job over ``n`` keys: (key position, value). Round 0: the first 90 %
    of the keys, each with its position (the last tenth of the round goes to the first keys
    again); round 1: every 100th of those keys 100 times, +1 each, and the last tenth of the
    keys, new after the restore, +7 once; round 2: every key once more, +1."""
    r, j = divmod(i, n)
    base = n - n // 10
    if r == 0:
        return (j if j < base else j - base), j
    if r == 1:
        return (j // 100 * 100 % base, 1) if j < base else (j, 7)
    return j, 1


def _expected(names: list, rounds: int) -> dict:
    out: dict = {}
    for i in range(len(names) * rounds):
        k, v = _event(len(names), i)
        out[names[k]] = out.get(names[k], 0) + v
    return out


def _flow(names: pa.Array, rounds: int) -> abs.Dataflow:
    """A running sum in a ValueState over ``rounds`` rounds of :func:`_event`."""
    n = len(names)

    def batch(idx):
        events = [_event(n, i) for i in idx.tolist()]
        return pa.RecordBatch.from_arrays([names.take(pa.array([k for k, _v in events])),
                                           pa.array([v for _k, v in events], pa.int64())], names=["k", "v"])

    def running_sum(ctx, event):
        total = ctx.state.total
        total.update((total.value() or 0) + event["v"])

    flow = abs.Dataflow("probed", max_parallelism=16)
    src = abs.GeneratorSource(n * rounds, num_keys=n, batch_size=1000, make_batch=batch)
    flow.source("src", src).key_by("k").process("sum", running_sum, state=[abs.ValueState("total", pa.int64())])
    return flow


def _final_state(root: str) -> dict:
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(store.list_checkpoints()[-1])
    got: dict = {}
    for kg in manifest.chains("sum", "total"):
        t = store.read_key_group(manifest, "sum", "total", kg)
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    return got


@pytest.mark.parametrize("kind", ["str", "int"])
def test_checkpoints_of_probed_key_groups_restore_exactly(tmp_path, kind):
    """A restore whose records change 1 % of the keys and add a tenth more (deltas of keys
    taken from the probed key groups' arrays and their added keys), restored again at another
    parallelism, whose records then change every key (full images): each checkpoint holds
    exactly the sums."""
    n = 6000
    names = pa.array([f"user-{i:05d}" if i % 7 else f"us\u00e9r-{i}" for i in range(n)]) if kind == "str" \
        else pa.array([i * 7919 - 10**12 for i in range(n)], pa.int64())
    cfg = abs.CheckpointConfig(interval=None)
    for rounds, parallelism in ((1, 1), (2, 1), (3, 2)):
        result = abs.run(_flow(names, rounds), parallelism=parallelism, storage=str(tmp_path),
                         restore="latest" if rounds > 1 else None, checkpoint=cfg)
        # a restore that goes on with the one new round (a fresh start would replay them all)
        assert (result.restored_from is not None) == (rounds > 1) and result.records_in["sum"] == n
        assert _final_state(str(tmp_path)) == _expected(names.to_pylist(), rounds), rounds
