"""The dataflow API: a named graph of operators with stable uids.

    flow = Dataflow("counts")
    events = flow.source("events", GeneratorSource(count=1_000_000))
    counts = events.key_by("key").process("count", count_fn, state=[ValueState("n", pa.int64())])
    counts.sink("out", CollectSink())

Streams carry Arrow record batches. Row-wise operators (``map``, ``filter``, ``flat_map``,
``process``, ``reduce``) see each record as a ``dict`` of column name -> Python value;
``map_batches`` and ``aggregate`` work on whole batches.

Edges between operators are *forward* (same subtask, chained in-process), *key_by*
(partitioned by key group), *rebalance* (round robin by batch) or *broadcast*.
State is stored under operator uids: give every stateful operator, source and sink a uid
you keep for the job's life (stateless operators get a generated uid from their position).
The graph is acyclic by construction: a stream can only consume streams that already exist.
The one way to build a cycle is :meth:`Stream.iterate`: its head takes the entering stream
and a *back-edge* from the end of the loop body (``Edge.back``); checkpoints of such a job
log the records on the back-edge as the snapshot's channel state (:mod:`abs.runtime.loops`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import pyarrow as pa

from .errors import DuplicateUidError, GraphError
from .keygroups import DEFAULT_MAX_PARALLELISM, MAX_MAX_PARALLELISM
from .connectors.sinks import Sink
from .connectors.sources import Source
from .state import ListState, MapState, ReducingState, ValueState

__all__ = ["Dataflow", "Stream", "KeyedStream", "Node", "Edge", "AGGREGATIONS"]

StateDescriptor = Union[ValueState, ListState, MapState, ReducingState]
KeySpec = Union[str, Sequence[str], Callable[[dict], Any]]

FORWARD, KEY_BY, REBALANCE, BROADCAST = "forward", "key_by", "rebalance", "broadcast"
AGGREGATIONS = ("sum", "count", "min", "max", "mean")
_UID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclasses.dataclass(frozen=True)
class Edge:
    """An input of a node: ``source`` node index, how records are partitioned, and the key
    (column name(s) or function) for ``key_by`` edges."""

    source: int
    partition: str = FORWARD
    key: Any = None
    back: bool = False  # the feedback edge of an iteration (from the end of its body to its head)


@dataclasses.dataclass(frozen=True)
class Node:
    """One logical operator. ``spec`` holds the kind-specific parameters."""

    index: int
    uid: str
    kind: str
    inputs: tuple[Edge, ...]
    spec: Mapping[str, Any]
    stateful: bool = False

    @property
    def keyed(self) -> bool:
        return any(e.partition == KEY_BY for e in self.inputs)


class Dataflow:
    """A named dataflow graph. ``max_parallelism`` is the number of key groups, fixed for
    the job's life (default 128): parallelism can later change freely up to it."""

    def __init__(self, name: str, max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> None:
        if not name or not isinstance(name, str):
            raise GraphError("Dataflow: name must be a non-empty string")
        if type(max_parallelism) is not int or not (1 <= max_parallelism <= MAX_MAX_PARALLELISM):
            raise GraphError(
                f"Dataflow {name!r}: max_parallelism must be an int in 1..{MAX_MAX_PARALLELISM}, got {max_parallelism!r}"
            )
        self.name = name
        self.max_parallelism = max_parallelism
        self.nodes: list[Node] = []
        self._uids: dict[str, int] = {}
        self._iterating: str | None = None  # the iteration whose body is being built

    # ------------------------------------------------------------------ building
    def source(self, uid: str, source: Source) -> "Stream":
        """Add a source; returns its output stream."""
        if not isinstance(source, Source):
            raise GraphError(f"source {uid!r}: expected an abs.Source, got {type(source).__name__}")
        return Stream(self, self._add(uid, "source", (), {"source": source}, stateful=True))

    def _add(self, uid: str | None, kind: str, inputs: tuple[Edge, ...], spec: dict, stateful: bool = False) -> int:
        for e in inputs:
            if not (0 <= e.source < len(self.nodes)):
                raise GraphError(f"{kind} {uid!r}: input stream does not belong to dataflow {self.name!r}")
        if uid is None:
            uid = f"{kind}-{len(self.nodes)}"
        if not isinstance(uid, str) or not _UID_RE.match(uid):
            raise GraphError(
                f"operator uid {uid!r}: use 1-128 characters from letters, digits, '_', '.', '-' "
                "(uids name the stored state)"
            )
        if uid in self._uids:
            raise DuplicateUidError(
                f"dataflow {self.name!r}: uid {uid!r} is used twice ({self.nodes[self._uids[uid]].kind} and {kind}); "
                "give each operator its own uid"
            )
        node = Node(len(self.nodes), uid, kind, inputs, spec, stateful)
        self.nodes.append(node)
        self._uids[uid] = node.index
        return node.index

    def node(self, uid: str) -> Node:
        try:
            return self.nodes[self._uids[uid]]
        except KeyError:
            raise GraphError(f"dataflow {self.name!r} has no operator {uid!r}") from None

    def consumers(self, index: int) -> list[Node]:
        return [n for n in self.nodes if any(e.source == index for e in n.inputs)]

    def validate(self) -> None:
        """Check the graph is runnable: at least one source, every stream consumed or sunk,
        keyed operators behind a key_by."""
        if not any(n.kind == "source" for n in self.nodes):
            raise GraphError(f"dataflow {self.name!r} has no source; add one with flow.source(uid, source)")
        for n in self.nodes:
            if n.kind in ("process", "reduce", "aggregate") and not n.keyed:
                raise GraphError(f"operator {n.uid!r} ({n.kind}) needs a keyed input: call key_by(...) first")
            for e in n.inputs:
                if not (0 <= e.source < len(self.nodes)):
                    raise GraphError(f"operator {n.uid!r}: an input names operator #{e.source}, which dataflow "
                                     f"{self.name!r} does not have")
                if e.back and n.kind != "iterate":
                    raise GraphError(
                        f"operator {n.uid!r} ({n.kind}) has a back-edge from {self.nodes[e.source].uid!r}: only an "
                        "iteration head takes one; build loops with stream.iterate(uid, body)"
                    )
                if not e.back and e.source >= n.index:
                    raise GraphError(
                        f"operator {n.uid!r} consumes {self.nodes[e.source].uid!r}, which comes after it: a cycle not "
                        "built with stream.iterate(uid, body); loops must go through an iteration"
                    )

    @property
    def has_loops(self) -> bool:
        return any(e.back for n in self.nodes for e in n.inputs)

    def _in_body(self, head: int) -> set[int]:
        """The nodes that depend on iteration head ``head`` (its loop body and beyond)."""
        reached = {head}
        for n in self.nodes[head + 1:]:
            if any(e.source in reached and not e.back for e in n.inputs):
                reached.add(n.index)
        return reached

    def fingerprint(self) -> dict:
        """JSON description of operators and their state, stored as the job fingerprint."""
        ops = []
        for n in self.nodes:
            entry: dict[str, Any] = {"uid": n.uid, "kind": n.kind}
            states = n.spec.get("state") or ()
            if states:
                entry["state"] = [s.to_json() for s in states]
            ops.append(entry)
        return {"name": self.name, "max_parallelism": self.max_parallelism, "operators": ops}

    def __repr__(self) -> str:
        return f"Dataflow({self.name!r}, {len(self.nodes)} operators)"


class Stream:
    """A stream of Arrow record batches produced by one operator."""

    def __init__(self, flow: Dataflow, index: int, partition: str = FORWARD, key: Any = None) -> None:
        self.flow = flow
        self.index = index
        self._partition = partition
        self._key = key

    @property
    def uid(self) -> str:
        return self.flow.nodes[self.index].uid

    def _edge(self) -> Edge:
        return Edge(self.index, self._partition, self._key)

    def _then(self, kind: str, uid: str | None, spec: dict, stateful: bool = False) -> "Stream":
        return Stream(self.flow, self.flow._add(uid, kind, (self._edge(),), spec, stateful))

    # ------------------------------------------------------------------ row-wise
    def map(self, fn: Callable[[dict], dict], *, uid: str | None = None) -> "Stream":
        """``fn(record) -> record`` for every record."""
        return self._then("map", uid, {"fn": _callable(fn, "map")})

    def filter(self, fn: Callable[[dict], bool], *, uid: str | None = None) -> "Stream":
        """Keep the records for which ``fn(record)`` is true."""
        return self._then("filter", uid, {"fn": _callable(fn, "filter")})

    def flat_map(self, fn: Callable[[dict], Iterable[dict]], *, uid: str | None = None) -> "Stream":
        """``fn(record) -> iterable of records``."""
        return self._then("flat_map", uid, {"fn": _callable(fn, "flat_map")})

    # ------------------------------------------------------------------ vectorized
    def map_batches(
        self, fn: Callable[[pa.RecordBatch], "pa.RecordBatch | pa.Table | None"], *, uid: str | None = None
    ) -> "Stream":
        """``fn(batch) -> batch | table | None`` for every Arrow batch."""
        return self._then("map_batches", uid, {"fn": _callable(fn, "map_batches")})

    # ------------------------------------------------------------------ topology
    def union(self, *others: "Stream", uid: str | None = None) -> "Stream":
        """Merge this stream with others (same columns)."""
        for o in others:
            if not isinstance(o, Stream):
                raise GraphError(f"union: expected streams of this dataflow, got {type(o).__name__} {o!r}; pass the "
                                 "streams returned by source(), map(), ... e.g. a.union(b, c)")
            if o.flow is not self.flow:
                raise GraphError("union: streams belong to different dataflows")
        edges = (self._edge(),) + tuple(o._edge() for o in others)
        return Stream(self.flow, self.flow._add(uid, "union", edges, {}))

    def key_by(self, key: KeySpec) -> "KeyedStream":
        """Partition by key: a column name, a list of column names (the key is a tuple), or
        a function ``fn(record) -> key``. Keys must be int, str, bytes, float, None or tuples."""
        if isinstance(key, str):
            spec: Any = key
        elif isinstance(key, (list, tuple)) and key and all(isinstance(k, str) for k in key):
            spec = tuple(key)
        elif callable(key):
            spec = key
        else:
            raise GraphError(f"key_by: expected a column name, a list of column names or a function, got {key!r}")
        return KeyedStream(self.flow, self.index, KEY_BY, spec)

    def rebalance(self) -> "Stream":
        """Distribute batches round robin over the next operator's subtasks."""
        return Stream(self.flow, self.index, REBALANCE)

    def broadcast(self) -> "Stream":
        """Send every batch to every subtask of the next operator."""
        return Stream(self.flow, self.index, BROADCAST)

    # ------------------------------------------------------------------ iteration
    def iterate(self, uid: str, body: Callable[["Stream"], tuple["Stream", "Stream"]]) -> "Stream":
        """A loop: ``body(loop)`` gets the stream of records entering the loop (this stream's
        records, then whatever the body feeds back) and returns ``(feedback, output)``: the
        records of ``feedback`` go round again (partition it as the body needs, e.g.
        ``feedback.key_by("node")``; a plain stream comes back to the same subtask), those of
        ``output`` leave the loop. Both must be built from ``loop``; the loop's records have
        this stream's columns. Returns ``output``.

        The head (``uid``) only merges its two inputs; give keyed state to operators in the
        body. Checkpoints stay consistent (the head logs what arrives on the feedback edge
        until the barrier comes round, and the log is replayed on restore), and a job whose
        inputs end finishes once nothing circulates any more (the first checkpoint, or
        termination probe, whose logs are empty). Iterations do not nest.
        """
        if not callable(body):
            raise GraphError(f"iterate {uid!r}: body must be a function loop -> (feedback, output), got {body!r}")
        flow = self.flow
        if flow._iterating is not None:
            raise GraphError(f"iterate {uid!r}: iterations do not nest (inside the body of {flow._iterating!r})")
        head = flow._add(uid, "iterate", (self._edge(),), {})
        flow._iterating = uid
        try:
            result = body(Stream(flow, head))
        finally:
            flow._iterating = None
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(s, Stream) for s in result)):
            raise GraphError(f"iterate {uid!r}: body must return (feedback, output) streams, got {result!r}")
        feedback, output = result
        body_nodes = flow._in_body(head)
        for what, s in (("feedback", feedback), ("output", output)):
            if s.flow is not flow:
                raise GraphError(f"iterate {uid!r}: the {what} stream belongs to another dataflow")
            if s.index not in body_nodes:
                raise GraphError(f"iterate {uid!r}: the {what} stream ({s.uid!r}) is not built from the loop's stream: "
                                 "build it in the body from the stream the body is given")
        if feedback.index == head:
            raise GraphError(f"iterate {uid!r}: the feedback is the loop's own input: every record would circle "
                             "forever; feed back the result of the body's operators")
        node = flow.nodes[head]
        back = dataclasses.replace(feedback._edge(), back=True)
        flow.nodes[head] = dataclasses.replace(node, inputs=node.inputs + (back,))
        return Stream(flow, output.index, output._partition, output._key)

    # ------------------------------------------------------------------ sinks
    def sink(self, uid: str, sink: Sink) -> None:
        """Write the stream to ``sink`` (stored under ``uid``)."""
        if not isinstance(sink, Sink):
            raise GraphError(f"sink {uid!r}: expected an abs.Sink, got {type(sink).__name__}")
        self.flow._add(uid, "sink", (self._edge(),), {"sink": sink}, stateful=True)


class KeyedStream(Stream):
    """A stream partitioned by key; keyed operators see state scoped to the current key."""

    def process(
        self,
        uid: str,
        fn: Callable[[Any, dict], None],
        *,
        state: Sequence[StateDescriptor] = (),
    ) -> Stream:
        """Per-record function with keyed state: ``fn(ctx, record)``.

        ``ctx.key`` is the current key, ``ctx.state.<name>`` the handle of each declared
        state (scoped to the current key), ``ctx.emit(record)`` emits a record downstream.
        """
        states = _states(uid, state)
        return self._then("process", uid, {"fn": _callable(fn, "process"), "state": states}, stateful=True)

    def reduce(self, uid: str, fn: Callable[[dict, dict], dict]) -> Stream:
        """Running reduce per key: ``fn(accumulated, record) -> accumulated``; emits the new
        accumulated record after every input record."""
        spec = {"fn": _callable(fn, "reduce"), "state": (ValueState("acc"),)}
        return self._then("reduce", uid, spec, stateful=True)

    def aggregate(
        self,
        uid: str,
        aggregations: Mapping[str, tuple[str, str]],
        *,
        emit: str = "updates",
        value_type: pa.DataType = pa.int64(),
    ) -> Stream:
        """Vectorized keyed aggregation over Arrow batches.

        ``aggregations`` maps an output column to ``(input column, function)`` with function
        in ``sum``, ``count``, ``min``, ``max``, ``mean``. The key must be one column
        (``key_by("col")``). ``emit="updates"`` emits, per input batch, one row per key that
        changed with its new aggregates (columns ``key`` + outputs); ``"none"`` emits nothing
        (the state is the result). ``value_type`` is the Arrow type in which ``sum``, ``min``
        and ``max`` are kept (``pa.float64()`` for floating-point columns); ``count`` is int64
        and ``mean`` keeps a float64 sum and an int64 count. State is stored as typed columns.
        """
        if not isinstance(value_type, pa.DataType) or not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            raise GraphError(f"aggregate {uid!r}: value_type must be an Arrow integer or floating type, got {value_type!r}")
        if not isinstance(self._key, str):
            raise GraphError(f"aggregate {uid!r}: key_by a single column name (vectorized), got {self._key!r}")
        if not isinstance(aggregations, Mapping):
            raise GraphError(f"aggregate {uid!r}: aggregations must be a dict {{output column: (input column, function)}}, "
                             f"got {type(aggregations).__name__}; pass e.g. {{'total': ('value', 'sum')}}")
        if not aggregations:
            raise GraphError(f"aggregate {uid!r}: give at least one aggregation")
        if emit not in ("updates", "none"):
            raise GraphError(f"aggregate {uid!r}: emit must be 'updates' or 'none', got {emit!r}")
        aggs = {}
        for out, pair in aggregations.items():
            if not (isinstance(pair, tuple) and len(pair) == 2 and pair[1] in AGGREGATIONS):
                raise GraphError(
                    f"aggregate {uid!r}: {out!r} must map to (column, function) with function in {AGGREGATIONS}, got {pair!r}"
                )
            if out == "key":
                raise GraphError(f"aggregate {uid!r}: 'key' is reserved for the key column")
            aggs[out] = pair
        states = []
        for out, (_col, fn) in aggs.items():
            if fn == "mean":
                states += [ValueState(f"{out}.sum", pa.float64()), ValueState(f"{out}.count", pa.int64())]
            elif fn == "count":
                states.append(ValueState(out, pa.int64()))
            else:
                states.append(ValueState(out, value_type))
        spec = {"aggregations": aggs, "emit": emit, "state": tuple(states), "value_type": value_type}
        return self._then("aggregate", uid, spec, stateful=True)


def _callable(fn: Any, what: str) -> Any:
    if not callable(fn):
        raise GraphError(f"{what}: expected a function, got {type(fn).__name__}")
    return fn


def _states(uid: str, states: Sequence[StateDescriptor]) -> tuple:
    if isinstance(states, (ValueState, ListState, MapState, ReducingState, str)) or not isinstance(states, Iterable):
        raise GraphError(f"operator {uid!r}: state must be a list of ValueState/ListState/MapState/ReducingState, got "
                         f"{states!r}; pass state=[...] (a list, even of one)")
    seen = set()
    for s in states:
        if not isinstance(s, (ValueState, ListState, MapState, ReducingState)):
            raise GraphError(f"operator {uid!r}: state must be ValueState/ListState/MapState/ReducingState, got {s!r}")
        if s.name in seen:
            raise GraphError(f"operator {uid!r}: state name {s.name!r} declared twice")
        seen.add(s.name)
    return tuple(states)
