"""GC never deletes a referenced file: random histories of checkpoints, crashed attempts,
savepoints and GC runs against a real (memory) store, plus the pure plan's rules."""
from __future__ import annotations

import uuid
import fsspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import CompactionPolicy, FileRef, GcRefusedError, Manifest, SnapshotStore, StoragePaths, plan_gc

KEY_GROUPS = (0, 1, 2)


def delta(changes: dict[int, int | None]) -> pa.Table:
    keys = sorted(changes)
    return pa.table({
        "key": pa.array(keys, pa.int64()),
        "value": pa.array([changes[k] or 0 for k in keys], pa.int64()),
        "op": pa.array([0 if changes[k] is not None else 1 for k in keys], pa.int8()),
    })


EVENT = st.one_of(
    st.tuples(st.just("checkpoint"), st.dictionaries(st.sampled_from(KEY_GROUPS),
                                                     st.dictionaries(st.integers(0, 6), st.none() | st.integers(1, 99),
                                                                     min_size=1, max_size=4), max_size=3)),
    st.tuples(st.just("crash"), st.sampled_from(KEY_GROUPS)),
    st.tuples(st.just("pending"), st.sampled_from(KEY_GROUPS)),
    st.tuples(st.just("savepoint"), st.none()),
    st.tuples(st.just("gc"), st.integers(1, 3)),
    st.tuples(st.just("pin"), st.booleans()),  # pin the oldest (True) or newest checkpoint
    st.tuples(st.just("unpin"), st.none()),
    st.tuples(st.just("corrupt"), st.booleans()),  # damage the oldest (True) or newest manifest
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(EVENT, min_size=1, max_size=14), policy_len=st.integers(1, 4))
def test_gc_never_deletes_a_file_a_retained_pinned_or_in_flight_checkpoint_needs(events, policy_len):
    """Also with pins (held checkpoints survive retention) and corrupt manifests (GC goes on;
    they protect nothing, and never cost a retained checkpoint a file)."""
    name = f"/gc-{uuid.uuid4().hex}"
    store = SnapshotStore.open(f"memory://{name}", policy=CompactionPolicy(max_chain_length=policy_len,
                                                                           max_delta_ratio=1000.0))
    store.init_job({"job_name": "j", "max_parallelism": 8})
    try:
        state: dict[int, dict[int, int]] = {kg: {} for kg in KEY_GROUPS}
        chains: dict[int, list[FileRef]] = {}
        expected: dict[int, dict[int, dict[int, int]]] = {}  # checkpoint -> kg -> live state
        in_flight: list[FileRef] = []
        leases: list = []  # (checkpoint id, lease)
        corrupt: set[int] = set()
        for kind, arg in events:
            cid = store.next_checkpoint_id()
            if kind == "checkpoint":
                for kg, changes in arg.items():
                    chains[kg] = store.write_key_group(cid, "op", "s", kg, chains.get(kg, []), delta(changes))
                    for k, v in changes.items():
                        state[kg].pop(k, None) if v is None else state[kg].__setitem__(k, v)
                store.commit(Manifest(checkpoint_id=cid, job_name="j", max_parallelism=8,
                                      keyed={"op": {"s": {kg: list(c) for kg, c in chains.items()}}} if chains else {}))
                expected[cid] = {kg: dict(state[kg]) for kg in chains}
            elif kind == "crash":  # files of an attempt that never commits; nobody declares them
                store.write_key_group(cid, "op", "s", arg, chains.get(arg, []), delta({99: 1}))
            elif kind == "pending":  # an attempt still running: the runtime declares its files
                in_flight += store.write_key_group(cid, "op", "s", arg, chains.get(arg, []), delta({98: 1}))
                in_flight.append(store.write_operator_state(cid, "src", 0, pa.table({"o": [cid]})))
            elif kind == "savepoint" and expected:
                source = max(expected)
                sp = store.savepoint(source, store.url)
                expected[sp.checkpoint_id] = expected[source]
            elif kind == "pin" and expected:
                held = min(expected) if arg else max(expected)
                leases.append((held, store.pin(held, held)))
            elif kind == "unpin" and leases:
                leases.pop(0)[1].release()
            elif kind == "corrupt" and expected:
                bad = min(expected) if arg else max(expected)
                path = StoragePaths.manifest(bad)
                store._io.put(path, b'{"format_version": 5, "checkpoint_id": ')
                store._manifests.pop(path, None)  # the cache of this process
                expected.pop(bad)
                corrupt.add(bad)
            elif kind == "gc":
                listing_before = store.list_files()
                manifests = {c: store.read_manifest(c) for c in store.list_checkpoints()}
                plan = store.gc(retain=arg, in_flight=in_flight)
                # the files they need: a range of a packed file (path#kg-N in files()) needs its file
                retained_refs = {p for c in plan.retained for p in manifests[c].paths()}
                declared = {r.path for r in in_flight}
                deleted = set(plan.delete_files)
                assert not deleted & retained_refs
                assert not deleted & declared
                newest = max((c for c, m in manifests.items() if m.kind == "checkpoint"), default=0)
                assert all(StoragePaths.parse(p).checkpoint_id <= newest for p in deleted)
                assert deleted <= set(listing_before)
                listing = store.list_files()
                assert retained_refs | declared <= set(listing)
                for held, _ in leases:
                    if held in manifests:
                        assert held in plan.retained and manifests[held].paths() <= set(listing)
                assert {c for c, _ in plan.corrupt} == {c for c in corrupt if StoragePaths.manifest(c) in listing_before}
                for c in plan.dropped:
                    expected.pop(c, None)
        # every checkpoint still listed is intact and reads back what was written
        report = store.verify()
        assert all(p.kind == "manifest" and set(p.checkpoints) <= corrupt for p in report.problems), report.lines()
        for c in store.list_checkpoints():
            m = store.read_manifest(c)
            got = {kg: dict(zip(*[store.read_key_group(m, "op", "s", kg)[col].to_pylist() for col in ("key", "value")]))
                   for kg in m.keyed.get("op", {}).get("s", {})}
            assert got == expected[c]
    finally:
        fsspec.filesystem("memory").rm(name, recursive=True)


# ---------------------------------------------------------------------- the pure plan
def _ref(path: str) -> FileRef:
    parsed = StoragePaths.parse(path)
    return FileRef(path=path, kind=parsed.category, checkpoint_id=parsed.checkpoint_id, rows=1, bytes=10,
                   checksum="0" * 64)


def _manifest(cid: int, paths: list[str], kind: str = "checkpoint") -> Manifest:
    return Manifest(checkpoint_id=cid, job_name="j", max_parallelism=4, kind=kind,
                    keyed={"o": {"s": {0: [_ref(p) for p in paths]}}})


T = "0" * 32


def test_plan_keeps_unknown_files_the_job_file_and_young_temporaries():
    base1 = f"state/o/s/kg-0000/00000001-base-{T}.arrow"
    base2 = f"state/o/s/kg-0000/00000002-base-{T}.arrow"
    listing = {
        "_job.json": 5, "README.txt": 5, "savepoints/sp-1/_job.json": 5,
        StoragePaths.manifest(1): 5, StoragePaths.manifest(2): 5, base1: 10, base2: 10,
        StoragePaths.manifest_temp(2, T): 5, StoragePaths.manifest_temp(3, T): 5,
        f"opstate/o/00000003-0-{T}.arrow": 10,
    }
    plan = plan_gc(listing, {1: _manifest(1, [base1]), 2: _manifest(2, [base2])}, retain=1)
    assert plan.retained == (2,) and plan.dropped == (1,)
    assert plan.delete_files == (StoragePaths.manifest_temp(2, T), base1)
    assert plan.delete_manifests == (StoragePaths.manifest(1),)
    assert set(plan.unknown) == {"README.txt", "savepoints/sp-1/_job.json"}
    assert set(plan.protected) == {StoragePaths.manifest_temp(3, T), f"opstate/o/00000003-0-{T}.arrow"}
    assert plan.bytes_freed == 5 + 10 + 5


def test_plan_retains_savepoints_regardless_of_retain():
    paths = {c: f"state/o/s/kg-0000/{c:08d}-base-{T}.arrow" for c in (1, 2, 3)}
    manifests = {1: _manifest(1, [paths[1]], "savepoint"), 2: _manifest(2, [paths[2]]), 3: _manifest(3, [paths[3]])}
    listing = {p: 10 for p in paths.values()} | {StoragePaths.manifest(c): 1 for c in manifests}
    plan = plan_gc(listing, manifests, retain=1)
    assert plan.retained == (1, 3) and plan.delete_files == (paths[2],)


def test_a_newer_savepoint_does_not_prove_an_attempt_dead():
    base1 = f"state/o/s/kg-0000/00000001-base-{T}.arrow"
    attempt = f"state/o/s/kg-0001/00000002-base-{T}.arrow"
    sp = f"state/o/s/kg-0000/00000003-base-{T}.arrow"
    manifests = {1: _manifest(1, [base1]), 3: _manifest(3, [sp], "savepoint")}
    listing = {base1: 10, attempt: 10, sp: 10, StoragePaths.manifest(1): 1, StoragePaths.manifest(3): 1}
    plan = plan_gc(listing, manifests, retain=1)
    assert plan.protect_newer_than == 1 and attempt in plan.protected and plan.empty


def test_plan_refuses_with_a_manifest_of_a_newer_format_and_a_bad_retain():
    with pytest.raises(GcRefusedError, match="checkpoint 4: manifest checkpoints/chk-00000004.json is of a newer format"):
        plan_gc({}, {}, retain=1, newer_format={4: "format version 99"})
    with pytest.raises(ValueError, match="retain >= 1"):
        plan_gc({}, {}, retain=0)


def test_plan_without_any_complete_checkpoint_deletes_nothing():
    listing = {f"state/o/s/kg-0000/00000001-base-{T}.arrow": 10, StoragePaths.manifest_temp(1, T): 3}
    plan = plan_gc(listing, {}, retain=1)
    assert plan.empty and set(plan.protected) == set(listing)



def test_gc_as_of_plans_as_if_that_checkpoint_were_the_newest(tmp_path):
    """A GC that runs behind later commits (the runtime's background GC) must decide as the
    commit that asked for it would have: checkpoint 3 committed after the request built on
    checkpoint 1 (it was pending then, so 1's files were declared in flight), and an
    up-to-date plan with retain=1 would drop 1 and 2."""
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": 8})
    c1 = store.write_key_group(1, "op", "s", 0, [], delta({1: 10}))
    store.commit(Manifest(checkpoint_id=1, job_name="j", max_parallelism=8, keyed={"op": {"s": {0: c1}}}))
    c2 = store.write_key_group(2, "op", "s", 0, [], delta({1: 20}))  # a new base: 2 does not need 1's file
    store.commit(Manifest(checkpoint_id=2, job_name="j", max_parallelism=8, keyed={"op": {"s": {0: c2}}}))
    in_flight = tuple(c1)  # checkpoint 3, pending when 2 committed, builds on 1
    c3 = store.write_key_group(3, "op", "s", 0, c1, delta({3: 30}))
    store.commit(Manifest(checkpoint_id=3, job_name="j", max_parallelism=8, keyed={"op": {"s": {0: c3}}}))
    young = store.write_key_group(4, "op", "s", 0, c3, delta({4: 40}))  # in flight, undeclared

    preview = store.plan_gc(1, in_flight=())  # what an up-to-date plan would do
    assert set(preview.dropped) == {1, 2}

    plan = store.gc(1, in_flight=in_flight, as_of=2)
    assert plan.retained == (2,) and plan.dropped == (1,)
    assert plan.protect_newer_than == 2
    files = set(store.list_files())
    assert {r.path for r in c1} <= files  # declared in flight at the request
    assert {r.path for r in c3} <= files and {r.path for r in young} <= files  # newer than as_of
    assert StoragePaths.manifest(3) in files and StoragePaths.manifest(1) not in files
    assert store.list_checkpoints() == [2, 3]
    assert store.read_chain(c3).column("key").to_pylist() == [1, 3]
