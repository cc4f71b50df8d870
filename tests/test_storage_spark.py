"""``spark.read.format("abs-snapshot")`` (storage/spark.py) against a real local Spark.

One snapshot root is written per module with :class:`SnapshotStore` (four checkpoints over 20
key groups: bases, deltas with upserts and deletes, compactions, a key group emptied by
deletes), holding an int-keyed typed state, an int-keyed list state, and a string-keyed
pickled state. The DataFrames are compared with ``abs-snapshot dump --format jsonl`` and with
a plain-Python model of the state.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from abs.cli import main as cli_main
from abs.keygroups import key_group
from storage import CompactionPolicy, FileRef, Manifest, SnapshotStore, StorageConfigError

pytestmark = pytest.mark.integration

MAX_PAR = 20
JOB = "sparkjob"
PICKLE_META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"pickle"}
TYPED_META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
# (operator, state): value Arrow type (None = pickled)
STATES: dict[tuple[str, str], pa.DataType | None] = {
    ("count", "n"): pa.int64(),
    ("count", "hist"): pa.list_(pa.int32()),
    ("words/agg 1", "info"): None,
}
RUNTIME_STATS = {"duration_s": 0.25, "alignment_s": 0.01, "sync_s": 0.002, "async_s": 0.1,
                 "parallelism": 4, "mode": "exactly_once"}


# ----------------------------------------------------------------------------- the snapshot
def _changes(cid: int) -> dict[tuple[str, str], dict[Any, Any]]:
    """Changes per checkpoint: key -> new value, or ``DELETE``."""
    if cid == 1:
        return {
            ("count", "n"): {k: k * 10 for k in range(400)},
            ("count", "hist"): {k: [k, k + 1] for k in range(0, 400, 3)},
            ("words/agg 1", "info"): {f"w{i}": {"n": i, "tags": ("a", i)} for i in range(200)},
        }
    if cid == 2:
        return {
            ("count", "n"): {**{k: -k for k in range(0, 400, 7)}, **{k: DELETE for k in range(1, 400, 11)},
                             **{k: k for k in range(400, 450)}},
            ("count", "hist"): {k: [] for k in range(0, 60, 3)},
            ("words/agg 1", "info"): {**{f"w{i}": DELETE for i in range(0, 200, 5)}, "new": [1, 2, 3]},
        }
    if cid == 3:  # every key of key group 3 of count/n deleted: an empty, still present chain
        kg3 = [k for k in range(450) if key_group(k, MAX_PAR) == 3]
        return {
            ("count", "n"): {**{k: k * 1000 for k in range(100, 130)}, **{k: DELETE for k in kg3}},
            ("words/agg 1", "info"): {f"w{i}": {"n": -i} for i in range(1, 200, 9)},
        }
    return {  # 4
        ("count", "n"): {**{k: 7 for k in range(200, 260) if key_group(k, MAX_PAR) != 3},
                         **{k: DELETE for k in range(440, 450)}},
        ("count", "hist"): {k: None for k in range(300, 330, 3)},
        ("words/agg 1", "info"): {**{f"w{i}": DELETE for i in range(100, 120)}, "w0": "back"},
    }


DELETE = object()


def _delta(changes: dict[Any, Any], vtype: pa.DataType | None) -> pa.Table:
    keys = list(changes)
    values = [changes[k] for k in keys]
    ops = [1 if v is DELETE else 0 for v in values]
    plain = [None if v is DELETE else v for v in values]
    if vtype is None:
        varr = pa.array([None if o else pickle.dumps(v, protocol=5) for v, o in zip(plain, ops)], pa.binary())
        meta = PICKLE_META
    else:
        varr = pa.array(plain, vtype)
        meta = TYPED_META
    karr = pa.array(keys, pa.int64() if isinstance(keys[0], int) else pa.string())
    schema = pa.schema([pa.field("key", karr.type), pa.field("value", varr.type), pa.field("op", pa.int8())],
                       metadata=meta)
    return pa.Table.from_arrays([karr, varr, pa.array(ops, pa.int8())], schema=schema)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Writes the root; returns its URL and the model state per checkpoint."""
    root = str(tmp_path_factory.mktemp("spark") / "root")
    store = SnapshotStore.open(root, policy=CompactionPolicy(max_chain_length=3, max_delta_ratio=50.0))
    store.init_job({"job_name": JOB, "max_parallelism": MAX_PAR})
    chains: dict[tuple[str, str], dict[int, list[FileRef]]] = {s: {} for s in STATES}
    model: dict[tuple[str, str], dict[Any, Any]] = {s: {} for s in STATES}
    models: dict[int, dict[tuple[str, str], dict[Any, Any]]] = {}
    for cid in (1, 2, 3, 4):
        for st, changes in _changes(cid).items():
            by_kg: dict[int, dict[Any, Any]] = {}
            for k, v in changes.items():
                by_kg.setdefault(key_group(k, MAX_PAR), {})[k] = v
                if v is DELETE:
                    model[st].pop(k, None)
                else:
                    model[st][k] = v
            for kg, kg_changes in sorted(by_kg.items()):
                chains[st][kg] = store.write_key_group(cid, st[0], st[1], kg, chains[st].get(kg, []),
                                                       _delta(kg_changes, STATES[st]))
        keyed: dict[str, dict[str, dict[int, list[FileRef]]]] = {}
        for (op, name), by_kg in chains.items():
            keyed.setdefault(op, {})[name] = {kg: list(c) for kg, c in by_kg.items()}
        store.commit(Manifest(checkpoint_id=cid, job_name=JOB, max_parallelism=MAX_PAR, keyed=keyed,
                              created_at=1_800_000_000.0 + cid,
                              stats=dict(RUNTIME_STATS, duration_s=0.25 * cid) if cid != 2 else {}))
        models[cid] = {st: dict(m) for st, m in model.items()}
    store.savepoint(3, root)  # checkpoint 5: a savepoint of 3
    return {"root": root, "store": store, "models": models}


@pytest.fixture(scope="module")
def reader(spark: Any) -> Any:
    import storage.spark

    storage.spark.register(spark)
    storage.spark.register(spark)  # idempotent

    def read(root: str, **options: Any) -> Any:
        r = spark.read.format("abs-snapshot")
        for k, v in options.items():
            r = r.option(k, v)
        return r.load(root)

    return read


# ----------------------------------------------------------------------------- helpers
def dump_rows(root: str, cid: int, op: str, state: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["dump", root, str(cid), "--operator", op, "--state", state, "--format", "jsonl",
                         "--limit", "0"])
    assert code == 0
    return [json.loads(line) for line in out.getvalue().splitlines() if line]


def _jsonable(value: Any, pickled: bool) -> Any:
    """A Spark cell as ``dump --format jsonl`` prints it."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return {"pickled_hex": bytes(value).hex()} if pickled else {"hex": bytes(value).hex()}
    return value


def spark_rows(df: Any, pickled: bool) -> list[dict[str, Any]]:
    return [{k: _jsonable(v, pickled and k == "value") for k, v in row.asDict(recursive=True).items()}
            for row in df.collect()]


def by_key(rows: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    out = {r["key"]: r for r in rows}
    assert len(out) == len(rows), "duplicate keys"
    return out


def check_schema(schema: Any, st: tuple[str, str]) -> None:
    from pyspark.sql import types as T

    key_type = T.StringType() if st[0] == "words/agg 1" else T.LongType()
    value_type = {("count", "n"): T.LongType(), ("count", "hist"): T.ArrayType(T.IntegerType(), True),
                  ("words/agg 1", "info"): T.BinaryType()}[st]
    assert [(f.name, f.dataType, f.nullable) for f in schema.fields] == [
        ("key_group", T.IntegerType(), False), ("key", key_type, False), ("value", value_type, True)]
    assert schema["key"].metadata == {"abs.encoding": "arrow"}
    assert schema["value"].metadata == {"abs.encoding": "pickle" if STATES[st] is None else "arrow"}


# ----------------------------------------------------------------------------- state table
@pytest.mark.parametrize("cid", [None, 2])
@pytest.mark.parametrize("st", list(STATES), ids=lambda s: "/".join(s))
def test_state_equals_dump_and_model(snapshot, reader, cid, st):
    root, models = snapshot["root"], snapshot["models"]
    options = {"operator": st[0], "state": st[1]}
    if cid is not None:
        options["checkpoint"] = cid
    df = reader(root, **options)
    pickled = STATES[st] is None
    check_schema(df.schema, st)
    rows = by_key(spark_rows(df, pickled))
    expected_cid = cid if cid is not None else 5  # latest complete: the savepoint of checkpoint 3
    dumped = by_key(dump_rows(root, expected_cid, *st))
    assert rows == dumped
    model = models[cid if cid is not None else 3][st]
    assert set(rows) == set(model)
    for k, r in rows.items():
        assert r["key_group"] == key_group(k, MAX_PAR)
        got = pickle.loads(bytes.fromhex(r["value"]["pickled_hex"])) if pickled else r["value"]
        assert got == model[k]


def test_latest_checkpoint_of_older_id_and_deleted_key_group(snapshot, reader):
    root = snapshot["root"]
    df = reader(root, operator="count", state="n", checkpoint=4)
    assert df.count() == len(snapshot["models"][4][("count", "n")])
    # key group 3 was emptied by deletes at checkpoint 3: its chain is there, its rows are not
    assert df.filter("key_group = 3").count() == 0
    assert reader(root, operator="count", state="n", checkpoint=2).filter("key_group = 3").count() > 0


def test_partitions_follow_key_groups_per_partition(snapshot, reader):
    root = snapshot["root"]
    groups = len(SnapshotStore.open(root).read_manifest(4).chains("count", "n"))
    assert groups == MAX_PAR
    assert reader(root, operator="count", state="n", checkpoint=4).rdd.getNumPartitions() == 1  # auto: tiny state
    assert reader(root, operator="count", state="n", checkpoint=4,
                  keyGroupsPerPartition=1).rdd.getNumPartitions() == groups
    df = reader(root, operator="count", state="n", checkpoint=4, keyGroupsPerPartition=6)
    assert df.rdd.getNumPartitions() == math.ceil(groups / 6)
    per_partition = df.rdd.mapPartitions(lambda rows: [sorted({r.key_group for r in rows})]).collect()
    assert [kgs for kgs in per_partition if kgs] == [
        [kg for kg in range(lo, min(lo + 6, groups)) if kg != 3] for lo in range(0, groups, 6)]
    assert df.count() == len(snapshot["models"][4][("count", "n")])


def test_key_groups_option_prunes(snapshot, reader):
    df = reader(snapshot["root"], operator="count", state="n", keyGroups="0-2,7", keyGroupsPerPartition=1)
    assert df.rdd.getNumPartitions() == 4
    assert sorted(r.key_group for r in df.select("key_group").distinct().collect()) == [0, 1, 2, 7]


def test_spark_sql_aggregate(snapshot, reader, spark):
    reader(snapshot["root"], operator="count", state="n", checkpoint=4).createOrReplaceTempView("counts")
    got = spark.sql("SELECT key_group, count(*) AS keys, sum(value) AS total FROM counts "
                    "GROUP BY key_group ORDER BY key_group").collect()
    model = snapshot["models"][4][("count", "n")]
    expected: dict[int, list[int]] = {}
    for k, v in model.items():
        e = expected.setdefault(key_group(k, MAX_PAR), [0, 0])
        e[0] += 1
        e[1] += v
    assert {r.key_group: [r.keys, r.total] for r in got} == expected
    joined = spark.sql("SELECT count(*) FROM counts c JOIN counts d ON c.key = d.key + 1").collect()[0][0]
    assert joined == sum(1 for k in model if k - 1 in model)


def test_user_schema_casts(snapshot, reader, spark):
    df = (spark.read.format("abs-snapshot").schema("key string, value double")
          .option("operator", "count").option("state", "n").option("checkpoint", 1).load(snapshot["root"]))
    rows = {r.key: r.value for r in df.collect()}
    assert rows == {str(k): float(v) for k, v in snapshot["models"][1][("count", "n")].items()}


# ----------------------------------------------------------------------------- checkpoints table
def test_checkpoints_table_matches_list_checkpoints(snapshot, reader):
    store: SnapshotStore = snapshot["store"]
    rows = {r.checkpoint_id: r for r in reader(snapshot["root"], table="checkpoints").collect()}
    assert sorted(rows) == [int(c) for c in store.list_checkpoints()] == [1, 2, 3, 4, 5]
    for cid, r in rows.items():
        m = store.read_manifest(cid)
        assert r.kind == m.kind
        assert r.job_name == JOB and r.max_parallelism == MAX_PAR
        assert r.created_at.timestamp() == pytest.approx(m.created_at)
        for name in ("bytes_written", "full_size", "files", "max_chain_length", "key_groups", "restore_bytes"):
            assert getattr(r, name) == m.stats[name], name
        assert json.loads(r.stats) == m.stats
        assert r.error is None
    assert rows[4].duration_s == 1.0 and rows[4].alignment_s == 0.01 and rows[4].parallelism == 4
    assert rows[4].mode == "exactly_once" and rows[4].sync_s == 0.002 and rows[4].async_s == 0.1
    assert rows[2].duration_s is None and rows[2].mode is None
    assert rows[5].kind == "savepoint" and rows[5].savepoint_of == 3 and rows[1].savepoint_of is None
    assert rows[5].max_chain_length == 1 and rows[4].max_chain_length > 1


# ----------------------------------------------------------------------------- errors
def _error(fn: Any) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return str(info.value)


def test_errors_through_spark(snapshot, reader, tmp_path: Path):
    root = snapshot["root"]
    msg = _error(lambda: reader(root, operator="nope", state="n").schema)
    assert "no keyed state for operator 'nope'" in msg and "'count'" in msg and "'words/agg 1'" in msg
    msg = _error(lambda: reader(root, operator="count", state="nope").schema)
    assert "has no state 'nope'" in msg and "'hist'" in msg and "'n'" in msg
    msg = _error(lambda: reader(root, operator="count", state="n", checkpoint=99).schema)
    assert "checkpoint 99 does not exist" in msg and "[1, 2, 3, 4, 5]" in msg
    msg = _error(lambda: reader(str(tmp_path / "empty"), operator="count", state="n").schema)
    assert "holds no snapshots" in msg


def test_load_raises_the_data_sources_own_error_first(snapshot, spark, tmp_path: Path):
    """Spark wraps a data source's error in an AnalysisException that starts with Spark's
    words and a traceback; storage.spark.load raises the cause itself, chained to it."""
    import storage.spark
    from storage import CheckpointNotFoundError, StateNotFoundError, StorageError

    root = snapshot["root"]
    with pytest.raises(CheckpointNotFoundError) as info:
        storage.spark.load(spark, root, operator="count", state="n", checkpoint=99)
    assert str(info.value).startswith(f"{root}: checkpoint 99 does not exist")
    assert "Traceback" not in str(info.value) and "PYTHON_DATA_SOURCE_ERROR" in str(info.value.__cause__)
    with pytest.raises(StateNotFoundError, match="has no state 'nope'"):
        storage.spark.load(spark, root, operator="count", state="nope")
    with pytest.raises(StorageError, match="holds no snapshots"):
        storage.spark.load(spark, str(tmp_path / "empty"), operator="count", state="n")
    df = storage.spark.load(spark, root, operator="count", state="n", checkpoint=4)
    assert df.count() == len(snapshot["models"][4][("count", "n")])
    assert storage.spark.cause(ValueError("no storage error here")) is None


def test_a_relative_root_is_the_callers_not_sparks_working_directory(snapshot, reader, spark, monkeypatch):
    """A relative root names a directory below the caller's working directory, as in
    ``abs-snapshot`` and ``abs.run(storage=...)``: Spark plans and reads a Python data source
    in its own Python workers, whose working directory is the one the session started in (on a
    cluster: each executor's work directory), so the path is made absolute before it goes to
    Spark (load) or where Spark plans it (spark.read.format: the executors then get the
    planned absolute path)."""
    import storage.spark

    root = Path(snapshot["root"])
    monkeypatch.chdir(root.parent.parent)  # not where this session's JVM and workers started
    relative = os.path.join(root.parent.name, root.name)
    df = storage.spark.load(spark, relative, operator="count", state="n", checkpoint=4)
    assert df.count() == len(snapshot["models"][4][("count", "n")])
    # a relative path given to Spark itself is planned against Spark's directory: the error
    # names the absolute path it was resolved to, not just the relative one
    # a pathlib.Path (what tmp_path and most code hold) is a path too; it raised AttributeError
    # "'PosixPath' object has no attribute '_get_object_id'" from Py4J
    assert storage.spark.load(spark, root, operator="count", state="n", checkpoint=4).count() == df.count()
    with pytest.raises(StorageConfigError, match=r"the snapshot root must be a path or URL.*got int"):
        storage.spark.load(spark, 42, operator="count", state="n")
    msg = _error(lambda: reader("no/such/root", operator="count", state="n").schema)
    assert "holds no snapshots" in msg and re.search(r"/no/such/root: holds no snapshots", msg), msg


def test_a_checkpoint_a_running_jobs_retention_drops_while_spark_reads_it_is_removed_not_damaged(spark, tmp_path):
    """The DataFrame of a root a job is writing is planned at one checkpoint; the job's
    retention (CheckpointConfig.retained) may drop that checkpoint before Spark's tasks read its
    files. They are gone, not damaged: the error says so and to read again (it said 'file ...
    is missing; the checkpoint cannot be restored; restore from an earlier checkpoint')."""
    import storage.spark
    from storage import CheckpointNotFoundError

    root = str(tmp_path / "live")
    store = SnapshotStore.open(root, fsync=False)
    store.init_job({"job_name": "live", "max_parallelism": 2})

    def commit_full(cid: int) -> None:  # every key group anew: dropping the checkpoint deletes its files
        chains = {kg: store.write_key_group(cid, "sum", "n", kg, [], pa.table({"key": [kg], "value": [cid]}))
                  for kg in range(2)}
        store.commit(Manifest(checkpoint_id=cid, job_name="live", max_parallelism=2, keyed={"sum": {"n": chains}}))

    commit_full(1)
    df = storage.spark.load(spark, root, operator="sum", state="n")  # planned at checkpoint 1
    commit_full(2)
    store.gc(1)  # what the job's retention does: checkpoint 1 dropped, data files first, manifest last
    with pytest.raises(Exception) as info:
        df.collect()
    found = storage.spark.cause(info.value)
    assert isinstance(found, CheckpointNotFoundError), info.value
    assert "checkpoint 1 was removed while Spark read it" in str(found) and "not damaged" in str(found)
    assert "read again" in str(found) and "cannot be restored" not in str(found)
    assert [r.value for r in storage.spark.load(spark, root, operator="sum", state="n").collect()] == [2, 2]


# ----------------------------------------------------------------------------- without Spark's JVM
def test_load_registers_the_data_source_once_per_session():
    """Spark warns when a data source replaces one registered before: load (and register)
    register it once per session, and again only with another session."""
    import storage.spark

    class Session:  # what load uses of a SparkSession, counting registrations
        def __init__(self) -> None:
            self.registered: list = []
            self.dataSource = type("Registration", (), {"register": lambda _, cls: self.registered.append(cls)})()
            self.read = self

        def format(self, name: str) -> "Session":
            assert name == storage.spark.SOURCE_NAME
            return self

        def options(self, **options: str) -> "Session":
            return self

        def load(self, root: str) -> str:
            return f"df of {root}"

    first, second = Session(), Session()
    assert storage.spark.load(first, "/r", operator="count", state="n") == "df of /r"
    storage.spark.load(first, "/r", table="checkpoints")
    storage.spark.register(first)
    assert [c.__name__ for c in first.registered] == ["AbsSnapshotDataSource"]
    storage.spark.load(second, "/r", table="checkpoints")
    assert len(second.registered) == 1


def test_options_and_types_without_a_session():
    from pyspark.sql import types as T

    from storage.spark import _parse_options, arrow_to_spark_type

    opts = _parse_options({"path": "s3://b/p", "storage.key": "k", "storage.client_kwargs.endpoint_url": "http://h:1",
                           "storage.config_kwargs.retries.max_attempts": "2",
                           "storageOptions": '{"secret": "123", "client_kwargs": {"region_name": "x"}}',
                           "keyGroups": "0-2, 9", "keyGroupsPerPartition": "auto", "checkpoint": "latest"})
    assert opts.storage_options == {"key": "k", "secret": "123", "config_kwargs": {"retries": {"max_attempts": 2}},
                                    "client_kwargs": {"region_name": "x", "endpoint_url": "http://h:1"}}
    assert opts.key_groups == {0, 1, 2, 9} and opts.key_groups_per_partition is None and opts.checkpoint is None
    # a keyGroups that names no key group read an empty DataFrame without a word
    for nothing in (" ", ",", " , "):
        with pytest.raises(StorageConfigError, match=r"option keyGroups=.* names no key group.*leave the option out"):
            _parse_options({"path": "/r", "keyGroups": nothing})
    assert arrow_to_spark_type(pa.uint64()) == T.DecimalType(20, 0)
    assert arrow_to_spark_type(pa.large_string()) == T.StringType()
    assert arrow_to_spark_type(pa.timestamp("ns")) == T.TimestampNTZType()
    assert arrow_to_spark_type(pa.map_(pa.string(), pa.struct([("a", pa.int8())]))) == T.MapType(
        T.StringType(), T.StructType([T.StructField("a", T.ByteType())]))


def source(root: str, **options: Any) -> Any:
    """The data source as Spark's Python workers drive it, in this process (no JVM)."""
    from pyspark.sql.datasource import CaseInsensitiveDict

    from storage.spark import AbsSnapshotDataSource

    return AbsSnapshotDataSource(CaseInsensitiveDict({"path": root, **{k: str(v) for k, v in options.items()}}))


def test_errors_in_process(snapshot, tmp_path: Path):
    from storage import CheckpointNotFoundError, StateNotFoundError, StorageConfigError, StorageError

    root = snapshot["root"]
    with pytest.raises(StateNotFoundError, match=r"operators: \['count', 'words/agg 1'\]"):
        source(root, operator="nope", state="n").schema()
    with pytest.raises(CheckpointNotFoundError, match=r"complete checkpoints: \[1, 2, 3, 4, 5\]"):
        source(root, operator="count", state="n", checkpoint=99).schema()
    with pytest.raises(StorageConfigError, match="option operator and state missing.*'count'/'n'"):
        source(root, checkpoint=4).schema()
    with pytest.raises(StorageConfigError, match="option state missing"):
        source(root, operator="count").schema()
    with pytest.raises(StorageError, match="holds no snapshots"):
        source(str(tmp_path / "empty"), table="checkpoints").schema()
    for bad, match in [({"keyGroupsPerPartition": 0}, "keyGroupsPerPartition"),
                       ({"checkpoint": "x"}, "option checkpoint='x'"),
                       ({"checkpint": 3}, r"unknown option\(s\) \['checkpint'\]"),
                       ({"table": "tables"}, "use 'state'"),
                       ({"keyGroups": "5-2"}, "option keyGroups"),
                       ({"keyGroups": "20"}, r"outside \[0, 20\)"),
                       ({"storageOptions": "[1]"}, "JSON object")]:
        with pytest.raises(StorageConfigError, match=match):
            source(root, operator="count", state="n", **bad).schema()


def test_reader_in_process(snapshot):
    """partitions() and read() driven directly: batches match the declared Arrow schema exactly."""
    from storage.spark import _target_schema

    ds = source(snapshot["root"], operator="count", state="n", checkpoint=3, keyGroupsPerPartition=8)
    schema = ds.schema()
    ds = pickle.loads(pickle.dumps(ds))  # as Spark ships it from schema() to the planner
    reader = ds.reader(schema)
    parts = reader.partitions()
    assert [len(p.chains) for p in parts] == [8, 8, 4]
    shipped = pickle.loads(pickle.dumps(reader))
    assert shipped.plan.chains == [] and not hasattr(shipped, "_groups")  # tasks get their chains from the partition
    target = _target_schema(schema)
    got = {}
    for part in parts:
        for batch in shipped.read(pickle.loads(pickle.dumps(part))):
            assert batch.schema.equals(target)
            got.update(zip(batch.column(1).to_pylist(), batch.column(2).to_pylist()))
    assert got == snapshot["models"][3][("count", "n")]
    table = next(iter(source(snapshot["root"], table="checkpoints").reader(
        source(snapshot["root"], table="checkpoints").schema()).read(None)))
    assert table.column(0).to_pylist() == [1, 2, 3, 4, 5]


def test_auto_partitioning_packs_contiguous_key_groups_by_bytes():
    from types import SimpleNamespace

    from storage.spark import _pack_by_bytes, auto_partition_count

    MiB = 1 << 20
    assert auto_partition_count(0, 0) == 0
    assert auto_partition_count(100_000, 20) == 1            # small: one task
    assert auto_partition_count(11 * MiB, 128) == 11         # >= 1 MiB each
    assert auto_partition_count(100 * MiB, 128) == 16        # at least 16 ...
    assert auto_partition_count(3200 * MiB, 128) == 100      # ... of ~32 MiB
    assert auto_partition_count(100_000 * MiB, 4096) == 256  # at most 256
    assert auto_partition_count(100 * MiB, 5) == 5           # never more than the key groups

    def chains(sizes):
        return [(kg, [SimpleNamespace(bytes=b)]) for kg, b in enumerate(sizes)]

    even = _pack_by_bytes(chains([MiB] * 128))
    assert len(even) == 16 and all(len(g) == 8 for g in even)
    assert [kg for g in even for kg, _ in g] == list(range(128))
    skewed = _pack_by_bytes(chains([40 * MiB] + [MiB] * 40))  # one big key group: alone in its partition
    assert [kg for kg, _ in skewed[0]] == [0]
    assert [kg for g in skewed for kg, _ in g] == list(range(41)) and len(skewed) <= auto_partition_count(80 * MiB, 41)
    assert 2 <= max(len(g) for g in skewed[1:]) <= 4
    few = _pack_by_bytes(chains([200 * MiB] * 3))
    assert [len(g) for g in few] == [1, 1, 1]


@pytest.mark.s3
def test_s3_root_with_storage_options(reader, s3_server, s3_root):
    """Executors open the root themselves: storage.* options (nested with dots) reach them."""
    options = s3_server.storage_options
    store = SnapshotStore.open(s3_root, options)
    store.init_job({"job_name": JOB, "max_parallelism": MAX_PAR})
    model = {k: k * 3 for k in range(60)}
    by_kg: dict[int, dict[int, int]] = {}
    for k, v in model.items():
        by_kg.setdefault(key_group(k, MAX_PAR), {})[k] = v
    chains = {kg: store.write_key_group(1, "count", "n", kg, [], _delta(c, pa.int64())) for kg, c in by_kg.items()}
    store.commit(Manifest(checkpoint_id=1, job_name=JOB, max_parallelism=MAX_PAR, keyed={"count": {"n": chains}}))
    df = reader(s3_root, operator="count", state="n", keyGroupsPerPartition=5,
                **{"storage.key": options["key"], "storage.secret": options["secret"],
                   "storage.endpoint_url": options["endpoint_url"],
                   "storage.config_kwargs.retries.max_attempts": 2})
    assert {r.key: r.value for r in df.collect()} == model
    assert df.rdd.getNumPartitions() == math.ceil(len(chains) / 5)


def test_reads_a_format_5_root_and_its_format_6_continuation_with_shared_ranges(reader, tmp_path: Path):
    """The format-5 fixture (packed ranges of a stream each) and a checkpoint written on top of
    it today (small deltas sharing a stream: format 6) both read as the store resolves them."""
    import shutil

    root = tmp_path / "format-5"
    shutil.copytree(Path(__file__).resolve().parent / "fixtures" / "format-5", root)
    store = SnapshotStore.open(str(root), policy=CompactionPolicy(max_delta_ratio=100.0))
    m2 = store.read_manifest(2)
    chains = {st: dict(m2.chains("count", st)) for st in ("n", "v")}
    meta = store.read_key_group(m2, "count", "n", 0).schema.metadata
    writes = [(kg, pa.table({"key": [f"k{kg}x"], "value": pa.array([kg], pa.int64())}).replace_schema_metadata(meta))
              for kg in range(8)]
    new = store.write_key_groups(3, [("count", "n", kg, chains["n"][kg], t) for kg, t in writes])
    assert all(chain[-1].shared for chain in new)
    chains["n"].update({kg: chain for (kg, _), chain in zip(writes, new)})
    store.commit(Manifest(checkpoint_id=3, job_name="fx", max_parallelism=8, keyed={"count": chains}))
    for cid in (2, 3):
        manifest = store.read_manifest(cid)
        for st in ("n", "v"):
            want = {r["key"]: r["value"] for kg in manifest.chains("count", st)
                    for r in store.read_key_group(manifest, "count", st, kg).to_pylist()}
            df = reader(str(root), operator="count", state=st, checkpoint=cid)
            assert {row["key"]: row["value"] for row in df.collect()} == want
