"""Loops (``Stream.iterate``): the graph rules, exact results with and without checkpoints,
the feedback log as channel state (stored, inspected, replayed), termination with bounded
input, and crashes (real SIGKILL) while a head logs, before the barrier comes round and
while the log is replayed. One test turns the logs off to show they are needed."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import re
import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.dataflow import Edge
from abs.errors import ConfigError, GraphError, ReconfigurationError
from abs.faults import Fault
from abs.runtime.loops import DROP_LOGS_FOR_TESTS, FeedbackLogs
from storage import SnapshotStore

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


collatz = _example("collatz")
components = _example("connected_components")

N = 3000  # Collatz numbers of the crash tests: read over ~2.5 s, so the loop is never empty meanwhile


def paced_numbers() -> abs.Source:
    return abs.GeneratorSource(count=N, make_batch=collatz.numbers(N).make_batch, batch_size=32, rate=300)


def check_collatz(table: pa.Table, count: int) -> None:
    """Every number left the loop exactly once, with its number of steps."""
    starts = table.column("start").to_pylist()
    twice = [n for n, c in collections.Counter(starts).items() if c > 1]
    assert not twice, f"numbers that left the loop twice: {twice[:10]}"
    missing = sorted(set(range(1, count + 1)) - set(starts))
    assert not missing, f"{len(missing)} numbers never left the loop: {missing[:10]}"
    for r in table.to_pylist():
        assert r["steps"] == collatz.steps_of(r["start"]), r


# ---------------------------------------------------------------------- the graph
def test_iterate_builds_one_back_edge_into_its_head():
    flow = collatz.build(collatz.numbers(10), abs.CollectSink())
    head = flow.node("collatz")
    assert head.kind == "iterate" and [e.back for e in head.inputs] == [False, True]
    assert flow.nodes[head.inputs[1].source].uid == "again" and head.inputs[1].partition == "rebalance"
    assert flow.has_loops
    from abs.runtime.plan import compile_plan

    plan = compile_plan(flow)
    task = plan.tasks[plan.task_of[head.index]]
    assert task.back_edges == (1,) and task.back_channels(3) == frozenset({1, 2, 3})


def test_bad_loops_are_refused_with_a_clear_error():
    def flow_with(body):
        flow = abs.Dataflow("bad")
        return flow, flow.source("s", abs.GeneratorSource(10)).iterate("loop", body)

    with pytest.raises(GraphError, match="feedback is the loop's own input"):
        flow_with(lambda loop: (loop, loop.map(lambda r: r)))
    outside = abs.Dataflow("other").source("x", abs.GeneratorSource(1))
    with pytest.raises(GraphError, match="another dataflow"):
        flow_with(lambda loop: (outside, loop.map(lambda r: r)))
    with pytest.raises(GraphError, match="do not nest"):
        flow_with(lambda loop: loop.iterate("inner", lambda l2: (l2.map(lambda r: r), l2.map(lambda r: r))))
    with pytest.raises(GraphError, match=r"must return \(feedback, output\)"):
        flow_with(lambda loop: loop.map(lambda r: r))
    with pytest.raises(GraphError, match="not built from the loop's stream"):
        flow = abs.Dataflow("bad2")
        src = flow.source("s", abs.GeneratorSource(10))
        side = src.map(lambda r: r, uid="side")
        src.iterate("loop", lambda loop: (side, loop.map(lambda r: r)))
    # a cycle made by hand (not through iterate), and a back-edge into a source
    flow = abs.Dataflow("hand")
    m1 = flow.source("s", abs.GeneratorSource(10)).map(lambda r: r, uid="m1")
    m2 = m1.map(lambda r: r, uid="m2")
    node = flow.nodes[m1.index]
    flow.nodes[m1.index] = dataclasses.replace(node, inputs=node.inputs + (Edge(m2.index),))
    with pytest.raises(GraphError, match="a cycle not built with stream.iterate"):
        flow.validate()
    flow.nodes[m1.index] = node
    src = flow.nodes[0]
    flow.nodes[0] = dataclasses.replace(src, inputs=(Edge(m2.index, back=True),))
    with pytest.raises(GraphError, match="only an iteration head takes one"):
        flow.validate()


def test_loops_refuse_stop_the_world_and_live_reconfiguration(tmp_path):
    flow = collatz.build(paced_numbers(), abs.CollectSink())
    with pytest.raises(ConfigError, match="stop_the_world"):
        abs.run(flow, storage=str(tmp_path), checkpoint=abs.CheckpointConfig(mode="stop_the_world"))
    job = abs.submit(flow, parallelism=2, storage=str(tmp_path / "r"), checkpoint=abs.CheckpointConfig(interval=0.2))
    try:
        with pytest.raises(ReconfigurationError, match="live reconfiguration of loops is not supported"):
            job.rescale(3)
    finally:
        result = job.wait(timeout=300)
    check_collatz(result.collected("out"), N)


# ---------------------------------------------------------------------- the feedback log
def test_feedback_logs_log_until_the_barrier_comes_round():
    logs = FeedbackLogs([1, 2])
    b = pa.record_batch([pa.array([1, 2])], names=["x"])
    assert logs.on_barrier(2, 5) == [] and logs.blocked == {2}  # came round before the snapshot
    logs.on_batch(1, b)  # before the snapshot: not logged
    assert logs.start(5, "job5") == [] and logs.blocked == frozenset()
    logs.on_batch(1, b)
    logs.on_batch(2, b)  # its barrier already came round: after the cut
    assert logs.start(6, "job6") == []  # a second checkpoint logs beside it
    logs.on_batch(1, b)
    assert logs.on_barrier(1, 5) == [(5, [b, b], "job5")]
    logs.on_batch(2, b)
    assert logs.drop(6) == "job6" and not logs
    assert logs.on_barrier(1, 6) == [] and logs.blocked == frozenset()  # an aborted log's barrier: ignored
    assert logs.start(7, "job7") == []
    assert logs.on_end(1) == [] and logs.on_end(2) == [(7, [], "job7")]
    assert logs.start(8, "job8") == [(8, [], "job8")]  # nothing live: complete at once


# ---------------------------------------------------------------------- whole jobs
@pytest.mark.parametrize("storage", [False, True])
def test_collatz_is_exact_and_ends_once_the_loop_is_quiet(tmp_path, storage):
    """Without storage the job ends through termination probes; with it, through the final
    checkpoint, whose logs are empty; both after every number left the loop."""
    kw = dict(storage=str(tmp_path), checkpoint=abs.CheckpointConfig(interval=0.1)) if storage else {}
    result = abs.run(collatz.build(collatz.numbers(2000, batch_size=64), abs.CollectSink()), parallelism=2, **kw)
    assert result.status == "FINISHED"
    check_collatz(result.collected("out"), 2000)
    if storage:
        store = SnapshotStore.open(str(tmp_path))
        last = store.read_manifest(store.latest_checkpoint())
        assert last.stats["loop_records"] == 0 and last.channel_logs == []


def test_connected_components_with_checkpoints_and_a_restore_that_continues(tmp_path):
    """Label propagation with keyed state inside the loop; the job is canceled mid-way and
    restored from its latest checkpoint, whose logged records are replayed: the labels are
    the union-find ones and the logs are in the manifest, sized and checksummed."""
    nodes, edges = 3000, 2500
    source = components.random_edges(nodes, edges)
    pairs = source.build_batch(np.arange(edges))
    want = components.components(zip(pairs.column("src").to_pylist(), pairs.column("dst").to_pylist()))
    slow = abs.GeneratorSource(count=edges, make_batch=source.make_batch, batch_size=16, rate=150)
    root = str(tmp_path / "root")
    job = abs.submit(components.build(slow, abs.CollectSink()), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.1))
    store = SnapshotStore.open(root)
    with_logs = None
    for _ in range(600):
        cid = job.trigger_checkpoint()
        manifest = store.read_manifest(cid)
        if manifest.channel_logs:
            with_logs = manifest
            break
    assert with_logs is not None, "no checkpoint caught records in the loop"
    first = job.cancel()
    assert first.status == "CANCELED"
    refs = with_logs.channel_logs
    assert sum(r.rows for r in refs) == with_logs.stats["loop_records"] > 0
    assert all(r.path.startswith(f"channels/{with_logs.checkpoint_id:08d}/") and r.bytes > 0 for r in refs)
    assert store.verify(with_logs.checkpoint_id).ok
    shown = subprocess.run([sys.executable, "-m", "abs.cli", "show", root, str(with_logs.checkpoint_id)],
                           capture_output=True, text=True, timeout=120)
    assert f"channel logs: {len(refs)} file(s), {sum(r.rows for r in refs)} records" in shown.stdout, shown.stdout
    # the independent reading of FORMAT.md (pyarrow and json only) finds the same records
    doc = (ROOT / "storage" / "FORMAT.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "channel_logs" in b]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("/data/ckpt", root).replace("chk-00000042", f"chk-{with_logs.checkpoint_id:08d}"), {})
    lines = printed.getvalue().splitlines()
    assert len(lines) == len(refs) and all(line.startswith("propagation#") for line in lines), lines
    assert sum(int(line.split()[1]) for line in lines) == sum(r.rows for r in refs)
    second = abs.run(components.build(slow, abs.CollectSink()), parallelism=3, storage=root, restore="latest",
                     checkpoint=abs.CheckpointConfig(interval=0.1))
    assert second.status == "FINISHED" and second.restored_from is not None
    both = pa.concat_tables([t for t in (first.collected("labels"), second.collected("labels")) if t.num_columns])
    assert components.final_labels(both) == want


def crash_twice(root: str, point: str, nth: int) -> abs.JobResult:
    """Attempt 0: a worker is SIGKILLed right after the 5th checkpoint is committed (records
    circulate then: the test checks its log is not empty); attempt 1 restores it, replaying
    the log, and a worker is SIGKILLed again at ``point`` of an iteration head."""
    result = abs.run(collatz.build(paced_numbers(), abs.CollectSink()), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.1, retained=1000),
                     restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
                     runtime=abs.RuntimeOptions(faults=(Fault("after_commit", "task1#0", nth=5),
                                                        Fault(point, "*", nth=nth, attempt=1))))
    assert result.status == "FINISHED" and len(result.restarts) == 2, result.restarts
    first = result.restarts[0]["restored_from"]
    assert SnapshotStore.open(root).read_manifest(first).stats["loop_records"] > 0, \
        "the checkpoint restored first caught nothing in the loop"
    return result


@pytest.mark.parametrize("point,nth", [("during_logging", 40), ("before_barrier_returns", 5),
                                       ("during_log_upload", 1), ("during_replay", 1)])
def test_a_kill_while_the_loop_is_snapshotted_or_replayed_restores_exactly(tmp_path, point, nth):
    """A worker is SIGKILLed at ``point`` of an iteration head (after a first restore whose
    log was replayed); the job restores the latest checkpoint, replays its logged records
    first, and every number leaves the loop exactly once."""
    check_collatz(crash_twice(str(tmp_path), point, nth).collected("out"), N)


def test_without_the_logs_a_restored_loop_loses_records(tmp_path, monkeypatch):
    """The same crash with the heads' logs dropped (counted, not stored): the records that
    circulated at the restored checkpoint are gone, so numbers never leave the loop. The
    logging is what makes the snapshot of a cycle complete."""
    monkeypatch.setenv(DROP_LOGS_FOR_TESTS, "1")
    result = abs.run(collatz.build(paced_numbers(), abs.CollectSink()), parallelism=2, storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=0.1, retained=1000),
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
                     runtime=abs.RuntimeOptions(faults=(Fault("after_commit", "task1#0", nth=5),)))
    assert result.status == "FINISHED" and len(result.restarts) == 1
    restored = SnapshotStore.open(str(tmp_path)).read_manifest(result.restarts[0]["restored_from"])
    assert restored.stats["loop_records"] > 0, "the restored checkpoint caught nothing in the loop"
    starts = set(result.collected("out").column("start").to_pylist())
    assert len(starts) < N, "no record was lost although the logs were dropped"


def test_a_restore_into_a_dataflow_without_the_iteration_is_refused(tmp_path):
    root = str(tmp_path)
    job = abs.submit(collatz.build(paced_numbers(), abs.CollectSink()), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.1))
    store = SnapshotStore.open(root)
    for _ in range(600):
        if store.read_manifest(job.trigger_checkpoint()).channel_logs:
            break
    job.cancel()
    flow = abs.Dataflow("collatz")
    flow.source("numbers", paced_numbers()).sink("out", abs.CollectSink())
    with pytest.raises(ConfigError, match=r"operator\(s\) \['collatz'\].*allow_non_restored_state"):
        abs.run(flow, storage=root, restore="latest", checkpoint=abs.CheckpointConfig(interval=0.1))
