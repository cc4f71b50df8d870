"""The writer's shortcuts for small key groups (a job with a large max parallelism: a few keys
a key group) give exactly what the general path gives.

- a columnar key group's full image written as a base straight from its capture
  (:meth:`abs.state.ColumnDelta.base`) encodes to the same bytes as the delta folded by
  :func:`storage.chains.resolve_chain`; where its keys have no order, it is not offered;
- order checks and the sort of few ``str``/``bytes`` keys in Python agree with Arrow's;
- a delta table already normalized is kept as it is, and a bad ``op`` column still refused;
- a checkpoint of thousands of key groups of a few keys each restores exactly.
"""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.columns import Column, KeyOrders
from abs.runtime.messages import WriteJob
from abs.runtime.writer import write_jobs
from abs.state import ColumnDelta
from storage import CheckpointSession, DeltaSchemaError, Manifest, SnapshotStore
from storage.chains import _text_strictly_increasing
from storage.format import encode_prepared
from storage.store_write import SHARE_BELOW, _encode, _encode_base
from storage.tables import SMALL_TEXT_ROWS, _keys_sorted, normalize_delta

texts = st.one_of(
    st.lists(st.text(max_size=6), max_size=SMALL_TEXT_ROWS),
    st.lists(st.binary(max_size=6), max_size=SMALL_TEXT_ROWS),
)


def _arrow_sorted(arr: pa.Array, strict: bool) -> bool:
    if len(arr) < 2:
        return True
    cmp = pc.less if strict else pc.less_equal
    return bool(pc.all(cmp(arr.slice(0, len(arr) - 1), arr.slice(1))).as_py())


@settings(max_examples=300, deadline=None)
@given(keys=texts, sort_first=st.booleans())
def test_order_checks_of_few_text_keys_agree_with_arrow(keys, sort_first):
    if sort_first:
        keys = sorted(keys)
    arr = pa.array(keys, pa.binary() if keys and isinstance(keys[0], bytes) else pa.string())
    assert _keys_sorted(pa.chunked_array([arr])) == _arrow_sorted(arr, strict=False)
    assert _text_strictly_increasing(arr) == _arrow_sorted(arr, strict=True)


@settings(max_examples=300, deadline=None)
@given(keys=texts)
def test_the_sort_of_few_text_keys_is_arrows(keys):
    keys = list(dict.fromkeys(keys))  # a full image's keys are unique
    if not keys:
        return
    order, ordered = KeyOrders().sort_text(0, keys)
    arr = pa.array(keys, pa.binary() if isinstance(keys[0], bytes) else pa.string())
    expected = pc.sort_indices(arr).to_numpy()
    assert order.tolist() == expected.tolist()
    assert ordered.equals(arr.take(pa.array(expected)))


def _column(keys: list, values: list, typecode: str = "q") -> Column:
    col = Column(typecode)
    for k, v in zip(keys, values):
        col.insert(k, v, 1)
    return col


def _same_bytes(delta: ColumnDelta) -> None:
    folded = _encode_base(normalize_delta(delta.to_table(KeyOrders(), 0), what="t"), SHARE_BELOW)
    base = delta.base(KeyOrders(), 0)
    assert base is not None and "op" not in base.schema.names
    direct = _encode(base, "base", SHARE_BELOW, sized=False)
    assert direct.table.equals(folded.table, check_metadata=True)
    assert encode_prepared(direct.table).data == encode_prepared(folded.table).data  # the file's bytes


@pytest.mark.parametrize("keys", [
    ["b", "a", "c"], ["solo"], [b"\xff", b"\x00", b"a"], ["é", "z", "日本", "a"],
    [5, -3, 2**40, 0], [7],
    [f"k{i}" for i in range(200)],  # past the small sort: Arrow's
    list(range(300, 0, -1)),
])
def test_a_full_image_written_as_a_base_from_its_capture_is_the_folded_delta(keys):
    col = _column(keys, list(range(len(keys))))
    _same_bytes(ColumnDelta(col.capture(0, full=True), pa.int64(), "value"))


def test_the_base_from_a_capture_keeps_nulls_and_pickled_values():
    col = _column(["b", "a"], [1, 2])
    col.set("b", None, 2)
    _same_bytes(ColumnDelta(col.capture(0, full=True), pa.int64(), "value"))
    objects = Column("O")
    for k, v in (("y", {"x": 1}), ("x", [2])):
        objects.insert(k, v, 1)
    _same_bytes(ColumnDelta(objects.capture(0, full=True), None, "value"))


def test_no_base_from_a_capture_that_is_not_a_full_image_or_whose_keys_have_no_order():
    col = _column(["a", "b", "c"], [1, 2, 3])
    col.delete("a", 2)
    assert ColumnDelta(col.capture(1), pa.int64(), "value").base(KeyOrders(), 0) is None  # a delete
    col = _column(list(range(100)), list(range(100)))
    col.set(5, 0, 3)
    assert ColumnDelta(col.capture(2), pa.int64(), "value").base(KeyOrders(), 0) is None  # one changed row
    mixed = _column([1, "a", b"b"], [1, 2, 3])
    assert ColumnDelta(mixed.capture(0, full=True), pa.int64(), "value").base(KeyOrders(), 0) is None


def test_a_normalized_delta_is_kept_and_a_bad_op_column_still_refused():
    table = pa.table({"key": ["a", "b"], "value": [1, 2]})
    once = normalize_delta(table, what="t")
    assert normalize_delta(once, what="t") is once
    bad = once.set_column(2, pa.field("op", pa.int8(), nullable=False), pa.array([0, 3], pa.int8()))
    with pytest.raises(DeltaSchemaError, match="other than 0"):
        normalize_delta(bad, what="t")


def test_a_write_job_pickles_to_itself():
    job = WriteJob("op", "s", 7, [], {"x": 1}, True)
    assert pickle.loads(pickle.dumps(job, protocol=5)) == job


@pytest.mark.parametrize("kind", ["string", "int"])
def test_thousands_of_small_key_groups_checkpoint_and_restore_exactly(tmp_path, kind):
    """4,096 key groups of 0 to 3 keys each, written by the writer's path (full images, then
    a checkpoint changing some of them and deleting a key), read back key group by key group."""
    mp = 4096
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": mp})
    orders, session = KeyOrders(), CheckpointSession()
    rng = np.random.default_rng(3)
    model: dict[int, dict] = {}
    cols: dict[int, Column] = {}
    for kg in range(mp):
        n = int(rng.integers(0, 4))
        keys = [f"k{kg}-{i}" if kind == "string" else kg * 10 + i for i in range(n)]
        values = rng.integers(-1000, 1000, size=n).tolist()
        if n:
            cols[kg] = _column(keys, values)
            model[kg] = dict(zip(keys, values))
    chains: dict[int, list] = {}
    for cid in (1, 2):
        if cid == 2:
            for kg in list(cols)[::3]:
                key = next(iter(model[kg]))
                cols[kg].set(key, model[kg][key] + 1, 3)
                model[kg][key] += 1
            kg = list(cols)[1]
            gone = next(iter(model[kg]))
            cols[kg].delete(gone, 3)
            del model[kg][gone]
        jobs = []
        for kg, col in cols.items():
            captured = col.capture(1 if cid == 2 else 0, full=cid == 1)
            if captured is not None:
                jobs.append(WriteJob("op", "s", kg, chains.get(kg, []), ColumnDelta(captured, pa.int64(), "value"), False))
        jobs = pickle.loads(pickle.dumps(jobs, protocol=5))  # as the writer process gets them
        out = write_jobs(store, orders, cid, jobs, session)
        chains.update({job.key_group: chain for job, chain in zip(jobs, out)})
        chains = {kg: c for kg, c in chains.items() if c}
        manifest = store.commit(Manifest(checkpoint_id=cid, job_name="j", max_parallelism=mp, keyed={"op": {"s": chains}}))
        session.written(cid, "op", {"s": dict(chains)})
        session.confirm(cid, "op")
        if cid == 1:
            assert manifest.stats["files_written"] == 1  # every key group in one packed file
    fresh = SnapshotStore.open(str(tmp_path))
    manifest = fresh.read_manifest(2)
    got = {}
    for kg in manifest.chains("op", "s"):
        table = fresh.read_key_group(manifest, "op", "s", kg)
        got[kg] = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))
    assert got == {kg: m for kg, m in model.items() if m}
    assert fresh.verify().ok


@pytest.mark.parametrize("key_type", [pa.string(), pa.binary(), pa.int64()])
def test_an_aggregates_full_images_written_as_bases_from_their_captures_are_the_folded_deltas(key_type):
    """The columnar aggregate's captures (string keys cut sorted per key group, as VarKeys),
    as the writer process receives them: the base from each encodes to the folded delta."""
    from test_aggregate import batch, feed, make_op

    op = make_op({"s": ("v", "sum")}, emit="none", m=64)
    raw = [f"customer-{i:05d}-é" for i in range(3000)] if key_type != pa.int64() else list(range(-1500, 1500))
    keys = [k.encode() for k in raw] if key_type == pa.binary() else raw
    for checkpoint_id in (1, 2):
        feed(op, batch(keys, list(range(len(keys))), key_type=key_type))  # every key changes
        captured = op.backend.capture(checkpoint_id, lazy=True)
        deltas = pickle.loads(pickle.dumps(list(captured["s"].values()), protocol=5))
        assert len(deltas) == 64
        for delta in deltas:
            _same_bytes(delta)


def test_captured_rows_and_var_keys_pickle_to_equal_writable_arrays_small_or_large():
    from abs.columns import Captured
    from abs.state.varkeys import VarKeys

    for n in (0, 3, 40, 5000):  # 5000: past the small form, numpy's own pickling
        keys = np.arange(n, dtype=np.int64) * 7
        values = np.linspace(0, 1, n, dtype=np.float32)
        nulls = np.arange(n) % 3 == 0
        changed = np.arange(0, n, 2, dtype=np.int64)
        text = VarKeys.from_arrow(pa.array([f"k{i}é" for i in range(n)], pa.string()), "string")
        for c in (Captured(keys, values, nulls, changed, ["gone"], True, False),
                  Captured(text, [{"a": 1}] * n, None, None, [], True, True),
                  Captured(keys[::2], values, None, None, [], False, False)):  # a strided view
            back = pickle.loads(pickle.dumps(c, protocol=5))
            for field in ("keys", "values", "nulls", "changed"):
                a, b = getattr(c, field), getattr(back, field)
                if isinstance(a, np.ndarray):
                    assert b.dtype == a.dtype and np.array_equal(a, b) and b.flags.writeable
                elif isinstance(a, VarKeys):
                    assert b.kind == a.kind and b.to_arrow().equals(a.to_arrow())
                    assert np.array_equal(b.offsets, a.offsets) and b.offsets.dtype == a.offsets.dtype
                else:
                    assert a == b
            assert (back.deleted, back.all_rows, back.complete) == (c.deleted, c.all_rows, c.complete)
