"""Restoring keys (string, binary, int) into the aggregate's columnar store in bulk
(``ColumnarKeyedState._bulk_slots`` / ``finish_restore`` in abs/state/columnar.py,
``IntKeyIndex.fill`` in abs/state/keyindex.py): the store is the one ``slots_for_var`` builds
from the same tables (slots may differ, key -> value may not), whatever the codes' collisions
(forced by cutting the codes to a few bits), the states, their key orders and the keys the
store held before; it answers lookups and captures like it; a key restored twice is refused.

Every test runs twice: string/binary keys indexed after the last key group, and indexed by a
thread of their own as the key groups come (``BackgroundFill``, which a restore of 128 k keys
and more uses), a run of keys at a time. The thread of string/binary keys fills its index in C
(``HashFill``): without ``abscore._native`` the tests of that thread skip, the others run."""
from __future__ import annotations

import gc
import threading
import types
from contextlib import nullcontext
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import abs
from abs.errors import StateError
from abs.keygroups import key_group_range, key_groups
from abs.runtime.operators import build_operator
from abs.state import columnar as columnar_module
from abs.state.columnar import ColumnarKeyedState
from abs.state import keyindex as keyindex_module
from abs.state.keyindex import HashFill, IntKeyIndex, SlotMap
from storage import SnapshotStore
from test_aggregate import SETTINGS, as_table
from test_aggregate_strings import colliding_codes

M = 8


@pytest.fixture(scope="module", autouse=True, params=["after the last key group", "by a thread as they come"])
def index_fill(request):
    """The way a bulk of string/binary keys is indexed (module-scoped: hypothesis tests take no
    function-scoped fixture)."""
    if request.param == "after the last key group":
        yield request.param
        return
    with mock.patch.object(columnar_module, "_BACKGROUND_FILL_MIN", 0), mock.patch.object(columnar_module, "_FILL_RUN", 1):
        yield request.param

DESCRIPTORS = [abs.ValueState("a", pa.int64()), abs.ValueState("b", pa.float64())]

# short keys (exact codes) and longer ones (hashed codes), multi-byte UTF-8, NULs
KEYS = st.one_of(st.text(max_size=3), st.text(min_size=8, max_size=14), st.sampled_from(["k1234567", "ключ", "a\x00"]))


def store() -> ColumnarKeyedState:
    return ColumnarKeyedState("agg", DESCRIPTORS, M, key_group_range(M, 1, 0))


def key_group_tables(keys: list, key_type: pa.DataType, rng: np.random.Generator, hows=(0, 1, 2)) -> list:
    """(state, kg, table) to restore: per key group a table of state "a" (every key) and one of
    state "b" (the same keys in the same order (0), shuffled (1), or a part of them (2): one of
    ``hows`` at random)."""
    arr = pa.array(keys, key_type)
    kgs = key_groups(arr, M)
    out = []
    for kg in sorted(set(kgs.tolist())):
        rows = np.flatnonzero(kgs == kg)
        ks = arr.take(pa.array(rows))
        out.append(("a", kg, pa.table({"key": ks, "value": pa.array(rows * 3 - 7, pa.int64())})))
        how = rng.choice(hows)
        sub = rows if how == 0 else rng.permutation(rows) if how == 1 else rows[rng.random(len(rows)) < 0.5]
        if len(sub):
            out.append(("b", kg, pa.table({"key": arr.take(pa.array(sub)), "value": pa.array(sub / 4, pa.float64())})))
    return out


def contents(s: ColumnarKeyedState) -> dict:
    return {name: sorted(s.items(name), key=repr) for name in ("a", "b")}


def by_key(s: ColumnarKeyedState, keys: list, key_type: pa.DataType) -> list:
    slots = s.slots_for_var(pa.array(keys, key_type))
    return [(s.columns["a"].values[x], s.columns["a"].present[x], s.columns["b"].values[x]) for x in slots.tolist()]


@SETTINGS
@given(st.lists(KEYS, max_size=60, unique=True), st.lists(KEYS, max_size=10), st.lists(KEYS, max_size=10),
       st.sampled_from([0, 1, 3, 64]), st.sampled_from([pa.string(), pa.large_binary()]), st.integers(0, 2**32))
def test_a_bulk_restore_gives_the_store_slots_for_var_builds(keys, before, after, bits, key_type, seed):
    if key_type == pa.large_binary():
        keys, before, after = ([k.encode() for k in ks] for ks in (keys, before, after))
    tables = key_group_tables(keys, key_type, np.random.default_rng(seed))
    with colliding_codes(bits):
        bulk, plain = store(), store()
        for s in (bulk, plain):
            if before:  # keys already there (new key groups are still loaded in bulk)
                s.touch(s.slots_for_var(pa.array(before, key_type)))
        with mock.patch.object(ColumnarKeyedState, "_bulk_slots", lambda self, kg, arr: None):
            for state, kg, table in tables:
                plain.restore(state, kg, table)
        for state, kg, table in tables:
            bulk.restore(state, kg, table)
        assert contents(bulk) == contents(plain)
        assert bulk.n == plain.n
        assert np.array_equal(np.sort(bulk.kg_counts), np.sort(plain.kg_counts))
        assert sorted(bulk.capture(1, lazy=False)) == sorted(plain.capture(1, lazy=False))
        bulk.finish_restore()
        assert bulk._unindexed is None
        # every key finds its own slot, new keys get new ones, in both stores alike
        probe = list(dict.fromkeys(keys + before + after))
        assert by_key(bulk, probe, key_type) == by_key(plain, probe, key_type)
        assert bulk.n == plain.n == len(probe)
        assert contents(bulk) == contents(plain)
        for s in (bulk, plain):
            s.touch(s.slots_for_var(pa.array(after + keys[:3], key_type)))
        got = {name: {kg: sorted(map(str, as_table(d).to_pylist())) for kg, d in by_kg.items()}
               for name, by_kg in bulk.capture(2, lazy=True).items()}
        want = {name: {kg: sorted(map(str, as_table(d).to_pylist())) for kg, d in by_kg.items()}
                for name, by_kg in plain.capture(2, lazy=True).items()}
        assert got == want


INT_KEYS = st.one_of(st.integers(0, 300), st.integers(-(2**63), 2**63 - 1))  # dense (direct range) and sparse (hash)


@SETTINGS
@given(st.lists(INT_KEYS, max_size=60, unique=True), st.lists(INT_KEYS, max_size=10), st.lists(INT_KEYS, max_size=10),
       st.integers(0, 2**32))
def test_int_keys_restored_in_bulk_give_the_store_slots_for_builds(keys, before, after, seed):
    tables = key_group_tables(keys, pa.int64(), np.random.default_rng(seed))
    bulk, plain = store(), store()
    for s in (bulk, plain):
        if before:
            s.touch(s.slots_for(np.array(before, np.int64)))
    with mock.patch.object(ColumnarKeyedState, "_bulk_slots", lambda self, kg, arr: None):
        for state, kg, table in tables:
            plain.restore(state, kg, table)
    for state, kg, table in tables:
        bulk.restore(state, kg, table)
    assert contents(bulk) == contents(plain) and bulk.n == plain.n
    bulk.finish_restore()
    probe = np.array(list(dict.fromkeys(keys + before + after)), np.int64)
    got = [bulk.columns["a"].values[x] for x in bulk.slots_for(probe).tolist()]
    assert got == [plain.columns["a"].values[x] for x in plain.slots_for(probe).tolist()]
    assert bulk.n == plain.n == len(probe)
    assert contents(bulk) == contents(plain)
    assert sorted(bulk.slots_for(probe).tolist()) == list(range(len(probe)))


@pytest.mark.parametrize("key", [5, 2**62 + 7])
def test_an_int_key_restored_twice_is_refused_by_name(key):
    s = store()
    s.restore("a", 1, pa.table({"key": pa.array([key, 11]), "value": pa.array([1, 2])}))
    s.restore("a", 2, pa.table({"key": pa.array([12, key]), "value": pa.array([3, 4])}))
    with pytest.raises(StateError, match=rf"key {key} is in the restored state twice \(key groups 1 and 2\).*corrupt"):
        s.finish_restore()


@pytest.mark.parametrize("bits", [0, 4, 64])
def test_many_keys_restored_in_bulk_over_few_codes_find_their_own_slots(bits):
    keys = [f"customer-{i:05d}" if i % 3 else f"{i}" for i in range(3000)]
    tables = key_group_tables(keys, pa.string(), np.random.default_rng(bits), hows=(0,))  # as the store writes them
    with colliding_codes(bits):
        s = store()
        for state, kg, table in tables:
            s.restore(state, kg, table)
        assert s._unindexed == 0  # nothing indexed until finish_restore
        s.finish_restore()
        slots = s.slots_for_var(pa.array(keys))
        assert s.n == len(keys) and sorted(slots.tolist()) == list(range(len(keys)))
        assert s.columns["a"].values[slots].tolist() == [i * 3 - 7 for i in range(len(keys))]
        if bits < 64:
            assert len(s.collisions) == len(keys)  # every key shares its code
        assert all(not by_kg for by_kg in s.capture(1).values())  # restored keys are not dirty


@pytest.mark.parametrize("twice", ["short key in two key groups", "long key in two key groups", "long key twice in a table"])
def test_a_key_restored_twice_is_refused_by_name(twice):
    key = "k1" if twice.startswith("short") else "customer-000001"
    s = store()
    if twice.endswith("table"):
        s.restore("a", 1, pa.table({"key": pa.array([key, "x", key]), "value": pa.array([1, 2, 3])}))
    else:
        s.restore("a", 1, pa.table({"key": pa.array([key, "x"]), "value": pa.array([1, 2])}))
        s.restore("a", 2, pa.table({"key": pa.array(["y", key]), "value": pa.array([3, 4])}))
    where = r"\(key group 1\)" if twice.endswith("table") else r"\(key groups 1 and 2\)"
    with pytest.raises(StateError, match=f"key '{key}' is in the restored state twice {where}.*corrupt"):
        s.finish_restore()


def test_a_key_group_restored_again_upserts_after_indexing_the_bulk():
    s = store()
    s.restore("a", 3, pa.table({"key": pa.array(["p", "customer-7"]), "value": pa.array([1, 2])}))
    s.restore("a", 3, pa.table({"key": pa.array(["customer-7", "q"]), "value": pa.array([5, 6])}))
    assert dict(s.items("a")) == {"p": 1, "customer-7": 5, "q": 6}
    assert s._unindexed is None and s.n == 3


def _restored_through_the_operator(tmp_path, names: pa.Array, aggs: dict):
    """An aggregate over ``names`` (value = the key's position) run to a checkpoint, then
    restored into a fresh operator at parallelism 1 through KeyedOp.restore, as a worker does."""
    n = len(names)
    flow = abs.Dataflow("bulk", max_parallelism=M)
    src = abs.GeneratorSource(n, num_keys=n, make_batch=lambda idx: pa.RecordBatch.from_arrays(
        [names.take(pa.array(idx)), pa.array(idx)], names=["k", "v"]))
    flow.source("src", src).key_by("k").aggregate("agg", aggs, emit="none")
    first = abs.run(flow, parallelism=1, storage=str(tmp_path))
    store_ = SnapshotStore.open(str(tmp_path))
    manifest = store_.read_manifest(first.last_checkpoint)
    node = next(n for n in flow.nodes if n.kind == "aggregate")
    ctx = types.SimpleNamespace(subtask=0, parallelism=1, max_parallelism=M,
                                key_group_range=key_group_range(M, 1, 0), send_to_driver=None)
    op = build_operator(node, ctx)
    op.restore({state: manifest.chains(node.uid, state) for state in manifest.keyed[node.uid]}, store_.read_chain)
    return op


def test_the_runtime_indexes_the_bulk_after_the_last_key_group(tmp_path):
    """A restore through the operator (KeyedOp.restore) leaves nothing to index."""
    op = _restored_through_the_operator(tmp_path, pa.array([f"name-{i:04d}" for i in range(500)]),
                                        {"s": ("v", "sum")})
    col = op.backend.columnar
    assert col is not None and col._unindexed is None and col.n == 500
    assert dict(op.backend.items("s")) == {f"name-{i:04d}": i for i in range(500)}


def test_a_restore_of_skewed_keys_is_sized_from_what_the_runtime_expects_not_from_its_first_key_group(tmp_path):
    """Every key in one key group: the first key group promises as many in each of the others.
    The runtime tells the store how many keys its chains hold at most (KeyedOp.restore), and
    the store and its index are sized for those, not for the M-fold guess."""
    pool = pa.array([f"name-{i:05d}" for i in range(20_000)])
    names = pool.filter(pa.array(key_groups(pool, M) == 3)).slice(0, 600)
    n = len(names)
    op = _restored_through_the_operator(tmp_path, names, {"s": ("v", "sum"), "c": ("v", "count")})
    col = op.backend.columnar
    assert col.n == n and col.capacity <= 2 * n  # without the bound: M * n and more
    assert col.map.hash.cap <= 3 * n
    assert col._restore_bound is None  # the bound was for that restore only
    assert dict(op.backend.items("s")) == {k: i for i, k in enumerate(names.to_pylist())}


@pytest.mark.parametrize("packed", [True, False])
def test_index_fill_places_keys_where_lookups_find_them_and_names_the_repeated_ones(packed):
    rng = np.random.default_rng(5)
    keys = rng.integers(-(2**40), 2**40, 20_000)
    keys[100:110] = keys[7]  # repeated: lookups find one of them, fill names the others
    index = IntKeyIndex(2 * len(keys))
    with nullcontext() if packed else mock.patch.object(keyindex_module, "_PACK_BITS", 0):
        rows, owners = index.fill(keys, 1000)
    found, _ = index.lookup(keys)
    owner = int(found[7]) - 1000
    same = {7, *range(100, 110)}
    assert owner in same
    want = np.arange(len(keys)) + 1000
    want[list(same)] = owner + 1000
    assert found.tolist() == want.tolist()
    assert sorted(rows.tolist()) == sorted(same - {owner})
    assert set(owners.tolist()) == {owner}
    assert index.size == len(keys)


def _needs_string_thread(index_fill: str) -> None:
    """Skip a test of the thread that indexes string/binary keys as they come where that thread
    cannot run: it fills its index in C (``HashFill`` needs ``abscore._native``); without the
    module those keys are indexed after the last key group (the other tests cover that)."""
    if index_fill == "by a thread as they come" and not HashFill.available():
        pytest.skip("the index thread of string/binary keys needs the C module abscore._native (HashFill)")


def _fill_threads(s: ColumnarKeyedState) -> list:
    """The store's index thread, if it has one (a thread of that name running)."""
    if s._fill is None:
        return []
    thread = s._fill._thread
    assert thread.name == "abs-index-fill" and thread in threading.enumerate()
    return [thread]


def _ended(threads: list) -> bool:
    for t in threads:
        t.join(timeout=30)
    return not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("run", [1, 700])
def test_a_thread_indexes_the_bulk_as_it_comes_and_ends_with_the_restore(index_fill, run):
    """Runs of one key group, or of ~3 (700 keys: the last run is handed over by finish_restore)."""
    _needs_string_thread(index_fill)
    keys = [f"customer-{i:05d}" for i in range(2000)]
    s = store()
    with mock.patch.object(columnar_module, "_FILL_RUN", run):
        for state, kg, table in key_group_tables(keys, pa.string(), np.random.default_rng(1), hows=(0,)):
            s.restore(state, kg, table)
    threads = _fill_threads(s)
    assert len(threads) == (index_fill == "by a thread as they come")
    s.finish_restore()
    assert s._fill is None and _ended(threads)
    slots = s.slots_for_var(pa.array(keys))
    assert sorted(slots.tolist()) == list(range(len(keys))) and s.n == len(keys)
    assert s.columns["a"].values[slots].tolist() == [i * 3 - 7 for i in range(len(keys))]


def test_keys_past_what_the_first_key_group_promised_are_indexed_anew(index_fill):
    """The thread's index is sized from the first key group (room for as many in each key
    group at load 1/2: 2,048 positions for 100 keys); 1,500 keys in all would fill it to 0.73:
    the store indexes every key after the last key group instead."""
    _needs_string_thread(index_fill)
    pool = pa.array([f"k{i}" for i in range(20000)])
    kgs = key_groups(pool, M)
    first = pool.filter(pa.array(kgs == 0)).slice(0, 100)
    rest = pool.filter(pa.array(kgs != 0)).slice(0, 1400)
    s = store()
    s.restore("a", 0, pa.table({"key": first, "value": pa.array(range(100))}))
    assert (s._fill is not None) == (index_fill == "by a thread as they come")
    rest_kgs = key_groups(rest, M)
    for kg in range(1, M):
        part = rest.filter(pa.array(rest_kgs == kg))
        s.restore("a", kg, pa.table({"key": part, "value": pa.array([int(k.as_py()[1:]) for k in part])}))
    s.finish_restore()
    assert s.n == 1500 and s.map.hash.size == 1500
    assert s.map.hash.size <= 0.5 * s.map.hash.cap  # built anew for all of them
    probe = pa.concat_arrays([first, rest])
    slots = s.slots_for_var(probe)
    assert sorted(slots.tolist()) == list(range(1500))
    assert s.columns["a"].values[slots].tolist() == list(range(100)) + [int(k[1:]) for k in rest.to_pylist()]


def test_a_restore_that_never_finishes_leaves_no_thread_behind(index_fill):
    if index_fill != "by a thread as they come":
        pytest.skip("no thread without the background fill")
    _needs_string_thread(index_fill)
    s = store()
    s.restore("a", 1, pa.table({"key": pa.array(["a-long-key-1", "b"]), "value": pa.array([1, 2])}))
    threads = _fill_threads(s)
    assert len(threads) == 1
    del s  # a restore that failed: nothing calls finish_restore
    gc.collect()
    assert _ended(threads)


def test_an_error_of_the_index_thread_is_raised_by_finish_restore(index_fill):
    if index_fill != "by a thread as they come":
        pytest.skip("no thread without the background fill")
    _needs_string_thread(index_fill)
    with mock.patch.object(IntKeyIndex, "fill_more", side_effect=MemoryError("no room for the index")):
        s = store()
        s.restore("a", 1, pa.table({"key": pa.array(["p", "q"]), "value": pa.array([1, 2])}))
        with pytest.raises(MemoryError, match="no room for the index"):
            s.finish_restore()


INT_LAYOUTS = {
    # key group -> its keys (M = 8 key groups; key_group_tables is not used: the layouts choose
    # what the first key group promises)
    "dense ids from 0": lambda: np.arange(3000),
    "a later key past the array the first key group sized": lambda: np.concatenate((np.arange(3000), [1 << 20])),
    "a later key just past the array the first key group sized": lambda: np.concatenate((np.arange(3000), [4096])),
    "ids far from 0": lambda: np.arange(3000) + 10**12,
    "the first key group spread wide, the others nearly empty": lambda: np.arange(0, 600_000, 30),
}


@pytest.mark.parametrize("layout", sorted(INT_LAYOUTS))
def test_int_keys_indexed_by_the_thread_give_the_map_the_restore_after_the_last_key_group_gives(index_fill, layout):
    """The dense array the thread fills (sized from the first key group restored) is taken only
    where the keys indexed after the last key group would get that very array; elsewhere the
    store indexes them itself."""
    keys = INT_LAYOUTS[layout]()
    kgs = key_groups(keys, M)
    if layout.startswith("the first key group spread wide"):
        kgs = np.where(keys % 600 == 0, 1 + keys % 7, 0)  # key group 0 first, with nearly all of them
    by_kg = {int(g): keys[kgs == g] for g in np.unique(kgs)}
    assert keys.max() != 4096 or by_kg[min(by_kg)].max() < 4096  # the first key group sizes the array below it
    stores = []
    for background in (False, True):
        s = store()
        with mock.patch.object(columnar_module, "_BACKGROUND_FILL_MIN", 0 if background else 1 << 40), \
                mock.patch.object(columnar_module, "_FILL_RUN", 1000):
            for g, ks in by_kg.items():
                s.load_checked("a", g, pa.table({"key": pa.array(ks), "value": pa.array(ks * 2)}))
        if background:
            assert (s._fill is not None) == (layout != "ids far from 0")
        with mock.patch.object(SlotMap, "fill_direct", autospec=True, side_effect=SlotMap.fill_direct) as scatter:
            s.finish_restore()
        if background and layout == "dense ids from 0":
            assert not scatter.called  # the thread's array, with the last run handed over by finish_restore
        stores.append(s)
    after, threaded = stores
    assert (after.map.direct is None) == (threaded.map.direct is None)
    if after.map.direct is not None:
        assert after.map.base == threaded.map.base and np.array_equal(after.map.direct, threaded.map.direct)
    assert after.map.hash.size == threaded.map.hash.size
    probe = np.concatenate((keys, [-5, 7 << 40]))
    for s in stores:
        slots = s.slots_for(probe)
        assert s.columns["a"].values[slots[:len(keys)]].tolist() == (keys * 2).tolist()
        assert s.n == len(keys) + 2
