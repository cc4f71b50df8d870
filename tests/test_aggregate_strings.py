"""String and binary keys on the aggregate's columnar path (``slots_for_var`` in
abs/state/columnar.py, abs/state/varkeys.py): the same updates, deltas and tables as the dict
path under any capture/confirm/abort sequence, exact sums when the index codes collide (forced
by cutting them to a few bits), restores across the paths, and index codes that are exact
for keys of up to 7 bytes."""
from __future__ import annotations

import pickle
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given
from hypothesis import strategies as st

import abs.columns
from abs.keygroups import key_group, key_groups
from abs.state import columnar as columnar_module
from abs.state.capture import group_bounds
from abs.state import varkeys
from abs.state.varkeys import Gathered, VarKeys, VarKeyStore, key_codes
from test_aggregate import (
    INT_AGGS,
    INT_VALUES,
    M,
    SETTINGS,
    as_table,
    assert_same_deltas,
    batch,
    feed,
    make_op,
    op_sequences,
    rows_of,
    run_both,
)

# short keys (exact codes), 8 bytes and more (hashed codes), multi-byte UTF-8, NULs
STRING_POOL = ["", "a", "b", "k1", "k12", "abcdefg", "abcdefgh", "abcdefghi", "ключ", "user-000000001",
               "user-000000002", "x" * 40, "a\x00", "\x00", "é"]
real_key_codes = key_codes


@contextmanager
def colliding_codes(bits: int):
    """Index codes cut to ``bits`` bits, every one of them flagged as a hash: distinct keys
    share codes all the time, and every row is checked against its slot's key (64: the real
    codes)."""

    if bits >= 64:
        yield
        return

    def few_bits(arr, out=None, *, rows=True):
        codes, _ = real_key_codes(arr)
        codes &= np.int64((1 << bits) - 1)
        if out is not None:
            out[:] = codes
        return codes if out is None else out, np.ones(len(codes), bool) if rows else None

    with mock.patch.object(columnar_module, "key_codes", few_bits):
        yield


def exact_dict_deltas():
    """The dict path's deltas hold exactly the changed keys: a key group of which 3/4 changed
    is otherwise written as its full image, unchanged keys included (both are right; this pool
    of keys puts four in one key group, where the two paths' deltas then differ)."""
    return mock.patch.object(abs.columns, "_IMAGE_SHARE", 1.01)


@SETTINGS
@given(op_sequences(INT_VALUES, STRING_POOL))
def test_string_keys_on_both_paths_agree(ops):
    with exact_dict_deltas():
        run_both(ops, INT_AGGS, pa.int64(), "v", pa.int64(), key_type=pa.string())


@SETTINGS
@given(op_sequences(INT_VALUES, STRING_POOL), st.sampled_from([0, 1, 3]))
def test_string_keys_on_both_paths_agree_when_index_codes_collide(ops, bits):
    with colliding_codes(bits), exact_dict_deltas():
        run_both(ops, INT_AGGS, pa.int64(), "v", pa.int64(), key_type=pa.string())


@SETTINGS
@given(st.lists(st.lists(st.tuples(st.text(max_size=12), st.integers(-50, 50)), min_size=1, max_size=40), max_size=8),
       st.sampled_from([0, 2, 5, 64]))
def test_colliding_codes_give_exact_sums_and_restore_exactly(batches, bits):
    with colliding_codes(bits) if bits < 64 else mock.patch.object(columnar_module, "key_codes", real_key_codes):
        op = make_op({"s": ("v", "sum"), "n": ("v", "count")})
        want: dict = {}
        for rows in batches:
            keys = [k for k, _ in rows]
            out = feed(op, batch(keys, [v for _, v in rows], key_type=pa.string()))
            for k, v in rows:
                want[k] = want.get(k, 0) + v
            assert out.column("key").to_pylist() == list(dict.fromkeys(keys))
            assert out.column("s").to_pylist() == [want[k] for k in dict.fromkeys(keys)]
        assert op.backend.columnar is not None
        assert dict(op.backend.items("s")) == want
        dst = make_op({"s": ("v", "sum"), "n": ("v", "count")})
        for state, by_kg in op.backend.capture_full(1).items():
            for kg, table in by_kg.items():
                assert table.schema.field("key").type == pa.string()
                dst.backend.restore(state, kg, table, verify=True)
        assert dst.backend.columnar is not None
        assert dict(dst.backend.items("s")) == want
        if want:
            keys = list(want)[:5] + ["a fresh key"]
            feed(dst, batch(keys, [1] * len(keys), key_type=pa.string()))
            for k in keys:
                want[k] = want.get(k, 0) + 1
            assert dict(dst.backend.items("s")) == want


@pytest.mark.parametrize("bits", [0, 4, 10])
def test_many_colliding_keys_over_index_rebuilds_stay_exact(bits):
    """Thousands of keys on a few codes: the index is rebuilt several times with codes that
    several slots share, and every key still finds its own slot."""
    rng = np.random.default_rng(bits)
    with colliding_codes(bits):
        op = make_op({"s": ("v", "sum")}, emit="none")
        want: dict = {}
        for _ in range(12):
            ks = [f"key-{k}" if k % 3 else f"{k}" for k in rng.integers(0, 3000, 700).tolist()]
            vs = rng.integers(-5, 6, len(ks)).tolist()
            feed(op, batch(ks, vs, key_type=pa.string()))
            for k, v in zip(ks, vs):
                want[k] = want.get(k, 0) + v
        store = op.backend.columnar
        assert store.n == len(want)  # one slot per key
        assert dict(op.backend.items("s")) == want
        got = {}
        for kg, table in op.backend.capture_full(1)["s"].items():
            keys = table.column("key").to_pylist()
            assert set(key_groups(pa.array(keys), M).tolist()) == {kg}
            got.update(zip(keys, table.column("value").to_pylist()))
        assert got == want


@pytest.mark.parametrize("key_type", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_string_and_binary_keys_stay_columnar_and_write_the_dict_paths_tables(key_type):
    binary = pa.types.is_binary(key_type) or pa.types.is_large_binary(key_type)
    raw = ["a", "bb", "a", "a longer key than seven bytes", ""]
    keys = [k.encode() for k in raw] if binary else raw
    col = make_op({"s": ("v", "sum"), "avg": ("v", "mean")})
    ref = make_op({"s": ("v", "sum"), "avg": ("v", "mean")}, columnar=False)
    b = batch(keys, [1, 2, 3, 4, 5], key_type=key_type)
    assert rows_of(feed(col, b)) == rows_of(feed(ref, b))
    assert col.backend.columnar is not None and col.backend.columnar.key_kind == ("binary" if binary else "string")
    a, d = col.backend.capture(1), ref.backend.capture(1)
    assert_same_deltas(a, d)
    t = pa.concat_tables(as_table(x) for x in a["s"].values())
    assert t.schema.field("key").type == (pa.binary() if binary else pa.string())


def test_another_key_kind_moves_the_state_to_the_dict_path():
    op = make_op({"s": ("v", "sum")}, emit="none")
    feed(op, batch(["x", "y"], [1, 2], key_type=pa.string()))
    op.backend.capture(1)
    op.backend.confirm(1)
    feed(op, batch(["y"], [5], key_type=pa.string()))
    feed(op, batch([b"x"], [7], key_type=pa.binary()))  # bytes keys are other keys than str ones
    assert op.backend.columnar is None
    assert dict(op.backend.items("s")) == {"x": 1, "y": 7, b"x": 7}
    changed = {k for t in op.backend.capture(2)["s"].values() for k in as_table(t).column("key").to_pylist()}
    assert {"y", b"x"} <= changed and "x" not in changed


def test_a_string_key_outside_the_subtask_range_is_refused():
    op = make_op({"s": ("v", "sum")}, parallelism=2, subtask=0)
    outside = next(k for k in (f"k{i}" for i in range(100)) if key_group(k, M) not in op.key_group_range)
    with pytest.raises(Exception, match="outside this subtask's range"):
        feed(op, batch([outside], [1], key_type=pa.string()))


def test_a_lazy_string_capture_pickles_each_key_group_with_its_own_rows_only():
    op = make_op({"s": ("v", "sum")}, emit="none")
    keys = [f"customer-{i:06d}" for i in range(4000)]
    feed(op, batch(keys, [1] * len(keys), key_type=pa.string()))
    per_row = 15 + 4 + 8 + 1  # key bytes, offset, value, op
    for captured in (op.backend.capture(1, lazy=True), op.backend.capture_full(2)):
        by_kg = captured["s"]
        assert len(by_kg) == M
        buffers: list = []
        blob = pickle.dumps(list(by_kg.values()), protocol=5, buffer_callback=buffers.append)
        shipped = len(blob) + sum(b.raw().nbytes for b in buffers)
        assert shipped < 1.5 * len(keys) * per_row, f"{shipped} bytes for {len(keys)} keys"
        got = {}
        for kg, delta in zip(by_kg, pickle.loads(blob, buffers=buffers)):
            t = as_table(delta)
            assert set(key_groups(t.column("key"), M).tolist()) == {kg}
            got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        assert got == {k: 1 for k in keys}


# ----------------------------------------------------------------------------- codes and keys


def reference_code(key: bytes) -> int | None:
    """The code of a key of up to 7 bytes (None for a longer key: a hash)."""
    if len(key) > 7:
        return None
    code = int.from_bytes(key, "little") | (len(key) << 56)
    return code - (1 << 64) if code >= 1 << 63 else code


@SETTINGS
@given(st.lists(st.binary(max_size=30), min_size=1, max_size=60), st.integers(0, 9))
def test_key_codes_are_exact_for_short_keys_and_equal_for_equal_keys(keys, cut):
    arr = pa.array(keys, pa.binary())
    codes, hashed = key_codes(arr)
    for k, c in zip(keys, codes.tolist()):
        want = reference_code(k)
        assert c == want if want is not None else c < 0  # a hash has the top bit set
    if hashed is None:
        assert all(len(k) <= 7 for k in keys)
    else:
        assert hashed.tolist() == [len(k) > 7 for k in keys]
    alone = {k: key_codes(pa.array([k], pa.binary()))[0][0] for k in set(keys)}
    assert codes.tolist() == [alone[k] for k in keys]  # a key's code depends on the key alone
    cut = min(cut, len(keys) - 1)  # a slice (offsets not starting at 0, any alignment) and the large type
    assert key_codes(arr.slice(cut))[0].tolist() == codes[cut:].tolist()
    assert key_codes(arr.cast(pa.large_binary()))[0].tolist() == codes.tolist()


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.one_of(
    st.binary(max_size=20),
    st.builds(lambda tail: b"customer-" + tail, st.binary(max_size=12)),
    st.lists(st.sampled_from([b"\0", b"a", b"z", b"\xff"]), max_size=19).map(b"".join))), max_size=60),
    st.booleans())
def test_gathered_keys_come_sorted_within_each_key_group_like_arrow_sorts_them(rows, sliced):
    """What storage writes: Arrow's order of binaries (byte by byte, a prefix first), stable;
    shared prefixes, zero bytes, keys of 8 bytes and more, equal keys."""
    kgs = np.array([g for g, _ in rows], np.int16)
    keys = [k for _, k in rows]
    arr = pa.array([b"x"] + keys, pa.binary()).slice(1) if sliced else pa.array(keys, pa.binary())
    order = np.argsort(kgs, kind="stable")
    bounds = group_bounds(kgs[order])
    sub, got = Gathered(VarKeys.from_arrow(arr, "binary"), order).sorted_slice(0, len(keys), bounds)
    want = sorted(range(len(keys)), key=lambda i: (kgs[i], keys[i], i))
    assert sub.tolist() == want
    assert got.tolist() == [keys[i] for i in want]
    for s, e, _ in bounds:
        run = arr.take(pa.array(order[s:e]))
        assert got.tolist()[s:e] == run.take(pc.sort_indices(run)).to_pylist()


def test_var_keys_cut_gather_and_convert():
    store = VarKeyStore("string", capacity=2)
    store.append(pa.array(["a", "bcd"]).slice(0))
    store.append(pa.array(["zz", "", "é", "long key of several words"]).slice(1))
    assert store[:4].tolist() == ["a", "bcd", "", "é"]
    assert store[np.array([4, 0, 2])].tolist() == ["long key of several words", "a", ""]
    assert store.key(3) == "é"
    cut = store[1:3]
    assert isinstance(cut, VarKeys) and len(cut) == 2 and cut.to_arrow().type == pa.string()
    assert cut.offsets[0] == 0 and cut.tolist() == ["bcd", ""]
    back = pickle.loads(pickle.dumps(cut))
    assert back.tolist() == ["bcd", ""] and back.data.nbytes == 3


@pytest.mark.parametrize("big", [False, True])
def test_the_key_store_widens_its_offsets_past_2_gib_of_bytes(monkeypatch, big):
    """A store's offsets are int32 (Arrow's ``string``) until its bytes pass 2 GiB, int64
    (``large_string``) from there on: here the limit is lowered to 40 bytes. Keys appended
    from either Arrow width read back the same on both sides of the switch, and so do their
    cuts, gathers and captures' sorted slices."""
    monkeypatch.setattr(varkeys, "_INT32_MAX", 40 if big else varkeys._INT32_MAX)
    store = VarKeyStore("string", capacity=2)
    want = []
    for i in range(6):
        words = [f"key-{i}-{j}" for j in range(i + 1)]  # 7 bytes each: the 3rd append passes 40
        store.append(pa.array(words, pa.large_string() if i % 2 else pa.string()))
        want += words
        wide = big and len("".join(want)) > 40
        assert store.offsets.dtype == (np.int64 if wide else np.int32)
        assert store.arrow_view().type == (pa.large_string() if wide else pa.string())
        assert store.arrow_view().to_pylist() == want
    assert store[:len(want)].tolist() == want and store[3:9].tolist() == want[3:9]
    assert store[np.array([20, 0, 7])].tolist() == [want[20], want[0], want[7]]
    assert [store.key(i) for i in range(len(want))] == want
    order = np.arange(len(want))[::-1].copy()
    sub, got = Gathered(store.view(), order).sorted_slice(0, len(want), [(0, len(want), 0)])
    assert got.tolist() == sorted(want) and [want[i] for i in sub.tolist()] == sorted(want)


@pytest.mark.parametrize("full", [True, False])
def test_a_string_keyed_key_group_moves_to_another_subtask_exactly(full):
    """Live reconfiguration: the key group leaves in the columnar store's own form (both
    stores stay columnar) and the new owner holds exactly its keys and sums."""
    src = make_op({"s": ("v", "sum")}, emit="none")
    keys = [f"k{i}" for i in range(40)] + [f"customer-{i:04d}" for i in range(40)]
    feed(src, batch(keys, list(range(80)), key_type=pa.string()))
    kg = key_group(keys[0], M)
    image = as_table(src.backend.capture_full(1)["s"][kg])
    src.backend.confirm(1)
    feed(src, batch(keys[::7], [1000] * len(keys[::7]), key_type=pa.string()))
    want = dict(src.backend.items("s"))
    tables, _chains = src.hand_out(kg, full=full)
    assert src.backend.columnar is not None
    base = {} if full else {"s": image}  # the changes apply over the last confirmed image
    dst = make_op({"s": ("v", "sum")}, emit="none", parallelism=2, subtask=1 if kg < M // 2 else 0)
    dst.take_in(kg, base, tables)
    assert dict(dst.backend.items("s")) == {k: v for k, v in want.items() if key_group(k, M) == kg}
    assert dst.backend.columnar is not None
    assert kg not in src.key_group_range
    assert dict(src.backend.items("s")) == {k: v for k, v in want.items() if key_group(k, M) != kg}


def test_restoring_string_keys_checks_like_the_dict_backend():
    good = make_op({"s": ("v", "sum")})
    feed(good, batch(["a", "customer-0001", "c"], [1, 2, 3], key_type=pa.string()))
    kg, table = next(iter(good.backend.capture_full(1)["s"].items()))
    op = make_op({"s": ("v", "sum")})
    with pytest.raises(Exception, match="wrong key group"):
        op.backend.restore("s", (kg + 1) % M, table, verify=True)
    op.backend.restore("s", kg, table, verify=True)
    assert op.backend.columnar is not None and op.backend.columnar.key_kind == "string"
    assert dict(op.backend.items("s")) == dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))
    assert all(not by_kg for by_kg in op.backend.capture(2).values())  # restored keys are not dirty
