"""Restore plans: key groups, chains, source splits, sink transactions, operator state and
channel logs redistributed into a new parallelism; planned from real stores, never reading a
state file."""
from __future__ import annotations

import copy
import pickle
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abs.keygroups as abs_kg
from recovery import (
    IncompatibleSnapshotError,
    KeyGroupRange,
    RestorePlan,
    key_group_range,
    plan_restore,
    routing_table,
    subtask_for_key_group,
)
from recovery.errors import ParallelismError, RecoveryError
from storage import CompactionPolicy, FileRef, Manifest, SnapshotStore

M = 128
MAX_P = 16
JOB: dict[str, Any] = {
    "name": "clicks",
    "max_parallelism": M,
    "operators": [
        {"uid": "events", "kind": "source"},
        {"uid": "count", "kind": "process", "state": [
            {"kind": "value", "name": "n", "type": "int64"},
            {"kind": "value", "name": "seen", "type": "int64"},
        ]},
        {"uid": "rules", "kind": "map"},
        {"uid": "config", "kind": "map"},
        {"uid": "out", "kind": "sink"},
    ],
}


def delta(keys: list[int], values: list[int], ops: list[int] | None = None) -> pa.Table:
    """A delta shaped like the runtime's: key int64, value int64, op int8."""
    return pa.table({
        "key": pa.array(keys, pa.int64()),
        "value": pa.array(values, pa.int64()),
        "op": pa.array(ops if ops is not None else [0] * len(keys), pa.int8()),
    })


def splits_at(cid: int) -> dict[str, int]:
    """Source offsets of checkpoint ``cid``: more splits as the job goes on."""
    return {f"s{j:02d}": 100 * j + cid for j in range(8 + cid)}


def pending_txns(cid: int, subtask: int) -> list[dict[str, Any]]:
    """Sink transactions of one subtask at checkpoint ``cid`` (oldest first, as the runtime keeps them)."""
    checkpoints = [cid - 1, cid] if subtask % 2 == 0 and cid > 1 else [cid]
    return [{"v": 1, "file": f"part-{c}-{subtask}", "checkpoint": c, "subtask": subtask, "rows": 1} for c in checkpoints]


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> tuple[SnapshotStore, dict[int, Manifest]]:
    """Checkpoints 1..16 of one job, checkpoint ``c`` taken at parallelism ``c``, with chains
    that grow by deltas, absent key groups, operator state, channel logs, offsets and sinks."""
    root = str(tmp_path_factory.mktemp("recovery-plan") / "root")
    store = SnapshotStore.open(root, policy=CompactionPolicy(max_chain_length=100, max_delta_ratio=1e9), fsync=False)
    store.init_job(JOB)
    n: dict[int, list[FileRef]] = {}
    seen: dict[int, list[FileRef]] = {}
    for kg in range(M):
        if kg % 5:
            n[kg] = store.write_key_group(1, "count", "n", kg, [], delta([kg * 1000 + j for j in range(3)], [1, 2, 3]))
        if kg % 3 == 0:
            seen[kg] = store.write_key_group(1, "count", "seen", kg, [], delta([kg * 1000], [kg]))
    manifests = {}
    for cid in range(1, MAX_P + 1):
        if cid > 1:
            for j in range(6):
                kg = (cid * 7 + j * 13) % M
                if kg in n:
                    n[kg] = store.write_key_group(cid, "count", "n", kg, n[kg],
                                                  delta([kg * 1000, kg * 1000 + 1], [cid, 0], [0, 1]))
        rules = {i: store.write_operator_state(cid, "rules", i, pa.table({"rule": [f"r{i}"]})) for i in range(cid)}
        config = {i: store.write_operator_state(cid, "config", i, pa.table({"k": ["x"], "v": [i]})) for i in range(cid)}
        logs = [store.write_channel_log(cid, f"task2#{i}", pa.table({"key": [i], "value": [i]}))
                for i in reversed(range(min(cid, 3)))]
        manifests[cid] = store.commit(Manifest(
            checkpoint_id=cid, job_name="clicks", max_parallelism=M,
            keyed={"count": {"n": dict(n), "seen": dict(seen)}},
            operator_state={"rules": rules, "config": config},
            operator_state_rules={"rules": "split", "config": "union"},
            channel_logs=logs,
            source_offsets={"events": splits_at(cid)},
            sink_transactions={"out": {str(i): pending_txns(cid, i) for i in range(cid)}},
            stats={"parallelism": cid},
        ))
    return store, manifests


def owner_of_every_chain(plan: RestorePlan) -> dict[tuple[str, str, int], tuple[int, list[FileRef]]]:
    out: dict[tuple[str, str, int], tuple[int, list[FileRef]]] = {}
    for sub in plan.subtasks:
        for uid, states in sub.keyed.items():
            for state, chains in states.items():
                for kg, chain in chains.items():
                    assert (uid, state, kg) not in out, f"key group {kg} of {uid}/{state} planned twice"
                    out[(uid, state, kg)] = (sub.index, chain)
    return out


# =========================================================================== key groups
def test_key_group_range_is_the_runtimes_formula():
    # one implementation (abscore.keygroups), not two that must agree
    assert key_group_range is abs_kg.key_group_range
    assert routing_table is abs_kg.routing_table and subtask_for_key_group is abs_kg.subtask_for_key_group
    assert KeyGroupRange is abs_kg.KeyGroupRange


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1024).flatmap(lambda m: st.tuples(st.just(m), st.integers(1, m))))
def test_key_group_ranges_partition_all_key_groups_in_order(mp):
    m, p = mp
    ranges = [key_group_range(m, p, i) for i in range(p)]
    assert ranges[0].start == 0 and ranges[-1].end == m - 1
    assert all(a.end + 1 == b.start for a, b in zip(ranges, ranges[1:]))
    assert all(len(r) >= 1 for r in ranges)
    table = routing_table(m, p)
    assert table == abs_kg.routing_table(m, p)
    for i, r in enumerate(ranges):
        assert all(table[kg] == i == subtask_for_key_group(m, p, kg) for kg in r)


def test_key_group_range_rejects_parallelism_above_max_parallelism():
    with pytest.raises(ParallelismError, match=r"Maximum parallelism \(8\) must not be smaller than parallelism \(9\)"):
        key_group_range(8, 9, 0)
    with pytest.raises(ParallelismError, match="Subtask index 3 is out of range"):
        key_group_range(8, 3, 3)
    assert str(KeyGroupRange(4, 7)) == "[4, 7]" and 5 in KeyGroupRange(4, 7) and 8 not in KeyGroupRange(4, 7)


# =========================================================================== the rescaling property
@pytest.mark.parametrize("p1", range(1, MAX_P + 1))
def test_every_key_group_goes_to_exactly_one_new_subtask_with_its_exact_chain(history, p1):
    _store, manifests = history
    manifest = manifests[p1]  # checkpoint p1 was taken at parallelism p1
    expected = {(uid, st_, kg): chain for uid, states in manifest.keyed.items()
                for st_, chains in states.items() for kg, chain in chains.items()}
    for p2 in range(1, MAX_P + 1):
        plan = plan_restore(manifest, JOB, p2)
        assert plan.previous_parallelism == p1 and plan.parallelism == p2 and len(plan.subtasks) == p2
        owners = [sub.index for sub in plan.subtasks for _ in sub.key_groups]
        assert owners == [kg * p2 // M for kg in range(M)]  # each key group in exactly one range
        planned = owner_of_every_chain(plan)
        assert planned.keys() == expected.keys()
        for key, (owner, chain) in planned.items():
            assert chain == expected[key]
            assert key[2] in plan.subtasks[owner].key_groups
        for sub in plan.subtasks:  # a subtask reads only files of its own key groups
            for ref in sub.files():
                kg = ref.location().key_group
                assert kg is None or kg in sub.key_groups
        keyed_total = sum(r.bytes for chain in expected.values() for r in chain)
        assert sum(sub.keyed_bytes for sub in plan.subtasks) == keyed_total


@settings(max_examples=150, deadline=None)
@given(p1=st.integers(1, MAX_P), p2=st.integers(1, MAX_P),
       known=st.sets(st.sampled_from([f"s{j:02d}" for j in range(30)]), max_size=30))
def test_source_splits_are_all_reassigned_once_with_their_offsets(history, p1, p2, known):
    manifest = history[1][p1]
    restored = manifest.source_offsets["events"]
    plan = plan_restore(manifest, JOB, p2, source_splits={"events": sorted(known)})
    seen = Counter()
    for sub in plan.subtasks:
        for split, offset in sub.source_splits["events"].items():
            seen[split] += 1
            if split in restored:
                assert offset == restored[split]
                assert split not in sub.initial_splits["events"]
            else:
                assert offset is None and split in sub.initial_splits["events"]
    assert set(seen) == set(restored) | known
    assert set(seen.values()) == {1}
    counts = [len(sub.source_splits["events"]) for sub in plan.subtasks]
    assert max(counts) - min(counts) <= 1  # round robin


@pytest.mark.parametrize("p1,p2", [(1, 16), (16, 1), (5, 7), (12, 3)])
def test_union_sink_transactions_go_to_every_subtask_in_checkpoint_order(history, p1, p2):
    manifest = history[1][p1]
    plan = plan_restore(manifest, JOB, p2)
    every = [t for i in range(p1) for t in pending_txns(p1, i)]
    expected = sorted(every, key=lambda t: (t["checkpoint"], t["subtask"]))
    for sub in plan.subtasks:
        assert sub.sink_transactions["out"] == expected
    assert plan.sink_transactions() == {"out": expected}
    assert [t["checkpoint"] for t in expected] == sorted(t["checkpoint"] for t in expected)


@pytest.mark.parametrize("p1,p2", [(1, 4), (16, 3), (7, 7), (4, 16)])
def test_operator_state_split_is_dealt_once_and_union_goes_to_everyone(history, p1, p2):
    manifest = history[1][p1]
    plan = plan_restore(manifest, JOB, p2)
    rules = [ref for _, ref in sorted(manifest.operator_state["rules"].items())]
    dealt = [ref for sub in plan.subtasks for ref in sub.operator_state.get("rules", [])]
    assert sorted(r.path for r in dealt) == sorted(r.path for r in rules)
    for sub in plan.subtasks:
        assert sub.operator_state.get("rules", []) == rules[sub.index::p2]
        assert sub.operator_state["config"] == [ref for _, ref in sorted(manifest.operator_state["config"].items())]
    assert plan.operator_state_rules == {"rules": "split", "config": "union"}


@pytest.mark.parametrize("p2", [1, 2, 3, 8])
def test_channel_logs_are_replayed_exactly_once(history, p2):
    manifest = history[1][5]
    plan = plan_restore(manifest, JOB, p2)
    got = [(sub.index, ref.location().task) for sub in plan.subtasks for ref in sub.channel_logs]
    assert sorted(t for _, t in got) == sorted(ref.location().task for ref in manifest.channel_logs)
    assert all(int(task.split("#")[1]) % p2 == i for i, task in got)


# =========================================================================== plan is pure data
def test_planning_reads_no_state_file(tmp_path):
    store = SnapshotStore.open(str(tmp_path / "root"), fsync=False)
    store.init_job(JOB)
    chains = {kg: store.write_key_group(1, "count", "n", kg, [], delta([kg], [kg])) for kg in (0, 40, 127)}
    store.commit(Manifest(checkpoint_id=1, job_name="clicks", max_parallelism=M, keyed={"count": {"n": chains}}))
    before = plan_restore(store.read_manifest(1), JOB, 2)
    store.fs.rm(f"{store.url}/state", recursive=True)  # every state file gone
    assert not [p for p in store.list_files() if p.startswith("state/")]
    after = plan_restore(SnapshotStore.open(store.url).read_manifest(1), JOB, 2)
    assert after == before
    assert after.total_bytes == sum(r.bytes for c in chains.values() for r in c) > 0
    assert [sorted(sub.keyed["count"]["n"]) for sub in after.subtasks] == [[0, 40], [127]]


def test_plan_totals_and_balance(history):
    plan = plan_restore(history[1][4], JOB, 4)
    assert plan.total_bytes == sum(s.read_bytes for s in plan.subtasks)
    sizes = [s.read_bytes for s in plan.subtasks]
    assert plan.balance == pytest.approx(max(sizes) / (sum(sizes) / 4))
    assert 1.0 <= plan.balance < 1.5
    assert plan.routing_table() == abs_kg.routing_table(M, 4)
    assert plan.keyed_chains(2) is plan.subtasks[2].keyed
    assert pickle.loads(pickle.dumps(plan)) == plan  # the driver ships parts of it to workers


def test_describe_prints_one_row_per_subtask_with_share_and_balance(history):
    plan = plan_restore(history[1][4], JOB, 3)
    text = plan.describe()
    lines = text.splitlines()
    assert lines[0] == f"restore plan: checkpoint 4 of job 'clicks', max_parallelism {M}, parallelism 4 -> 3"
    assert lines[1].split()[:3] == ["subtask", "key", "groups"]
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert set(rows) == {"0", "1", "2", "total"}
    assert rows["0"][1:3] == ["[0,", "42]"] and rows["2"][1:3] == ["[86,", "127]"]
    shares = [float(rows[i][9].rstrip("%")) for i in ("0", "1", "2")]
    assert sum(shares) == pytest.approx(100, abs=0.2)
    assert "balance: max/mean bytes per subtask" in text
    assert "sink 'out': " in text and "(union)" in text
    assert "operator state 'rules': rule 'split'" in text
    assert str(plan) == text


def test_source_assignment_fills_initial_offsets_for_the_runtime(history):
    plan = plan_restore(history[1][2], JOB, 3, source_splits={"events": ["s00", "new-a", "new-b"]})
    assignment = plan.source_assignment(lambda uid, split: f"start:{uid}:{split}")
    flat = {split: off for per_sub in assignment["events"].values() for split, off in per_sub.items()}
    assert flat["new-a"] == "start:events:new-a" and flat["new-b"] == "start:events:new-b"
    assert flat["s00"] == splits_at(2)["s00"]
    assert set(assignment["events"]) == {0, 1, 2}
    assert plan.source_assignment()["events"][0] == plan.subtasks[0].source_splits["events"]


def test_splits_only_known_now_start_at_initial_offsets(history):
    plan = plan_restore(history[1][1], JOB, 2, source_splits={"events": [], "clicks2": ["a", "b", "c"]})
    assert plan.subtasks[0].source_splits["clicks2"] == {"a": None, "c": None}
    assert plan.subtasks[1].initial_splits["clicks2"] == ("b",)


# =========================================================================== refusing to plan
def test_state_the_job_no_longer_declares_fails_unless_allowed(history):
    job = copy.deepcopy(JOB)
    job["operators"][1]["state"] = [{"kind": "value", "name": "n", "type": "int64"}]
    with pytest.raises(IncompatibleSnapshotError, match="'seen'.*allow_non_restored_state=True") as info:
        plan_restore(history[1][3], job, 2)
    assert info.value.report is not None and "undeclared_state" in info.value.report.kinds
    plan = plan_restore(history[1][3], job, 2, allow_non_restored_state=True)
    assert all(set(sub.keyed.get("count", {})) <= {"n"} for sub in plan.subtasks)
    assert plan.dropped == ("count/seen: keyed state 'seen'",)
    assert "not restored (allow_non_restored_state): count/seen" in plan.describe()


def test_removed_operator_fails_unless_allowed(history):
    job = copy.deepcopy(JOB)
    job["operators"] = [op for op in job["operators"] if op["uid"] != "out"]
    with pytest.raises(IncompatibleSnapshotError, match="uid 'out'.*same uid"):
        plan_restore(history[1][3], job, 2)
    plan = plan_restore(history[1][3], job, 2, allow_non_restored_state=True)
    assert plan.sink_transactions() == {}


def test_max_parallelism_mismatch_and_too_much_parallelism_refuse_to_plan(history):
    manifest = history[1][2]
    with pytest.raises(IncompatibleSnapshotError, match="max_parallelism 128.*re-key"):
        plan_restore(manifest, {**JOB, "max_parallelism": 256}, 4)
    with pytest.raises(IncompatibleSnapshotError, match="parallelism 129 exceeds max_parallelism 128"):
        plan_restore(manifest, JOB, 129)
    with pytest.raises(RecoveryError):
        plan_restore(manifest, JOB, 0)


def test_unknown_operator_state_rule_refuses_to_plan(history):
    manifest = Manifest.from_json(history[1][2].to_json())
    manifest.operator_state_rules["rules"] = "hash-by-key"
    with pytest.raises(IncompatibleSnapshotError, match="rule 'hash-by-key'.*upgrade"):
        plan_restore(manifest, JOB, 2)
    del manifest.operator_state_rules["rules"]
    with pytest.raises(IncompatibleSnapshotError, match="no redistribution rule"):
        plan_restore(manifest, JOB, 2)


def test_without_a_fingerprint_everything_in_the_snapshot_is_planned(history):
    manifest = history[1][2]
    plan = plan_restore(manifest, None, 5)
    assert sum(sub.chain_count for sub in plan.subtasks) == sum(len(c) for s in manifest.keyed.values() for c in s.values())
    assert plan.dropped == ()


def test_transactions_without_checkpoint_ids_keep_subtask_order(history):
    manifest = Manifest.from_json(history[1][2].to_json())
    manifest.sink_transactions = {"out": {"1": ["b1", "b2"], "0": ["a1"], "10": ["k"], "2": ["c"]}}
    plan = plan_restore(manifest, JOB, 3)
    assert all(sub.sink_transactions["out"] == ["a1", "b1", "b2", "c", "k"] for sub in plan.subtasks)
