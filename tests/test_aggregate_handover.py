"""Key groups of the vectorized aggregate moving between subtasks while the job runs, in the
columnar store's own form (ColumnarKeyedState.export_key_group / release_key_group /
adopt_key_group through AggregateBackend and KeyedOp.hand_out / take_in).

The model: per key, its running sum and count, and per subtask the image of each key group as
of its last confirmed capture (the captures of a subtask folded when a confirmation covers
them, as storage resolves a chain). A schedule of batches (each key routed to its key group's
owner), captures, confirmations, aborts, moves of key groups back and forth and compactions
(refused while a capture is unconfirmed) must keep:
every subtask's state equal to the model on the key groups it owns and empty elsewhere; every
capture free of key groups the subtask does not own; a key of a key group the subtask gave
away refused; the new owner's first capture after a move holding the whole key group; and
both stores columnar throughout.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from abs.errors import StateError
from abs.keygroups import key_group
from abs.state import columnar as columnar_module
from abs.state.keyindex import HashFill
from test_aggregate import M, as_table, batch, feed, make_op

AGGS = {"s": ("v", "sum"), "n": ("v", "count")}
INT_POOL = [0, 1, 2, 3, 5, 8, 13, -1, -7, 1000, 2**40, 77, 78, 79, 4096, 4097]
STR_POOL = [f"k{i}" for i in range(12)] + [f"customer-{i:04d}" for i in range(12)]  # short (exact codes) and long (hashed)


def _key_type(pool):
    return pa.string() if isinstance(pool[0], str) else pa.int64()


def _owned(op):
    return set(op.key_group_range)


def _state(op, name):
    return {k: v for k, v in op.backend.items(name)}


def _table_of(rows: dict, key_type) -> pa.Table:
    keys = sorted(rows)
    return pa.table({"key": pa.array(keys, key_type), "value": pa.array([rows[k] for k in keys], pa.int64())})


class Subtask:
    """One aggregate subtask and what storage holds of it: per key group, the image of its
    last confirmed capture (captures folded in order when a confirmation covers them)."""

    def __init__(self, subtask: int, key_type) -> None:
        self.op = make_op(AGGS, emit="none", parallelism=2, subtask=subtask)
        self.key_type = key_type
        self.stored: dict[str, dict[int, dict]] = {"s": {}, "n": {}}
        self.pending: dict[int, dict] = {}  # capture id -> its deltas (state -> kg -> rows)
        self.last_id = 0
        self.confirmed = 0
        self.fresh: set[int] = set()  # key groups taken in since the last capture: it must hold them whole

    def capture(self, cid: int, model: dict) -> None:
        deltas = self.op.backend.capture(cid, lazy=bool(cid % 2))
        mine = _owned(self.op)
        got: dict = {}
        for name, by_kg in deltas.items():
            got[name] = {}
            for kg, d in by_kg.items():
                assert kg in mine, f"capture {cid} holds key group {kg}, which the subtask does not own ({mine})"
                t = as_table(d)
                assert set(t.column("op").to_pylist()) <= {0}
                got[name][kg] = dict(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        for kg in self.fresh:  # taken in since the last capture: every key of it, in every state
            want = {k for k in model if key_group(k, M) == kg}
            for name in ("s", "n"):
                assert set(got[name].get(kg, {})) == want, (name, kg)
        self.fresh = set()
        self.pending[cid] = got
        self.last_id = cid

    def confirm(self, cid: int) -> None:
        self.op.backend.confirm(cid)
        self.confirmed = max(self.confirmed, cid)
        for c in sorted(c for c in self.pending if c <= cid):
            for name, by_kg in self.pending.pop(c).items():
                for kg, rows in by_kg.items():
                    self.stored[name].setdefault(kg, {}).update(rows)

    def abort(self, cid: int) -> None:
        self.op.backend.abort(cid)
        self.pending.pop(cid, None)


def _move(src: Subtask, dst: Subtask, kg: int, full: bool) -> None:
    used_full = full or src.op.need_full
    tables, chains = src.op.hand_out(kg, full=full)
    base = {} if used_full else {name: _table_of(src.stored[name].get(kg, {}), src.key_type)
                                 for name in ("s", "n") if src.stored[name].get(kg)}
    for name in ("s", "n"):  # the old owner's chain of the key group is forgotten
        src.stored[name].pop(kg, None)
        dst.stored[name].pop(kg, None)
    for p in src.pending.values():  # captures taken before the move still write it at the old owner
        for name in p:
            p[name].pop(kg, None)
    dst.op.take_in(kg, base, tables)
    src.fresh.discard(kg)
    dst.fresh.add(kg)


def _check(subtasks, model: dict) -> None:
    for t in subtasks:
        mine = _owned(t.op)
        assert t.op.backend.columnar is not None, "the store stays columnar"
        want_s = {k: v[0] for k, v in model.items() if key_group(k, M) in mine}
        want_n = {k: v[1] for k, v in model.items() if key_group(k, M) in mine}
        assert _state(t.op, "s") == want_s
        assert _state(t.op, "n") == want_n


def schedules(pool):
    return st.lists(
        st.one_of(
            st.tuples(st.just("batch"), st.lists(st.tuples(st.sampled_from(pool), st.integers(-50, 50)), max_size=20)),
            st.tuples(st.just("capture"), st.integers(0, 1)),
            st.tuples(st.just("confirm"), st.integers(0, 1), st.integers(0, 2)),
            st.tuples(st.just("abort"), st.integers(0, 1)),
            st.tuples(st.just("move"), st.integers(0, M - 1), st.booleans()),
            st.tuples(st.just("misroute"), st.sampled_from(pool)),
            st.tuples(st.just("compact"), st.integers(0, 1)),
        ),
        max_size=40,
    )


def run_schedule(steps, pool) -> None:
    key_type = _key_type(pool)
    subtasks = [Subtask(0, key_type), Subtask(1, key_type)]
    model: dict = {}  # key -> [sum, count]
    next_id = 0
    for step in steps:
        kind = step[0]
        if kind == "batch":
            for t in subtasks:  # each key to its key group's owner, in order
                rows = [(k, v) for k, v in step[1] if key_group(k, M) in _owned(t.op)]
                if rows:
                    feed(t.op, batch([k for k, _ in rows], [v for _, v in rows], key_type=key_type))
            for k, v in step[1]:
                got = model.setdefault(k, [0, 0])
                got[0] += v
                got[1] += 1
        elif kind == "capture":
            next_id += 1
            subtasks[step[1]].capture(next_id, model)
        elif kind == "confirm":
            t = subtasks[step[1]]
            ids = sorted(t.pending)
            if ids:
                t.confirm(ids[-1 - step[2] % len(ids)])
        elif kind == "abort":
            t = subtasks[step[1]]
            if t.pending:
                t.abort(max(t.pending))
        elif kind == "move":
            kg = step[1]
            src, dst = subtasks if kg in _owned(subtasks[0].op) else subtasks[::-1]
            if len(_owned(src.op)) > 1:  # a subtask keeps a key group
                _move(src, dst, kg, step[2])
        elif kind == "compact":  # drop the slots of key groups given away (once every capture is confirmed)
            t = subtasks[step[1]]
            store = t.op.backend.columnar
            if t.last_id > t.confirmed:
                with pytest.raises(StateError, match="no confirmation covers"):
                    store.compact()
            else:
                store.compact()
                mine = _owned(t.op)
                assert store.n == sum(1 for k in model if key_group(k, M) in mine)
        else:  # a key sent to a subtask that does not own its key group is refused
            k = step[1]
            wrong = subtasks[1] if key_group(k, M) in _owned(subtasks[0].op) else subtasks[0]
            before = (_state(wrong.op, "s"), _state(wrong.op, "n"))
            with pytest.raises(StateError, match="outside this subtask's range"):
                feed(wrong.op, batch([k], [1], key_type=key_type))
            assert (_state(wrong.op, "s"), _state(wrong.op, "n")) == before
        _check(subtasks, model)
    # what storage holds of each subtask, after a last capture confirmed, is the model
    for t in subtasks:
        next_id += 1
        t.capture(next_id, model)
        t.confirm(next_id)
        mine = _owned(t.op)
        for name, i in (("s", 0), ("n", 1)):
            held = {k: v for kg, rows in t.stored[name].items() if kg in mine for k, v in rows.items()}
            assert held == {k: v[i] for k, v in model.items() if key_group(k, M) in mine}, name


SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(schedules(INT_POOL))
def test_int_keyed_key_groups_move_back_and_forth_exactly(steps):
    run_schedule(steps, INT_POOL)


@SETTINGS
@given(schedules(STR_POOL))
def test_string_keyed_key_groups_move_back_and_forth_exactly(steps):
    run_schedule(steps, STR_POOL)


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("pool", [INT_POOL, STR_POOL], ids=["int", "string"])
def test_a_key_group_moves_in_the_columnar_form_and_comes_back(pool, full):
    """One key group there and back, with changes on both sides: both stores stay columnar,
    the keys coming back find their old slots (no slot is added), and each side holds exactly
    its key groups' sums."""
    key_type = _key_type(pool)
    a, b = Subtask(0, key_type), Subtask(1, key_type)
    kg = next(g for g in _owned(a.op) if sum(key_group(k, M) == g for k in pool) >= 2)
    mine = [k for k in pool if key_group(k, M) in _owned(a.op)]
    model = {k: [i, 1] for i, k in enumerate(mine)}
    feed(a.op, batch(mine, list(range(len(mine))), key_type=key_type))
    a.capture(1, model)
    a.confirm(1)
    moved = [k for k in mine if key_group(k, M) == kg]
    feed(a.op, batch(moved[:1], [100], key_type=key_type))
    model[moved[0]] = [model[moved[0]][0] + 100, 2]
    slots_before = a.op.backend.columnar.n
    _move(a, b, kg, full)
    _check([a, b], model)
    with pytest.raises(StateError, match="outside this subtask's range"):  # its slot is still there
        feed(a.op, batch(moved[:1], [1], key_type=key_type))
    _check([a, b], model)
    feed(b.op, batch(moved, [1] * len(moved), key_type=key_type))
    for k in moved:
        model[k] = [model[k][0] + 1, model[k][1] + 1]
    b.capture(2, model)
    b.confirm(2)
    _move(b, a, kg, full)
    _check([a, b], model)
    assert a.op.backend.columnar.n == slots_before, "the keys found their old slots"
    a.capture(3, model)
    _check([a, b], model)


def test_a_table_that_does_not_fit_moves_the_new_owner_to_the_dict_backend():
    """A handed-over key group the columnar store cannot hold (string keys into a store of int
    keys) moves the new owner to the dict backend, with every value it had."""
    a = Subtask(0, pa.string())
    b = Subtask(1, pa.int64())
    kg = next(iter(_owned(a.op)))
    keys = [k for k in STR_POOL if key_group(k, M) == kg]
    ints = [k for k in INT_POOL if key_group(k, M) in _owned(b.op)]
    feed(a.op, batch(keys, [3] * len(keys), key_type=pa.string()))
    feed(b.op, batch(ints, [5] * len(ints)))
    tables, _ = a.op.hand_out(kg, full=True)
    b.op.take_in(kg, {}, tables)
    assert b.op.backend.columnar is None
    assert _state(b.op, "s") == {**{k: 3 for k in keys}, **{k: 5 for k in ints}}
    assert a.op.backend.columnar is not None and kg not in _owned(a.op)


def test_released_slots_leave_full_captures_and_the_migration_to_the_dict_backend():
    a = Subtask(0, pa.int64())
    keys = [k for k in INT_POOL if key_group(k, M) in _owned(a.op)]
    feed(a.op, batch(keys, list(range(len(keys)))))
    kg = key_group(keys[0], M)
    a.op.hand_out(kg, full=True)
    full = a.op.backend.capture_full(5)
    assert all(kg not in by_kg for by_kg in full.values())
    assert sorted(k for t in full["s"].values() for k in as_table(t).column("key").to_pylist()) == \
        sorted(k for k in keys if key_group(k, M) != kg)
    a.op.backend.migrate_to_dict()
    assert _state(a.op, "s") == {k: i for i, k in enumerate(keys) if key_group(k, M) != kg}
    assert np.all(a.op.backend.dict_backend.key_group_range.mask == a.op.key_group_range.mask)


@pytest.mark.parametrize("lazy", [True, False])
def test_a_capture_leaves_out_a_released_key_group_whose_keys_changed_since_the_confirmed_one(lazy):
    """Slots changed since the last confirmed capture are listed per epoch; a key group given
    away after its keys changed must not come back through those lists."""
    a = Subtask(0, pa.int64())
    keys = [k for k in range(4000) if key_group(k, M) in _owned(a.op)][:400]
    feed(a.op, batch(keys, [1] * len(keys)))
    a.op.backend.capture(1)
    a.op.backend.confirm(1)
    kg = key_group(keys[0], M)
    feed(a.op, batch(keys[:1], [5]))  # one slot changed: a capture reads the epoch's list
    a.op.hand_out(kg, full=False)
    deltas = a.op.backend.capture(2, lazy=lazy)
    assert all(kg not in by_kg for by_kg in deltas.values())


def test_a_handed_over_delta_with_deletes_moves_the_new_owner_to_the_dict_backend():
    """An aggregate writes no delete; a delta that has one (from the dict backend of another
    operator's encoding) is applied by the dict backend, which the new owner moves to."""
    a = Subtask(0, pa.int64())
    b = Subtask(1, pa.int64())
    kg = next(iter(_owned(a.op)))
    keys = [k for k in range(200) if key_group(k, M) == kg][:3]
    feed(a.op, batch(keys, [2, 3, 4]))
    tables, _ = a.op.hand_out(kg, full=True)
    t = tables["s"]
    ops = pa.array([1 if k == keys[0] else 0 for k in t.column("key").to_pylist()], pa.int8())
    tables["s"] = t.set_column(t.schema.get_field_index("op"), t.schema.field("op"), ops)
    b.op.take_in(kg, {}, tables)
    assert b.op.backend.columnar is None
    assert _state(b.op, "s") == {keys[1]: 3, keys[2]: 4}


# ----------------------------------------------------------------------------- a running job

JOB_M, JOB_KEYS, JOB_TOTAL, JOB_HOLD = 16, 997, 40_000, 16_000


class StringSums:
    """Batches of the job below: key ``"user-<i % JOB_KEYS>"``, value ``i % 7`` (picklable)."""

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        return pa.record_batch({"key": pa.array([f"user-{i % JOB_KEYS}" for i in idx.tolist()]),
                                "value": pa.array(idx % 7, pa.int64())})


@pytest.mark.parametrize("strategy,batch_size", [("all_at_once", None), ("fluid", None)])
def test_an_aggregate_job_rescaled_while_it_runs_ends_with_exact_sums(tmp_path, strategy, batch_size):
    """2 -> 3 -> 1 workers of a string-keyed aggregate while checkpoints run every 50 ms: the
    final checkpoint holds every key's sum and count once, exactly."""
    from pacing import PacedSource

    import abs

    gate, root = str(tmp_path / "gate"), str(tmp_path / "root")
    flow = abs.Dataflow("live-sums", max_parallelism=JOB_M)
    src = abs.GeneratorSource(JOB_TOTAL, num_keys=JOB_KEYS, num_splits=4, batch_size=200, make_batch=StringSums(),
                              rate=8000)
    flow.source("src", PacedSource(src, JOB_TOTAL, gate=gate, hold_per_split=JOB_HOLD // 4)).key_by("key").aggregate(
        "sum", {"total": ("value", "sum"), "n": ("value", "count")}, emit="none")
    job = abs.submit(flow, parallelism=2, storage=root, checkpoint=abs.CheckpointConfig(interval=0.05, retained=1))
    try:
        job.trigger_checkpoint()
        assert job.rescale(3, strategy=strategy, batch=batch_size).status == "COMPLETED"
        job.trigger_checkpoint()
        assert job.rescale(1, strategy=strategy, batch=batch_size).status == "COMPLETED"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and not result.failed_checkpoints and result.parallelism == 1
    assert result.records_in["sum"] == JOB_TOTAL
    from storage import SnapshotStore

    store = SnapshotStore.open(root)
    manifest = store.read_manifest(result.last_checkpoint)
    for state, want in (("total", lambda k: sum(i % 7 for i in range(k, JOB_TOTAL, JOB_KEYS))),
                        ("n", lambda k: len(range(k, JOB_TOTAL, JOB_KEYS)))):
        got: dict = {}
        for kg in manifest.keyed["sum"][state]:
            t = store.read_key_group(manifest, "sum", state, kg)
            keys = t.column("key").to_pylist()
            assert not set(keys) & set(got), f"key group {kg} repeats keys"
            got.update(zip(keys, t.column("value").to_pylist()))
        assert got == {f"user-{k}": want(k) for k in range(JOB_KEYS)}, state


def test_the_slots_of_key_groups_given_away_are_dropped_at_the_first_batch_after_a_confirmation():
    a = Subtask(0, pa.string())
    b = Subtask(1, pa.string())
    keys = [f"user-{i}" for i in range(3000)]
    mine = [k for k in keys if key_group(k, M) in _owned(a.op)]
    feed(a.op, batch(mine, [1] * len(mine), key_type=pa.string()))
    model = {k: [1, 1] for k in mine}
    a.capture(1, model)
    a.confirm(1)
    gone = sorted(_owned(a.op))[:2]  # half of subtask 0's key groups
    for kg in gone:
        _move(a, b, kg, full=False)
    store = a.op.backend.columnar
    n = store.n
    staying = [k for k in mine if key_group(k, M) not in gone]
    a.capture(2, model)  # pending: the store keeps its arrays
    feed(a.op, batch(staying[:5], [1] * 5, key_type=pa.string()))
    assert store.n == n
    a.abort(2)  # aborted: its upload may still run
    feed(a.op, batch(staying[:5], [-1] * 5, key_type=pa.string()))
    assert store.n == n
    a.capture(3, model)
    a.confirm(3)
    feed(a.op, batch(staying[:5], [1] * 5, key_type=pa.string()))
    for k in staying[:5]:
        model[k] = [2, 4]  # 1, then +1, -1, +1
    assert store.n == len(staying) < n
    _check([a, b], model)
    a.capture(4, model)  # the five keys changed since 3, in their new slots
    assert sorted(k for t in (as_table(d) for d in a.op.backend.capture(5)["s"].values())
                  for k in t.column("key").to_pylist()) == sorted(staying[:5])


@pytest.mark.parametrize("pool", [INT_POOL, STR_POOL], ids=["int", "string"])
def test_a_key_group_from_an_aggregate_on_the_dict_backend_joins_a_columnar_one(pool):
    """The old owner's aggregate moved to the dict backend (as it does for keys of another
    kind): its key group travels in the dict backend's tables, which the new owner's columnar
    store takes as they are."""
    key_type = _key_type(pool)
    a, b = Subtask(0, key_type), Subtask(1, key_type)
    mine = [k for k in pool if key_group(k, M) in _owned(a.op)]
    feed(a.op, batch(mine, list(range(len(mine))), key_type=key_type))
    a.op.backend.migrate_to_dict()
    kg = key_group(mine[0], M)
    tables, _ = a.op.hand_out(kg, full=True)
    b.op.take_in(kg, {}, tables)
    assert b.op.backend.columnar is not None and a.op.backend.columnar is None
    assert _state(b.op, "s") == {k: i for i, k in enumerate(mine) if key_group(k, M) == kg}
    assert _state(b.op, "n") == {k: 1 for k in mine if key_group(k, M) == kg}
    assert _state(a.op, "s") == {k: i for i, k in enumerate(mine) if key_group(k, M) != kg}


def test_a_store_that_took_a_key_group_in_moves_to_the_dict_backend_with_it():
    """After a key group joined the columnar store, a move to the dict backend (a batch of
    another key kind) keeps its keys, and its next capture still holds the key group whole."""
    a, b = Subtask(0, pa.int64()), Subtask(1, pa.int64())
    mine = [k for k in range(200) if key_group(k, M) in _owned(a.op)]
    feed(a.op, batch(mine, [2] * len(mine)))
    kg = key_group(mine[0], M)
    tables, _ = a.op.hand_out(kg, full=True)
    b.op.take_in(kg, {}, tables)
    b.op.backend.migrate_to_dict()
    moved = sorted(k for k in mine if key_group(k, M) == kg)
    assert _state(b.op, "s") == {k: 2 for k in moved}
    got = b.op.backend.capture(1)["s"]
    assert sorted(as_table(got[kg]).column("key").to_pylist()) == moved


# the thread that indexes string/binary keys as they come fills its index in C (HashFill)
needs_native_fill = pytest.mark.skipif(
    not HashFill.available(), reason="the index thread of string keys needs the C module abscore._native (HashFill)")


@pytest.mark.parametrize("background", [False, pytest.param(True, marks=needs_native_fill)],
                         ids=["indexed at the first lookup", "indexed by a thread"])
def test_a_compaction_right_after_a_restore_indexes_the_restored_keys(background):
    """Key groups restored in bulk and not indexed yet (the index is built at the first
    lookup, or by a thread as they come and finished at the first lookup), one of them given
    away, then a compaction: the kept keys are found again (a batch over them adds no slot) and
    hold their restored sums."""
    src = Subtask(0, pa.string())
    mine = [k for k in STR_POOL if key_group(k, M) in _owned(src.op)]
    feed(src.op, batch(mine, [4] * len(mine), key_type=pa.string()))
    full = src.op.backend.capture_full(1)
    a = Subtask(0, pa.string())
    with mock.patch.object(columnar_module, "_BACKGROUND_FILL_MIN", 0 if background else 1 << 17), \
            mock.patch.object(columnar_module, "_FILL_RUN", 1):
        for name, by_kg in full.items():
            for kg, t in by_kg.items():
                a.op.backend.restore(name, kg, as_table(t))
    store = a.op.backend.columnar
    assert store._unindexed is not None and (store._fill is not None) == background
    kg = min(next(iter(full.values())))  # the key group restored first: the compaction renumbers every kept slot
    assert store.kg[0] == kg
    a.op.hand_out(kg, full=True)
    store.compact()
    kept = [k for k in mine if key_group(k, M) != kg]
    assert store.n == len(kept)
    feed(a.op, batch(kept, [1] * len(kept), key_type=pa.string()))
    assert store.n == len(kept)
    assert _state(a.op, "s") == {k: 5 for k in kept}
