"""The driver of one job on the test cluster (tests/test_spark_cluster.py), run as its own
process: a process holds one SparkContext, and the rest of the suite shares a ``local[4]`` one.

    python tests/cluster_job.py STATE_JSON WORK_DIR SCENARIO...   # writes WORK_DIR/result.json

One Spark application runs the scenarios in turn (its executors start once); each one's
result (or exception) is recorded under its name.

Scenarios: ``same`` (a job needing more slots than the cluster has, then the counting job on
the local launcher and on the cluster, storage on the cluster's S3 server), ``tools`` (the
snapshot tools and the data source on the root ``same`` wrote, offline ``savepoint`` and
``rekey`` with ``--spark`` on the cluster, a wrong per-job secret from an executor), ``failover`` (an
abs worker process killed with SIGKILL after a checkpoint, then a Spark executor JVM killed
with SIGKILL in the restarted attempt), ``microbatch`` (a file stream through
``SparkMicroBatchSource`` staged on S3, an executor JVM killed mid-stream), ``rate`` (Spark's
rate source, unbounded, the same way; the job canceled after the restore), ``kill-host``
(every process of a host running an abs worker killed: the job goes on on the others; the
host stays lost), ``shrink`` (after kill-host: a job of two workers loses one of the two hosts
left, goes on with one worker, and rescales back to two once the host is revived).

The job's functions live in this file, run as ``__main__``: cloudpickle ships them by value.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import abs  # noqa: E402
from abs.connectors.file_sink import FileSink, read_output  # noqa: E402
from abs.faults import Fault  # noqa: E402
from pacing import PacedSource  # noqa: E402
from processes import wait_while_running  # noqa: E402

TOTAL, KEYS = 30_000, 250
MB_KEYS = 37  # keys of the micro-batch scenario's rows
COUNTED_ROOT: list = []  # the S3 root the counting job of 'same' wrote (read by 'tools')


def _cluster_module():
    spec = importlib.util.spec_from_file_location("abs_cluster", HERE.parent / "scripts" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    # the network namespace of the process that counted: which "host" it ran on
    ctx.emit({"key": ctx.key, "count": c, "net": os.readlink("/proc/self/ns/net")})


def count_rows_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "id": row["id"], "count": c})


def counting_flow(sink: abs.Sink, per_checkpoint: int) -> abs.Dataflow:
    # 32 key groups: every checkpoint, and the offline rewrites of scenario tools, write one
    # file per key group to S3
    flow = abs.Dataflow("cluster-counts", max_parallelism=32)
    src = PacedSource(abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=6, batch_size=250), per_checkpoint)
    flow.source("src", src).key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", sink)
    return flow


def per_key_counts(table: pa.Table) -> dict:
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[str(k)].append(c)
    return {k: sorted(v) for k, v in per_key.items()}


def spark_session(state: dict):
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    # the code the executors import: this checkout and the tests' helpers (on a real cluster:
    # SparkContext.addPyFile / --py-files)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(HERE.parent), str(HERE)]
    return (
        SparkSession.builder.master(state["master_url"])
        .appName("abs-cluster-test")
        .config("spark.driver.host", state["driver_host"])
        .config("spark.driver.bindAddress", state["driver_host"])
        .config("spark.driver.memory", "512m")
        .config("spark.executor.memory", "512m")
        .config("spark.cores.max", str(state["cores"]))
        .config("spark.ui.enabled", "false")
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(paths))
        .getOrCreate()
    )


def storage(state: dict) -> tuple[str, dict]:
    import fsspec

    options = {"key": "testing", "secret": "testing", "endpoint_url": state["s3_endpoint"],
               "config_kwargs": {"retries": {"max_attempts": 3}, "connect_timeout": 5}}
    bucket = "abs-cluster"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    return f"s3://{bucket}/{uuid.uuid4().hex}", options


def kill_executor_after_checkpoint(state: dict, handle: abs.JobHandle, checkpoint: int = 1) -> dict:
    """Once the job completed checkpoint ``checkpoint``, SIGKILL the Spark executor JVM of a
    host that runs one of its abs workers (the last such host)."""
    cluster = _cluster_module()
    deadline = time.monotonic() + 180
    while (handle.metrics()["last_checkpoint"] or 0) < checkpoint and time.monotonic() < deadline:
        time.sleep(0.05)
    hosts = cluster.abs_worker_hosts(state)
    pids = cluster.executor_pids(state, hosts[-1]) if hosts else []
    after = handle.metrics()["last_checkpoint"]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return {"killed_executors": pids, "killed_host": hosts[-1] if hosts else None, "killed_after_checkpoint": after}


def write_json_files(directory: Path, files: int, rows: int) -> int:
    directory.mkdir(parents=True)
    for f in range(files):
        with open(directory / f"part-{f:03d}.json", "w") as fh:
            for i in range(f * rows, (f + 1) * rows):
                fh.write(json.dumps({"id": i, "key": i % MB_KEYS, "name": f"row-{i}"}) + "\n")
    return files * rows


def run_microbatch(spark, state: dict, root: str, options: dict, work: Path) -> dict:
    """A file stream through the micro-batch bridge, staged on S3, counted on the cluster's
    workers; an executor JVM of a worker's host killed mid-stream."""
    from abs.connectors.spark_microbatch import SparkMicroBatchSource

    total = write_json_files(work / "in", files=4, rows=300)
    df = (spark.readStream.schema("id long, key long, name string")
          .option("maxFilesPerTrigger", 1).json(str(work / "in")))
    src = SparkMicroBatchSource(df, staging=f"{root}/staging", storage_options=options,
                                checkpoint_location=str(work / "spark-checkpoint"), num_splits=4,
                                trigger={"availableNow": True}, batch_size=25)
    flow = abs.Dataflow("cluster-microbatch")
    flow.source("src", PacedSource(src, 100)).key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", FileSink(f"{root}/out", format="parquet", storage_options=options))
    handle = abs.submit(flow, executor=abs.SparkExecutor(spark, num_workers=2, slot_wait=60.0),
                        checkpoint=abs.CheckpointConfig(interval=0.3, retained=2), storage=f"{root}/snap",
                        storage_options=options, restart=abs.RestartStrategy(max_restarts=2, delay=0.5))
    out = kill_executor_after_checkpoint(state, handle)
    result = handle.wait(timeout=300)
    table = read_output(f"{root}/out", "parquet", storage_options=options)
    out.update(status=result.status, restarts=[str(r.get("error", r))[:300] for r in result.restarts],
               total=total, spark=per_key_counts(table), active_queries=len(spark.streams.active),
               writers=sorted(src._drv_writers), driver_writer=f"{socket.gethostname()}:{os.getpid()}")
    return out


def run_rate(spark, state: dict, root: str, options: dict, work: Path) -> dict:
    """Spark's rate source (unbounded) through the micro-batch bridge, staged on S3 by the
    query's tasks on the cluster's executors; once rows were counted and checkpointed, the
    executor JVM of a host running an abs worker is killed; the job is canceled after it
    counted rows again. What the checkpoints' offsets cover is returned for the test."""
    import fsspec
    from abs.connectors.spark_microbatch import SparkMicroBatchSource
    from microbatch_check import check_committed, rows_read, staged_batches
    from storage import SnapshotStore

    stream = (spark.readStream.format("rate").option("rowsPerSecond", 300).option("numPartitions", 2).load()
              .selectExpr("value AS id", f"value % {MB_KEYS} AS key", "'r' AS name"))
    staging = f"{root}/staging"
    src = SparkMicroBatchSource(stream, staging=staging, storage_options=options, num_splits=4,
                                checkpoint_location=str(work / "spark-checkpoint"),
                                trigger={"processingTime": "300 milliseconds"}, batch_size=50)
    flow = abs.Dataflow("cluster-rate")
    flow.source("src", src).key_by("key").process(
        "count", count_rows_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", FileSink(f"{root}/out", format="parquet", storage_options=options))
    handle = abs.submit(flow, executor=abs.SparkExecutor(spark, num_workers=2, slot_wait=60.0),
                        checkpoint=abs.CheckpointConfig(interval=0.3, retained=3), storage=f"{root}/snap",
                        storage_options=options, restart=abs.RestartStrategy(max_restarts=2, delay=0.5))
    counted = lambda: handle.metrics()["records_in"].get("count", 0)  # noqa: E731 - since the attempt's start
    wait_while_running("rows counted and checkpointed",
                       lambda: counted() >= 150 and handle.metrics()["completed_checkpoints"] >= 2, handle)
    out = kill_executor_after_checkpoint(state, handle, checkpoint=handle.metrics()["last_checkpoint"])
    wait_while_running("a restart", lambda: handle.metrics()["restarts"] and handle.metrics()["status"] == "RUNNING", handle)
    seen = handle.metrics()["completed_checkpoints"]
    wait_while_running("rows counted after the restore, three checkpoints",
                       lambda: counted() >= 150 and handle.metrics()["completed_checkpoints"] >= seen + 3, handle)
    result = handle.cancel()
    table = read_output(f"{root}/out", "parquet", storage_options=options)
    store = SnapshotStore.open(f"{root}/snap", storage_options=options)
    *_, before, latest = store.list_checkpoints()
    staged = staged_batches(fsspec.filesystem("s3", skip_instance_cache=True, **options), staging)
    ids = table.column("id").to_pylist() if table.num_columns else []
    missing, beyond = check_committed(ids, rows_read(store.read_manifest(before).source_offsets["src"], staged, 4),
                                      rows_read(store.read_manifest(latest).source_offsets["src"], staged, 4))
    out.update(status=result.status, restarts=[str(r.get("error", r))[:300] for r in result.restarts],
               ids=len(ids), distinct=len(set(ids)), spark=per_key_counts(table) if table.num_columns else {},
               missing=missing, beyond=beyond, latest=[latest, store.read_manifest(latest).source_offsets["src"]],
               staged={b: [len(p) for p in parts] for b, parts in staged.items()},
               active_queries=len(spark.streams.active))
    return out


def run_cli(*argv: str) -> dict:
    """``abs-snapshot ARGV`` in this process (so that ``--spark`` uses this process's session on
    the cluster: a second application would find no free cores)."""
    import contextlib
    import io

    from abs import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return {"code": code, "out": out.getvalue()[-3000:], "err": err.getvalue()[-3000:]}


def state_by_key(spark, root: str, options: dict) -> tuple[dict, int, int]:
    """The counting state of the latest checkpoint in ``root``, read by the ``abs-snapshot``
    data source on the executors: ``({key: count}, partitions, highest key group)``."""
    df = (spark.read.format("abs-snapshot").option("operator", "count").option("state", "n")
          .option("keyGroupsPerPartition", 4).option("storageOptions", json.dumps(options)).load(root))
    rows = df.select("key_group", "key", "value").collect()
    return ({str(r["key"]): int(r["value"]) for r in rows}, df.rdd.getNumPartitions(),
            max(r["key_group"] for r in rows))


def run_tools(spark, state: dict, root: str, options: dict) -> dict:
    """The snapshot tools on the S3 root the counting job of ``same`` wrote: ``abs-snapshot
    ls/show/verify``, the ``abs-snapshot`` data source, offline ``savepoint --spark`` and
    ``rekey --spark`` on the cluster's master; then a connection with a wrong per-job secret
    from an executor (another host) to a driver-side listener."""
    import threading
    from multiprocessing.connection import Listener

    import storage.spark

    opts = [f"--storage-option={k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in options.items()]
    out: dict = {"root": root, "step_seconds": {}}
    t = time.monotonic()

    def step(name: str) -> None:
        nonlocal t
        out["step_seconds"][name] = round(time.monotonic() - t, 1)
        t = time.monotonic()

    for command in (("ls",), ("show", "latest"), ("verify",)):
        out[command[0]] = run_cli(command[0], root, *command[1:], *opts, "-q")
    step("cli")
    storage.spark.register(spark)
    checkpoints = (spark.read.format("abs-snapshot").option("table", "checkpoints")
                   .option("storageOptions", json.dumps(options)).load(root).collect())
    out["checkpoint_ids"] = sorted(int(r["checkpoint_id"]) for r in checkpoints)
    out["state"], out["partitions"], _ = state_by_key(spark, root, options)
    step("data source")
    master = ["--spark", "--master", state["master_url"]]
    out["savepoint"] = run_cli("savepoint", root, "latest", f"{root}-sp", *opts, *master, "-q")
    step("savepoint --spark")
    out["rekey"] = run_cli("rekey", root, "latest", f"{root}-rekey", *opts, "--max-parallelism", "64", *master, "-q")
    step("rekey --spark")
    for name in ("sp", "rekey"):
        out[f"verify_{name}"] = run_cli("verify", f"{root}-{name}", *opts, "-q")
    out["sp_state"], _, _ = state_by_key(spark, f"{root}-sp", options)
    out["rekey_state"], _, out["rekey_max_key_group"] = state_by_key(spark, f"{root}-rekey", options)
    step("read back")

    # the per-job secret across hosts: a Spark task (on an executor, another namespace when
    # there are some) connects to a listener of this process with a wrong key, then the right one
    secret = os.urandom(32)
    listener = Listener((state["driver_host"], 0), authkey=secret)
    address = (state["driver_host"], listener.address[1])
    accepted: list = []

    def accept() -> None:
        for _ in range(2):
            try:
                conn = listener.accept()
                accepted.append(["accepted", conn.recv_bytes().decode()])
                conn.close()
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                accepted.append([type(exc).__name__, str(exc)])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()

    def probe(_):
        from abs.runtime.channels import connect_channel

        net = os.readlink("/proc/self/ns/net")
        got = []
        for key in (b"not the job's secret", secret):
            try:
                connect_channel(address, key, hello=net.encode()).close()
                got.append("accepted")
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                got.append(type(exc).__name__)
        return [net, got]

    out["secret_task"] = spark.sparkContext.parallelize([0], 1).map(probe).collect()[0]
    thread.join(60)
    listener.close()
    out["secret_driver"] = accepted
    step("secret")
    return out


def run_shrink(spark, state: dict, root: str, options: dict, work: Path) -> dict:
    """After kill-host (two hosts left): a job of two workers, one host of them lost; the
    restart finds one slot and goes on with one worker (RestartStrategy.min_workers=1); the
    lost host comes back and the job rescales back to two workers, live."""
    cluster = _cluster_module()
    gate = work / "go-on"
    sink_dir = f"{root}/out"
    flow = abs.Dataflow("cluster-shrink", max_parallelism=32)
    # every split waits at 3,000 of its 5,000 records until the gate opens: the job runs
    # while the host is lost, the restart shrinks it and the host comes back
    src = PacedSource(abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=6, batch_size=250), 500,
                      hold_per_split=3_000, gate=str(gate))
    flow.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", FileSink(sink_dir, format="parquet", storage_options=options))
    handle = abs.submit(flow, executor=abs.SparkExecutor(spark, num_workers=2, slot_wait=10.0),
                        checkpoint=abs.CheckpointConfig(interval=0.3, retained=3), storage=f"{root}/snap",
                        storage_options=options,
                        restart=abs.RestartStrategy(max_restarts=2, delay=0.5, min_workers=1))
    out: dict = {}
    try:
        wait_while_running("a first checkpoint", lambda: (handle.metrics()["last_checkpoint"] or 0) >= 1, handle)
        hosts = cluster.abs_worker_hosts(state)
        out["killed_host"] = hosts[-1] if hosts else None
        out["killed"] = cluster.kill_host(state, hosts[-1]) if hosts else []
        wait_while_running("the restart with one worker", lambda: len(handle.metrics()["restarts"]) >= 1
              and handle.metrics()["status"] == "RUNNING", handle)
        out["workers_after_restart"] = handle.metrics()["workers"]
        t0 = time.monotonic()
        cluster.revive_host(state, out["killed_host"])
        wait_while_running("the live rescale back to two workers", lambda: any(
            r.kind == "rescale" and r.status == "COMPLETED" for r in handle.reconfigurations()), handle)
        out["rescaled_back_s"] = round(time.monotonic() - t0, 1)
        out["workers_after_rescale"] = handle.metrics()["workers"]
    finally:
        gate.write_text("")
    result = handle.wait(timeout=300)
    out.update(status=result.status, parallelism=result.parallelism,
               restarts=[{k: str(v)[:300] for k, v in r.items()} for r in result.restarts],
               spark=per_key_counts(read_output(sink_dir, "parquet", storage_options=options)))
    return out


def run_scenario(spark, state: dict, scenario: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    root, options = storage(state)
    t0 = time.monotonic()
    checkpoint = abs.CheckpointConfig(interval=0.3, retained=3)
    out: dict = {"driver_net": os.readlink("/proc/self/ns/net"), "storage": root}
    if scenario == "same":
        try:  # first: a job needing more slots than the cluster has
            abs.run(counting_flow(abs.CollectSink(), 1000), executor=abs.SparkExecutor(spark, num_workers=state["cores"] + 1),
                    checkpoint=checkpoint, storage=f"{root}/slots", storage_options=options)
            out["slots_error"] = None
        except abs.ConfigError as exc:
            out["slots_error"] = str(exc)
        local = abs.run(counting_flow(abs.CollectSink(), 4000), parallelism=2, checkpoint=checkpoint,
                        storage=str(work / "local"))
        on_spark = abs.run(counting_flow(abs.CollectSink(), 4000), executor=abs.SparkExecutor(spark, num_workers=2),
                           checkpoint=checkpoint, storage=root, storage_options=options)
        table = on_spark.collected("out")
        out.update(local=per_key_counts(local.collected("out")), spark=per_key_counts(table),
                   status=on_spark.status, checkpoints=len(on_spark.completed_checkpoints),
                   nets=sorted(set(table.column("net").to_pylist())))
        COUNTED_ROOT[:] = [root]
    elif scenario == "tools":
        if not COUNTED_ROOT:
            raise RuntimeError("scenario 'tools' reads the root the counting job of 'same' wrote: run 'same' first")
        out.update(run_tools(spark, state, COUNTED_ROOT[0], options))
    elif scenario == "microbatch":
        out.update(run_microbatch(spark, state, root, options, work))
    elif scenario == "failover":
        # attempt 0: a real SIGKILL of abs worker 1 right after checkpoint 2's manifest is
        # committed; attempt 1: once it completed checkpoint 3, SIGKILL an executor JVM
        sink_dir = f"{root}/out"
        handle = abs.submit(
            counting_flow(FileSink(sink_dir, format="parquet", storage_options=options), 500),
            executor=abs.SparkExecutor(spark, num_workers=2, slot_wait=60.0),
            checkpoint=checkpoint, storage=f"{root}/snap", storage_options=options,
            restart=abs.RestartStrategy(max_restarts=3, delay=0.5),
            runtime=abs.RuntimeOptions(faults=[Fault("after_commit", "task1#1", nth=2)]),
        )
        out.update(kill_executor_after_checkpoint(state, handle, checkpoint=3))
        result = handle.wait(timeout=300)
        out.update(status=result.status, restarts=[str(r.get("error", r))[:300] for r in result.restarts],
                   restored_from=[r.get("restored_from") for r in result.restarts],
                   spark=per_key_counts(read_output(sink_dir, "parquet", storage_options=options)))
    elif scenario == "kill-host":
        # a whole "host" lost (its worker JVM, executor, Python and abs workers) after a
        # checkpoint: the job restores on the hosts that remain
        sink_dir = f"{root}/out"
        handle = abs.submit(
            counting_flow(FileSink(sink_dir, format="parquet", storage_options=options), 500),
            executor=abs.SparkExecutor(spark, num_workers=2, slot_wait=60.0),
            checkpoint=checkpoint, storage=f"{root}/snap", storage_options=options,
            restart=abs.RestartStrategy(max_restarts=2, delay=0.5),
        )
        cluster = _cluster_module()
        deadline = time.monotonic() + 180
        while (handle.metrics()["last_checkpoint"] or 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        hosts = cluster.abs_worker_hosts(state)
        out["killed_host"] = hosts[-1] if hosts else None
        out["killed_after_checkpoint"] = handle.metrics()["last_checkpoint"]
        out["killed"] = cluster.kill_host(state, hosts[-1]) if hosts else []
        result = handle.wait(timeout=300)
        out.update(status=result.status, restarts=[str(r.get("error", r))[:300] for r in result.restarts],
                   restored_from=[r.get("restored_from") for r in result.restarts],
                   spark=per_key_counts(read_output(sink_dir, "parquet", storage_options=options)))
    elif scenario == "rate":
        out.update(run_rate(spark, state, root, options, work))
    elif scenario == "shrink":
        out.update(run_shrink(spark, state, root, options, work))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: same, tools, failover, microbatch, rate, kill-host or shrink")
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main() -> None:
    state_file, work, scenarios = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    state = json.loads(Path(state_file).read_text())
    results: dict = {}
    try:
        spark = spark_session(state)
    except BaseException:  # noqa: BLE001 - reported to the test in the result file
        spark, results["session"] = None, {"exception": traceback.format_exc()}
    for scenario in scenarios if spark is not None else []:
        try:
            results[scenario] = run_scenario(spark, state, scenario, work / scenario)
        except BaseException:  # noqa: BLE001 - reported to the test; the next scenario still runs
            results[scenario] = {"exception": traceback.format_exc()}
        (work / "result.json").write_text(json.dumps(results))
    (work / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
