"""The keyed-backend contract (abs/state/protocol.py), checked against every backend.

Each test runs against the dict backend (typed value state in columnar key groups, untyped
value state, and a reducing state in dict key groups), the columnar aggregate store and the
switching aggregate backend, on what they all hold: int64 keys with int64 values. Writes go
through each backend's own write path (handles; ``slots_for``/``touch`` for the columnar
store, as the aggregate does); everything else goes through the protocol alone: capture,
confirm, abort, restore from resolved chains, key groups, items.
"""
from __future__ import annotations

import inspect
import pickle

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from abs.errors import StateError
from abs.keygroups import KeyGroupRange, key_group
from abs.state import (
    AggregateBackend,
    ColumnarKeyedState,
    KeyedBackend,
    KeyedStateBackend,
    ReducingState,
    ValueState,
)
from abs.state.protocol import Delta
from storage import resolve_chain

M = 16
RANGE = KeyGroupRange(4, 11)
KEYS = [k for k in range(400) if key_group(k, M) in RANGE][:24]
OUTSIDE = next(k for k in range(400) if key_group(k, M) not in RANGE)
NAME = "v"


def _replace(_old, new):
    return new


class Variant:
    """One backend under test: how to build it and how to write one key's value."""

    def __init__(self, name, make, write):
        self.name = name
        self.make = make
        self.write = write

    def __repr__(self):
        return self.name


def _dict_backend(descriptor):
    def make(rng=RANGE):
        return KeyedStateBackend("op", [descriptor], M, rng)

    def write(b, key, value):
        b.set_current_key(key)
        h = b.state(NAME)
        if isinstance(descriptor, ReducingState):
            h.add(value)
        else:
            h.update(value)

    return make, write


def _columnar_write(store, key, value):
    """What the aggregate's columnar fold does for one row: find or add the slot, stamp it,
    write the accumulator."""
    slots = store.slots_for(np.array([key], np.int64))
    store.touch(slots)
    col = store.columns[NAME]
    col.values[slots] = value
    col.valid[slots] = True


def _make_columnar(rng=RANGE):
    return ColumnarKeyedState("op", [ValueState(NAME, pa.int64())], M, rng)


def _make_aggregate(rng=RANGE):
    return AggregateBackend(KeyedStateBackend("op", [ValueState(NAME, pa.int64())], M, rng), {NAME: 0})


def _aggregate_write(b, key, value):
    if b.columnar is not None:
        _columnar_write(b.columnar, key, value)
    else:
        _dict_backend(ValueState(NAME, pa.int64()))[1](b.dict_backend, key, value)


VARIANTS = [
    Variant("dict-typed-columns", *_dict_backend(ValueState(NAME, pa.int64()))),
    Variant("dict-untyped", *_dict_backend(ValueState(NAME))),
    Variant("dict-reducing", *_dict_backend(ReducingState(NAME, _replace, pa.int64()))),
    Variant("columnar", _make_columnar, _columnar_write),
    Variant("aggregate", _make_aggregate, _aggregate_write),
]
COLUMNAR = [v for v in VARIANTS if v.name in ("columnar", "aggregate")]
DICT = [v for v in VARIANTS if v.name.startswith("dict")]


def restorable(source: Variant, target: Variant) -> bool:
    """A snapshot restores into a state of the same kind; the bare columnar store takes typed
    numeric tables only (the aggregate backend moves to the dict backend for the others)."""
    if (source.name == "dict-reducing") != (target.name == "dict-reducing"):
        return False
    return not (target.name == "columnar" and source.name == "dict-untyped")


def rows(delta) -> dict:
    """{key: (op, value)} of a delta (a table or a lazy Delta), decoded independently."""
    table = delta if isinstance(delta, pa.Table) else delta.to_table()
    meta = table.schema.metadata
    keys = table.column("key").to_pylist()
    values = table.column("value").to_pylist()
    if meta[b"abs.key_encoding"] == b"pickle":
        keys = [pickle.loads(k) for k in keys]
    if meta[b"abs.value_encoding"] == b"pickle":
        values = [None if v is None else pickle.loads(v) for v in values]
    ops = table.column("op").to_pylist() if "op" in table.schema.names else [0] * len(keys)
    assert len(set(keys)) == len(keys), "a delta holds each key once"
    return {k: (o, v) for k, o, v in zip(keys, ops, values)}


def tables(captured) -> dict:
    return {kg: d if isinstance(d, pa.Table) else d.to_table() for kg, d in captured[NAME].items()}


# ----------------------------------------------------------------------------- shape


PROTOCOL_MEMBERS = [n for n in dir(KeyedBackend) if not n.startswith("_")]


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_implements_the_protocol(variant):
    b = variant.make()
    assert isinstance(b, KeyedBackend)
    assert PROTOCOL_MEMBERS  # the protocol is not empty
    for name in PROTOCOL_MEMBERS:
        declared = inspect.getattr_static(KeyedBackend, name)
        if isinstance(declared, property):
            getattr(b, name)  # readable
            continue
        want = inspect.signature(declared)
        got = inspect.signature(getattr(type(b), name))
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == [
            (p.name, p.kind, p.default) for p in want.parameters.values()
        ], (variant, name)
    assert b.operator_uid == "op" and b.max_parallelism == M and b.key_group_range == RANGE
    assert [d.name for d in b.descriptors] == [NAME]
    assert b.last_confirmed is None and b.pending_captures == ()


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_lazy_deltas_are_deltas(variant):
    b = variant.make()
    for k in KEYS[:5]:
        variant.write(b, k, k)
    captured = b.capture(1, lazy=True)
    assert captured[NAME]
    for kg, d in captured[NAME].items():
        if not isinstance(d, pa.Table):
            assert isinstance(d, Delta)
            assert isinstance(d.to_table(), pa.Table)
            assert d.complete in (True, False)


# ----------------------------------------------------------------------------- key groups


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_deltas_are_per_key_group_of_the_range(variant):
    b = variant.make()
    for k in KEYS:
        variant.write(b, k, k * 10)
    captured = b.capture(1)
    assert set(captured) == {NAME}
    seen = {}
    for kg, table in tables(captured).items():
        assert kg in RANGE
        for key, (op, value) in rows(table).items():
            assert key_group(key, M) == kg
            seen[key] = (op, value)
    assert seen == {k: (0, k * 10) for k in KEYS}
    for kg in RANGE:
        got = dict(b.items(NAME, kg))
        assert got == {k: k * 10 for k in KEYS if key_group(k, M) == kg}
    assert dict(b.items(NAME)) == {k: k * 10 for k in KEYS}


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_a_key_outside_the_range_is_refused(variant):
    b = variant.make()
    with pytest.raises(StateError, match="outside this subtask's range"):
        variant.write(b, OUTSIDE, 1)
    assert dict(b.items(NAME)) == {}


# ----------------------------------------------------------------------------- incremental deltas


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_a_delta_holds_what_changed_since_the_last_confirmed_checkpoint(variant):
    b = variant.make()
    for k in KEYS:
        variant.write(b, k, 1)
    assert b.capture(1, lazy=True)[NAME]
    b.confirm(1)
    assert b.last_confirmed == 1
    assert b.capture(2)[NAME] == {}, "nothing changed since 1"
    b.confirm(2)
    variant.write(b, KEYS[0], 5)
    first = {k: v for t in tables(b.capture(3)).values() for k, v in rows(t).items()}
    assert first == {KEYS[0]: (0, 5)}
    variant.write(b, KEYS[1], 6)
    # 3 is not confirmed: 4 carries both changes (overlapping captures)
    second = {k: v for t in tables(b.capture(4)).values() for k, v in rows(t).items()}
    assert second == {KEYS[0]: (0, 5), KEYS[1]: (0, 6)}
    assert b.pending_captures == (3, 4)
    b.abort(3)  # forgets nothing
    b.confirm(4)
    b.confirm(3)  # late and older: harmless
    assert b.last_confirmed == 4 and b.pending_captures == ()
    assert b.capture(5)[NAME] == {}


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_an_aborted_capture_forgets_nothing(variant):
    b = variant.make()
    variant.write(b, KEYS[0], 1)
    b.capture(1)
    b.abort(1)
    variant.write(b, KEYS[1], 2)
    got = {k: v for t in tables(b.capture(2)).values() for k, v in rows(t).items()}
    assert got == {KEYS[0]: (0, 1), KEYS[1]: (0, 2)}


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_checkpoint_ids_must_increase(variant):
    b = variant.make()
    b.capture(3)
    with pytest.raises(StateError, match="must increase"):
        b.capture(3)
    b.confirm(3)
    with pytest.raises(StateError, match="must increase"):
        b.capture(2)
    with pytest.raises(StateError, match="is not an int"):
        b.capture("4")


# every step: write a key, capture (eager or lazy), confirm or abort a pending capture
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.sampled_from(KEYS[:10]), st.integers(-(2**40), 2**40)),
        st.tuples(st.just("capture"), st.booleans()),
        st.tuples(st.just("confirm"), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 3)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_confirmed_deltas_fold_into_the_state_and_restore(variant, steps):
    """The state at each confirmed checkpoint is the previous confirmed state plus its delta,
    and the chain of confirmed deltas, resolved, restores into a fresh backend of every kind."""
    b = variant.make()
    model: dict = {}
    captured: dict[int, tuple[dict, dict]] = {}  # id -> (kg -> delta table, model at capture)
    chains: dict[int, list] = {}  # kg -> confirmed delta tables, oldest first
    confirmed: dict = {}  # the state at the last confirmed checkpoint
    next_id = 1
    for step in steps:
        if step[0] == "write":
            _, key, value = step
            variant.write(b, key, value)
            model[key] = value
        elif step[0] == "capture":
            deltas = b.capture(next_id, lazy=step[1])
            captured[next_id] = (tables(deltas), dict(model))
            next_id += 1
        else:
            pending = sorted(c for c in captured if c in b.pending_captures)
            if not pending:
                continue
            cid = pending[min(step[1], len(pending) - 1)]
            if step[0] == "abort":
                b.abort(cid)
                continue
            by_kg, at_capture = captured[cid]
            b.confirm(cid)
            for kg, table in by_kg.items():
                chains.setdefault(kg, []).append(table)
                confirmed.update({k: v for k, (op, v) in rows(table).items() if op == 0})
            assert confirmed == at_capture, f"confirmed state of checkpoint {cid}"
    assert dict(b.items(NAME)) == model
    for target in [t for t in VARIANTS if restorable(variant, t)]:
        fresh = target.make()
        for kg, chain in chains.items():
            fresh.restore(NAME, kg, resolve_chain(chain, first_is_base=False), verify=True)
        assert dict(fresh.items(NAME)) == confirmed, (variant, target)
        assert fresh.capture(1)[NAME] == {}, "restored keys are not changed keys"


# ----------------------------------------------------------------------------- restore


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_a_full_capture_restores_into_every_backend(variant):
    b = variant.make()
    for k in KEYS:
        variant.write(b, k, -k)
    b.capture(1)
    b.confirm(1)
    full = b.capture_full(2)
    assert set(full[NAME]) == {key_group(k, M) for k in KEYS}
    for table in full[NAME].values():
        assert all(op == 0 for op, _ in rows(table).values())
    for target in [t for t in VARIANTS if restorable(variant, t)]:
        fresh = target.make()
        for kg, table in full[NAME].items():
            fresh.restore(NAME, kg, table)
        assert dict(fresh.items(NAME)) == {k: -k for k in KEYS}, target
        target.write(fresh, KEYS[0], 99)  # a restored backend goes on: only the new change is dirty
        got = {k: v for t in tables(fresh.capture(1)).values() for k, v in rows(t).items()}
        assert got == {KEYS[0]: (0, 99)}, target


def _table_of(variant, keys_values):
    b = variant.make(KeyGroupRange(0, M - 1))
    for k, v in keys_values:
        variant.write(b, k, v)
    return b.capture_full(1)[NAME]


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_restore_with_verify_refuses_keys_of_another_key_group(variant):
    by_kg = _table_of(variant, [(k, 1) for k in KEYS])
    kg, table = next(iter(by_kg.items()))
    wrong = next(g for g in RANGE if g != kg)
    b = variant.make()
    with pytest.raises(StateError, match="wrong key group"):
        b.restore(NAME, wrong, table, verify=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_restore_refuses_a_key_group_outside_the_range(variant):
    table = _table_of(variant, [(OUTSIDE, 1)])[key_group(OUTSIDE, M)]
    with pytest.raises(StateError, match="outside this subtask's range"):
        variant.make().restore(NAME, key_group(OUTSIDE, M), table)


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_restore_refuses_another_state_kind_and_unresolved_deletes(variant):
    kg = key_group(KEYS[0], M)
    table = _table_of(variant, [(KEYS[0], 1)])[kg]
    other = b"value" if variant.name == "dict-reducing" else b"reducing"
    relabeled = table.replace_schema_metadata({**table.schema.metadata, b"abs.state_kind": other})
    with pytest.raises(StateError, match="declared as"):
        variant.make().restore(NAME, kg, relabeled)
    op = pa.array([1] * table.num_rows, pa.int8())
    with_delete = table.set_column(table.schema.get_field_index("op"), pa.field("op", pa.int8(), nullable=False), op)
    with pytest.raises(StateError, match="contains deletes"):
        variant.make().restore(NAME, kg, with_delete)


def test_the_columnar_store_refuses_a_table_it_cannot_hold_and_the_aggregate_backend_moves():
    untyped = next(v for v in VARIANTS if v.name == "dict-untyped")
    kg = key_group(KEYS[0], M)
    table = _table_of(untyped, [(KEYS[0], 7)])[kg]
    with pytest.raises(StateError, match="does not fit the columnar store"):
        _make_columnar().restore(NAME, kg, table)
    agg = _make_aggregate()
    agg.restore(NAME, kg, table)
    assert agg.columnar is None, "moved to the dict backend"
    assert dict(agg.items(NAME)) == {KEYS[0]: 7}


@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_unknown_state_is_named(variant):
    with pytest.raises(StateError, match="no state named 'nope'"):
        list(variant.make().items("nope"))


# ----------------------------------------------------------------------------- deletes (dict backend only)


@pytest.mark.parametrize("variant", DICT, ids=repr)
def test_a_delete_through_a_handle_is_in_the_delta_and_resolves_away(variant):
    """The columnar store never deletes (an aggregate keeps its keys); the dict backend's
    deletes travel as op=1 rows and vanish when the chain is resolved."""
    b = variant.make()
    for k in KEYS[:3]:
        variant.write(b, k, k + 1)
    kg0 = key_group(KEYS[0], M)
    base = tables(b.capture(1))
    b.confirm(1)
    b.set_current_key(KEYS[0])
    handle = b.state(NAME)
    assert (handle.get() if isinstance(b.descriptors[0], ReducingState) else handle.value()) == KEYS[0] + 1
    handle.clear()
    assert (handle.get() if isinstance(b.descriptors[0], ReducingState) else handle.value()) is None
    delta = tables(b.capture(2))
    assert rows(delta[kg0])[KEYS[0]] == (1, None)
    resolved = resolve_chain([base[kg0], delta[kg0]], first_is_base=False)
    fresh = variant.make()
    fresh.restore(NAME, kg0, resolved)
    assert dict(fresh.items(NAME, kg0)) == {k: k + 1 for k in KEYS[1:3] if key_group(k, M) == kg0}


@pytest.mark.parametrize("variant", COLUMNAR, ids=repr)
def test_columnar_capture_of_every_key_of_a_key_group_is_complete(variant):
    """Both backends mark a delta that holds the whole key group ``complete`` (storage then
    writes it as a base); the columnar store when every slot of the key group changed."""
    b = variant.make()
    kg0 = key_group(KEYS[0], M)
    same = [k for k in KEYS if key_group(k, M) == kg0]
    for k in same:
        variant.write(b, k, 1)
    b.capture(1)
    b.confirm(1)
    for k in same:
        variant.write(b, k, 2)
    d = b.capture(2, lazy=True)[NAME][kg0]
    assert d.complete is True
    if len(same) > 1:
        b.confirm(2)
        variant.write(b, same[0], 3)
        assert b.capture(3, lazy=True)[NAME][kg0].complete is False
