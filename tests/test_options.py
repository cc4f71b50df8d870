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
