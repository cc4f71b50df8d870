"""The vectorized aggregate (abs/runtime/aggregate.py): the columnar path for integer keys must
behave exactly like the dict-based KeyedStateBackend path (emitted updates, captured deltas
under any capture/confirm/abort sequence, table encoding), snapshots must restore across the
two paths, results must match pyarrow's group_by (nulls, NaN), and other keys must take the
dict path. String and binary keys on the columnar path: tests/test_aggregate_strings.py."""
from __future__ import annotations

import math
import pickle
import types

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import abs
from abs.errors import StateError
from abs.keygroups import key_group, key_group_range, key_groups
from abs.state import AggregateBackend, ColumnarKeyedState
from abs.state.keyindex import IntKeyIndex, SlotMap, _by_home, representatives
from abs.runtime.operators import AggregateOp, build_operator
from storage import SnapshotStore

M = 8  # max parallelism: a handful of key groups
INT_AGGS = {"s": ("v", "sum"), "n": ("v", "count"), "lo": ("v", "min"), "hi": ("v", "max"), "avg": ("v", "mean")}
FLOAT_AGGS = {"s": ("f", "sum"), "n": ("f", "count"), "lo": ("f", "min"), "hi": ("f", "max"), "avg": ("f", "mean")}


class DictAggregateOp(AggregateOp):
    columnar = False


def make_op(aggs=INT_AGGS, *, columnar=True, emit="updates", value_type=pa.int64(), parallelism=1, subtask=0, m=M):
    flow = abs.Dataflow("agg-test")
    src = flow.source("src", abs.GeneratorSource(10, num_keys=3))
    src.key_by("k").aggregate("agg", aggs, emit=emit, value_type=value_type)
    node = next(n for n in flow.nodes if n.kind == "aggregate")
    ctx = types.SimpleNamespace(subtask=subtask, parallelism=parallelism, max_parallelism=m,
                                key_group_range=key_group_range(m, parallelism, subtask), send_to_driver=None)
    op = build_operator(node, ctx) if columnar else DictAggregateOp(node, ctx)
    op.open()
    out: list = []
    op.outputs = [out.append]
    op.collected = out
    return op


def batch(keys, values, key_type=pa.int64(), value_type=pa.int64(), col="v"):
    return pa.RecordBatch.from_arrays([pa.array(keys, key_type), pa.array(values, value_type)], names=["k", col])


def feed(op, b):
    """Process one batch; return the update batch it emitted (or None)."""
    before = len(op.collected)
    op.process(b)
    new = op.collected[before:]
    assert len(new) <= 1
    return new[0] if new else None


def norm(v):
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return v


def rows_of(rb):
    """(schema, rows sorted by key): Arrow's hash group-by (the dict path) orders groups
    mostly, not always, by first appearance; the columnar path always does."""
    if rb is None:
        return None
    cols = rb.schema.names
    rows = [tuple(norm(x) for x in r) for r in zip(*(rb.column(c).to_pylist() for c in cols))]
    return rb.schema, sorted(rows, key=lambda r: r[0])


def as_table(delta):
    return delta if isinstance(delta, pa.Table) else delta.to_table()


def canon_deltas(deltas):
    """state -> kg -> (schema incl. metadata, rows sorted by key)."""
    out = {}
    for state, by_kg in deltas.items():
        out[state] = {}
        for kg, d in by_kg.items():
            t = as_table(d)
            rows = sorted(zip(t.column("key").to_pylist(), map(norm, t.column("value").to_pylist()), t.column("op").to_pylist()))
            out[state][kg] = (t.schema, rows)
    return out


def assert_same_deltas(a, b):
    ca, cb = canon_deltas(a), canon_deltas(b)
    assert ca.keys() == cb.keys()
    for state in ca:
        assert ca[state].keys() == cb[state].keys(), state
        for kg in ca[state]:
            sa, ra = ca[state][kg]
            sb, rb = cb[state][kg]
            assert sa.equals(sb, check_metadata=True), (state, kg, sa, sb)
            assert ra == rb, (state, kg)


def state_dict(op, name):
    """Live contents of one state (via a full capture on a copy-free path: items())."""
    return {k: norm(v) for k, v in op.backend.items(name)}


# ----------------------------------------------------------------------------- equivalence

POOL = [0, 1, 2, 3, 5, 8, 13, -1, -7, 1000, 2**40, -(2**62), 2**63 - 1, -(2**63), 77, 78, 79]
INT_VALUES = st.one_of(st.none(), st.integers(-50, 50))
FLOAT_VALUES = st.one_of(st.none(), st.just(float("nan")), st.integers(-40, 40).map(lambda i: i / 2))


def batches_of(values, pool=POOL):
    return st.lists(st.tuples(st.sampled_from(pool), values), max_size=30)


def op_sequences(values, pool=POOL):
    return st.lists(
        st.one_of(
            st.tuples(st.just("batch"), batches_of(values, pool)),
            st.tuples(st.just("capture"), st.booleans(), st.integers(1, 2)),
            st.tuples(st.just("full"), st.integers(1, 2)),
            st.tuples(st.just("confirm"), st.integers(0, 4)),
            st.tuples(st.just("abort"), st.integers(0, 4)),
        ),
        max_size=30,
    )


def run_both(ops, aggs, value_type, col, arrow_value_type, key_type=pa.int64()):
    col_op = make_op(aggs, value_type=value_type)
    dict_op = make_op(aggs, columnar=False, value_type=value_type)
    assert col_op.backend.columnar is not None and dict_op.backend.columnar is None
    next_id = 1
    captured: list[int] = []
    for step in ops:
        kind = step[0]
        if kind == "batch":
            keys = [k for k, _ in step[1]]
            vals = [v for _, v in step[1]]
            b = batch(keys, vals, key_type=key_type, value_type=arrow_value_type, col=col)
            got = feed(col_op, b)
            assert rows_of(got) == rows_of(feed(dict_op, b))
            if got is not None:  # one row per distinct key, in order of first appearance
                assert got.column("key").to_pylist() == list(dict.fromkeys(keys))
        elif kind in ("capture", "full"):
            next_id += step[-1]  # ids increase, sometimes with gaps
            if kind == "capture":
                lazy = step[1]
                a = col_op.backend.capture(next_id, lazy=lazy)
                b = dict_op.backend.capture(next_id, lazy=lazy)
            else:
                a = col_op.backend.capture_full(next_id)
                b = dict_op.backend.capture_full(next_id)
            assert_same_deltas(a, b)
            captured.append(next_id)
        elif kind == "confirm":
            cid = (captured[-1 - step[1] % len(captured)] if captured else next_id) if step[1] < 4 else next_id + 1
            col_op.backend.confirm(cid)
            dict_op.backend.confirm(cid)
            next_id = max(next_id, cid)  # later capture ids must exceed confirmed ones
        else:
            cid = captured[-1 - step[1] % len(captured)] if captured else next_id
            col_op.backend.abort(cid)
            dict_op.backend.abort(cid)
        assert col_op.backend.pending_captures == dict_op.backend.pending_captures
        assert col_op.backend.last_confirmed == dict_op.backend.last_confirmed
    next_id += 1
    assert_same_deltas(col_op.backend.capture(next_id), dict_op.backend.capture(next_id))
    next_id += 1
    assert_same_deltas(col_op.backend.capture_full(next_id), dict_op.backend.capture_full(next_id))
    assert col_op.backend.columnar is not None  # never fell back


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(op_sequences(INT_VALUES))
def test_columnar_and_dict_paths_agree_on_int_values(ops):
    run_both(ops, INT_AGGS, pa.int64(), "v", pa.int64())


@SETTINGS
@given(op_sequences(FLOAT_VALUES))
def test_columnar_and_dict_paths_agree_on_float_values_with_nan(ops):
    # halves in a small range: every sum is exact in float64, so both paths agree bit for bit
    run_both(ops, FLOAT_AGGS, pa.float64(), "f", pa.float64())


def test_capture_semantics_follow_confirmations_out_of_order_and_aborts():
    op = make_op({"s": ("v", "sum")}, emit="none")
    b = op.backend
    feed(op, batch([1, 2], [1, 1]))
    assert {k for t in b.capture(1).get("s").values() for k in t.column("key").to_pylist()} == {1, 2}
    feed(op, batch([3], [1]))
    assert _keys(b.capture(2)) == {1, 2, 3}  # 1 unconfirmed: still included
    feed(op, batch([4], [1]))
    b.abort(2)
    assert _keys(b.capture(3)) == {1, 2, 3, 4}
    b.confirm(1)  # forgets what 1 captured only
    feed(op, batch([5], [1]))
    assert _keys(b.capture(4)) == {3, 4, 5}
    b.confirm(4)
    b.confirm(3)  # late, older: harmless
    assert _keys(b.capture(5)) == set()
    feed(op, batch([1], [1]))
    b.confirm(7)  # implies nothing pending; 1 stays changed
    assert _keys(b.capture(8)) == {1}
    with pytest.raises(StateError):
        b.capture(8)
    with pytest.raises(StateError):
        b.capture(6)


def test_many_unconfirmed_captures_keep_exact_deltas():
    # captures that are never confirmed (storage failing): the per-epoch lists are dropped
    # past a size and captures scan; the deltas must stay those of the dict path
    ops = [make_op({"s": ("v", "sum")}, emit="none"), make_op({"s": ("v", "sum")}, emit="none", columnar=False)]
    rng = np.random.default_rng(9)
    for cid in range(1, 13):
        b = batch(rng.integers(0, 40, 60).tolist(), [1] * 60) if cid < 8 else batch([cid], [1])
        for op in ops:
            feed(op, b)
        assert_same_deltas(ops[0].backend.capture(cid), ops[1].backend.capture(cid))
        if cid == 9:
            for op in ops:
                op.backend.confirm(4)  # an old one: later changes stay
        if cid == 10:
            for op in ops:
                op.backend.abort(10)
    for op in ops:
        op.backend.confirm(11)
        feed(op, batch([3], [1]))
    assert_same_deltas(ops[0].backend.capture(13), ops[1].backend.capture(13))
    assert _keys(ops[0].backend.capture(14)) == {3, 12}


def _keys(deltas):
    out = set()
    for d in deltas["s"].values():
        t = as_table(d)
        keys = t.column("key").to_pylist()
        if t.schema.metadata[b"abs.key_encoding"] == b"pickle":
            keys = [pickle.loads(k) for k in keys]
        out.update(keys)
    return out


def test_lazy_capture_is_frozen_at_the_barrier():
    op = make_op({"s": ("v", "sum")}, emit="none")
    feed(op, batch(list(range(50)), [1] * 50))
    lazy = op.backend.capture(1, lazy=True)
    assert not any(isinstance(d, pa.Table) for d in lazy["s"].values())
    feed(op, batch(list(range(50)), [100] * 50))
    got = {}
    for kg, d in lazy["s"].items():
        t = d.to_table()
        assert set(key_groups(np.array(t.column("key").to_pylist(), np.int64), M).tolist()) == {kg}
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == {k: 1 for k in range(50)}
    # nulls too, when every key changed (copied wholesale) and when a few did (gathered)
    for keys in ([1, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]):
        op = make_op({"s": ("v", "sum")}, emit="none")
        feed(op, batch(list(range(1, 11)), [None] + [1] * 9))
        op.backend.capture(1)
        op.backend.confirm(1)
        feed(op, batch(keys, [None] * len(keys)))
        lazy = op.backend.capture(2, lazy=True)
        feed(op, batch([1], [5]))
        got = {}
        for d in lazy["s"].values():
            t = d.to_table()
            got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        assert got == {k: (None if k == 1 else 1) for k in keys}


def test_a_lazy_capture_pickles_each_key_group_with_its_own_rows_only():
    """What the writer process receives: each key group's delta carries its own rows, not the
    whole capture (pyarrow pickles a slice of an array with its parent's whole buffers, which
    made a checkpoint of 1M keys send 128 times the state through the writer's pipe)."""
    from abs.state import ColumnDelta

    op = make_op({"s": ("v", "sum"), "n": ("v", "count")}, emit="none")
    keys = list(range(4000))
    feed(op, batch(keys, [1] * len(keys)))
    for lazy in (op.backend.capture(1, lazy=True), op.backend.capture_full(2)):
        for name, by_kg in lazy.items():
            assert len(by_kg) == M
            buffers: list = []
            blob = pickle.dumps(list(by_kg.values()), protocol=5, buffer_callback=buffers.append)
            shipped = len(blob) + sum(b.raw().nbytes for b in buffers)
            assert shipped < 1.5 * len(keys) * 17, f"{name}: {shipped} bytes for {len(keys)} keys"
            back = pickle.loads(blob, buffers=buffers)
            for kg, delta in zip(by_kg, back):
                t = delta if isinstance(delta, pa.Table) else delta.to_table()
                assert isinstance(delta, (ColumnDelta, pa.Table))
                assert set(key_groups(np.array(t.column("key").to_pylist(), np.int64), M).tolist()) == {kg}
                assert t.column("value").to_pylist() == [1] * t.num_rows


def test_full_captures_follow_new_keys_and_new_values_with_the_kept_order():
    """Captures of every slot reuse the store's order by key group until a key is added."""
    op = make_op({"s": ("v", "sum")}, emit="none")
    live: dict = {}

    def fold(keys, value):
        feed(op, batch(keys, [value] * len(keys)))
        for k in keys:
            live[k] = live.get(k, 0) + value

    def captured(deltas):
        got = {}
        for kg, d in deltas["s"].items():
            t = d if isinstance(d, pa.Table) else d.to_table()
            assert set(key_groups(np.array(t.column("key").to_pylist(), np.int64), M).tolist()) <= {kg}
            got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        return got

    fold(list(range(0, 300, 3)), 1)
    for cid, (keys, value) in enumerate([(list(range(0, 300, 3)), 2),  # same keys: the kept order
                                         (list(range(0, 400, 3)) + [1000, 7], 3),  # new keys: sorted again
                                         (list(range(0, 400, 3)) + [1000, 7], 4)], start=1):
        assert captured(op.backend.capture(cid, lazy=True)) == live
        op.backend.confirm(cid)
        fold(keys, value)
    assert captured(op.backend.capture_full(9)) == live


# ----------------------------------------------------------------------------- results


def test_sum_count_min_max_mean_with_nulls_match_pyarrow_group_by():
    rng = np.random.default_rng(3)
    n = 3000
    keys = rng.integers(0, 40, n)
    ints = [None if x % 7 == 0 else int(x) - 500 for x in rng.integers(0, 1000, n)]
    floats = [None if i % 11 == 0 else (float("nan") if i % 13 == 0 else float(x)) for i, x in enumerate(rng.normal(size=n))]
    keys[:5] = 99  # key 99: only null values
    for i in range(5):
        ints[i] = None
        floats[i] = None
    full = pa.table({"k": keys, "v": pa.array(ints, pa.int64()), "f": pa.array(floats, pa.float64())})
    for aggs, col, vt in ((INT_AGGS, "v", pa.int64()), (FLOAT_AGGS, "f", pa.float64())):
        op = make_op(aggs, value_type=vt, emit="none")
        for off in range(0, n, 256):
            op.process(full.slice(off, 256).to_batches()[0])
        assert op.backend.columnar is not None
        expected = full.group_by("k").aggregate([(col, "sum"), (col, "count"), (col, "min"), (col, "max"), (col, "mean")])
        exp = {r["k"]: r for r in expected.to_pylist()}
        got = {name: dict(op.backend.items(name)) for name in ("s", "n", "lo", "hi", "avg.sum", "avg.count")}
        assert set(got["s"]) == set(exp)
        for k, r in exp.items():
            assert got["n"][k] == r[f"{col}_count"] == got["avg.count"][k]
            for name, fn in (("lo", "min"), ("hi", "max")):
                assert norm(got[name][k]) == norm(r[f"{col}_{fn}"]), (k, fn)
            if r[f"{col}_sum"] is None:
                assert got["s"][k] is None and got["avg.sum"][k] is None
            else:
                assert got["s"][k] == pytest.approx(r[f"{col}_sum"], nan_ok=True)
                assert got["avg.sum"][k] / got["avg.count"][k] == pytest.approx(r[f"{col}_mean"], nan_ok=True)
        assert got["s"][99] is None and got["n"][99] == 0 and got["lo"][99] is None


def test_updates_are_one_row_per_key_in_first_appearance_order_with_nulls():
    op = make_op(INT_AGGS)
    out = feed(op, batch([5, 3, 5, 9], [1, None, 4, None]))
    assert out.schema.names == ["key", "s", "n", "lo", "hi", "avg"]
    assert out.column("key").to_pylist() == [5, 3, 9]
    assert out.column("s").to_pylist() == [5, None, None]
    assert out.column("n").to_pylist() == [2, 0, 0]
    assert out.column("lo").to_pylist() == [1, None, None]
    assert out.column("hi").to_pylist() == [4, None, None]
    assert out.column("avg").to_pylist() == [2.5, None, None]
    out = feed(op, batch([3, 5], [7, None]))
    assert out.column("key").to_pylist() == [3, 5]
    assert out.column("s").to_pylist() == [7, 5]
    assert out.column("avg").to_pylist() == [7.0, 2.5]
    # the key column keeps its Arrow type
    op32 = make_op({"s": ("v", "sum")})
    out = feed(op32, batch([1, 2, 1], [1, 2, 3], key_type=pa.int32()))
    assert out.schema.field("key").type == pa.int32()
    assert op32.backend.columnar is not None


def test_sum_of_int_column_kept_as_float_and_narrow_types():
    op = make_op({"s": ("v", "sum"), "lo": ("v", "min")}, value_type=pa.float32(), emit="updates")
    out = feed(op, batch([1, 1, 2], [1, 2, 3], value_type=pa.int16()))
    assert out.column("s").type == pa.float64() and out.column("s").to_pylist() == [3.0, 3.0]
    t = op.backend.capture_full(1)["s"]
    assert all(x.schema.field("value").type == pa.float32() for x in t.values())
    d = make_op({"s": ("v", "sum"), "lo": ("v", "min")}, value_type=pa.float32(), columnar=False)
    assert rows_of(feed(d, batch([1, 1, 2], [1, 2, 3], value_type=pa.int16()))) == rows_of(out)
    assert_same_deltas(op.backend.capture_full(2), d.backend.capture_full(2))


def test_value_not_fitting_the_declared_type_fails_the_capture():
    op = make_op({"s": ("v", "sum")}, value_type=pa.int8(), emit="none")
    feed(op, batch([1, 1], [100, 100]))
    with pytest.raises(StateError, match="does not fit"):
        op.backend.capture(1)


def test_int64_sum_that_could_wrap_is_refused():
    op = make_op({"s": ("v", "sum")}, emit="none")
    feed(op, batch([1, 2], [2**62, 2**62]))
    feed(op, batch([1], [2**61]))  # 3 * 2**61: fits
    with pytest.raises(StateError, match="int64 range"):
        feed(op, batch([1], [2**62]))
    assert dict(op.backend.items("s")) == {1: 3 * 2**61, 2: 2**62}


# ----------------------------------------------------------------------------- restore


def string_key(k: int) -> str:
    """A string key for ``k``: short ones (exact codes in the store's index) and long ones
    (hashed codes)."""
    return f"k{k}" if k % 2 else f"customer-{k:+06d}"


def random_batches(seed, n=12, keys=60, strings=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        size = int(rng.integers(1, 80))
        ks = rng.integers(-keys // 2, keys // 2, size).tolist()
        vs = [None if x < -40 else int(x) for x in rng.integers(-50, 50, size)]
        if strings:
            out.append(batch([string_key(k) for k in ks], vs, key_type=pa.string()))
        else:
            out.append(batch(ks, vs))
    return out


@pytest.mark.parametrize("strings", [False, True], ids=["int keys", "string keys"])
@pytest.mark.parametrize("src_columnar,dst_columnar", [(True, False), (False, True), (True, True), (False, False)])
def test_restore_round_trip_between_paths(src_columnar, dst_columnar, strings):
    src = make_op(columnar=src_columnar)
    for b in random_batches(1, strings=strings):
        feed(src, b)
    snap = src.backend.capture_full(1)
    for p in (1, 2):  # also split over two subtasks
        dsts = [make_op(columnar=dst_columnar, parallelism=p, subtask=i) for i in range(p)]
        for dst in dsts:
            for state, by_kg in snap.items():
                for kg, table in by_kg.items():
                    if kg in dst.key_group_range:
                        dst.backend.restore(state, kg, table, verify=True)
            assert (dst.backend.columnar is not None) == dst_columnar
            # restored keys are not dirty
            assert all(not by_kg for by_kg in dst.backend.capture(1).values())
        live = make_op(columnar=not dst_columnar)
        for state, by_kg in snap.items():
            for kg, table in by_kg.items():
                live.backend.restore(state, kg, table)
        for b in random_batches(2, strings=strings):
            routed = []
            for dst in dsts:
                g = key_groups(b.column("k"), M)
                mask = (g >= dst.key_group_range.start) & (g <= dst.key_group_range.end)
                sub = b.filter(pa.array(mask))
                if sub.num_rows:
                    routed.append(rows_of(feed(dst, sub))[1])
            want = rows_of(feed(live, b))[1]
            assert sorted(r for rows in routed for r in rows) == sorted(want)
        merged = {}
        for dst in dsts:
            for state, by_kg in dst.backend.capture_full(5).items():
                merged.setdefault(state, {}).update(by_kg)
        assert_same_deltas(merged, live.backend.capture_full(5))


@pytest.mark.parametrize("columnar", [True, False])
def test_aggregation_added_on_restore_gets_entries_for_restored_keys(columnar):
    old = make_op({"s": ("v", "sum")})
    feed(old, batch([1, 2, 3], [1, 2, 3]))
    snap = old.backend.capture_full(1)
    new_aggs = {"s": ("v", "sum"), "hi": ("v", "max")}
    ops = [make_op(new_aggs, columnar=columnar), make_op(new_aggs, columnar=False)]
    for op in ops:
        for kg, t in snap["s"].items():
            op.backend.restore("s", kg, t)
        assert dict(op.backend.items("hi")) == {}
        feed(op, batch([2, 4], [10, 4]))
    for op in ops:
        assert dict(op.backend.items("hi")) == {2: 10, 4: 4}
        assert dict(op.backend.items("s")) == {1: 1, 2: 12, 3: 3, 4: 4}
    assert_same_deltas(ops[0].backend.capture_full(2), ops[1].backend.capture_full(2))


def test_restore_checks_like_the_dict_backend():
    op = make_op({"s": ("v", "sum")})
    good = make_op({"s": ("v", "sum")})
    feed(good, batch([1, 2, 3], [1, 2, 3]))
    kg, table = next(iter(good.backend.capture_full(1)["s"].items()))
    with pytest.raises(StateError, match="wrong key group"):
        op.backend.restore("s", (kg + 1) % M, table, verify=True)
    with pytest.raises(StateError, match="no state named"):
        op.backend.restore("nope", kg, table)
    bad_kind = table.replace_schema_metadata({**table.schema.metadata, b"abs.state_kind": b"list"})
    with pytest.raises(StateError, match="list state"):
        op.backend.restore("s", kg, bad_kind)
    deletes = table.set_column(2, "op", pa.array([1] * table.num_rows, pa.int8()))
    with pytest.raises(StateError, match="deletes"):
        op.backend.restore("s", kg, deletes)
    assert op.backend.columnar is not None


@pytest.mark.parametrize("strings", [False, True], ids=["int keys", "string keys"])
def test_incremental_checkpoints_through_the_snapshot_store_restore_into_both_paths(tmp_path, strings):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "agg-test", "max_parallelism": M})
    op = make_op(emit="none")
    cid = 0
    for i, b in enumerate(random_batches(7, n=20, strings=strings)):
        feed(op, b)
        if i % 3 == 2:
            cid += 1
            snap = op.snapshot(cid)
            chains = {s: dict(c) for s, c in snap.prev_chains.items()}
            for state, by_kg in snap.deltas.items():
                for kg, d in by_kg.items():
                    chains[state][kg] = store.write_key_group(cid, "agg", state, kg, snap.prev_chains[state].get(kg, []), as_table(d))
            snap.on_chains(cid, chains)
            if i % 2:
                op.notify_complete(cid)  # every other checkpoint completes
            else:
                op.notify_abort(cid)
    last_chains = op.confirmed_chains
    for columnar in (True, False):
        restored = make_op(columnar=columnar, emit="none")
        restored.restore(last_chains, store.read_chain)
        assert (restored.backend.columnar is not None) == columnar
        for state in ("s", "n", "lo", "hi", "avg.sum", "avg.count"):
            live = {}
            for kg, chain in last_chains[state].items():
                t = store.read_chain(chain)
                live.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
            assert dict(restored.backend.items(state)) == live


@pytest.mark.parametrize("strings", [False, True], ids=["int keys", "string keys"])
def test_snapshot_after_restore_is_consistent_with_the_live_operator(tmp_path, strings):
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "agg-test", "max_parallelism": M})
    op = make_op(emit="none")
    batches = random_batches(11, n=10, strings=strings)
    chains = {s: {} for s in op.confirmed_chains}
    for cid, b in enumerate(batches, start=1):
        feed(op, b)
        snap = op.snapshot(cid)
        chains = {s: dict(c) for s, c in snap.prev_chains.items()}
        for state, by_kg in snap.deltas.items():
            for kg, d in by_kg.items():
                chains[state][kg] = store.write_key_group(cid, "agg", state, kg, snap.prev_chains[state].get(kg, []), as_table(d))
        snap.on_chains(cid, chains)
        op.notify_complete(cid)
    want = {s: dict(op.backend.items(s)) for s in chains}
    for columnar in (True, False):
        r = make_op(columnar=columnar, emit="none")
        r.restore(chains, store.read_chain)
        assert {s: dict(r.backend.items(s)) for s in chains} == want


# ----------------------------------------------------------------------------- fallback


def test_string_keys_on_the_dict_path_write_string_key_columns():
    op = make_op({"s": ("v", "sum"), "avg": ("v", "mean")}, columnar=False)
    out = feed(op, batch(["a", "b", "a"], [1, 2, 3], key_type=pa.string()))
    assert op.backend.columnar is None
    assert out.column("key").to_pylist() == ["a", "b"]
    assert out.column("s").to_pylist() == [4, 2]
    assert out.column("avg").to_pylist() == [2.0, 2.0]
    deltas = op.backend.capture(1)
    t = pa.concat_tables(as_table(d) for d in deltas["s"].values())
    assert t.schema.field("key").type == pa.string()
    assert dict(zip(t.column("key").to_pylist(), t.column("value").to_pylist())) == {"a": 4, "b": 2}


def test_string_keys_fold_like_int_keys_with_nulls_nan_and_new_keys():
    """The dict path folds a key group's partial results with numpy (Column.fold) and falls
    back to key-by-key merges where it must: either way it agrees with the columnar path (float
    sums to the last bits, which depend on the order of the additions)."""

    def same(a, b):
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)
        return a == b

    def agree(got: dict, want: dict) -> bool:
        return got.keys() == want.keys() and all(
            all(same(x, y) for x, y in zip(got[k], want[k])) for k in want)

    rng = np.random.default_rng(11)
    for aggs, col, vtype in ((INT_AGGS, "v", pa.int64()), (FLOAT_AGGS, "f", pa.float64())):
        value_type = pa.float64() if col == "f" else pa.int64()
        by_str = make_op(aggs, value_type=value_type, columnar=False)  # the dict path's fold
        by_int = make_op(aggs, value_type=value_type)
        for i in range(15):
            size = int(rng.integers(1, 90))
            ks = rng.integers(0, 70, size).tolist()
            nulls = 0.0 if i < 8 else 0.1  # the first batches fold with numpy throughout
            if col == "f":
                vs = [None if x < nulls else (math.nan if x > 0.95 else float(x)) for x in rng.random(size)]
            else:
                vs = [None if x < nulls else int(50 - 100 * x) for x in rng.random(size)]
            got = feed(by_str, batch([f"k{k}" for k in ks], vs, key_type=pa.string(), value_type=vtype, col=col))
            want = feed(by_int, batch(ks, vs, value_type=vtype, col=col))
            assert agree({r[0]: r[1:] for r in zip(*(got.column(c).to_pylist() for c in got.schema.names))},
                         {f"k{r[0]}": r[1:] for r in zip(*(want.column(c).to_pylist() for c in want.schema.names))})
        assert by_str.backend.columnar is None and by_int.backend.columnar is not None
        for state in by_int.backend.descriptors:
            assert agree({k: (v,) for k, v in by_str.backend.items(state.name)},
                         {f"k{k}": (v,) for k, v in by_int.backend.items(state.name)}), state.name


def test_string_keyed_sums_near_the_int64_limit_merge_key_by_key_and_fail_past_it():
    op = make_op({"s": ("v", "sum")}, emit="none", columnar=False)
    feed(op, batch(["a", "b"], [2**62, 2**62], key_type=pa.string()))
    feed(op, batch(["a", "c"], [2**61, 5], key_type=pa.string()))  # past 2**62: key by key, exact
    assert dict(op.backend.items("s")) == {"a": 3 * 2**61, "b": 2**62, "c": 5}
    with pytest.raises(StateError, match="does not fit"):
        feed(op, batch(["a"], [2**62], key_type=pa.string()))


def test_restoring_string_keyed_state_into_an_int_keyed_store_moves_to_the_dict_path():
    src = make_op({"s": ("v", "sum")})
    feed(src, batch(["x", "y"], [1, 2], key_type=pa.string()))
    assert src.backend.columnar is not None  # string keys stay columnar
    dst = make_op({"s": ("v", "sum")})
    feed(dst, batch([7], [3]))
    for kg, t in src.backend.capture_full(1)["s"].items():
        dst.backend.restore("s", kg, t)
    assert dst.backend.columnar is None
    assert dict(dst.backend.items("s")) == {"x": 1, "y": 2, 7: 3}


@pytest.mark.parametrize("second", ["string", "null", "huge_uint64"])
def test_migration_to_the_dict_path_keeps_state_and_unconfirmed_changes(second):
    op = make_op({"s": ("v", "sum")}, emit="none")
    ref = make_op({"s": ("v", "sum")}, emit="none", columnar=False)
    for o in (op, ref):
        feed(o, batch([1, 2, 3], [1, 2, 3]))
        o.backend.capture(1)
        feed(o, batch([4], [4]))
        o.backend.capture(2)
        o.backend.confirm(1)
        feed(o, batch([5], [5]))
    if second == "string":
        b = batch(["z"], [9], key_type=pa.string())
    elif second == "null":
        b = batch([None, 1], [9, 1])
    else:
        b = batch([2**64 - 1, 1], [9, 1], key_type=pa.uint64())
    feed(op, b)
    assert op.backend.columnar is None
    feed(ref, b)
    want = dict(ref.backend.items("s"))
    assert dict(op.backend.items("s")) == want
    # everything changed since checkpoint 1 (the last confirmed) is in the next delta
    got = _keys(op.backend.capture(3))
    assert got >= _keys(ref.backend.capture(3))
    assert {4, 5} <= got and not got & {2, 3}


def test_key_outside_the_subtask_range_is_refused():
    op = make_op({"s": ("v", "sum")}, parallelism=2, subtask=0)
    outside = next(k for k in range(100) if key_group(k, M) not in op.key_group_range)
    with pytest.raises(StateError, match="outside this subtask's range"):
        feed(op, batch([outside], [1]))


# ----------------------------------------------------------------------------- the index


@pytest.mark.parametrize("pattern", ["small", "random", "strided", "extremes"])
def test_int_key_index_agrees_with_a_dict(pattern):
    rng = np.random.default_rng(hash(pattern) % 1000)
    if pattern == "small":
        pool = np.arange(-40, 40)
    elif pattern == "random":
        pool = rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64)
    elif pattern == "strided":
        pool = np.arange(3000, dtype=np.int64) * 4096
    else:
        pool = np.array([-(2**63), 2**63 - 1, 0, -1, 1, 2**62, -(2**62)], np.int64)
    index = IntKeyIndex(16)
    known: dict = {}
    for _ in range(40):
        q = rng.choice(pool, int(rng.integers(1, 400)))
        slots, ends = index.lookup(q)
        assert slots.tolist() == [known.get(k, -1) for k in q.tolist()]
        miss = slots < 0
        if miss.any():
            new, inverse = np.unique(q[miss], return_inverse=True)
            start = np.empty(len(new), np.int64)
            start[inverse] = ends[miss]
            ids = np.arange(len(known), len(known) + len(new))
            known.update(zip(new.tolist(), ids.tolist()))
            if 2 * len(known) > index.cap or not index.insert(new, ids, start):
                index = IntKeyIndex(4 * len(known))
                index.build(np.array(list(known), np.int64), np.array(list(known.values()), np.int64))
    everything = np.array(list(known), np.int64)
    assert index.lookup(everything)[0].tolist() == list(known.values())


@pytest.mark.parametrize("pattern", ["dense0", "dense_offset", "growing", "negative", "mixed", "sparse_then_dense", "takeover"])
def test_slot_map_dense_range_and_hash_agree_with_a_dict(pattern):
    rng = np.random.default_rng(len(pattern))
    huge = rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64)

    def draw(step):
        if pattern == "dense0":
            return rng.integers(0, 5000, 300)
        if pattern == "dense_offset":
            return rng.integers(10**12, 10**12 + 3000, 300)
        if pattern == "growing":
            return rng.integers(0, 2000 * (step + 1) ** 2, 300)  # the dense range keeps doubling
        if pattern == "negative":
            return rng.integers(-3000, 3000, 300)
        if pattern == "mixed":
            return np.concatenate((rng.integers(0, 3000, 150), rng.choice(huge, 150)))
        if pattern == "takeover":  # keys beyond the dense range (hash) until it grows over them
            if step == 0:
                return np.arange(10)
            if step == 1:
                return 200_000 + np.arange(300)
            return np.concatenate((rng.integers(0, 10_000 * step, 5000), 200_000 + rng.integers(0, 300, 50)))
        # far keys first (hash), then dense ones
        return rng.choice(huge, 300) if step < 5 else rng.integers(0, 70_000 * (step - 4), 300)

    m = SlotMap()
    known: dict = {}
    all_keys = np.zeros(0, np.int64)
    for step in range(25):
        q = draw(step).astype(np.int64)
        slots, ends = m.find(q)
        assert slots.tolist() == [known.get(k, -1) for k in q.tolist()], step
        miss = slots < 0
        if miss.any():
            new, inverse = np.unique(q[miss], return_inverse=True)
            start = None
            if ends is not None:
                start = np.empty(len(new), np.int64)
                start[inverse] = ends[miss]
            ids = np.arange(len(known), len(known) + len(new))
            known.update(zip(new.tolist(), ids.tolist()))
            all_keys = np.concatenate((all_keys, new))
            m.place(all_keys, new, ids, start)
    assert m.find(all_keys)[0].tolist() == list(range(len(all_keys)))
    if pattern in ("dense0", "growing", "dense_offset", "sparse_then_dense", "takeover"):
        assert m.direct is not None
    if pattern == "takeover":
        assert m.base + len(m.direct) > 200_300  # the range took the hashed keys over


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 70_000), min_size=1, max_size=300), st.sampled_from([0, 5, -(2**40), 2**61]),
       st.lists(st.integers(0, 2**62), max_size=3))
@example([0, 65535], 0, []).via("the last key of the range")
@example([0, 65536], 0, []).via("one past it")
def test_fill_direct_places_dense_keys_as_place_does_and_names_the_repeated_ones(keys, shift, far):
    """A fresh map's fill_direct: keys[i] -> i where the dense range place() would use covers
    them all (else None, the map untouched); rows of a key given twice come back with the row
    their key finds, and every key finds a row holding it."""
    k = np.array(keys + far, np.int64) + np.int64(shift)
    m = SlotMap()
    placed = m.fill_direct(k)
    if len(np.unique(k)) == len(k):  # as place() would: all keys in its dense range, or None
        plain = SlotMap()
        plain.place(k, k, np.arange(len(k)), None)
        assert (placed is not None) == (plain.direct is not None and not plain.hash.size)
    if placed is None:
        assert m.direct is None and not m.hash.size
        return
    found = m.find(k)[0]
    assert (k[found] == k).all()
    twice, owners = placed
    assert twice.tolist() == np.flatnonzero(found != np.arange(len(k))).tolist()
    assert owners.tolist() == found[twice].tolist()
    assert len(twice) == len(k) - len(np.unique(k))


@pytest.mark.parametrize("bits", [4, 16, 17, 20, 32, 33])
def test_home_positions_are_ordered_by_radix_passes_up_to_2_to_the_32(bits):
    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 5000):
        home = rng.integers(0, 1 << bits, n)
        order = _by_home(home, 1 << bits)
        assert np.array_equal(np.sort(order), np.arange(n))
        assert np.array_equal(home[order], np.sort(home))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300), st.integers(1, 3000),
       st.sampled_from([1, 7, 64, 2**32 + 1, 2**56]))
def test_representatives_give_one_row_of_each_distinct_value_and_its_index(pool, n, scale):
    rng = np.random.default_rng(n)
    values = np.array(pool, np.int64) if pool else np.zeros(1, np.int64)
    x = values[rng.integers(0, len(values), n)] * np.int64(scale)  # many repeats; and keys a stride apart
    rows, inverse = representatives(x)
    assert len(rows) == len(np.unique(x))
    assert np.array_equal(np.sort(x[rows]), np.unique(x))  # each distinct value once
    assert np.array_equal(x[rows][inverse], x)  # every element points at a row of its own value


def test_many_keys_grow_the_store_and_capture_only_what_changed():
    op = make_op({"s": ("v", "sum")}, emit="none")
    keys = np.arange(50_000, dtype=np.int64) * 7919
    for off in range(0, len(keys), 4096):
        op.process(batch(keys[off:off + 4096], np.ones(min(4096, len(keys) - off), np.int64)))
    b = op.backend
    assert b.columnar.n == 50_000
    assert sum(t.num_rows for t in b.capture(1)["s"].values()) == 50_000
    b.confirm(1)
    feed(op, batch(keys[::1000], np.ones(50, np.int64)))
    d = b.capture(2)["s"]
    assert sorted(k for t in d.values() for k in t.column("key").to_pylist()) == sorted(keys[::1000].tolist())
    assert dict(b.items("s"))[int(keys[0])] == 2
    assert isinstance(b, AggregateBackend) and isinstance(b.columnar, ColumnarKeyedState)
