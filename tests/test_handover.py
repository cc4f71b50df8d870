"""Key groups leaving one subtask's backend and joining another's (abs.state.handover), and
the chain bookkeeping that goes with it (CheckpointSession.forget).

The model: a dict per state of what the key group holds. Random writes and deletes run on the
old owner between captures and confirmations; the handover (the changes since the last
confirmed checkpoint over that checkpoint's resolved image, or everything) must give the new
owner exactly the model, the old owner must refuse the key group from then on, and the new
owner's next capture must hold every live key (it writes the key group as a base of its own).
"""
from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from abs.errors import StateError
from abs.keygroups import KeyGroupRange, key_group
from abs.state import KeyedStateBackend, ListState, MapState, ValueState
from abs.state.handover import adopt_key_group, export_key_group, release_key_group
from storage import resolve_chain
from storage.session import CheckpointSession

M = 8
KG = 3
KEYS = [k for k in range(2000) if key_group(k, M) == KG][:12]
SKEYS = [f"k{k}" for k in range(4000) if key_group(f"k{k}", M) == KG][:12]

STATES = {
    "typed": (ValueState("s", pa.int64()), KEYS, lambda i: i * 7),  # a column of int64
    "untyped": (ValueState("s"), SKEYS, lambda i: {"n": i}),  # a column of objects
    "list": (ListState("s", pa.int64()), KEYS, lambda i: [i, i + 1]),  # dict key groups
    "map": (MapState("s"), SKEYS, lambda i: {"a": i}),
}


def _write(b, kind, key, value):
    b.set_current_key(key)
    h = b.state("s")
    if kind == "list":
        h.update(value)
    elif kind == "map":
        h.clear()
        for k, v in value.items():
            h.put(k, v)
    else:
        h.update(value)


def _delete(b, key):
    b.set_current_key(key)
    b.state("s").clear()


def _image(b, cid):
    """The resolved table of KG as of capture ``cid`` (a full capture folded)."""
    full = b.capture_full(cid)["s"].get(KG)
    return None if full is None else resolve_chain([full], first_is_base=True)


ops = st.lists(st.tuples(st.sampled_from(["w", "d"]), st.integers(0, 11), st.integers(0, 50)), max_size=30)


@pytest.mark.parametrize("kind", sorted(STATES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=ops, after=ops, pending=ops, full=st.booleans(), capture_pending=st.booleans())
def test_handover_gives_the_new_owner_exactly_the_state(kind, before, after, pending, full, capture_pending):
    descriptor, keys, value = STATES[kind]
    old = KeyedStateBackend("op", [descriptor], M, KeyGroupRange(0, M - 1))
    new = KeyedStateBackend("op", [descriptor], M, KeyGroupRange(0, 1))
    model: dict = {}

    def run(steps):
        for op, i, v in steps:
            key = keys[i]
            if op == "w":
                _write(old, kind, key, value(v))
                model[key] = value(v)
            else:
                _delete(old, key)
                model.pop(key, None)

    run(before)
    base = _image(old, 1)  # checkpoint 1: its resolved image is what storage would give back
    old.confirm(1)
    run(after)
    if capture_pending:
        old.capture(2)  # captured, never confirmed before the handover
    run(pending)
    changes = export_key_group(old, KG, full=full)
    release_key_group(old, KG)
    adopt_key_group(new, KG, {} if full or base is None else {"s": base}, changes)

    got = dict(new.items("s", KG))
    assert got == model
    with pytest.raises(StateError):
        old.items("s", KG)
    assert KG not in old.key_group_range and KG in new.key_group_range
    # the new owner's next capture holds every live key: it starts a chain of its own
    captured = new.capture(5)["s"].get(KG)
    if model:
        table = captured if isinstance(captured, pa.Table) else captured.to_table()
        live = resolve_chain([table], first_is_base=False)
        assert set(live.column("key").to_pylist()) == set(model)
    else:
        assert captured is None


def test_a_released_key_group_refuses_records():
    b = KeyedStateBackend("op", [ValueState("s", pa.int64())], M, KeyGroupRange(0, M - 1))
    _write(b, "typed", KEYS[0], 1)
    release_key_group(b, KG)
    b.current_key, b.current_kg = KEYS[0], KG
    with pytest.raises(StateError, match="outside this subtask"):
        b.state("s").update(2)
    with pytest.raises(StateError, match="does not own"):
        release_key_group(b, KG)


def test_adopting_an_owned_key_group_is_refused():
    b = KeyedStateBackend("op", [ValueState("s", pa.int64())], M, KeyGroupRange(0, M - 1))
    with pytest.raises(StateError, match="already owns"):
        adopt_key_group(b, KG, {}, {})


def test_a_pending_capture_still_writes_a_released_key_group():
    """A checkpoint aligned before the handover holds the key group at its old owner."""
    b = KeyedStateBackend("op", [ValueState("s", pa.int64())], M, KeyGroupRange(0, M - 1))
    _write(b, "typed", KEYS[0], 5)
    captured = b.capture(1, lazy=True)["s"][KG]
    release_key_group(b, KG)
    table = captured.to_table()
    assert table.column("key").to_pylist() == [KEYS[0]] and table.column("value").to_pylist() == [5]


# ----------------------------------------------------------------------------- session


def _ref(cid, kg):
    return f"state/op/s/{kg}/{cid}.arrow"  # the session keeps chains as they come


def test_forget_drops_the_key_group_from_checkpoints_captured_before_the_move():
    s = CheckpointSession()
    s.declare("op", ["s"])
    s.written(1, "op", {"s": {1: [_ref(1, 1)], 2: [_ref(1, 2)]}})
    s.forget("op", 2, captured=1)  # moved out after capture 1
    assert s.confirm(1, "op")
    assert sorted(s.confirmed("op")["s"]) == [1]  # the old owner never names key group 2 again
    s.written(2, "op", {"s": {1: [_ref(2, 1)]}})
    assert s.confirm(2, "op")
    assert sorted(s.confirmed("op")["s"]) == [1]


def test_forget_keeps_what_a_later_capture_wrote():
    """A new owner: chains captured before the key group arrived do not hold it, the first one
    after does, and confirming an older checkpoint late does not drop it."""
    s = CheckpointSession()
    s.declare("op", ["s"])
    s.written(3, "op", {"s": {1: [_ref(3, 1)]}})
    s.forget("op", 2, captured=3)  # moved in after capture 3
    s.written(4, "op", {"s": {1: [_ref(3, 1)], 2: [_ref(4, 2)]}})
    assert s.confirm(3, "op")
    assert sorted(s.confirmed("op")["s"]) == [1]
    assert s.confirm(4, "op")
    assert s.confirmed("op")["s"][2] == [_ref(4, 2)]


def test_a_key_group_moved_out_and_back_drops_its_stale_chain():
    s = CheckpointSession()
    s.declare("op", ["s"])
    s.restored("op", "s", 2, [_ref(1, 2)])
    s.written(2, "op", {"s": {2: [_ref(1, 2), _ref(2, 2)]}})
    s.forget("op", 2, captured=2)  # out after capture 2
    s.forget("op", 2, captured=2)  # and back before the next capture
    assert s.confirm(2, "op")
    assert s.confirmed("op")["s"] == {}  # written whole again, never over the stale chain
