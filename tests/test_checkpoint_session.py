"""CheckpointSession: the chains a checkpoint builds on are those of the newest completed one,
its writes remember the bases that make values images, and acks become the manifest."""
from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import (CheckpointSession, CompactionPolicy, FileRef, KeyGroupCapture, Lineage, SnapshotStore,
                     StoragePaths)
from storage.errors import InvalidChainError
from storage.session import merge_acks, with_written

META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}


@functools.lru_cache(maxsize=None)  # one file per (checkpoint, key group, kind): paths hold a random token
def ref(cid: int, kg: int, kind: str = "base") -> FileRef:
    return FileRef(path=StoragePaths.state_file(cid, "op", "n", kg, kind), kind=kind, checkpoint_id=cid, rows=1,
                   bytes=10, checksum="0" * 64)


# ----------------------------------------------------------------------------- chains
events = st.lists(st.tuples(st.sampled_from(["write", "complete", "abort"]), st.integers(1, 6),
                            st.dictionaries(st.integers(0, 3), st.booleans(), max_size=3)), max_size=25)


@settings(max_examples=300, deadline=None)
@given(events)
def test_a_checkpoint_builds_on_the_chains_of_the_newest_completed_checkpoint_that_wrote_them(history):
    session = CheckpointSession()
    session.declare("op", ["n"])
    expected: dict = {"n": {}}  # what the newest completed checkpoint wrote
    written: dict[int, dict] = {}  # checkpoint -> chains it wrote and that still count
    completed = 0
    for event, cid, kgs in history:
        if event == "write":
            if cid <= completed:
                continue  # checkpoint ids only grow past a completed one
            base = session.prev_chains("op")
            chains = with_written(base, [("n", kg, [ref(cid, kg)] if keep else []) for kg, keep in kgs.items()])
            session.written(cid, "op", chains)
            written[cid] = chains
        elif event == "complete":
            confirmed = session.confirm(cid, "op")
            assert confirmed == (cid in written)
            if cid in written:
                expected = written[cid]
            written = {c: w for c, w in written.items() if c > cid}
            completed = max(completed, cid)
        else:
            session.abort(cid, "op")
            written.pop(cid, None)
        assert session.confirmed("op") == expected
        assert session.pending_ids() == sorted(written)
        assert session.prev_chains("op", full=True) == {state: {} for state in expected}


def test_restored_chains_are_built_on_and_states_are_kept_apart_per_operator():
    session = CheckpointSession()
    session.declare("a", ["x", "y"])
    session.restored("a", "x", 3, [ref(5, 3)])
    assert session.prev_chains("a") == {"x": {3: [ref(5, 3)]}, "y": {}}
    assert session.prev_chains("b") == {}
    session.written(6, "b", {"z": {1: [ref(6, 1)]}})
    assert not session.confirm(6, "a")  # checkpoint 6 wrote nothing for a: a's chains stay
    assert session.confirmed("a") == {"x": {3: [ref(5, 3)]}, "y": {}}
    assert session.confirm(6, "b") and session.confirmed("b") == {"z": {1: [ref(6, 1)]}}


def test_an_empty_written_chain_drops_its_key_group():
    prev = {"n": {1: [ref(1, 1)], 2: [ref(1, 2)]}}
    assert with_written(prev, [("n", 1, []), ("n", 3, [ref(2, 3)]), ("m", 0, [])]) == \
        {"n": {2: [ref(1, 2)], 3: [ref(2, 3)]}, "m": {}}
    assert prev == {"n": {1: [ref(1, 1)], 2: [ref(1, 2)]}}  # not changed


# ----------------------------------------------------------------------------- writing
def full_image(values: dict[int, int]) -> pa.Table:
    keys = np.array(sorted(values), dtype=np.int64)
    return pa.table({"key": pa.array(keys), "value": pa.array([values[int(k)] for k in keys], pa.int64())}
                    ).replace_schema_metadata(META)


def as_dict(table: pa.Table) -> dict:
    return dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))


@pytest.mark.parametrize("same_keys", [True, False])
def test_a_full_image_over_the_same_keys_object_is_written_as_a_values_image(memory_root, same_keys):
    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=10.0))
    session = CheckpointSession()
    keys = np.arange(0, 300, 3, dtype=np.int64)
    model = {int(k): int(k) for k in keys}
    (chain,) = session.write(store, 1, [KeyGroupCapture("op", "n", 2, [], full_image(model), True,
                                                        image_keys=lambda: keys)])
    assert len(chain) == 1 and chain[0].kind == "base"
    model = {k: v + 1 for k, v in model.items()}
    again = keys if same_keys else keys.copy()  # equal keys, but not the object the session saw
    (chain2,) = session.write(store, 2, [KeyGroupCapture("op", "n", 2, chain, full_image(model), True,
                                                         image_keys=lambda: again)])
    assert as_dict(store.read_chain(chain2)) == model
    if same_keys:
        assert chain2[0] == chain[0] and len(chain2) == 2 and store.read_file(chain2[1]).column_names == ["value"]
    else:
        assert len(chain2) == 1 and chain2[0].checkpoint_id == 2


def test_no_values_image_over_a_base_that_no_longer_heads_the_chain(memory_root):
    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=10.0))
    session = CheckpointSession()
    keys = np.arange(10, dtype=np.int64)
    model = {int(k): 0 for k in keys}
    (chain,) = session.write(store, 1, [KeyGroupCapture("op", "n", 0, [], full_image(model), True,
                                                        image_keys=lambda: keys)])
    other = store.write_key_group(2, "op", "n", 0, [], full_image(model))  # e.g. a restore's chain
    (chain3,) = session.write(store, 3, [KeyGroupCapture("op", "n", 0, other, full_image(model), True,
                                                         image_keys=lambda: keys)])
    assert len(chain3) == 1 and chain3[0].checkpoint_id == 3


# ----------------------------------------------------------------------------- committing
def ack(keyed: dict, offsets: dict | None = None, sinks: dict | None = None) -> dict:
    return {"keyed": keyed, "source_offsets": offsets or {}, "sink_transactions": sinks or {}}


def test_the_acks_of_a_checkpoint_make_its_manifest(memory_root):
    store = SnapshotStore.open(memory_root)
    store.init_job({"job_name": "j", "max_parallelism": 8})
    chains = {kg: store.write_key_group(1, "op", "n", kg, [], full_image({kg: kg})) for kg in range(4)}
    acks = [ack({"op": {"n": {0: chains[0], 1: chains[1]}}}, {"src": {"s0": 5}}, {"sink": {"0": ["t0"]}}),
            ack({"op": {"n": {2: chains[2], 3: chains[3]}}}, {"src": {"s1": 7}}, {"sink": {"1": ["t1"]}})]
    manifest = CheckpointSession.manifest(1, acks, job_name="j", max_parallelism=8, stats={"mode": "exactly_once"},
                                          lineage=Lineage.following("run", None))
    assert manifest.keyed == {"op": {"n": chains}}
    assert manifest.source_offsets == {"src": {"s0": 5, "s1": 7}}
    assert manifest.sink_transactions == {"sink": {"0": ["t0"], "1": ["t1"]}}
    store.commit(manifest)
    stored = store.read_manifest(1)
    assert stored.keyed == {"op": {"n": chains}} and stored.stats["mode"] == "exactly_once"
    assert as_dict(store.read_key_group(stored, "op", "n", 3)) == {3: 3}


def test_a_later_ack_overrides_an_earlier_one_per_split_and_subtask():
    keyed, offsets, sinks = merge_acks([ack({"op": {"n": {0: [ref(1, 0)]}}}, {"src": {"s": 1}}, {"k": {"0": [1]}}),
                                        ack({"op": {"n": {1: [ref(2, 1)]}}}, {"src": {"s": 2}}, {"k": {"0": [2]}})])
    assert keyed == {"op": {"n": {0: [ref(1, 0)], 1: [ref(2, 1)]}}}
    assert offsets == {"src": {"s": 2}} and sinks == {"k": {"0": [2]}}


def test_a_key_group_in_two_acks_is_refused():
    """Each key group has one owner in a checkpoint, also while live reconfiguration moves it."""
    with pytest.raises(InvalidChainError, match=r"key group\(s\) \[0\] are in the snapshots of two subtasks"):
        merge_acks([ack({"op": {"n": {0: [ref(1, 0)]}}}, {}, {}), ack({"op": {"n": {0: [ref(2, 0)]}}}, {}, {})])
