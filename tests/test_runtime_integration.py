"""Integration tests with real worker processes, real TCP channels and real storage."""
from __future__ import annotations

import collections
import socket
import time

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.keygroups import key_group
from pacing import PacedSource
from recovery import IncompatibleSnapshotError
from storage import SnapshotStore, StorageUnavailableError

pytestmark = pytest.mark.integration

NUM_KEYS = 300


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def counting_flow(source: abs.Source, name: str = "counts") -> abs.Dataflow:
    flow = abs.Dataflow(name)
    flow.source("src", source).key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", abs.CollectSink())
    return flow


def slow_source(total: int = 48_000) -> PacedSource:
    # each source reader emits at most 2,000 records per completed checkpoint, so that
    # checkpoints fall all along the stream however loaded the machine (``.inner`` is the
    # GeneratorSource, whose records_before tells what a checkpoint's offsets hold)
    return PacedSource(abs.GeneratorSource(total, num_keys=NUM_KEYS, num_splits=6, batch_size=200), 2_000)


def held(source: abs.Source, per_checkpoint: int, hold: int, tmp_path) -> PacedSource:
    """``source`` paced by completed checkpoints, each reader stopping for good at ``hold``
    records (its gate file is never created): a job that is certainly still running after
    its first checkpoints, for a test that then cancels it or takes a savepoint."""
    return PacedSource(source, per_checkpoint, hold=hold, gate=str(tmp_path / "never-opened"))


def assert_exact_running_counts(out: pa.Table, total: int) -> None:
    per_key: dict[int, list[int]] = collections.defaultdict(list)
    for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist()):
        per_key[k].append(c)
    expected = collections.Counter(np.arange(total) % NUM_KEYS)
    assert set(per_key) == set(expected)
    for k, counts in per_key.items():
        # each record counted exactly once, in order: no loss, no duplicate
        assert counts == list(range(1, expected[k] + 1)), f"key {k}"


def state_at(store: SnapshotStore, cid: int, uid: str, state: str) -> dict:
    manifest = store.read_manifest(cid)
    values: dict = {}
    for kg in manifest.keyed.get(uid, {}).get(state, {}):
        table = store.read_key_group(manifest, uid, state, kg)
        for k, v in zip(table.column("key").to_pylist(), table.column("value").to_pylist()):
            assert key_group(k, manifest.max_parallelism) == kg, "key stored in the wrong key group"
            assert k not in values
            values[k] = v
    return values


def test_keyed_count_with_checkpoints_every_200ms_gives_exact_output(tmp_path):
    result = abs.run(
        counting_flow(slow_source()),
        parallelism=3,
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=100),
        storage=str(tmp_path),
    )
    assert result.status == "FINISHED"
    assert len(result.completed_checkpoints) >= 3
    assert result.records_in["count"] == 48_000
    assert_exact_running_counts(result.collected("out"), 48_000)
    for c in result.completed_checkpoints:  # where each one's duration went, step after step
        p = c.phases
        steps = [p["source"], p["snapshot"], p["upload"], p["uploaded"], p["acked"], p["committed"]]
        assert steps == sorted(steps) and p.get("barrier", 0.0) <= p["snapshot"], p
        assert p["acked"] == c.duration, (p, c.duration)


def test_snapshot_n_holds_exactly_the_records_before_barrier_n(tmp_path):
    src = slow_source()
    result = abs.run(
        counting_flow(src),
        parallelism=3,
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=100),
        storage=str(tmp_path),
    )
    store = SnapshotStore.open(str(tmp_path))
    ids = store.list_checkpoints()
    assert len(ids) == len(result.completed_checkpoints) >= 3
    mid_stream = 0
    for cid in ids:
        manifest = store.read_manifest(cid)
        offsets = manifest.source_offsets["src"]
        assert sorted(offsets) == [str(s) for s in range(6)]
        before = src.inner.records_before(offsets)
        expected = dict(collections.Counter((before % NUM_KEYS).tolist()))
        assert state_at(store, cid, "count", "n") == expected, f"checkpoint {cid}"
        mid_stream += 0 < len(before) < 48_000
    assert mid_stream >= 2, "checkpoints should fall in the middle of the stream"
    # counters over a fixed key set: key groups whose keys stayed are [base, values image] (the
    # values alone, format 4) when they have a stream of their own; these (2 or 3 keys each)
    # share one (format 6), where a new base costs less than a values image's own stream.
    # Either way those chains were among the ones checked above
    chains = [chain for cid in ids for chain in store.read_manifest(cid).keyed["count"]["n"].values()]
    values_images = sum(1 for chain in chains if len(chain) > 1 and "key" not in store.read_file(chain[1]).column_names)
    assert values_images > 0 or all(chain[0].shared for chain in chains)
    # incremental: a checkpoint writes files only for key groups whose state changed since
    # the previous one; the others keep referencing earlier files
    for prev, cid in zip(ids, ids[1:]):
        before, after = state_at(store, prev, "count", "n"), state_at(store, cid, "count", "n")
        changed = {key_group(k, 128) for k in set(before) | set(after) if before.get(k) != after.get(k)}
        chains = store.read_manifest(cid).keyed["count"]["n"]
        written = {kg for kg, chain in chains.items() if any(ref.checkpoint_id == cid for ref in chain)}
        assert written <= changed, f"checkpoint {cid} rewrote unchanged key groups {sorted(written - changed)}"
        kept = set(chains) - written
        assert all(ref.checkpoint_id < cid for kg in kept for ref in chains[kg])


def test_collect_sink_output_of_a_canceled_job_and_its_restore_is_exactly_once(tmp_path):
    """CollectSink epochs become visible with their checkpoint's manifest: what the canceled
    job collected plus what the restored job collects is every running count exactly once."""
    total = 30_000

    def source():
        return abs.GeneratorSource(total, num_keys=NUM_KEYS, num_splits=6, batch_size=200)

    # 10,000 records per reader, held at 3,000: still running when canceled
    job = _run_until_checkpoints(counting_flow(held(source(), 1_000, 3_000, tmp_path)), 2, parallelism=3,
                                 storage=str(tmp_path), checkpoint=abs.CheckpointConfig(interval=0.2))
    last = job.trigger_checkpoint()  # returns once its manifest is committed ...
    first = job.cancel()  # ... and the job stops before the workers commit their sink epochs
    assert first.completed_checkpoints[-1].checkpoint_id >= last
    assert 0 < first.collected("out").num_rows < total
    second = abs.run(counting_flow(source()), parallelism=2, restore="latest", storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=0.3))
    assert second.restored_from == first.completed_checkpoints[-1].checkpoint_id
    assert_exact_running_counts(pa.concat_tables([first.collected("out"), second.collected("out")]), total)


def test_stop_the_world_baseline_gives_the_same_exact_output(tmp_path):
    src = slow_source(24_000)
    result = abs.run(
        counting_flow(src),
        parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.2, mode="stop_the_world", retained=100),
        storage=str(tmp_path),
    )
    assert len(result.completed_checkpoints) >= 2
    assert_exact_running_counts(result.collected("out"), 24_000)
    store = SnapshotStore.open(str(tmp_path))
    for cid in store.list_checkpoints():
        manifest = store.read_manifest(cid)
        before = src.inner.records_before(manifest.source_offsets["src"])
        assert state_at(store, cid, "count", "n") == dict(collections.Counter((before % NUM_KEYS).tolist()))


@pytest.mark.parametrize("parallelism", [1, 2])
def test_aggregate_taking_queued_batches_together_checkpoints_exactly_the_records_before_each_barrier(tmp_path, parallelism):
    """With emit="none" the keyed task hands the aggregate the batches queued on a channel as
    one (Task._with_queued): never past a barrier, so every checkpoint holds exactly the sums
    of the records before its source offsets."""
    src = slow_source(24_000)
    flow = abs.Dataflow("agg-merged")
    flow.source("src", src).key_by("key").aggregate("sums", {"total": ("seq", "sum")}, emit="none")
    result = abs.run(flow, parallelism=parallelism, storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=100))
    assert len(result.completed_checkpoints) >= 3
    store = SnapshotStore.open(str(tmp_path))
    for cid in store.list_checkpoints():
        before = src.inner.records_before(store.read_manifest(cid).source_offsets["src"])
        sums = np.bincount(before % NUM_KEYS, weights=before, minlength=NUM_KEYS).astype(np.int64)
        expected = {k: int(sums[k]) for k in np.unique(before % NUM_KEYS).tolist()}
        assert state_at(store, cid, "sums", "total") == expected, f"checkpoint {cid}"
    assert len(before) == 24_000


def test_vectorized_aggregate_and_reduce(tmp_path):
    flow = abs.Dataflow("agg")
    src = abs.GeneratorSource(30_000, num_keys=NUM_KEYS, num_splits=4, batch_size=1000)
    events = flow.source("src", src)
    events.key_by("key").aggregate("sums", {"total": ("seq", "sum"), "n": ("seq", "count"), "hi": ("seq", "max")},
                                   emit="updates").sink("agg_out", abs.CollectSink())
    events.key_by("key").reduce("red", lambda a, r: {"key": r["key"], "value": a["value"] + r["value"], "seq": r["seq"]}) \
        .sink("red_out", abs.CollectSink())
    result = abs.run(flow, parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.1), storage=str(tmp_path))
    seq = np.arange(30_000)
    agg = result.collected("agg_out").to_pandas() if False else result.collected("agg_out")
    final: dict = {}
    for k, t, n, hi in zip(*(agg.column(c).to_pylist() for c in ("key", "total", "n", "hi"))):
        prev = final.get(k)
        if prev is None or n > prev[1]:
            final[k] = (t, n, hi)
    for k in range(NUM_KEYS):
        mine = seq[seq % NUM_KEYS == k]
        assert final[k] == (int(mine.sum()), len(mine), int(mine.max()))
    red = result.collected("red_out")
    best: dict = {}
    for k, v in zip(red.column("key").to_pylist(), red.column("value").to_pylist()):
        best[k] = max(best.get(k, 0), v)
    assert best == dict(collections.Counter((seq % NUM_KEYS).tolist()))
    store = SnapshotStore.open(str(tmp_path))
    last = store.latest_checkpoint()
    totals = state_at(store, last, "sums", "total")
    assert totals == {k: int(seq[seq % NUM_KEYS == k].sum()) for k in range(NUM_KEYS)}


def test_union_rebalance_broadcast_and_row_operators():
    flow = abs.Dataflow("topology")
    a = flow.source("a", abs.GeneratorSource(2_000, num_keys=10, num_splits=2, batch_size=100))
    b = flow.source("b", abs.GeneratorSource(1_000, num_keys=10, num_splits=3, batch_size=64))
    merged = a.map(lambda r: {"key": r["key"], "seq": r["seq"], "src": "a"}).union(
        b.map(lambda r: {"key": r["key"], "seq": r["seq"], "src": "b"})
    )
    evens = merged.rebalance().filter(lambda r: r["seq"] % 2 == 0)
    evens.flat_map(lambda r: [r, r]).sink("dup", abs.CollectSink())
    merged.broadcast().map_batches(lambda batch: batch.select(["seq"])).sink("bc", abs.CollectSink())
    result = abs.run(flow, parallelism=2)
    dup = collections.Counter(zip(result.collected("dup").column("src").to_pylist(), result.collected("dup").column("seq").to_pylist()))
    expected = collections.Counter()
    for src, n in (("a", 2_000), ("b", 1_000)):
        for s in range(0, n, 2):
            expected[(src, s)] = 2
    assert dup == expected
    bc = collections.Counter(result.collected("bc").column("seq").to_pylist())
    expected_bc = collections.Counter()
    for n in (2_000, 1_000):
        for s in range(n):
            expected_bc[s] += 2  # once per subtask
    assert bc == expected_bc


def test_restore_latest_into_other_parallelism_gives_uninterrupted_state(tmp_path):
    src = abs.GeneratorSource(60_000, num_keys=NUM_KEYS, num_splits=6, batch_size=200)
    # 20,000 records per reader, 1,000 per completed checkpoint, held at 4,000: still
    # running, with state in several checkpoints, when canceled
    job = _run_until_checkpoints(counting_flow(held(src, 1_000, 4_000, tmp_path)), 3, parallelism=3,
                                 checkpoint=abs.CheckpointConfig(interval=0.2, retained=100),
                                 storage=str(tmp_path))
    first = job.cancel()
    assert first.status == "CANCELED"
    # the restore reads ranges of packed files: each worker packs the key groups it changed
    restored = SnapshotStore.open(str(tmp_path)).read_manifest(first.completed_checkpoints[-1].checkpoint_id)
    assert any(ref.packed for ref in restored.iter_refs())
    result = abs.run(counting_flow(src), parallelism=2, restore="latest", storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=0.5, retained=100))
    assert result.restored_from == first.completed_checkpoints[-1].checkpoint_id
    store = SnapshotStore.open(str(tmp_path))
    final = state_at(store, store.latest_checkpoint(), "count", "n")
    assert final == dict(collections.Counter((np.arange(60_000) % NUM_KEYS).tolist()))
    # ids never reused across the restart
    assert min(c.checkpoint_id for c in result.completed_checkpoints) > first.completed_checkpoints[-1].checkpoint_id


def test_failing_key_function_names_the_operator():
    flow = abs.Dataflow("bad-key")
    flow.source("src", abs.GeneratorSource(1_000, num_splits=2, batch_size=100)).key_by(
        lambda r: 1 // (r["seq"] - 500)
    ).process("counter", count_fn, state=[abs.ValueState("n")]).sink("out", abs.CollectSink())
    with pytest.raises(abs.OperatorError, match="counter.*ZeroDivisionError|ZeroDivisionError.*counter") as err:
        abs.run(flow, parallelism=2)
    assert err.value.result is not None and err.value.result.status == "FAILED"


def test_failing_process_function_names_the_operator():
    def boom(ctx, row):
        if row["seq"] == 777:
            raise ValueError("bad record 777")

    flow = abs.Dataflow("bad-fn")
    flow.source("src", abs.GeneratorSource(2_000, num_splits=2, batch_size=100)).key_by("key").process(
        "exploder", boom
    ).sink("out", abs.CollectSink())
    with pytest.raises(abs.OperatorError, match="exploder") as err:
        abs.run(flow, parallelism=2)
    assert "bad record 777" in str(err.value)


def test_killed_worker_fails_the_job_and_leaves_no_partial_checkpoint(tmp_path):
    flow = counting_flow(slow_source())
    with pytest.raises(abs.WorkerLostError, match="worker"):
        abs.run(flow, parallelism=3, checkpoint=abs.CheckpointConfig(interval=0.2, retained=100),
                storage=str(tmp_path), runtime=abs.RuntimeOptions(faults=(("after_sync_snapshot", "task1#1", 1),)))
    store = SnapshotStore.open(str(tmp_path))
    # the worker died in its first snapshot: every checkpoint needed its ack, none is complete
    assert store.list_checkpoints() == []
    assert store.verify().ok


def test_duplicate_uids_and_unkeyed_process_are_refused():
    flow = abs.Dataflow("dups")
    s = flow.source("x", abs.GeneratorSource(10))
    with pytest.raises(abs.DuplicateUidError, match="'x'"):
        s.sink("x", abs.CollectSink())
    with pytest.raises(abs.GraphError):
        abs.Dataflow("nosrc").validate()


def _run_until_checkpoints(flow, n, **kwargs):
    """Submit ``flow`` (whose source is paced or held, see :func:`held`) and return its handle
    once ``n`` checkpoints completed; the deadline only bounds a hang."""
    job = abs.submit(flow, **kwargs)
    deadline = time.monotonic() + 120
    while job.metrics()["completed_checkpoints"] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.status == "RUNNING" and job.metrics()["completed_checkpoints"] >= n, job.metrics()
    return job


def test_job_stopped_at_p4_restores_at_p2_and_at_p5_with_exact_output_and_state(tmp_path):
    """A keyed job runs at P = 4 and is stopped after some checkpoints; the same checkpoint is
    restored at P = 2 (in place) and at P = 5 (in a copy of the snapshot root and of the
    output): output and state equal an uninterrupted run's, no record lost or duplicated."""
    import shutil

    from abs.connectors.file_sink import FileSink, read_output

    total = 40_000

    def flow(out, hold=False):
        # the same records and splits; the first run is held (10,000 records per reader, 1,000
        # per completed checkpoint, held at 3,000) so that it is stopped in the middle, the
        # restored runs are not
        src: abs.Source = abs.GeneratorSource(total, num_keys=NUM_KEYS, num_splits=8, batch_size=200)
        if hold:
            src = held(src, 1_000, 3_000, tmp_path)
        f = abs.Dataflow("files")
        f.source("src", src).key_by("key").process(
            "count", count_fn, state=[abs.ValueState("n", pa.int64())]
        ).sink("out", FileSink(str(out), format="parquet"))
        return f

    storage = tmp_path / "snapshots"
    job = _run_until_checkpoints(flow(tmp_path / "out", hold=True), 3, parallelism=4, storage=str(storage),
                                 checkpoint=abs.CheckpointConfig(interval=0.2, retained=2))
    first = job.cancel()
    assert first.status == "CANCELED" and first.parallelism == 4
    stopped_at = first.completed_checkpoints[-1].checkpoint_id
    assert first.records_in["count"] < total, "stopped in the middle of the input"
    shutil.copytree(storage, tmp_path / "snapshots5")
    shutil.copytree(tmp_path / "out", tmp_path / "out5")
    expected_state = dict(collections.Counter((np.arange(total) % NUM_KEYS).tolist()))
    for p, root, out in ((2, storage, tmp_path / "out"), (5, tmp_path / "snapshots5", tmp_path / "out5")):
        result = abs.run(flow(out), parallelism=p, restore="latest", storage=str(root),
                         checkpoint=abs.CheckpointConfig(interval=0.3, retained=2))
        assert result.restored_from == stopped_at and result.parallelism == p
        assert_exact_running_counts(read_output(str(out), "parquet"), total)
        store = SnapshotStore.open(str(root))
        assert state_at(store, store.latest_checkpoint(), "count", "n") == expected_state


def test_a_savepoint_path_or_timeout_of_the_wrong_kind_is_refused_before_anything_is_taken(tmp_path):
    """savepoint(5) took a checkpoint and then failed with a bare TypeError ("argument of type
    'int' is not iterable"); trigger_checkpoint(timeout="x") a TypeError from adding a float
    and a str; a timeout of 0 or below reported a checkpoint that "did not complete"."""
    total = 12_000
    job = abs.submit(counting_flow(held(abs.GeneratorSource(total, num_keys=NUM_KEYS, num_splits=6, batch_size=200),
                                        1_000, 1_000, tmp_path)), parallelism=2, storage=str(tmp_path / "root"))
    try:
        for path in (5, "", " "):
            with pytest.raises(abs.ConfigError, match=r"savepoint\(path=.*\): the path must be a non-empty str"):
                job.savepoint(path)
        for timeout in ("x", 0, -1.0, float("nan")):
            with pytest.raises(abs.ConfigError, match=r"checkpoint: timeout must be a positive number of seconds"):
                job.trigger_checkpoint(timeout=timeout)
            with pytest.raises(abs.ConfigError, match=r"reconfiguration: timeout must be a positive number"):
                job.rescale(3, timeout=timeout)
        assert job.metrics()["completed_checkpoints"] == 0 and job.reconfigurations() == []
    finally:
        job.cancel()


def test_collected_of_a_uid_that_is_no_collect_sink_is_refused_naming_the_collect_sinks(tmp_path):
    """A misspelt uid (or a FileSink's) returned an empty table, as if the sink had received
    nothing."""
    flow = counting_flow(abs.GeneratorSource(500, num_keys=NUM_KEYS))
    flow.source("more", abs.GeneratorSource(10)).sink("files", abs.FileSink(str(tmp_path / "files")))
    result = abs.run(flow, parallelism=1)
    assert result.collected("out").num_rows == 500
    for uid in ("ouT", "files", "count"):
        with pytest.raises(abs.ConfigError, match=rf"JobResult\.collected\('{uid}'\): job 'counts' has no CollectSink "
                                                  rf"'{uid}'; its CollectSinks: \['out'\]; pass one of those uids"):
            result.collected(uid)


def test_a_savepoint_into_the_running_jobs_own_root_is_refused_before_anything_is_taken(tmp_path, monkeypatch):
    """savepoint(<the job's own storage root>) wrote the savepoint under the root's next
    checkpoint id; the job's next checkpoint then failed its commit (CheckpointExistsError),
    which failed the job at tolerable_failures=0. storage_options that are no mapping failed
    with a bare ValueError from dict() after a checkpoint had been taken."""
    root = tmp_path / "root"
    job = abs.submit(counting_flow(held(abs.GeneratorSource(12_000, num_keys=NUM_KEYS, num_splits=6, batch_size=200),
                                        1_000, 1_000, tmp_path)), parallelism=2, storage=str(root),
                     checkpoint=abs.CheckpointConfig(tolerable_failures=0))
    try:
        monkeypatch.chdir(tmp_path)
        for path in (str(root), f"{root}/", f"file://{root}", "root"):
            with pytest.raises(abs.ConfigError, match=r"savepoint\(path=.*\): that is the storage root of the running "
                                                      r"job 'counts'.*pass another directory, or None"):
                job.savepoint(path)
        with pytest.raises(abs.ConfigError, match=r"savepoint\(storage_options=\.\.\.\): must be a mapping .* got str 'x'"):
            job.savepoint(str(tmp_path / "sp"), storage_options="x")
        assert job.metrics()["completed_checkpoints"] == 0
        written = job.savepoint()  # the default, <storage>/savepoints/sp-<id>, is a root of its own
        assert SnapshotStore.open(written).read_manifest(SnapshotStore.open(written).latest_checkpoint()).kind == "savepoint"
        assert job.trigger_checkpoint(timeout=120) > 0 and job.status == "RUNNING"
    finally:
        job.cancel()


def test_savepoint_copied_elsewhere_restores_into_another_parallelism(tmp_path):
    import shutil

    src = abs.GeneratorSource(40_000, num_keys=NUM_KEYS, num_splits=8, batch_size=200)
    # the first run is held (10,000 records per reader, held at 3,000) so that it is still
    # running at the savepoint
    job = _run_until_checkpoints(counting_flow(held(src, 1_000, 3_000, tmp_path)), 2, parallelism=4, storage=str(tmp_path / "a"),
                                 checkpoint=abs.CheckpointConfig(interval=0.2))
    written = job.savepoint(str(tmp_path / "sp"))
    job.cancel()
    savepoint = str(tmp_path / "moved" / "sp")  # relocatable: copied to a new directory
    shutil.copytree(written, savepoint)
    shutil.rmtree(written)
    store_sp = SnapshotStore.open(savepoint)
    (sp_id,) = store_sp.list_checkpoints()
    assert store_sp.read_manifest(sp_id).kind == "savepoint"
    result = abs.run(counting_flow(src), parallelism=5, restore=savepoint, storage=str(tmp_path / "b"),
                     checkpoint=abs.CheckpointConfig(interval=0.3, retained=1))
    assert result.restored_from == sp_id
    store_b = SnapshotStore.open(str(tmp_path / "b"))
    final = state_at(store_b, store_b.latest_checkpoint(), "count", "n")
    assert final == dict(collections.Counter((np.arange(40_000) % NUM_KEYS).tolist()))
    assert store_b.verify().ok
    # the new root is self-contained: every referenced file lives under it
    for cid in store_b.list_checkpoints():
        for ref in store_b.read_manifest(cid).files().values():
            assert (tmp_path / "b" / ref.path).exists()


@pytest.mark.timeout(120)  # only bounds a hang: one refused connection, no retries
def test_unreachable_storage_fails_at_start_with_the_storage_error_naming_the_root():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flow = counting_flow(abs.GeneratorSource(100))
    with pytest.raises(StorageUnavailableError,
                       match=r"^s3://abs-missing-bucket/x: .*the storage endpoint is unreachable.*check the endpoint URL"):
        abs.run(flow, storage="s3://abs-missing-bucket/x",
                storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
                                 "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}},
                checkpoint=abs.CheckpointConfig(interval=1.0))


def test_restore_refuses_a_renamed_operator_unless_allowed(tmp_path):
    src = abs.GeneratorSource(4_000, num_keys=NUM_KEYS, num_splits=2, batch_size=500)
    abs.run(counting_flow(src), parallelism=2, storage=str(tmp_path), checkpoint=abs.CheckpointConfig())
    renamed = abs.Dataflow("counts")
    renamed.source("src", src).key_by("key").process(
        "count-v2", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", abs.CollectSink())
    with pytest.raises(IncompatibleSnapshotError, match=r"operator uid 'count' has keyed state 'n' in the snapshot, "
                       r"but the job has no operator with this uid; .*allow_non_restored_state=True"):
        abs.run(renamed, parallelism=2, restore="latest", storage=str(tmp_path))
    result = abs.run(renamed, parallelism=3, restore="latest", storage=str(tmp_path),
                     allow_non_restored_state=True)
    assert result.status == "FINISHED"


def test_restore_latest_falls_back_past_a_corrupt_checkpoint(tmp_path, capfd):
    src = abs.GeneratorSource(20_000, num_keys=NUM_KEYS, num_splits=4, batch_size=200)
    # 10,000 records per reader, 1,000 per completed checkpoint: ten checkpoints or more, each
    # with new state (not held: the newest checkpoint must have written files of its own)
    job = _run_until_checkpoints(counting_flow(PacedSource(src, 1_000)), 3, parallelism=2,
                                 storage=str(tmp_path), checkpoint=abs.CheckpointConfig(interval=0.2, retained=10))
    job.cancel()
    store = SnapshotStore.open(str(tmp_path))
    latest = store.latest_checkpoint()
    # the newest checkpoint that wrote files of its own (under load one may complete before the
    # source's next records reach the counter, and write nothing): damaging one of them breaks
    # it and every later checkpoint, whose chains build on it
    newest_files = next(own for cid in sorted(store.list_checkpoints(), reverse=True)
                        if (own := [ref for ref in store.read_manifest(cid).files().values() if ref.checkpoint_id == cid]))
    victim = tmp_path / newest_files[0].path
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    # the first run's CollectSink output of the skipped checkpoint went to its JobResult and
    # cannot be taken back: the restore refuses unless told that repeating it is fine
    with pytest.raises(abs.RepeatedOutputError, match=rf"sink 'out' already committed output of checkpoint\(s\) {latest}"):
        abs.run(counting_flow(src), parallelism=3, restore="latest", storage=str(tmp_path))
    result = abs.run(counting_flow(src), parallelism=3, restore="latest", storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(retained=10), allow_repeated_output=True)
    assert result.restored_from is not None and result.restored_from < latest
    assert result.repeated_output == {"out": list(range(result.restored_from + 1, latest + 1))}
    assert newest_files[0].path in capfd.readouterr().err
    final = state_at(store, store.latest_checkpoint(), "count", "n")
    assert final == dict(collections.Counter((np.arange(20_000) % NUM_KEYS).tolist()))


def _children_of(pid: int) -> list[int]:
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def where_am_i(ctx, row):
    import os

    seen = ctx.state.seen
    if seen.value() is None:  # once per key: which CPUs this worker and its writer may use
        seen.update(1)
        writers = [sorted(os.sched_getaffinity(c)) for c in _children_of(os.getpid())]
        ctx.emit({"key": ctx.key, "pid": os.getpid(), "cpus": str(sorted(os.sched_getaffinity(0))),
                  "writers": str(writers)})


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_pinned_workers_run_on_one_cpu_each_and_their_writers_on_all(tmp_path):
    import os

    cpus = sorted(os.sched_getaffinity(0))
    flow = abs.Dataflow("pinned")
    flow.source("src", abs.GeneratorSource(4_000, num_keys=40, num_splits=2, batch_size=100)).key_by("key").process(
        "where", where_am_i, state=[abs.ValueState("seen", pa.int64())]).sink("out", abs.CollectSink())
    result = abs.run(flow, parallelism=2, executor=abs.LocalExecutor(pin_cpus=True), storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=0.2))
    out = result.collected("out")
    by_pid = {pid: (c, w) for pid, c, w in zip(out.column("pid").to_pylist(), out.column("cpus").to_pylist(),
                                               out.column("writers").to_pylist())}
    assert len(by_pid) == 2
    pinned = sorted(eval(c) for c, _ in by_pid.values())
    assert pinned == sorted([[cpus[0]], [cpus[1 % len(cpus)]]])  # worker i on the i-th CPU
    for _, writers in by_pid.values():
        assert eval(writers) == [cpus]  # the writer process (the worker's only child) is free
    free = abs.run(flow, parallelism=1, storage=str(tmp_path / "free"), checkpoint=abs.CheckpointConfig(interval=0.2))
    assert set(free.collected("out").column("cpus").to_pylist()) == {str(cpus)}  # not pinned by default
