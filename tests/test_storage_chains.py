"""Chain reconstruction equals a model dict under random upsert/delete/compaction sequences."""
from __future__ import annotations

import pickle
import uuid
from typing import Any

import fsspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import CompactionPolicy, DeltaSchemaError, InvalidChainError, SnapshotStore, resolve_chain
from storage.chains import compaction_reason

KEYS = {
    "int": st.integers(min_value=-3, max_value=12),
    "str": st.sampled_from(["", "a", "b", "ä", "key/with/slash", "k" * 30, "0"]),
}
PY_VALUES = st.one_of(st.integers(), st.text(max_size=5), st.tuples(st.integers(), st.booleans()), st.none())


def make_delta(ops: list[tuple[Any, int, Any]], key_kind: str, value_kind: str) -> pa.Table:
    keys = pa.array([k for k, _, _ in ops], pa.int64() if key_kind == "int" else pa.string())
    if value_kind == "typed":
        values = {"count": pa.array([hash(repr(v)) % 1000 for _, _, v in ops], pa.int64()),
                  "label": pa.array([repr(v) for _, _, v in ops], pa.string())}
        meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
    else:
        values = {"value": pa.array([pickle.dumps(v) for _, _, v in ops], pa.binary())}
        meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"pickle"}
    table = pa.table({"key": keys, **values, "op": pa.array([o for _, o, _ in ops], pa.int8())})
    return table.replace_schema_metadata(meta)


def decode(table: pa.Table, value_kind: str) -> dict[Any, Any]:
    keys = table.column("key").to_pylist()
    if value_kind == "typed":
        return dict(zip(keys, table.column("label").to_pylist()))
    return {k: pickle.loads(v) for k, v in zip(keys, table.column("value").to_pylist())}


def model_value(v: Any, value_kind: str) -> Any:
    return repr(v) if value_kind == "typed" else v


@st.composite
def histories(draw):
    key_kind = draw(st.sampled_from(sorted(KEYS)))
    value_kind = draw(st.sampled_from(["typed", "pickled"]))
    op = st.tuples(KEYS[key_kind], st.sampled_from([0, 0, 1]), PY_VALUES)
    checkpoints = draw(st.lists(st.lists(op, max_size=12), min_size=1, max_size=8))
    policy = CompactionPolicy(max_chain_length=draw(st.integers(1, 4)),
                              max_delta_ratio=draw(st.sampled_from([0.05, 1.0, 1000.0])))
    return key_kind, value_kind, checkpoints, policy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_reading_a_chain_equals_the_model_after_every_checkpoint(history):
    key_kind, value_kind, checkpoints, policy = history
    name = f"/chains-{uuid.uuid4().hex}"
    store = SnapshotStore.open(f"memory://{name}", policy=policy)
    try:
        model: dict[Any, Any] = {}
        chain: list = []
        for cid, ops in enumerate(checkpoints, start=1):
            for key, op, value in ops:
                if op == 0:
                    model[key] = model_value(value, value_kind)
                else:
                    model.pop(key, None)
            chain = store.write_key_group(cid, "op", "state", 7, chain, make_delta(ops, key_kind, value_kind))
            assert chain[0].kind == "base" and all(r.kind == "delta" for r in chain[1:])
            assert len(chain) <= policy.max_chain_length
            resolved = store.read_chain(chain)
            assert "op" not in resolved.column_names
            assert resolved.num_rows == len(model)
            assert decode(resolved, value_kind) == model
            assert resolved.schema.metadata[b"abs.value_encoding"] == (b"arrow" if value_kind == "typed" else b"pickle")
    finally:
        fsspec.filesystem("memory").rm(name, recursive=True)


def delta(rows: list[tuple[Any, Any, int]]) -> pa.Table:
    return pa.table({"key": [r[0] for r in rows], "value": [r[1] for r in rows],
                     "op": pa.array([r[2] for r in rows], pa.int8())})


def test_resolve_keeps_the_last_row_of_a_key_within_one_delta():
    out = resolve_chain([delta([(1, "a", 0), (1, "b", 0), (2, "x", 0), (2, "", 1), (3, "c", 1), (3, "C", 0)])],
                        first_is_base=False)
    assert dict(zip(out["key"].to_pylist(), out["value"].to_pylist())) == {1: "b", 3: "C"}


def test_pickled_keys_compare_by_their_bytes():
    k1, k2 = pickle.dumps(("user", 1)), pickle.dumps(("user", 2))
    base = pa.table({"key": pa.array([k1, k2], pa.binary()), "value": [1, 2]})
    out = resolve_chain([base, pa.table({"key": pa.array([k1], pa.binary()), "value": [0],
                                          "op": pa.array([1], pa.int8())})], first_is_base=True)
    assert out["key"].to_pylist() == [k2]


def test_a_delta_whose_columns_differ_from_the_base_is_refused():
    base = pa.table({"key": [1], "value": ["a"]})
    other = pa.table({"key": [2], "other": ["b"], "op": pa.array([0], pa.int8())})
    with pytest.raises(DeltaSchemaError, match="does not match its base"):
        resolve_chain([base, other], first_is_base=True)


@pytest.mark.parametrize("table, message", [
    (pa.table({"value": [1]}), "needs exactly one 'key' column"),
    (pa.table({"key": [1, None], "value": [1, 2]}), "null keys"),
    (pa.table({"key": [1], "value": [1], "op": pa.array([2], pa.int8())}), "other than 0"),
    (pa.table({"key": [1], "value": [1], "op": ["upsert"]}), "expected int8"),
])
def test_malformed_deltas_are_refused_naming_the_key_group(memory_root, table, message):
    store = SnapshotStore.open(memory_root)
    with pytest.raises(DeltaSchemaError, match=rf"checkpoint 1: op/s key group 3: .*{message}"):
        store.write_key_group(1, "op", "s", 3, [], table)
    assert store.list_files() == {}


def test_a_delta_without_op_column_is_all_upserts(memory_root):
    store = SnapshotStore.open(memory_root)
    chain = store.write_key_group(1, "op", "s", 0, [], pa.table({"key": [1, 2], "value": ["a", "b"]}))
    assert store.read_chain(chain).num_rows == 2


def test_a_previous_chain_of_another_key_group_is_refused(memory_root):
    store = SnapshotStore.open(memory_root)
    chain = store.write_key_group(1, "op", "s", 0, [], delta([(1, "a", 0)]))
    with pytest.raises(InvalidChainError, match="another operator/state/key group"):
        store.write_key_group(2, "op", "s", 1, chain, delta([(2, "b", 0)]))
    with pytest.raises(InvalidChainError, match="only deltas may follow the base"):
        store.write_key_group(2, "op", "s", 0, chain + chain, delta([(2, "b", 0)]))


def test_key_groups_outside_max_parallelism_are_refused(memory_root):
    store = SnapshotStore.open(memory_root)
    store.init_job({"job_name": "j", "max_parallelism": 4})
    with pytest.raises(ValueError, match=r"key group 4 is outside \[0, 4\)"):
        store.write_key_group(1, "op", "s", 4, [], delta([(1, "a", 0)]))


def test_compaction_rule():
    from storage import FileRef

    def ref(kind: str, cid: int, size: int) -> FileRef:
        return FileRef(path=f"state/o/s/kg-0000/{cid:08d}-{kind}-{'0' * 32}.arrow", kind=kind, checkpoint_id=cid,
                       rows=1, bytes=size, checksum="0" * 64)

    policy = CompactionPolicy(max_chain_length=3, max_delta_ratio=0.5)
    assert compaction_reason(policy, [], 10_000) is None
    assert compaction_reason(policy, [ref("base", 1, 1000)], 400) is None
    assert "delta/base" in compaction_reason(policy, [ref("base", 1, 1000)], 501)
    assert compaction_reason(policy, [ref("base", 1, 1000), ref("delta", 2, 100)], 100) is None
    assert "chain length 4 > 3" in compaction_reason(policy, [ref("base", 1, 1000), ref("delta", 2, 1), ref("delta", 3, 1)], 1)
    with pytest.raises(ValueError, match="max_chain_length"):
        CompactionPolicy(max_chain_length=0)


# ------------------------------------------------------------------ sorted files and fast resolution
def model_resolve(tables: list[pa.Table]) -> dict[Any, Any]:
    state: dict[Any, Any] = {}
    for table in tables:
        ops = table.column("op").to_pylist() if "op" in table.column_names else [0] * table.num_rows
        for key, value, op in zip(table.column("key").to_pylist(), table.column("value").to_pylist(), ops):
            if op == 0:
                state[key] = value
            else:
                state.pop(key, None)
    return state


@pytest.mark.parametrize("key_kind", ["int sorted", "int unsorted", "str"])
@pytest.mark.parametrize("changes", [0, 3, 40, 400])  # none, few (zero-copy slices), many (filter)
def test_resolution_agrees_with_the_model_on_every_path(key_kind, changes):
    import numpy as np

    rng = np.random.default_rng(changes)
    n = 4000
    base_keys = rng.choice(10 * n, size=n, replace=False)
    if key_kind == "int sorted":
        base_keys = np.sort(base_keys)
    as_keys = (lambda ks: pa.array(ks, pa.int64())) if key_kind.startswith("int") else \
        (lambda ks: pa.array([f"k{k:06d}" for k in ks], pa.string()))
    base = pa.table({"key": as_keys(base_keys), "value": pa.array([f"v{k}" for k in base_keys])})
    tables = [base]
    for round_ in range(2):
        existing = rng.choice(base_keys, size=changes, replace=True)  # duplicates: the later row wins
        fresh = rng.integers(10 * n, 11 * n, size=changes // 4)
        keys = np.concatenate([existing, fresh, existing[: changes // 5]])
        ops = np.concatenate([np.zeros(len(existing) + len(fresh), np.int8), np.ones(changes // 5, np.int8)])
        tables.append(pa.table({"key": as_keys(keys), "value": pa.array([f"r{round_}-{k}" for k in keys]),
                                "op": pa.array(ops, pa.int8())}))
        for chain in (tables, tables[:1] + [tables[-1]]):
            out = resolve_chain(chain, first_is_base=True)
            got = dict(zip(out.column("key").to_pylist(), out.column("value").to_pylist()))
            assert out.num_rows == len(got) == len(model_resolve(chain))
            assert got == model_resolve(chain)


def test_rows_are_stored_sorted_by_key_keeping_the_order_of_a_keys_rows(memory_root):
    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=1000.0))
    chain = store.write_key_group(1, "op", "s", 0, [], delta([(9, "i", 0), (3, "c", 0), (5, "e", 0)]))
    chain = store.write_key_group(2, "op", "s", 0, chain, delta([(5, "E", 0), (1, "a", 0), (5, "", 1), (9, "I", 0)]))
    base, stored = (store.read_file(ref) for ref in chain)
    assert base.column("key").to_pylist() == [3, 5, 9]
    assert list(zip(stored["key"].to_pylist(), stored["op"].to_pylist())) == [(1, 0), (5, 0), (5, 1), (9, 0)]
    out = store.read_chain(chain)
    assert dict(zip(out["key"].to_pylist(), out["value"].to_pylist())) == {1: "a", 3: "c", 9: "I"}


def test_keys_that_do_not_sort_keep_the_writers_order():
    from storage.format import sort_by_key

    table = pa.table({"key": pa.array([{"a": 2}, {"a": 1}]), "value": [1, 2]})
    assert sort_by_key(table).column("value").to_pylist() == [1, 2]
    table = pa.table({"key": ["b", "a", "b"], "value": [1, 2, 3]})
    assert sort_by_key(table).column("value").to_pylist() == [2, 1, 3]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.data())
def test_resolution_over_a_base_of_several_batches_equals_the_model(batch_sizes, data):
    """Few changed rows take the zero-copy path (slices of the base's batches): cuts at the
    first and last row of a batch, in neighbouring rows and in every batch all keep the rest."""
    import numpy as np

    n = sum(batch_sizes)
    keys = np.arange(n, dtype=np.int64) * 3
    table = pa.table({"key": keys, "value": pa.array([f"v{k}" for k in keys])})
    bounds = np.cumsum([0] + batch_sizes)
    base = pa.Table.from_batches([table.slice(a, b - a).combine_chunks().to_batches()[0]
                                  for a, b in zip(bounds[:-1], bounds[1:])])
    assert base.column("key").num_chunks == len(batch_sizes)
    rows = data.draw(st.lists(st.integers(0, n - 1), max_size=max(1, n // 64), unique=True))
    ops = data.draw(st.lists(st.sampled_from([0, 1]), min_size=len(rows), max_size=len(rows)))
    delta_keys = [int(keys[r]) for r in rows] + [3 * n + 1]  # and one new key
    delta = pa.table({"key": pa.array(delta_keys, pa.int64()),
                      "value": pa.array([f"new{k}" for k in delta_keys]),
                      "op": pa.array(ops + [0], pa.int8())})
    out = resolve_chain([base, delta], first_is_base=True)
    got = dict(zip(out.column("key").to_pylist(), out.column("value").to_pylist()))
    assert out.num_rows == len(got)
    assert got == model_resolve([base, delta])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_base_and_one_sorted_delta_resolve_to_the_kept_rows_then_the_upserts(data):
    """The path for a base plus one delta with strictly increasing integer keys (most key
    groups on restore) returns exactly the base rows whose key the delta does not touch, in
    base order, then the delta's upserts in delta order: over few cuts (zero-copy slices) and
    many (filter), bases of several batches, deltas with and without ``op``, a delta whose
    value column is all null (another type), and unsorted bases, which it leaves to the
    general path."""
    from unittest import mock

    import numpy as np

    import storage.chains as chains

    n = data.draw(st.integers(0, 300), label="base rows")
    base_keys = np.arange(n, dtype=np.int64) * 3  # gaps: new keys land before, between and after
    if data.draw(st.booleans(), label="unsorted base"):
        base_keys = base_keys[data.draw(st.permutations(range(n)))] if n else base_keys
    splits = data.draw(st.sets(st.integers(1, n - 1), max_size=3) if n > 1 else st.just(set()), label="batch splits")
    bounds = [0, *sorted(splits), n]
    table = pa.table({"key": base_keys, "value": pa.array([f"v{k}" for k in base_keys.tolist()], pa.string())})
    base = pa.Table.from_batches([b for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo
                                  for b in table.slice(lo, hi - lo).combine_chunks().to_batches()], schema=table.schema)
    base = base.replace_schema_metadata(data.draw(st.sampled_from([
        None, {b"abs.value_encoding": b"arrow"}, {b"abs.file_kind": b"base", b"abs.value_encoding": b"arrow"}])))

    keys = sorted(data.draw(st.sets(st.integers(-3, 3 * n + 3), max_size=max(1, n)), label="delta keys"))
    with_op = data.draw(st.booleans(), label="op column")
    ops = [0] * len(keys)
    if with_op:
        ops = data.draw(st.lists(st.sampled_from([0, 1]), min_size=len(keys), max_size=len(keys)), label="ops")
    null_values = data.draw(st.booleans(), label="all-null values")
    values = pa.nulls(len(keys)) if null_values else pa.array([f"new{k}" for k in keys], pa.string())
    columns = {"key": pa.array(keys, pa.int64()), "value": values}
    if with_op:
        columns["op"] = pa.array(ops, pa.int8())
    delta = pa.table(columns).replace_schema_metadata({b"abs.value_encoding": b"arrow", b"abs.key_encoding": b"arrow"})

    results = []

    def spy(*args):
        results.append(real(*args))
        return results[-1]

    real = chains._resolve_sorted_pair
    with mock.patch.object(chains, "_resolve_sorted_pair", spy):
        out = resolve_chain([base, delta], first_is_base=True)

    sorted_base = n > 0 and bool(np.all(np.diff(base_keys) > 0))
    assert [r is not None for r in results] == [sorted_base]
    changed = set(keys)
    upserts = [(k, None if null_values else f"new{k}") for k, op in zip(keys, ops) if op == 0]
    expected = [(k, f"v{k}") for k in base_keys.tolist() if k not in changed] + upserts
    assert out.column_names == ["key", "value"]
    assert list(zip(out.column("key").to_pylist(), out.column("value").to_pylist())) == expected
    assert out.schema.metadata == {b"abs.value_encoding": b"arrow", b"abs.key_encoding": b"arrow"}
    assert out.schema.field("value").type == pa.string()


@pytest.mark.parametrize("key_type", [pa.string(), pa.binary(), pa.large_string()])
def test_one_delta_of_text_keys_resolves_whether_sorted_or_repeating(key_type, monkeypatch):
    """A sorted table of unique string or binary keys (a writer's image) is every key once
    without a distinct count; unsorted, repeated keys and several deltas still fold."""
    import pyarrow.compute as pc

    def keys(xs: list[str]) -> pa.Array:
        return pa.array([x.encode() if key_type == pa.binary() else x for x in xs], key_type)

    def delta(xs: list[str], values: list[int]) -> pa.Table:
        return pa.table({"key": keys(xs), "value": pa.array(values, pa.int64())})

    counted = []
    real = pc.count_distinct
    monkeypatch.setattr(pc, "count_distinct", lambda *a, **kw: counted.append(1) or real(*a, **kw))
    sorted_image = delta(["a", "b", "c"], [1, 2, 3])
    assert resolve_chain([sorted_image], first_is_base=False).equals(sorted_image)
    assert not counted
    repeated = resolve_chain([delta(["b", "a", "b"], [1, 2, 3])], first_is_base=False)
    assert dict(zip(repeated.column("key").to_pylist(), repeated.column("value").to_pylist())) == {
        keys(["a"])[0].as_py(): 2, keys(["b"])[0].as_py(): 3}
    two = resolve_chain([delta(["a", "b"], [1, 2]), delta(["b", "c"], [5, 6])], first_is_base=False)
    assert sorted(zip(two.column("key").to_pylist(), two.column("value").to_pylist())) == [
        (keys([k])[0].as_py(), v) for k, v in (("a", 1), ("b", 5), ("c", 6))]
