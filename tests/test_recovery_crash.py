"""Crash tests: a real SIGKILL (or SIGSTOP) of a worker at each named fault point, global
failover from the latest complete checkpoint, and output that equals a run without
failures: no record lost, none duplicated (two-phase-commit file sink)."""
from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.faults import Fault
from abs.files import FileSink, read_output
from storage import SnapshotStore

pytestmark = pytest.mark.integration

TOTAL, KEYS = 24_000, 200


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def flow(out: str) -> abs.Dataflow:
    f = abs.Dataflow("crash")
    # 4 s of input: fault points after the 2nd or 3rd checkpoint are reached even on a loaded machine
    src = abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=4, batch_size=200, rate=1_500)
    f.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink(
        "out", FileSink(out, format="parquet")
    )
    return f


def assert_exactly_once(out: str) -> None:
    table = read_output(out, "parquet")
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    expected = collections.Counter((np.arange(TOTAL) % KEYS).tolist())
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in expected.items()}


def run_with(tmp_path, *faults: Fault, restarts: int = 2, **kwargs) -> abs.JobResult:
    out = str(tmp_path / "out")
    result = abs.run(
        flow(out),
        parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.25, retained=2),
        storage=str(tmp_path / "snap"),
        restart=abs.RestartStrategy(max_restarts=restarts, delay=0.1),
        faults=faults,
        **kwargs,
    )
    assert result.status == "FINISHED"
    assert_exactly_once(out)
    assert SnapshotStore.open(str(tmp_path / "snap")).verify().ok
    return result


@pytest.mark.parametrize(
    "fault",
    [
        Fault("process", "task1#0", nth=40),
        Fault("during_alignment", "task1#1", nth=2),
        Fault("after_sync_snapshot", "task1#0", nth=2),
        Fault("after_barrier_forward", "task0#1", nth=3),
        Fault("during_upload", "task1#1", nth=20),
        Fault("before_ack", "task0#0", nth=2),
        Fault("before_commit", "task1#1", nth=2),
        Fault("after_commit", "task1#0", nth=2),
        Fault("sink_commit", "task1#1", nth=2),
    ],
    ids=lambda f: f.point,
)
def test_kill_9_at_fault_point_recovers_with_exact_output(tmp_path, fault):
    result = run_with(tmp_path, fault)
    assert len(result.restarts) == 1
    assert "signal 9" in result.restarts[0]["error"]


def test_kill_9_during_the_restore_itself(tmp_path):
    result = run_with(
        tmp_path,
        Fault("after_sync_snapshot", "task1#0", nth=3),
        Fault("restore", "task1#1", nth=1, attempt=1),
        restarts=3,
    )
    assert len(result.restarts) == 2
    assert result.restarts[0]["restored_from"] is not None


def test_hung_worker_is_detected_by_heartbeat_and_replaced(tmp_path):
    result = run_with(tmp_path, Fault("process", "task1#1", nth=30, action="hang"), heartbeat_timeout=3.0)
    assert len(result.restarts) == 1
    assert "heartbeat" in result.restarts[0]["error"]


def test_without_restarts_the_failure_names_the_worker(tmp_path):
    with pytest.raises(abs.WorkerLostError, match=r"worker 1 .*signal 9"):
        abs.run(flow(str(tmp_path / "out")), parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.25),
                storage=str(tmp_path / "snap"), faults=[Fault("process", "task1#1", nth=5)])


def test_storage_write_failures_fail_only_that_checkpoint_and_the_job_goes_on(tmp_path):
    out = str(tmp_path / "out")
    root = str(tmp_path / "snap")
    result = abs.run(
        flow(out),
        parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.25, retained=50),
        storage=f"faulty://{root}",
        # in every worker, the 3rd and 4th state-file writes fail, then one is torn
        storage_options={"target_protocol": "file", "faults": [
            {"op": "write", "nth": 3, "times": 2, "path_glob": "*/state/*"},
            {"op": "write", "nth": 9, "action": "tear", "path_glob": "*/state/*"},
        ]},
    )
    assert result.status == "FINISHED" and not result.restarts
    assert result.failed_checkpoints, "the injected write failures must fail some checkpoint"
    assert any("upload failed" in reason for _cid, reason in result.failed_checkpoints)
    failed_ids = {cid for cid, _r in result.failed_checkpoints}
    completed = [c.checkpoint_id for c in result.completed_checkpoints]
    assert any(c > min(failed_ids) for c in completed), "a later checkpoint must succeed"
    store = SnapshotStore.open(root)
    assert not failed_ids & set(store.list_checkpoints())
    assert store.verify().ok
    assert_exactly_once(out)
    final = {}
    manifest = store.read_manifest(store.latest_checkpoint())
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        final.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert final == dict(collections.Counter((np.arange(TOTAL) % KEYS).tolist()))
