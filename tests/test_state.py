"""Keyed state backend: handles, bulk API, dirty tracking, capture/confirm/abort, encoding
and restore. The state-machine test fails if dirty tracking ever loses a change."""
from __future__ import annotations

import copy
import dataclasses
import operator
import pickle
import re
from typing import Any, Iterator

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from abs.errors import ConfigError, StateError
from abs.keygroups import KeyGroupRange, key_group
from abs.state.encoding import arrow_to_list
from abs.state import (
    ColumnDelta,
    KeyedStateBackend,
    ListState,
    MapState,
    PickledDelta,
    ReducingState,
    ValueState,
)

M = 16
RANGE = KeyGroupRange(4, 11)


def keys_in_range(candidates, rng=RANGE, m=M, n=6):
    return [k for k in candidates if key_group(k, m) in rng][:n]


INT_KEYS = keys_in_range(range(1000))
STR_KEYS = keys_in_range(f"user-{i}" for i in range(1000))
TUPLE_KEYS = keys_in_range((i, f"t{i}") for i in range(1000))
OUT_OF_RANGE_KEY = next(k for k in range(1000) if key_group(k, M) not in RANGE)


def backend(*descriptors, rng=RANGE):
    return KeyedStateBackend("op", list(descriptors), M, rng)


def at(b, key):
    b.current_key = key
    b.current_kg = key_group(key, M)


def decode_table(table):
    """Independent decoder used by the tests: {key: (op, value)}."""
    meta = table.schema.metadata
    keys = table.column("key").to_pylist()
    values = table.column("value").to_pylist()
    if meta[b"abs.key_encoding"] == b"pickle":
        keys = [pickle.loads(k) for k in keys]
    if meta[b"abs.value_encoding"] == b"pickle":
        values = [None if v is None else pickle.loads(v) for v in values]
    if meta[b"abs.state_kind"] == b"map":
        values = [None if v is None else dict(v) for v in values]
    ops = table.column("op").to_pylist() if "op" in table.schema.names else [0] * len(keys)
    return {k: (o, v) for k, o, v in zip(keys, ops, values)}


def apply_deltas(base, deltas):
    """base: {state: {key: value}}; deltas: capture() output. Returns a new dict."""
    out = copy.deepcopy(base)
    for state, by_kg in deltas.items():
        target = out.setdefault(state, {})
        for kg, table in by_kg.items():
            for key, (op, value) in decode_table(table).items():
                assert key_group(key, M) == kg
                if op == 0:
                    target[key] = value
                else:
                    assert op == 1
                    target.pop(key, None)
    return out


def contents(b):
    return {d.name: dict(b.items(d.name)) for d in b.descriptors}


# ----------------------------------------------------------------------------- descriptors


def test_descriptor_kinds_types_and_json():
    def add(a, x):
        return a + x

    v = ValueState("v", pa.int64())
    l = ListState("l", pa.string())
    m = MapState("m", pa.string(), pa.float64())
    r = ReducingState("r", add, pa.int64())
    assert [d.kind for d in (v, l, m, r)] == ["value", "list", "map", "reducing"]
    assert v.value_arrow_type() == pa.int64()
    assert l.value_arrow_type() == pa.list_(pa.string())
    assert m.value_arrow_type() == pa.map_(pa.string(), pa.float64())
    assert r.value_arrow_type() == pa.int64()
    assert ValueState("u").value_arrow_type() is None
    assert ListState("u").value_arrow_type() is None
    assert MapState("u").value_arrow_type() is None
    assert v.to_json() == {"kind": "value", "name": "v", "type": "int64"}
    assert l.to_json() == {"kind": "list", "name": "l", "element_type": "string"}
    assert m.to_json() == {"kind": "map", "name": "m", "key_type": "string", "value_type": "double"}
    assert r.to_json() == {
        "kind": "reducing",
        "name": "r",
        "type": "int64",
        "reduce_fn": f"{__name__}.test_descriptor_kinds_types_and_json.<locals>.add",
    }
    assert ReducingState("x", operator.add).to_json()["reduce_fn"] == "_operator.add"
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.name = "w"


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: ValueState(""), "non-empty str"),
        (lambda: ValueState("a/b"), "without '/'"),
        (lambda: ValueState(3), "non-empty str"),
        (lambda: ValueState("v", "int64"), "pyarrow DataType"),
        (lambda: ListState("l", int), "element_type must be a pyarrow DataType"),
        (lambda: MapState("m", pa.string()), "both key_type and value_type"),
        (lambda: ReducingState("r", 5), "reduce_fn must be callable"),
    ],
)
def test_descriptor_validation_raises_config_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_backend_validation():
    with pytest.raises(ConfigError, match="declared twice"):
        backend(ValueState("a"), ListState("a"))
    with pytest.raises(ConfigError, match="not a state descriptor"):
        backend("a")
    with pytest.raises(ConfigError, match="within"):
        KeyedStateBackend("op", [], 8, KeyGroupRange(0, 8))
    b = backend(ValueState("a"), ListState("b"))
    with pytest.raises(StateError, match=r"no state named 'c' \(declared: 'a', 'b'\)"):
        b.state("c")
    assert b.state("a") is b.state("a")


# ----------------------------------------------------------------------------- handles


def test_value_state_handle():
    b = backend(ValueState("v"))
    v = b.state("v")
    k1, k2 = STR_KEYS[:2]
    at(b, k1)
    assert v.value() is None
    v.update({"x": 1})
    at(b, k2)
    assert v.value() is None
    v.update(None)  # None is a value; clear() deletes
    assert dict(b.items("v")) == {k1: {"x": 1}, k2: None}
    v.clear()
    at(b, k1)
    assert v.value() == {"x": 1}
    assert dict(b.items("v")) == {k1: {"x": 1}}


def test_list_state_handle_returns_copies():
    b = backend(ListState("l"))
    lst = b.state("l")
    at(b, INT_KEYS[0])
    assert lst.get() == []
    lst.add(1)
    lst.add(2)
    got = lst.get()
    got.append(99)
    assert lst.get() == [1, 2]
    lst.update(x for x in (5, 6))
    assert lst.get() == [5, 6]
    lst.update([])
    assert list(b.items("l")) == []
    lst.add(3)
    lst.clear()
    assert lst.get() == []


def test_map_state_handle():
    b = backend(MapState("m"))
    m = b.state("m")
    at(b, TUPLE_KEYS[0])
    assert m.is_empty() and m.get("a") is None and m.get("a", 7) == 7 and not m.contains("a")
    assert list(m.items()) == [] and list(m.keys()) == [] and list(m.values()) == []
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1 and m.contains("b") and not m.is_empty()
    assert dict(m.items()) == {"a": 1, "b": 2}
    assert sorted(m.keys()) == ["a", "b"] and sorted(m.values()) == [1, 2]
    m.remove("a")
    m.remove("zzz")
    assert dict(m.items()) == {"b": 2}
    m.remove("b")  # the last entry: the key disappears
    assert m.is_empty() and list(b.items("m")) == []
    m.put("c", 3)
    m.clear()
    assert m.is_empty()


def test_reducing_state_handle():
    b = backend(ReducingState("r", lambda acc, x: acc + x))
    r = b.state("r")
    at(b, INT_KEYS[0])
    assert r.get() is None
    r.add(5)
    r.add(7)
    assert r.get() == 12
    r.clear()
    assert r.get() is None
    r.add("x")  # the first value is stored as is
    assert r.get() == "x"


def test_out_of_range_key_group_raises_state_error_on_every_handle_method():
    b = backend(ValueState("v"), ListState("l"), MapState("m"), ReducingState("r", operator.add))
    b.current_key = OUT_OF_RANGE_KEY
    b.current_kg = key_group(OUT_OF_RANGE_KEY, M)
    calls = [
        lambda: b.state("v").value(),
        lambda: b.state("v").update(1),
        lambda: b.state("v").clear(),
        lambda: b.state("l").get(),
        lambda: b.state("l").add(1),
        lambda: b.state("l").update([1]),
        lambda: b.state("l").clear(),
        lambda: b.state("m").get(1),
        lambda: b.state("m").put(1, 2),
        lambda: b.state("m").remove(1),
        lambda: b.state("m").contains(1),
        lambda: b.state("m").items(),
        lambda: b.state("m").is_empty(),
        lambda: b.state("m").clear(),
        lambda: b.state("r").get(),
        lambda: b.state("r").add(1),
        lambda: b.state("r").clear(),
    ]
    for call in calls:
        with pytest.raises(StateError, match="outside this subtask's range"):
            call()
    b.current_kg = M + 3  # past the end of the list
    with pytest.raises(StateError, match="outside"):
        b.state("v").update(1)
    b.current_kg = None
    with pytest.raises(StateError, match="no current key"):
        b.state("v").update(1)
    assert contents(b) == {"v": {}, "l": {}, "m": {}, "r": {}}


def test_errors_that_are_not_about_key_groups_propagate_unchanged():
    def bad(acc, x):
        raise TypeError("boom in reduce")

    b = backend(ValueState("v"), ReducingState("r", bad))
    at(b, INT_KEYS[0])
    b.state("r").add(1)
    with pytest.raises(TypeError, match="boom in reduce"):
        b.state("r").add(2)
    assert b.state("r").get() == 1
    b.current_key = ["unhashable"]
    with pytest.raises(TypeError, match="unhashable"):
        b.state("v").update(1)


def test_set_current_key_checks_the_range():
    b = backend(ValueState("v"))
    b.set_current_key(INT_KEYS[0])
    assert b.current_kg == key_group(INT_KEYS[0], M)
    with pytest.raises(StateError, match="wrong subtask"):
        b.set_current_key(OUT_OF_RANGE_KEY)


# ----------------------------------------------------------------------------- bulk API


def test_bulk_get_put_delete_items():
    b = backend(ValueState("v", pa.int64()), ListState("l"))
    kg = key_group(INT_KEYS[0], M)
    same = [k for k in range(2000) if key_group(k, M) == kg][:4]
    assert b.get_many("v", kg, same) == [None] * 4
    b.put_many("v", kg, same, [1, 2, 3, 4])
    assert b.get_many("v", kg, same) == [1, 2, 3, 4]
    b.delete_many("v", kg, same[:2] + [10**9])
    assert b.get_many("v", kg, same) == [None, None, 3, 4]
    assert dict(b.items("v", kg)) == {same[2]: 3, same[3]: 4}
    assert dict(b.items("v")) == {same[2]: 3, same[3]: 4}
    b.put_many("l", kg, same[:2], [[1], []])  # an empty list deletes
    assert dict(b.items("l")) == {same[0]: [1]}
    with pytest.raises(StateError, match="2 keys and 1 values"):
        b.put_many("v", kg, same[:2], [1])
    out_kg = key_group(OUT_OF_RANGE_KEY, M)
    for call in (
        lambda: b.get_many("v", out_kg, [1]),
        lambda: b.put_many("v", out_kg, [1], [1]),
        lambda: b.delete_many("v", out_kg, [1]),
        lambda: b.items("v", out_kg),
        lambda: b.restore("v", out_kg, pa.table({"key": [1], "value": [1]})),
    ):
        with pytest.raises(StateError, match="outside"):
            call()
    deltas = b.capture(1)
    assert set(deltas["v"]) == {kg}
    assert decode_table(deltas["v"][kg]) == {same[0]: (1, None), same[1]: (1, None), same[2]: (0, 3), same[3]: (0, 4)}


# ----------------------------------------------------------------------------- capture


def test_capture_returns_only_changed_key_groups_and_nothing_when_unchanged():
    b = backend(ValueState("v", pa.int64()), ValueState("w"))
    assert b.capture(1) == {"v": {}, "w": {}}
    v = b.state("v")
    at(b, INT_KEYS[0])
    v.update(1)
    d = b.capture(2)
    assert set(d["v"]) == {key_group(INT_KEYS[0], M)} and d["w"] == {}
    b.confirm(2)
    assert b.capture(3) == {"v": {}, "w": {}}
    at(b, INT_KEYS[1])
    v.clear()  # deleting a key that does not exist changes nothing
    assert b.capture(4) == {"v": {}, "w": {}}


def test_delta_covers_everything_since_the_last_confirmed_checkpoint():
    b = backend(ValueState("v", pa.int64()))
    v = b.state("v")
    k1, k2, k3 = INT_KEYS[:3]
    at(b, k1)
    v.update(1)
    d1 = b.capture(1)
    at(b, k2)
    v.update(2)
    d2 = b.capture(2)  # 1 not confirmed: its key is in 2 as well
    assert apply_deltas({}, d2) == {"v": {k1: 1, k2: 2}}
    b.abort(2)
    at(b, k3)
    v.update(3)
    d3 = b.capture(3)  # 2 aborted: nothing lost
    assert apply_deltas({}, d3) == {"v": {k1: 1, k2: 2, k3: 3}}
    b.confirm(1)
    at(b, k1)
    v.clear()
    d4 = b.capture(4)  # base: checkpoint 1
    assert b.last_confirmed == 1
    assert apply_deltas(apply_deltas({}, d1), d4) == {"v": {k2: 2, k3: 3}}
    b.confirm(4)  # implies 3
    assert b.pending_captures == ()
    assert b.capture(5) == {"v": {}}


def test_out_of_order_and_skipped_confirmations():
    b = backend(ValueState("v", pa.int64()))
    v = b.state("v")
    for i, k in enumerate(INT_KEYS[:4], start=3):
        at(b, k)
        v.update(i)
        b.capture(i)
    assert b.pending_captures == (3, 4, 5, 6)
    b.confirm(5)  # 3 and 4 implied
    assert b.pending_captures == (6,) and b.last_confirmed == 5
    b.confirm(4)  # late: no effect
    assert b.pending_captures == (6,) and b.last_confirmed == 5
    assert set(b.capture(7)["v"]) == {key_group(INT_KEYS[3], M)}
    b.abort(99)  # unknown: ignored
    with pytest.raises(StateError, match="must increase"):
        b.capture(7)
    with pytest.raises(StateError, match="must increase"):
        b.capture(2)


def test_abort_with_later_pending_capture_loses_nothing():
    b = backend(ValueState("v", pa.int64()))
    v = b.state("v")
    k1, k2 = INT_KEYS[:2]
    at(b, k1)
    v.update(1)
    b.capture(1)
    at(b, k2)
    v.update(2)
    b.capture(2)
    b.abort(1)  # folded into 2
    b.abort(2)  # folded back into the dirty sets
    assert apply_deltas({}, b.capture(3)) == {"v": {k1: 1, k2: 2}}


def test_aborted_changes_are_forgotten_once_a_later_capture_containing_them_is_confirmed():
    b = backend(ValueState("v", pa.int64()))
    v = b.state("v")
    k1, k2 = INT_KEYS[:2]
    at(b, k1)
    v.update(1)
    b.capture(1)
    at(b, k2)
    v.update(2)
    b.capture(2)
    b.abort(1)
    b.confirm(2)
    assert b.capture(3) == {"v": {}}  # no redundant upserts


def test_mutation_after_capture_does_not_change_the_captured_tables():
    b = backend(
        ListState("l"),
        ListState("lt", pa.int64()),
        MapState("m"),
        MapState("mt", pa.string(), pa.int64()),
        ValueState("v"),
    )
    k = STR_KEYS[0]
    at(b, k)
    obj = {"nested": [1]}
    b.state("v").update(obj)
    for name in ("l", "lt"):
        b.state(name).add(1)
    for name in ("m", "mt"):
        b.state(name).put("a", 1)
    deltas = b.capture(1)
    before = apply_deltas({}, deltas)
    obj["nested"].append(2)  # in-place mutation of a live value
    for name in ("l", "lt"):
        b.state(name).add(2)
    for name in ("m", "mt"):
        b.state(name).put("b", 2)
    assert apply_deltas({}, deltas) == before
    assert before["v"][k] == {"nested": [1]} and before["l"][k] == [1] and before["mt"][k] == {"a": 1}


def test_capture_full_returns_every_non_empty_key_group_and_counts_as_a_capture():
    b = backend(ValueState("v", pa.int64()), MapState("m"))
    for i, k in enumerate(INT_KEYS):
        at(b, k)
        b.state("v").update(i)
    b.confirm(0)
    full = b.capture_full(1)
    kgs = {key_group(k, M) for k in INT_KEYS}
    assert set(full["v"]) == kgs and full["m"] == {}
    for table in full["v"].values():
        assert set(table.column("op").to_pylist()) == {0}
    assert apply_deltas({}, full) == contents(b) | {"m": {}}
    b.confirm(1)
    assert b.capture(2) == {"v": {}, "m": {}}


@pytest.mark.parametrize("arrow_type, bad, when", [
    (pa.int64(), "not an int", "update"),  # a columnar state refuses the write itself
    (pa.int64(), 2.5, "update"),  # never truncated to 2
    (pa.int32(), 1 << 40, "update"),
    (pa.string(), 42, "capture"),  # a dict-backed state finds out when it encodes the snapshot
])
def test_typed_value_that_does_not_fit_raises_naming_the_key(arrow_type, bad, when):
    b = backend(ValueState("v", arrow_type))
    at(b, STR_KEYS[0])
    message = rf"state 'v'.*value {re.escape(repr(bad))} of key 'user-\d+'.*{arrow_type}"
    if when == "update":
        with pytest.raises(StateError, match=message):
            b.state("v").update(bad)
        assert b.state("v").value() is None and b.capture(1) == {"v": {}}  # nothing was stored
    else:
        b.state("v").update(bad)
        with pytest.raises(StateError, match=message):
            b.capture(1)


# ----------------------------------------------------------------------------- encoding


def _single_table(deltas, state):
    (table,) = deltas[state].values()
    return table


@pytest.mark.parametrize(
    "key,key_type,key_encoding",
    [
        (INT_KEYS[0], pa.int64(), b"arrow"),
        (STR_KEYS[0], pa.string(), b"arrow"),
        (b"raw", pa.binary(), b"arrow"),
        (TUPLE_KEYS[0], pa.binary(), b"pickle"),
        (2**70, pa.binary(), b"pickle"),
        (True, pa.binary(), b"pickle"),
        (1.5, pa.binary(), b"pickle"),
    ],
)
def test_key_column_encoding(key, key_type, key_encoding):
    rng = KeyGroupRange(0, M - 1)
    b = backend(ValueState("v"), rng=rng)
    at(b, key)
    b.state("v").update(1)
    t = _single_table(b.capture(1), "v")
    assert t.schema.field("key").type == key_type
    assert t.schema.metadata[b"abs.key_encoding"] == key_encoding
    assert t.schema.metadata[b"abs.value_encoding"] == b"pickle"
    assert t.schema.metadata[b"abs.state_kind"] == b"value"
    assert t.schema.field("op").type == pa.int8()
    assert decode_table(t) == {key: (0, 1)}


def test_mixed_key_types_in_one_key_group_are_pickled():
    rng = KeyGroupRange(0, M - 1)
    b = backend(ValueState("v", pa.int64()), rng=rng)
    kg = key_group(1, M)
    other = next(f"s{i}" for i in range(1000) if key_group(f"s{i}", M) == kg)
    b.put_many("v", kg, [1, other], [10, 20])
    t = _single_table(b.capture(1), "v")
    assert t.schema.metadata[b"abs.key_encoding"] == b"pickle"
    assert t.schema.metadata[b"abs.value_encoding"] == b"arrow"
    assert t.schema.field("value").type == pa.int64()
    assert decode_table(t) == {1: (0, 10), other: (0, 20)}


def test_value_column_types():
    b = backend(
        ValueState("v", pa.float64()),
        ListState("l", pa.int32()),
        MapState("m", pa.string(), pa.int64()),
        ReducingState("r", operator.add, pa.int64()),
    )
    at(b, INT_KEYS[0])
    b.state("v").update(1.5)
    b.state("l").add(3)
    b.state("m").put("x", 1)
    b.state("r").add(4)
    d = b.capture(1)
    assert _single_table(d, "v").schema.field("value").type == pa.float64()
    assert _single_table(d, "l").schema.field("value").type == pa.list_(pa.int32())
    assert _single_table(d, "m").schema.field("value").type == pa.map_(pa.string(), pa.int64())
    assert _single_table(d, "r").schema.field("value").type == pa.int64()
    assert _single_table(d, "l").column("value").to_pylist() == [[3]]


# ----------------------------------------------------------------------------- restore

KINDS = [
    (ValueState("s", pa.int64()), lambda i: i * 10),
    (ValueState("s", pa.string()), lambda i: None if i % 7 == 3 else f"v{i}"),
    (ValueState("s"), lambda i: {"any": [i, "thing"]}),
    (ListState("s", pa.string()), lambda i: [f"e{i}", "x"]),
    (ListState("s"), lambda i: [i, (i, "t")]),
    (MapState("s", pa.string(), pa.float64()), lambda i: {"a": float(i), "b": 0.5}),
    (MapState("s"), lambda i: {(i,): [i]}),
    (ReducingState("s", operator.add, pa.int64()), lambda i: i + 1),
    (ReducingState("s", operator.add), lambda i: (i,)),
]


def _kind_id(x):
    return "-".join(str(v) for v in x.to_json().values()) if hasattr(x, "to_json") else ""


@pytest.mark.parametrize("descriptor,make_value", KINDS, ids=_kind_id)
@pytest.mark.parametrize("keys", [INT_KEYS, STR_KEYS, TUPLE_KEYS], ids=["int", "str", "tuple"])
def test_restore_round_trip(descriptor, make_value, keys):
    src = backend(descriptor)
    for i, k in enumerate(keys):
        src.put_many("s", key_group(k, M), [k], [make_value(i)])
    full = src.capture_full(1)
    incremental = src.capture(2)  # 1 not confirmed: also everything, with an op column
    for deltas in (full, incremental):
        dst = backend(descriptor)
        for kg, table in deltas["s"].items():
            dst.restore("s", kg, table, verify=True)
        assert contents(dst) == contents(src)
        assert dst.capture(1) == {"s": {}}  # restored keys are not dirty
    # without the op column too
    dst = backend(descriptor)
    for kg, table in full["s"].items():
        dst.restore("s", kg, table.drop_columns(["op"]))
    assert contents(dst) == contents(src)


@pytest.mark.parametrize("array", [
    pa.array([1, 2, None]), pa.array([1, -2, 3]), pa.array([2**64 - 1], pa.uint64()), pa.array([1.5, None]),
    pa.array([1.5, 2.0]), pa.array([1.5], pa.float32()), pa.array([True, False]), pa.array(["a", None, "b"]),
    pa.array(["x"], pa.large_string()), pa.array([b"x", None]), pa.array([[1]], pa.list_(pa.int64())),
], ids=lambda a: str(a.type))
def test_arrow_to_list_gives_what_to_pylist_gives(array):
    for column in (pa.chunked_array([array, array]), array, pa.chunked_array([], array.type)):
        got, expected = arrow_to_list(column), column.to_pylist()
        assert got == expected and [type(v) for v in got] == [type(v) for v in expected]


def test_restore_rejects_bad_tables():
    b = backend(ValueState("v", pa.int64()), ListState("l"))
    at(b, INT_KEYS[0])
    b.state("v").update(1)
    b.confirm(1)
    b.state("v").clear()
    kg = key_group(INT_KEYS[0], M)
    delta = b.capture(2)["v"][kg]
    with pytest.raises(StateError, match="contains deletes; resolve the chain"):
        backend(ValueState("v", pa.int64())).restore("v", kg, delta)
    b.state("l").add(1)
    list_table = b.capture(3)["l"][kg]
    with pytest.raises(StateError, match="holds list state but the state is declared as value"):
        backend(ValueState("l")).restore("l", kg, list_table)
    bad_meta = list_table.replace_schema_metadata({b"abs.key_encoding": b"zstd-v9", b"abs.value_encoding": b"pickle"})
    with pytest.raises(StateError, match="encoding b'zstd-v9'"):
        backend(ListState("l")).restore("l", kg, bad_meta)
    with pytest.raises(StateError, match="needs 'key' and 'value'"):
        backend(ListState("l")).restore("l", kg, pa.table({"k": [1]}))
    wrong_kg = next(g for g in RANGE if g != kg)
    with pytest.raises(StateError, match="wrong key group"):
        backend(ListState("l")).restore("l", wrong_kg, list_table, verify=True)


# ----------------------------------------------------------------------------- state machine

POOL = INT_KEYS[:2] + STR_KEYS[:1] + TUPLE_KEYS[:1]
DESCRIPTORS = [
    ValueState("v", pa.int64()),
    ValueState("vp"),
    ListState("l"),
    MapState("m", pa.string(), pa.int64()),
    ReducingState("r", operator.add, pa.int64()),
]


class DirtyTrackingMachine(RuleBasedStateMachine):
    """Random writes, captures (incremental and full), confirms (any pending id: out of order,
    skipping older ones) and aborts. At every capture, applying the delta to the state of its
    base (the last confirmed checkpoint) must give the live state, and exactly the key groups
    written since that base must appear; at every confirm, the confirmed state is rebuilt from
    the stored deltas, and every later pending delta must also apply on top of it."""

    @initialize()
    def setup(self):
        self.b = backend(*DESCRIPTORS)
        self.truth = {d.name: {} for d in DESCRIPTORS}
        self.clock = 0  # counts writes that change state
        self.touched = []  # (time, state, kg)
        self.next_id = 1
        self.captures = {}  # id -> dict(full, base, deltas, truth, time)
        self.pending = []  # captured, neither confirmed nor aborted
        self.materialized = {None: {d.name: {} for d in DESCRIPTORS}}  # confirmed id -> state
        self.confirmed = None
        self.confirm_time = 0

    def _touch(self, state, key):
        self.clock += 1
        self.touched.append((self.clock, state, key_group(key, M)))

    @rule(key=st.sampled_from(POOL), value=st.integers(-5, 5))
    def value_update(self, key, value):
        at(self.b, key)
        self.b.state("v").update(value)
        self.truth["v"][key] = value
        self._touch("v", key)

    @rule(key=st.sampled_from(POOL), value=st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=2)))
    def pickled_value_update(self, key, value):
        at(self.b, key)
        self.b.state("vp").update(value)
        self.truth["vp"][key] = copy.deepcopy(value)
        self._touch("vp", key)

    @rule(key=st.sampled_from(POOL), state=st.sampled_from([d.name for d in DESCRIPTORS]))
    def clear(self, key, state):
        at(self.b, key)
        self.b.state(state).clear()
        if key in self.truth[state]:
            del self.truth[state][key]
            self._touch(state, key)

    @rule(key=st.sampled_from(POOL), value=st.integers(0, 9))
    def list_add(self, key, value):
        at(self.b, key)
        self.b.state("l").add(value)
        self.truth["l"].setdefault(key, []).append(value)
        self._touch("l", key)

    @rule(key=st.sampled_from(POOL), values=st.lists(st.integers(0, 9), max_size=2))
    def list_update(self, key, values):
        at(self.b, key)
        self.b.state("l").update(values)
        if values:
            self.truth["l"][key] = list(values)
            self._touch("l", key)
        elif self.truth["l"].pop(key, None) is not None:
            self._touch("l", key)

    @rule(key=st.sampled_from(POOL), mk=st.sampled_from(["a", "b"]), value=st.integers(0, 9))
    def map_put(self, key, mk, value):
        at(self.b, key)
        self.b.state("m").put(mk, value)
        self.truth["m"].setdefault(key, {})[mk] = value
        self._touch("m", key)

    @rule(key=st.sampled_from(POOL), mk=st.sampled_from(["a", "b"]))
    def map_remove(self, key, mk):
        at(self.b, key)
        self.b.state("m").remove(mk)
        m = self.truth["m"].get(key)
        if m is not None and mk in m:
            del m[mk]
            if not m:
                del self.truth["m"][key]
            self._touch("m", key)

    @rule(key=st.sampled_from(POOL), value=st.integers(0, 9))
    def reduce_add(self, key, value):
        at(self.b, key)
        self.b.state("r").add(value)
        self.truth["r"][key] = self.truth["r"].get(key, 0) + value
        self._touch("r", key)

    @rule(keys=st.lists(st.sampled_from(POOL), max_size=4, unique=True), value=st.integers(0, 3), delete=st.booleans())
    def bulk(self, keys, value, delete):
        by_kg = {}
        for k in keys:
            by_kg.setdefault(key_group(k, M), []).append(k)
        for kg, ks in by_kg.items():
            if delete:
                self.b.delete_many("v", kg, ks)
                for k in ks:
                    if self.truth["v"].pop(k, None) is not None:
                        self._touch("v", k)
            else:
                self.b.put_many("v", kg, ks, [value] * len(ks))
                for k in ks:
                    self.truth["v"][k] = value
                    self._touch("v", k)

    @rule(gap=st.integers(1, 3), full=st.booleans())
    def capture(self, gap, full):
        cid = self.next_id
        self.next_id += gap
        base = self.b.last_confirmed
        assert base == self.confirmed
        deltas = self.b.capture_full(cid) if full else self.b.capture(cid)
        truth = copy.deepcopy(self.truth)
        start = self.materialized[None] if full else self.materialized[base]
        assert apply_deltas(start, deltas) == truth, f"capture {cid} on base {base} lost a change"
        if not full:
            expected = {d.name: set() for d in DESCRIPTORS}
            for t, state, kg in self.touched:
                if t > self.confirm_time:
                    expected[state].add(kg)
            assert {s: set(by_kg) for s, by_kg in deltas.items()} == expected
        self.captures[cid] = dict(full=full, base=base, deltas=deltas, truth=truth, time=self.clock)
        self.pending.append(cid)

    @rule()
    def checkpoint_completes_at_once(self):
        self.capture(1, False)
        self._confirm(self.pending[-1])

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def confirm(self, data):
        self._confirm(data.draw(st.sampled_from(self.pending)))

    def _confirm(self, cid):
        c = self.captures[cid]
        start = self.materialized[None] if c["full"] else self.materialized[c["base"]]
        state = apply_deltas(start, c["deltas"])
        assert state == c["truth"], f"stored delta {cid} no longer reproduces its capture"
        self.b.confirm(cid)
        self.materialized[cid] = state
        self.confirmed = cid
        self.confirm_time = c["time"]
        for later in [x for x in self.pending if x > cid]:
            lc = self.captures[later]
            if not lc["full"] and (lc["base"] is None or lc["base"] <= cid):
                assert apply_deltas(state, lc["deltas"]) == lc["truth"], f"delta {later} on base {cid}"
        self.pending = [x for x in self.pending if x > cid]

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data):
        cid = data.draw(st.sampled_from(self.pending))
        self.b.abort(cid)
        self.pending.remove(cid)

    @invariant()
    def backend_equals_model(self):
        if hasattr(self, "b"):
            assert contents(self.b) == self.truth
            assert self.b.pending_captures == tuple(self.pending)


DirtyTrackingMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDirtyTracking = DirtyTrackingMachine.TestCase


@pytest.mark.parametrize("arrow_type, make", [
    (pa.int64(), int),  # columnar key groups: ColumnDelta
    (pa.float64(), float),
    (pa.string(), str),  # dict key groups: PendingDelta
])
def test_lazy_capture_of_immutable_values_is_frozen_at_the_barrier(arrow_type, make):
    from abs.keygroups import KeyGroupRange, key_group
    from abs.state import ColumnDelta, KeyedStateBackend, PendingDelta, ValueState

    backend = KeyedStateBackend("op", [ValueState("n", arrow_type), ValueState("obj")], 8, KeyGroupRange(0, 7))
    n, obj = backend.state("n"), backend.state("obj")
    for k in range(20):
        backend.current_key, backend.current_kg = k, key_group(k, 8)
        n.update(make(k))
        obj.update([k])
    lazy = backend.capture(1, lazy=True)
    eager_kg = next(iter(lazy["obj"]))
    kind = PendingDelta if arrow_type == pa.string() else ColumnDelta
    assert all(isinstance(d, kind) for d in lazy["n"].values())
    assert isinstance(lazy["obj"][eager_kg], ColumnDelta)  # untyped values: a column, frozen by one pickle
    # writes after the barrier must not leak into the captured delta
    for k in range(40):
        backend.current_key, backend.current_kg = k, key_group(k, 8)
        n.update(make(1000 + k))
        if k % 2:
            n.clear()
    got = {}
    for delta in lazy["n"].values():
        t = delta.to_table()
        assert set(t.column("op").to_pylist()) == {0}
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == {k: make(k) for k in range(20)}
    objs = {}
    for delta in lazy["obj"].values():
        t = delta.to_table()
        objs.update(zip(t.column("key").to_pylist(), map(pickle.loads, t.column("value").to_pylist())))
    assert objs == {k: [k] for k in range(20)}


def test_lazy_capture_with_few_changed_keys_is_frozen_at_the_barrier():
    import pyarrow as pa
    from abs.keygroups import KeyGroupRange, key_group
    from abs.state import KeyedStateBackend, ValueState

    backend = KeyedStateBackend("op", [ValueState("n", pa.int64())], 4, KeyGroupRange(0, 3))
    n = backend.state("n")

    def put(k, v):
        backend.current_key, backend.current_kg = k, key_group(k, 4)
        n.update(v)

    for k in range(2000):
        put(k, 0)
    backend.capture(1)
    backend.confirm(1)
    for k in range(5):  # few changes: values looked up in the synchronous part
        put(k, 7)
    lazy = backend.capture(2, lazy=True)
    for k in range(2000):
        put(k, 99)
    got = {}
    for delta in lazy["n"].values():
        t = delta.to_table()
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == {k: 7 for k in range(5)}


# ----------------------------------------------------------------------------- columnar key groups

COLUMN_KEYS = st.one_of(st.integers(-3, 12), st.sampled_from([1 << 70, "a", ("t", 1), b"b"]))


@pytest.mark.parametrize("typecode", ["q", "O"])
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(COLUMN_KEYS, st.one_of(st.none(), st.integers(-9, 9)), st.booleans()), max_size=40),
       st.integers(0, 40))
def test_a_column_agrees_with_a_dict_under_writes_nulls_and_deletes(typecode, ops, capture_at):
    """Dense slots (a delete moves the last slot into the hole), nulls following their slot,
    keys switching from an int array to a list: reads, full captures and the changed rows of
    an incremental capture all agree with a plain dict. ``O``: a column of Python objects
    (an untyped state), where None is a value like any other."""
    from abs.columns import Column

    col, model = Column(typecode), {}
    changed_after: dict = {}
    for step, (key, value, delete) in enumerate(ops):
        epoch = 1 if step < capture_at else 2
        if delete:
            assert col.delete(key, epoch) == (key in model)
            if key in model:
                changed_after[key] = epoch
            model.pop(key, None)
        else:
            col.set(key, value, epoch)
            model[key] = value
            changed_after[key] = epoch
        assert len(col) == len(model) and dict(col.items()) == model
        assert all(col.get(k) == v for k, v in model.items())
    full = col.capture(0, full=True)
    if model:
        keys, values, nulls = full.delta_rows()
        got = {k: (None if nulls is not None and nulls[i] else values[i] if typecode == "O" else int(values[i]))
               for i, k in enumerate(keys.tolist() if hasattr(keys, "tolist") else keys)}
        assert got == model and full.complete
        assert typecode != "O" or (nulls is None and isinstance(values, list))
    else:
        assert full is None
    since_1 = col.capture(1)  # what changed in epoch 2
    expect_up = {k for k, e in changed_after.items() if e == 2 and k in model}
    expect_del = {k for k, e in changed_after.items() if e == 2 and k not in model}
    if since_1 is None:
        assert not expect_up and not expect_del
    else:
        keys, _, _ = since_1.delta_rows()
        got_up = set(keys.tolist() if hasattr(keys, "tolist") else keys)
        if since_1.complete:
            assert got_up == set(model)
        else:
            assert got_up == expect_up
        assert set(since_1.deleted) == expect_del


def replay_rounds(col: Any, rounds: list, convert: Any = None) -> Iterator[int]:
    """Apply ``rounds`` of ``(key, value, delete)`` writes to a Column, one epoch a round
    (``convert``: applied to the non-null values); yields each epoch after its writes."""
    for epoch, ops in enumerate(rounds, start=1):
        for key, value, delete in ops:
            if delete:
                col.delete(key, epoch)
            else:
                col.set(key, value if convert is None or value is None else convert(value), epoch)
        yield epoch


@pytest.mark.parametrize("typecode", ["q", "O"])
@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(-20, 20), st.one_of(st.none(), st.integers(-9, 9)), st.booleans()),
                         max_size=25), min_size=1, max_size=6))
def test_full_images_sorted_with_remembered_key_orders_equal_a_fresh_sort(typecode, rounds):
    """The writer keeps each key group's key order between snapshots (KeyOrders) and hands
    the store images already sorted. Over rounds of writes, nulls and deletes (which move
    slots), every image and every complete delta must equal the rows the store would get by
    sorting the capture itself, nulls staying with their keys (``O``: an untyped state, its
    values a list of objects); an unchanged key array reuses the remembered order, a changed
    one is sorted afresh."""
    import numpy as np

    from abs.columns import Column, KeyOrders
    from abs.state import ColumnDelta
    from storage.format import sort_by_key

    col, orders = Column(typecode), KeyOrders()
    for epoch in replay_rounds(col, rounds):
        captured = col.capture(epoch - 1, full=True)
        if captured is None:
            continue
        captured.deleted = []  # deletes are not part of an image
        delta = ColumnDelta(captured, pa.int64() if typecode == "q" else None, "value")
        known = orders._known.get("s")
        expect = sort_by_key(delta.to_table())
        got_image = delta.image(orders, "s")
        got_delta = delta.to_table(orders, "s")
        assert got_image.equals(expect)
        assert got_delta.equals(expect)
        keys = np.array(col.keys.tolist(), dtype=np.int64)
        if known is not None and np.array_equal(known[0], keys):
            assert orders._known["s"][1] is known[1]  # same keys: the remembered order, no new sort
            assert np.shares_memory(got_delta.column("key").chunk(0).to_numpy(), known[2])  # and sorted keys
        assert got_delta.column("key").to_pylist() == sorted(keys.tolist())


_HANDLE_OPS = st.lists(
    st.tuples(st.sampled_from(["value", "update", "rmw", "clear", "delete_many"]), st.integers(0, 2),
              st.booleans(), st.integers(-9, 9)),
    max_size=60,
)


@settings(max_examples=500, deadline=None)
@given(_HANDLE_OPS)
def test_column_handle_remembered_slot_never_writes_a_moved_slot(ops):
    """value() remembers the slot it read for update(); deletes move slots (swap-remove). A
    remembered slot that survived a delete would write another key's value: the model
    catches it. A key is either the same object in every "record" (as interned small ints
    are) or a fresh int object (as the runtime's keys usually are)."""
    from abs.columns import Column

    b = KeyedStateBackend("op", [ValueState("n", pa.int64())], 1, KeyGroupRange(0, 0))
    n = b.state("n")
    assert isinstance(b._slot("n").data[0], Column)
    model: dict = {}
    same = [1000 + k for k in range(3)]
    for op, k, same_object, v in ops:
        key = same[k] if same_object else k + 1000  # k + 1000: a new int object
        assert (key is same[k]) == same_object
        b.current_key, b.current_kg = key, 0
        if op == "value":
            assert n.value() == model.get(k)
        elif op == "update":
            n.update(v)
            model[k] = v
        elif op == "rmw":
            n.update((n.value() or 0) + v)
            model[k] = model.get(k, 0) + v
        elif op == "clear":
            n.clear()
            model.pop(k, None)
        else:
            b.delete_many("n", 0, [key])
            model.pop(k, None)
    for k in range(3):
        b.current_key, b.current_kg = same[k], 0
        assert n.value() == model.get(k), k


@pytest.mark.parametrize("delete", ["clear", "delete_many"])
def test_column_handle_update_after_a_slot_moved_writes_its_own_key(delete):
    """The shortest sequence a stale remembered slot gets wrong: A is read in the last
    slot, deleting B moves A into B's hole, C is appended into A's old slot, then A is
    written (the same key object, as an interned int would be)."""
    b = KeyedStateBackend("op", [ValueState("n", pa.int64())], 1, KeyGroupRange(0, 0))
    n = b.state("n")
    a, b_key, c = 1000, 1001, 1002

    def at(key):
        b.current_key, b.current_kg = key, 0

    at(b_key), n.update(1)
    at(a), n.update(2)
    at(a)
    assert n.value() == 2
    if delete == "clear":
        at(b_key), n.clear()
    else:
        b.delete_many("n", 0, [b_key])
    at(c), n.update(3)
    at(a), n.update(5)
    got = {}
    for key in (a, b_key, c):
        at(key)
        got[key] = n.value()
    assert got == {a: 5, b_key: None, c: 3}


@pytest.mark.parametrize("bad", ["text", 1 << 63, 1.5])
def test_column_handle_remembered_slot_refuses_a_value_the_type_cannot_hold(bad):
    """The update of a read-modify-write writes the slot value() found; a value an int64
    cannot hold is refused there as on a lookup (StateError or the array's error, nothing
    changed), and the next update of the key still writes its slot."""
    b = KeyedStateBackend("op", [ValueState("n", pa.int64())], 1, KeyGroupRange(0, 0))
    n = b.state("n")
    b.current_key, b.current_kg = "a", 0
    n.update(1)
    assert n.value() == 1
    with pytest.raises((StateError, TypeError, OverflowError)):
        n.update(bad)
    assert n.value() == 1
    n.update(n.value() + 1)
    b.current_key = "b"
    assert n.value() is None
    b.current_key = "a"
    assert n.value() == 2


def test_untyped_value_state_round_trips_through_restore_with_any_keys():
    """An untyped value state's column restores in bulk (empty column, int keys), with a
    key list (mixed key types), key by key into a non-empty column, and with verify."""
    from array import array

    keys = INT_KEYS[:3] + STR_KEYS[:2] + TUPLE_KEYS[:1]
    src = backend(ValueState("v"))
    values = {}
    for i, k in enumerate(keys):
        at(src, k)
        src.state("v").update({"i": i, "none": None} if i % 2 else None)  # None is a value
        values[k] = {"i": i, "none": None} if i % 2 else None
    tables = src.capture_full(1)["v"]
    for verify in (False, True):
        dst = backend(ValueState("v"))
        for kg, table in tables.items():
            dst.restore("v", kg, resolve_for_restore(table), verify=verify)
        got = {}
        for k in keys:
            at(dst, k)
            got[k] = dst.state("v").value()
        assert got == values
        assert dst.capture(2) == {"v": {}}  # restored keys are not dirty
        for kg in tables:  # int keys stay unboxed in an array, other keys in a list
            col = dst._slot("v").data[kg]
            assert isinstance(col.keys, array) == all(type(k) is int for k in col.keys)
    # into a non-empty column: upserted key by key
    dst = backend(ValueState("v"))
    at(dst, keys[0])
    dst.state("v").update("old")
    at(dst, keys[1])
    dst.state("v").update("kept")
    for kg, table in tables.items():
        dst.restore("v", kg, resolve_for_restore(table))
    at(dst, keys[0])
    assert dst.state("v").value() == values[keys[0]]


def resolve_for_restore(table: pa.Table) -> pa.Table:
    """A full capture's table as the store hands it to restore: upserts only, no op column."""
    return table.drop_columns(["op"])


# ----------------------------------------------------------------------------- untyped lazy capture


def test_lazy_capture_of_untyped_state_is_frozen_at_the_barrier():
    """Untyped values can be mutable objects: the lazy capture (one pickle of the values) must
    hold them as they were at the barrier, whatever the task does to them afterwards."""
    b = backend(ListState("l"), ValueState("v"), MapState("m"))
    l, v, m = (b.state(n) for n in ("l", "v", "m"))
    doc = {"n": 1, "tags": ["a"]}
    for k in INT_KEYS[:3]:
        at(b, k)
        l.add(k)
        v.update(doc)
        m.put("x", [k])
    lazy = b.capture(1, lazy=True)
    # untyped value state: a column (ColumnDelta); list and map states: dicts (PickledDelta)
    assert all(isinstance(d, ColumnDelta if name == "v" else PickledDelta) for name, by_kg in lazy.items()
               for d in by_kg.values())
    for k in INT_KEYS[:3]:  # after the barrier: in-place mutations and new writes
        at(b, k)
        l.add(99)
        m.get("x").append(99)
    doc["tags"].append("b")
    doc["n"] = 2
    at(b, INT_KEYS[0])
    v.clear()
    got = apply_deltas({}, {name: {kg: d.to_table() for kg, d in by_kg.items()} for name, by_kg in lazy.items()})
    assert got == {
        "l": {k: [k] for k in INT_KEYS[:3]},
        "v": {k: {"n": 1, "tags": ["a"]} for k in INT_KEYS[:3]},
        "m": {k: {"x": [k]} for k in INT_KEYS[:3]},
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["put", "add", "clear"]), st.sampled_from(INT_KEYS + STR_KEYS),
                          st.integers(-5, 5)), max_size=40), st.booleans())
def test_lazy_untyped_deltas_equal_eager_ones_and_survive_pickling(ops, confirm_first):
    """Replaying the same writes on two backends, one captured lazily (ColumnDelta for the
    value state, PickledDelta for the list state; each also pickled and unpickled as the
    writer process gets it) and one eagerly, gives the same rows."""
    lazy_b, eager_b = backend(ValueState("v"), ListState("l")), backend(ValueState("v"), ListState("l"))
    for i, (op, key, x) in enumerate(ops):
        for b in (lazy_b, eager_b):
            at(b, key)
            if op == "put":
                b.state("v").update({"x": x})
            elif op == "add":
                b.state("l").add(x)
            else:
                b.state("v").clear()
                b.state("l").clear()
        if confirm_first and i == len(ops) // 2:
            for b in (lazy_b, eager_b):
                b.capture(1)
                b.confirm(1)
    lazy = lazy_b.capture(2, lazy=True)
    eager = eager_b.capture(2)
    assert lazy.keys() == eager.keys()
    for name in eager:
        assert lazy[name].keys() == eager[name].keys()
        for kg, table in eager[name].items():
            d = lazy[name][kg]
            shipped = pickle.loads(pickle.dumps(d, protocol=5))
            assert decode_table(d.to_table()) == decode_table(table) == decode_table(shipped.to_table())
            if isinstance(d, PickledDelta):
                assert d.image() is None and not d.complete
