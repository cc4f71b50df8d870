"""The typed options of abs.run / abs.submit: abs.Restore (restore=) says the same as the plain
values restore= took before, which keep working."""
from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abs
from abs import Restore
from abs.runtime.restore import check_restore_option

# ----------------------------------------------------------------------------- Restore (pure)

KEYWORD_CONSTRUCTORS = {"latest": Restore.latest, "latest-if-any": Restore.latest_if_any, "fresh": Restore.fresh}


def constructed(value):
    """The constructor call a user writes for a plain restore= value."""
    if value is None:
        return Restore.none()
    if isinstance(value, int):
        return Restore.checkpoint(value)
    if value in KEYWORD_CONSTRUCTORS:
        return KEYWORD_CONSTRUCTORS[value]()
    return Restore.savepoint(value)


legacy_values = st.one_of(
    st.none(),
    st.sampled_from(["latest", "latest-if-any", "fresh"]),
    st.integers(min_value=1, max_value=2**63),
    st.text(min_size=1).filter(lambda s: s not in ("latest", "latest-if-any", "fresh")),
)


@settings(max_examples=400, deadline=None)
@given(value=legacy_values)
def test_parse_of_a_plain_restore_value_round_trips_and_equals_its_constructor(value):
    r = Restore.parse(value)
    assert r == constructed(value)
    assert r.value == value and type(r.value) is type(value)
    assert Restore.parse(r) is r and Restore.parse(r.value) == r
    assert hash(r) == hash(constructed(value))


def test_each_constructor_means_its_plain_value():
    assert Restore.none().value is None
    assert Restore.latest().value == "latest"
    assert Restore.latest_if_any().value == "latest-if-any"
    assert Restore.fresh().value == "fresh"
    assert Restore.checkpoint(7).value == 7
    assert Restore.savepoint("s3://b/sp-7").value == "s3://b/sp-7"
    assert str(Restore.latest_if_any()) == "restore='latest-if-any'"


def test_restore_is_frozen():
    r = Restore.checkpoint(3)
    with pytest.raises(AttributeError):
        r.checkpoint_id = 4  # type: ignore[misc]


# today's messages (abs.runtime.restore.check_restore_option before Restore), kept word for word
WRONG_TYPE = r"^restore must be None, 'latest', 'latest-if-any', 'fresh', a checkpoint id or a savepoint path, got "


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.booleans(), st.floats(), st.lists(st.integers(), max_size=2), st.binary(max_size=3),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
def test_parse_refuses_values_of_other_types_with_the_same_message_as_before(value):
    with pytest.raises(abs.ConfigError, match=WRONG_TYPE):
        Restore.parse(value)
    with pytest.raises(abs.ConfigError, match=WRONG_TYPE):
        check_restore_option(value, "/some/root")


@settings(max_examples=100, deadline=None)
@given(cid=st.integers(max_value=0))
def test_parse_and_the_constructor_refuse_ids_below_one_naming_where_to_find_one(cid):
    message = rf"^restore={cid}: checkpoint ids are integers >= 1; pass one 'abs-snapshot ls ROOT' lists$"
    for make in (Restore.parse, Restore.checkpoint):
        with pytest.raises(abs.ConfigError, match=message):
            make(cid)


def test_an_empty_path_is_refused_with_the_same_message_as_before():
    message = r"^restore='': pass 'latest', 'latest-if-any', 'fresh', a checkpoint id or a savepoint path$"
    for make in (Restore.parse, Restore.savepoint):
        with pytest.raises(abs.ConfigError, match=message):
            make("")


@pytest.mark.parametrize("word", ["latest", "latest-if-any", "fresh"])
def test_a_savepoint_path_that_is_a_keyword_is_refused_naming_both_ways_out(word):
    with pytest.raises(abs.ConfigError, match=rf"is a restore keyword, not a path; pass './{word}'.*Restore\."):
        Restore.savepoint(word)


def test_a_hand_built_restore_obeys_the_constructors_rules():
    with pytest.raises(abs.ConfigError, match="unknown; use one of the Restore constructors"):
        Restore("newest")  # type: ignore[arg-type]
    with pytest.raises(abs.ConfigError, match=r"takes neither a checkpoint id nor a path; use Restore.latest\(\)"):
        Restore("latest", checkpoint_id=3)
    with pytest.raises(abs.ConfigError, match=r"needs a checkpoint id; use Restore.checkpoint\(id\)"):
        Restore("checkpoint")


@pytest.mark.parametrize("restore", [Restore.latest(), Restore.latest_if_any(), Restore.fresh(), Restore.checkpoint(3)])
def test_a_typed_restore_without_storage_is_refused_like_its_plain_value(restore):
    with pytest.raises(abs.ConfigError, match=r"needs storage= .*pass storage="):
        abs.run(small_flow(), restore=restore)


# ----------------------------------------------------------------------------- Restore in real jobs


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def small_flow() -> abs.Dataflow:
    f = abs.Dataflow("small")
    src = abs.GeneratorSource(1_000, num_keys=10, num_splits=2, batch_size=200)
    f.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink(
        "mem", abs.CollectSink())
    return f


@pytest.mark.integration
def test_run_and_submit_take_a_typed_restore(tmp_path, capfd):
    root = str(tmp_path / "snap")
    first = abs.run(small_flow(), parallelism=2, storage=root, restore=Restore.latest_if_any())
    assert first.restored_from is None and first.status == "FINISHED"
    assert "starting fresh (restore='latest-if-any':" in capfd.readouterr().err
    by_id = abs.run(small_flow(), parallelism=2, storage=root, restore=Restore.checkpoint(first.last_checkpoint))
    assert by_id.restored_from == first.last_checkpoint
    latest = abs.submit(small_flow(), parallelism=2, storage=root, restore=Restore.latest()).wait(timeout=300)
    assert latest.restored_from == by_id.last_checkpoint
    assert f"restoring checkpoint {by_id.last_checkpoint} of {root}" in capfd.readouterr().err


@pytest.mark.integration
@pytest.mark.s3
def test_a_savepoint_on_s3_restores_with_the_jobs_storage_options(s3_server, s3_root):
    """restore=<an s3:// savepoint> opened the savepoint without storage options: with the
    endpoint and credentials given as storage_options (as the README's cluster example does),
    the restore failed with NoCredentialsError, and no option reached the savepoint."""
    from storage import SnapshotStore

    options = s3_server.storage_options
    first = abs.run(small_flow(), parallelism=2, storage=f"{s3_root}/a", storage_options=options)
    savepoint = f"{s3_root}/sp"
    SnapshotStore.open(f"{s3_root}/a", options).savepoint(first.last_checkpoint, savepoint)
    second = abs.run(small_flow(), parallelism=3, storage=f"{s3_root}/b", storage_options=options, restore=savepoint)
    assert second.status == "FINISHED" and second.restored_from is not None
    assert second.collected("mem").num_rows == 0  # restored at the end of the input: nothing left to do
    assert SnapshotStore.open(f"{s3_root}/b", options).verify().ok


# ----------------------------------------------------------------------------- RuntimeOptions

import inspect  # noqa: E402
import warnings  # noqa: E402

from abs import RuntimeOptions  # noqa: E402
from abs.faults import Fault  # noqa: E402


def test_run_and_submit_take_one_list_of_options_without_the_test_knobs():
    run, submit = inspect.signature(abs.run), inspect.signature(abs.submit)
    assert list(run.parameters) == list(submit.parameters)
    assert [p.default for p in run.parameters.values()] == [p.default for p in submit.parameters.values()]
    assert "runtime" in run.parameters and "restore" in run.parameters
    assert "faults" not in run.parameters and "heartbeat_timeout" not in run.parameters


@pytest.mark.parametrize("fn", [abs.run, abs.submit], ids=["run", "submit"])
def test_an_unknown_keyword_is_refused_naming_the_function(fn):
    with pytest.raises(TypeError, match=rf"^{fn.__name__}\(\) got an unexpected keyword argument 'paralelism'$"):
        fn(small_flow(), paralelism=2)


def test_runtime_options_default_to_what_run_used_before_and_are_frozen():
    r = RuntimeOptions()
    assert (r.heartbeat_timeout, r.startup_timeout, r.faults) == (30.0, 120.0, ())
    with pytest.raises(AttributeError):
        r.heartbeat_timeout = 1.0  # type: ignore[misc]
    # fault tuples become Fault objects: equal options compare and hash equal
    a = RuntimeOptions(faults=[("process", "task1#0", 3)])
    assert a.faults == (Fault("process", "task1#0", 3),)
    assert a == RuntimeOptions(faults=(Fault("process", "task1#0", 3),)) and hash(a) == hash(RuntimeOptions(faults=a.faults))


@pytest.mark.parametrize("kwargs, message", [
    ({"heartbeat_timeout": 0}, r"RuntimeOptions\(heartbeat_timeout=0\): expected a number of seconds > 0; pass e.g. heartbeat_timeout=30.0"),
    ({"startup_timeout": float("inf")}, r"RuntimeOptions\(startup_timeout=inf\): expected a number of seconds > 0"),
    ({"startup_timeout": "60"}, r"RuntimeOptions\(startup_timeout='60'\): expected a number of seconds > 0"),
    ({"heartbeat_timeout": True}, r"RuntimeOptions\(heartbeat_timeout=True\)"),
    ({"faults": "process"}, r"RuntimeOptions\(faults='process'\): expected a sequence of abs.faults.Fault"),
    ({"faults": [("no_such_point", "*", 1)]}, r"unknown fault point 'no_such_point'.*pass abs.faults.Fault objects"),
    ({"faults": [42]}, r"RuntimeOptions\(faults=\[42\]\): .*pass abs.faults.Fault objects"),
])
def test_bad_runtime_options_are_refused_naming_the_option(kwargs, message):
    with pytest.raises(abs.ConfigError, match=message):
        RuntimeOptions(**kwargs)


def test_runtime_must_be_runtime_options():
    with pytest.raises(abs.ConfigError, match=r"runtime must be an abs.RuntimeOptions, got dict; pass runtime=abs.RuntimeOptions"):
        abs.run(small_flow(), runtime={"heartbeat_timeout": 3.0})


@pytest.mark.parametrize("fn", [abs.run, abs.submit], ids=["run", "submit"])
@pytest.mark.parametrize("kwargs", [{"faults": ()}, {"heartbeat_timeout": 5.0}, {"faults": (), "heartbeat_timeout": 5.0}])
def test_the_old_keywords_warn_naming_runtime_options(fn, kwargs):
    spelled = ", ".join(f"{k}=..." for k in kwargs)
    expected = (rf"abs\.{fn.__name__}\({spelled}\) is deprecated .*; pass "
                rf"runtime=abs\.RuntimeOptions\({spelled}\) instead")
    with pytest.warns(DeprecationWarning, match=expected) as record:
        with pytest.raises(abs.ConfigError, match="expected an abs.Dataflow"):  # stops before any worker starts
            fn("not a flow", **kwargs)
    assert [w.filename for w in record if issubclass(w.category, DeprecationWarning)] == [__file__]  # the caller's line


def test_the_old_keywords_beside_runtime_are_refused():
    with pytest.raises(abs.ConfigError, match=r"heartbeat_timeout=\.\.\. given beside runtime=; pass them only inside "
                                              r"runtime=abs\.RuntimeOptions\(heartbeat_timeout=\.\.\.\)"):
        abs.run(small_flow(), heartbeat_timeout=3.0, runtime=RuntimeOptions())


@pytest.mark.integration
@pytest.mark.parametrize("spelling", ["runtime", "deprecated"])
def test_runtime_options_reach_the_workers_a_hung_worker_is_found_by_heartbeat(tmp_path, spelling):
    knobs = {"heartbeat_timeout": 3.0, "faults": [Fault("process", "task1#1", nth=2, action="hang")]}
    restart = abs.RestartStrategy(max_restarts=1, delay=0.1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if spelling == "runtime":
            result = abs.run(small_flow(), parallelism=2, storage=str(tmp_path / "snap"), restart=restart,
                             runtime=RuntimeOptions(**knobs))
        else:
            result = abs.run(small_flow(), parallelism=2, storage=str(tmp_path / "snap"), restart=restart, **knobs)
    ours = [w for w in record if issubclass(w.category, DeprecationWarning) and "RuntimeOptions" in str(w.message)]
    assert len(ours) == (spelling == "deprecated")
    assert result.status == "FINISHED" and len(result.restarts) == 1
    assert "heartbeat" in result.restarts[0]["error"]
    assert result.collected("mem").num_rows >= 1_000


@pytest.mark.parametrize("fn", [abs.run, abs.submit], ids=["run", "submit"])
@pytest.mark.parametrize("restart, got", [
    (3, r"int 3"),
    ("3", r"str '3'"),
    (abs.RestartStrategy, r"the class abs\.config\.RestartStrategy itself"),
])
def test_restart_must_be_a_restart_strategy_instance(fn, restart, got):
    with pytest.raises(abs.ConfigError, match=rf"restart must be an abs\.RestartStrategy instance or None, got {got}; "
                                              r"pass restart=abs\.RestartStrategy\(max_restarts=\.\.\.\)"):
        fn(small_flow(), parallelism=1, restart=restart)


@pytest.mark.parametrize("fn", [abs.run, abs.submit], ids=["run", "submit"])
@pytest.mark.parametrize("storage_options, got", [("x", r"str 'x'"), ([("key", "k")], r"list \[\('key', 'k'\)\]")])
def test_storage_options_must_be_a_mapping(fn, storage_options, got, tmp_path):
    with pytest.raises(abs.ConfigError, match=rf"storage_options must be a mapping \(a dict of the file system's "
                                              rf"options\) or None, got {got}; pass e\.g\. storage_options="):
        fn(small_flow(), parallelism=1, storage=str(tmp_path / "snap"), storage_options=storage_options)
    assert not (tmp_path / "snap").exists()  # refused before the root was opened


@pytest.mark.parametrize("fn", [abs.run, abs.submit], ids=["run", "submit"])
@pytest.mark.parametrize("executor, got", [
    (object(), r"object <object object at 0x[0-9a-f]+>"),
    (abs.LocalExecutor, r"the class abs\.runtime\.executors\.LocalExecutor itself"),
    (4, r"int 4"),
])
def test_an_executor_that_is_no_executor_is_refused_before_the_job_starts(fn, executor, got):
    """Such an executor failed the job once it had started, with "'object' object has no
    attribute 'launch'" (or a TypeError of the unbound method, for the class itself)."""
    with pytest.raises(abs.ConfigError, match=rf"executor must be 'local' or an executor object \(abs\.LocalExecutor"
                                              rf"\(\.\.\.\), abs\.SparkExecutor\(spark, num_workers=\.\.\.\)\), got {got}"):
        fn(small_flow(), parallelism=1, executor=executor)


@pytest.mark.parametrize("fn", [abs.run, abs.submit], ids=["run", "submit"])
@pytest.mark.parametrize("name", ["allow_non_restored_state", "allow_repeated_output"])
@pytest.mark.parametrize("value, got", [("no", r"str 'no'"), (0, r"int 0"), (None, r"None")])
def test_the_allow_options_take_true_or_false_alone(fn, name, value, got, tmp_path):
    """allow_non_restored_state="no" read as true: a restore then dropped state silently."""
    with pytest.raises(abs.ConfigError, match=rf"{name} must be True or False, got {got}"):
        fn(small_flow(), parallelism=1, storage=str(tmp_path / "snap"), **{name: value})
    assert not (tmp_path / "snap").exists()
