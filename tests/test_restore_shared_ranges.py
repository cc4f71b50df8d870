"""A restore of many small key groups (a large max_parallelism): the key groups whose chains
are each their rows of one shared range are read with SnapshotStore.read_range, the range
fetched and decoded once, and loaded together (the backends' restore_slices), with the state
each key group's own read and restore gave."""
from __future__ import annotations

import types

import pyarrow as pa
import pytest

import abs
from abs.keygroups import key_group_range, key_groups
from abs.runtime.operators import _restore_units, _SharedRange, build_operator
from storage import CompactionPolicy, InvalidChainError, SnapshotStore
from storage import store_read
from storage.store import KeyGroupWrite

OP, M = "sum", 64
META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow", b"abs.state_kind": b"value"}


def table(keys: list, values: list) -> pa.Table:
    return pa.table({"key": pa.array(keys), "value": pa.array(values, pa.int64())}).replace_schema_metadata(META)


def small_key_groups(store: SnapshotStore, keys_per_kg: int = 3, n: int = M) -> tuple[dict, dict]:
    """Checkpoint 1 of key groups ``0 .. n - 1`` with a few keys each: their bases share ranges."""
    from storage import Manifest

    models = {kg: {f"k{kg}-{i}": kg * 100 + i for i in range(keys_per_kg)} for kg in range(n)}
    chains = dict(enumerate(store.write_key_groups(1, [
        KeyGroupWrite(OP, "total", kg, [], table(list(m), list(m.values())), complete=True)
        for kg, m in models.items()])))
    store.commit(Manifest(checkpoint_id=1, job_name="j", max_parallelism=M, keyed={OP: {"total": chains}}))
    return models, chains


@pytest.fixture
def store(memory_root) -> SnapshotStore:
    s = SnapshotStore.open(memory_root, policy=CompactionPolicy())
    s.init_job({"job_name": "j", "max_parallelism": M})
    return s


def counting(monkeypatch, store: SnapshotStore) -> dict:
    """Counts of the fetches of ranges and of the tables decoded, through ``store``'s reader."""
    counts = {"fetched": 0, "decoded": 0}
    io = store._io
    real_get_range, real_decode = io.get_range, store_read.decode_table

    def get_range(path, offset, size):
        counts["fetched"] += 1
        return real_get_range(path, offset, size)

    def decode(*args, **kwargs):
        counts["decoded"] += 1
        return real_decode(*args, **kwargs)

    object.__setattr__(io, "get_range", get_range)
    monkeypatch.setattr(store_read, "decode_table", decode)
    return counts


def test_read_range_reads_a_shared_range_once_and_gives_each_chain_what_read_chain_gives(store, memory_root,
                                                                                          monkeypatch):
    models, chains = small_key_groups(store)
    assert all(len(c) == 1 and c[0].shared for c in chains.values())
    by_range: dict = {}
    for kg, chain in chains.items():
        by_range.setdefault(chain[0].range_id, []).append(kg)
    kgs = max(by_range.values(), key=len)
    assert len(kgs) > 2
    fresh = SnapshotStore.open(memory_root)
    counts = counting(monkeypatch, fresh)
    got, parts = fresh.read_range([chains[kg] for kg in kgs])
    assert counts == {"fetched": 1, "decoded": 1}  # the range once, for all its key groups
    assert len(parts) == len(kgs)
    alone = SnapshotStore.open(memory_root)
    for kg, (offset, rows) in zip(kgs, parts):
        mine = got.slice(offset, rows)
        expected = alone.read_chain(chains[kg])
        assert mine.equals(expected) and mine.schema.equals(expected.schema, check_metadata=True)
        assert dict(zip(mine.column("key").to_pylist(), mine.column("value").to_pylist())) == models[kg]


def test_read_range_refuses_chains_that_are_not_one_reference_each_to_the_same_shared_range(store):
    _models, chains = small_key_groups(store)
    later = store.write_key_groups(2, [KeyGroupWrite(OP, "total", kg, [], table([f"x{kg}"], [kg]), complete=True)
                                       for kg in (0, 1)])
    assert later[0][0].shared and later[0][0].range_id != chains[0][0].range_id
    with pytest.raises(InvalidChainError, match="read_range got no chains"):
        store.read_range([])
    with pytest.raises(InvalidChainError, match="not one reference to the rows of the first chain's shared range"):
        store.read_range([chains[2], later[1]])
    with pytest.raises(InvalidChainError, match="not one reference"):
        store.read_range([chains[2], chains[3] * 2])
    with pytest.raises(InvalidChainError, match="not one reference"):
        store.read_range([[]])


def test_restore_units_group_the_key_groups_of_a_shared_range_and_leave_the_rest_alone(store):
    _models, chains = small_key_groups(store)
    wanted = [("total", kg, chain) for kg, chain in chains.items()]
    wanted.append(("other", 5, chains[5]))  # another state: a range of its own, of one key group
    units = _restore_units(wanted)
    groups = [u for _s, _kg, u in units if type(u) is _SharedRange]
    assert sum(len(g) for g in groups) == M and len({g[0][1][0].range_id for g in groups}) == len(groups)
    assert ("other", 5, chains[5]) in units  # read alone, as a plain chain
    assert [kg for _s, _kg, u in units if type(u) is _SharedRange for kg, _c in u] == list(range(M))


def _flow(kind: str, mp: int, names: pa.Array, rounds: int = 1) -> abs.Dataflow:
    """Every key of ``names`` ``rounds`` times, value = its position (an aggregate's sum, or a
    process function's running sum in a ValueState)."""
    n = len(names)
    flow = abs.Dataflow(f"shared-{kind}", max_parallelism=mp)
    src = abs.GeneratorSource(n * rounds, num_keys=n, batch_size=997, make_batch=lambda idx: pa.RecordBatch.from_arrays(
        [names.take(pa.array([i % n for i in idx])), pa.array([i % n for i in idx], pa.int64())], names=["k", "v"]))
    keyed = flow.source("src", src).key_by("k")
    if kind == "process":
        def running_sum(ctx, event):
            total = ctx.state.total
            total.update((total.value() or 0) + event["v"])

        keyed.process(OP, running_sum, state=[abs.ValueState("total", pa.int64())])
    else:
        keyed.aggregate(OP, {"total": ("v", "sum"), "m": ("v", "mean")}, emit="none")
    return flow


def _restored_op(root: str, flow: abs.Dataflow, mp: int, read_range: bool, monkeypatch=None):
    store_ = SnapshotStore.open(root)
    manifest = store_.read_manifest(store_.list_checkpoints()[-1])
    node = next(n for n in flow.nodes if n.uid == OP)
    ctx = types.SimpleNamespace(subtask=0, parallelism=1, max_parallelism=mp,
                                key_group_range=key_group_range(mp, 1, 0), send_to_driver=None)
    op = build_operator(node, ctx)
    counts = counting(monkeypatch, store_) if monkeypatch is not None else None
    op.restore({state: manifest.chains(OP, state) for state in manifest.keyed[OP]}, store_.read_chain,
               readers=2, read_range=store_.read_range if read_range else None)
    return op, manifest, counts


@pytest.mark.parametrize("kind", ["process", "aggregate"])
@pytest.mark.parametrize("key_type", ["string", "int"])
def test_a_restore_through_shared_ranges_loads_the_state_each_key_group_alone_loads(tmp_path, kind, key_type,
                                                                                     monkeypatch):
    mp, n = 4096, 5000
    names = pa.array([f"name-{i:05d}" for i in range(n)]) if key_type == "string" \
        else pa.array([i * 7919 for i in range(n)], pa.int64())
    flow = _flow(kind, mp, names)
    abs.run(flow, parallelism=1, storage=str(tmp_path), checkpoint=abs.CheckpointConfig(interval=None))
    op, manifest, counts = _restored_op(str(tmp_path), flow, mp, True, monkeypatch)
    ranges = {chain[0].range_id for by_kg in manifest.keyed[OP].values() for chain in by_kg.values()}
    assert counts["fetched"] == len(ranges) < mp // 8  # each range once, not once per key group
    alone, _m, _c = _restored_op(str(tmp_path), flow, mp, False)
    expected = {k: v for k, v in zip(names.to_pylist(), range(n))}
    kg_of = dict(zip(names.to_pylist(), key_groups(names, mp).tolist()))
    for state in manifest.keyed[OP]:
        got = dict(op.backend.items(state))
        assert got == dict(alone.backend.items(state))
        if state == "total":
            assert got == expected
        for kg in {kg_of[k] for k in list(expected)[::50]}:  # each key in its own key group
            mine = dict(op.backend.items(state, kg))
            assert mine == dict(alone.backend.items(state, kg)) and {kg_of[k] for k in mine} == {kg}
    # the restored key groups are the chains the next checkpoint builds on
    assert op.confirmed_chains == {s: dict(c) for s, c in manifest.keyed[OP].items()}
    if kind == "aggregate":
        assert op.backend.columnar is not None and op.backend.columnar.n == n
    kgs = key_groups(names, mp)
    assert len(set(kgs.tolist())) > mp // 2  # most key groups hold a key or two


@pytest.mark.parametrize("kind", ["process", "aggregate"])
def test_a_job_at_max_parallelism_4096_restores_its_exact_state(tmp_path, kind):
    """End to end: a checkpoint of 4,096 small key groups restored by the workers, every key
    then updated again: the final checkpoint holds restored + new for every key."""
    mp, n = 4096, 6000
    names = pa.array([f"user-{i:05d}" for i in range(n)])
    abs.run(_flow(kind, mp, names), parallelism=1, storage=str(tmp_path),
            checkpoint=abs.CheckpointConfig(interval=None))
    abs.run(_flow(kind, mp, names, rounds=2), parallelism=2, storage=str(tmp_path), restore="latest",
            checkpoint=abs.CheckpointConfig(interval=None))
    store_ = SnapshotStore.open(str(tmp_path))
    manifest = store_.read_manifest(store_.list_checkpoints()[-1])
    got: dict = {}
    for kg in manifest.chains(OP, "total"):
        t = store_.read_key_group(manifest, OP, "total", kg)
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == {k: 2 * i for i, k in enumerate(names.to_pylist())}  # restored, then once more
