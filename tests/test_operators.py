"""Operator runtimes in-process: records as dicts, keys taken from the same conversion."""
from __future__ import annotations

import datetime
import decimal

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.errors import GraphError
from abs.keygroups import key_groups
from abs.runtime.operators import KeyExtractor, batch_rows, keyed_loop


def _cases() -> list[pa.RecordBatch]:
    mixed = pa.RecordBatch.from_pylist([
        {"a": 1, "b": "x", "c": None, "d": [1, 2], "e": {"x": 1},
         "f": datetime.datetime(2020, 1, 1), "g": decimal.Decimal("1.5")},
        {"a": None, "b": None, "c": 3.5, "d": None, "e": None, "f": None, "g": None},
    ])
    return [
        mixed,
        pa.RecordBatch.from_arrays([pa.array([1, 2]), pa.array([3, 4])], names=["a", "a"]),
        pa.RecordBatch.from_arrays([pa.array([1, 2])], names=["quote'and\"backslash\\n"]),
        pa.RecordBatch.from_arrays([pa.array([1])], names=["x"]).slice(0, 0),
        pa.record_batch([], schema=pa.schema([])),
    ]


@pytest.mark.parametrize("batch", _cases(), ids=["mixed-types", "repeated-name", "odd-name", "empty", "no-columns"])
def test_batch_rows_equal_to_pylist(batch):
    rows, columns = batch_rows(batch)
    assert rows == batch.to_pylist()
    assert [type(v) for r in rows for v in r.values()] == [type(v) for r in batch.to_pylist() for v in r.values()]
    assert columns == [c.to_pylist() for c in batch.columns]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=8), min_size=1, max_size=5),
       st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), min_size=0, max_size=20))
def test_batch_rows_any_column_names(names, values):
    batch = pa.RecordBatch.from_arrays([pa.array(values, pa.int64())] * len(names), names=names)
    assert batch_rows(batch)[0] == batch.to_pylist()


def test_keys_from_converted_columns_match_the_batch():
    batch = pa.RecordBatch.from_pydict({"k": [3, 1, 3], "s": ["a", "b", "c"], "v": [1.0, 2.0, 3.0]})
    rows, columns = batch_rows(batch)
    by_column = KeyExtractor("op", "k", 128)
    by_tuple = KeyExtractor("op", ("k", "s"), 128)
    by_function = KeyExtractor("op", lambda r: r["s"] * 2, 128)
    assert by_column.keys(batch, rows, columns) == by_column.keys(batch) == [3, 1, 3]
    assert by_tuple.keys(batch, rows, columns) == by_tuple.keys(batch) == [(3, "a"), (1, "b"), (3, "c")]
    assert by_function.keys(batch, rows, columns) == by_function.keys(batch) == ["aa", "bb", "cc"]
    with pytest.raises(GraphError, match="key column 'nope' is not in the stream"):
        KeyExtractor("op", "nope", 128).keys(batch, rows, columns)


class _Backend:
    current_key = current_kg = None


@pytest.mark.parametrize("batch", _cases()[:4], ids=["mixed-types", "repeated-name", "odd-name", "empty"])
def test_keyed_loop_calls_with_the_rows_keys_and_key_groups_of_batch_rows(batch):
    at = 0
    kgs = key_groups(batch.column(at), 128).tolist()
    backend, ctx = _Backend(), type("Ctx", (), {})()
    seen = []
    keyed_loop(tuple(batch.schema.names), at)(
        lambda c, row: seen.append((backend.current_key, backend.current_kg, c.key, row)), ctx, backend, kgs,
        [c.to_pylist() for c in batch.columns])
    keys = batch.column(at).to_pylist()
    assert seen == [(k, g, k, row) for k, g, row in zip(keys, kgs, batch_rows(batch)[0])]
    assert len({id(row) for *_, row in seen}) == len(seen)  # a dict of its own per record


def test_process_context_holds_key_emit_state_and_any_attribute_a_function_sets():
    from abs.runtime.operators import ProcessContext, _state_namespace

    state = _state_namespace({"total": 1, "seen": 2})
    ctx = ProcessContext(state)
    assert (ctx.key, ctx.emit, ctx.state.total, ctx.state.seen) == (None, None, 1, 2)
    ctx.key, ctx.cache = "k", {}  # a function may keep its own things on ctx
    assert ctx.key == "k" and ctx.cache == {}
    assert repr(state) == "namespace(total=1, seen=2)"
    odd = _state_namespace({"my-state": 1, "__private": 2})  # names a slot cannot have
    assert getattr(odd, "my-state") == 1 and getattr(odd, "__private") == 2


def _process_op(key, fn, states):
    import types

    import abs
    from abs.keygroups import KeyGroupRange
    from abs.runtime.operators import ProcessOp

    flow = abs.Dataflow("ops")
    flow.source("src", abs.GeneratorSource(10)).key_by(key).process("p", fn, state=states)
    nodes = flow.nodes.values() if isinstance(flow.nodes, dict) else flow.nodes
    node = next(n for n in nodes if n.kind == "process")
    op = ProcessOp(node, types.SimpleNamespace(max_parallelism=flow.max_parallelism,
                                              key_group_range=KeyGroupRange(0, flow.max_parallelism - 1)))
    op.open()
    return op


def test_process_keyed_by_a_column_sees_what_a_key_function_sees():
    import abs

    def count(ctx, row):
        n = ctx.state.n
        n.update((n.value() or 0) + row["v"])
        ctx.emit({"key": ctx.key, "n": n.value(), "row": str(sorted(row.items()))})

    batch = pa.RecordBatch.from_pydict({"k": ["a", "b", "a", "c", "a"], "v": [1, 2, 3, 4, 5]})
    got = {}
    for name, key in (("column", "k"), ("function", lambda r: r["k"])):
        op = _process_op(key, count, [abs.ValueState("n", pa.int64())])
        out = []
        op.outputs.append(out.append)
        op.process(batch)
        op.process(batch)
        got[name] = pa.Table.from_batches(out).to_pylist()
    assert got["column"] == got["function"]
    assert [r["n"] for r in got["column"]][-5:] == [10, 4, 13, 8, 18]


@pytest.mark.parametrize("mp", ["8", 8.0, True, None])
def test_a_max_parallelism_that_is_not_an_int_is_refused_when_the_dataflow_is_made(mp):
    """A str raised a bare TypeError from a comparison, and 8.0 or True passed until the job
    ran (ParallelismError then, or True taken as 1)."""
    import abs

    with pytest.raises(GraphError, match=r"Dataflow 'x': max_parallelism must be an int in 1\.\.32768, got"):
        abs.Dataflow("x", max_parallelism=mp)


def test_builder_arguments_of_the_wrong_shape_are_refused_naming_the_argument():
    """state=ValueState(...) (not in a list) raised a bare TypeError ("'ValueState' object is
    not iterable"), aggregate(uid, [...]) an AttributeError ("'list' object has no attribute
    'items'"), union("x") an AttributeError ("'str' object has no attribute 'flow'")."""
    import abs

    def keyed() -> abs.KeyedStream:
        return abs.Dataflow("x").source("src", abs.GeneratorSource(10)).key_by("key")

    for state in (abs.ValueState("n", pa.int64()), "n", 3):
        with pytest.raises(GraphError, match=r"operator 'p': state must be a list of ValueState/ListState/MapState/"
                                             r"ReducingState, got .*; pass state=\[\.\.\.\]"):
            keyed().process("p", lambda ctx, row: None, state=state)
    with pytest.raises(GraphError, match=r"aggregate 'a': aggregations must be a dict \{output column: \(input column, "
                                         r"function\)\}, got list; pass e\.g\. \{'total': \('value', 'sum'\)\}"):
        keyed().aggregate("a", [("total", ("value", "sum"))])
    stream = abs.Dataflow("y").source("src", abs.GeneratorSource(10))
    with pytest.raises(GraphError, match=r"union: expected streams of this dataflow, got str 'x'"):
        stream.union("x")
    # the right shapes still build
    keyed().process("p", lambda ctx, row: None, state=[abs.ValueState("n", pa.int64())])
    keyed().process("p", lambda ctx, row: None, state=(abs.ValueState("n"),))
    keyed().aggregate("a", {"total": ("value", "sum")})


@pytest.mark.parametrize("kwargs, message", [
    ({"count": -1}, r"count must be an int >= 0 or None, got -1"),
    ({"count": "10"}, r"count must be an int >= 0 or None, got '10'"),  # was a bare TypeError from '<'
    ({"count": 10, "rate": float("nan")}, r"rate must be a finite number > 0 .* got nan"),  # failed in the workers
    ({"count": 10, "rate": 0}, r"rate must be a finite number > 0"),
    ({"count": 10, "num_keys": 0}, r"num_splits, batch_size and num_keys must be ints >= 1, got num_keys=0"),
    ({"count": 10, "batch_size": "4"}, r"num_splits, batch_size and num_keys must be ints >= 1, got batch_size='4'"),
    ({"count": 10, "make_batch": 3}, r"make_batch must be a function"),
])
def test_generator_source_options_are_refused_as_config_errors_naming_the_option(kwargs, message):
    import numpy as np

    import abs

    with pytest.raises(abs.ConfigError, match=rf"^GeneratorSource: {message}"):
        abs.GeneratorSource(**kwargs)
    assert abs.GeneratorSource(np.int64(10), num_keys=np.int32(3), rate=np.float32(5.0)).count == 10  # numpy numbers fit
