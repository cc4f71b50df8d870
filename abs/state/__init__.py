"""Keyed state: declared state descriptors, two keyed backends behind one protocol, and the
Arrow encoding of their snapshots.

Modules (one concept each; import the public names from ``abs.state``):

* :mod:`~abs.state.descriptors`: ``ValueState``, ``ListState``, ``MapState``,
  ``ReducingState`` (what an operator declares);
* :mod:`~abs.state.protocol`: :class:`KeyedBackend`, what every backend promises the runtime
  (capture, confirm, abort, restore, key groups), and :class:`Delta`, a captured delta;
* :mod:`~abs.state.dict_backend`: :class:`KeyedStateBackend`, any keys and state kinds, with
  :mod:`~abs.state.slots` (the storage of one state), :mod:`~abs.state.handles` (what
  user code calls, per record) and :mod:`~abs.state.restored` (restored columnar key groups,
  probed through an index over their arrays on first use, or built);
* :mod:`~abs.state.columnar`: :class:`ColumnarKeyedState`, the aggregate's columnar store for
  int64, string or binary keys, with its key index :mod:`~abs.state.keyindex` and its string
  keys :mod:`~abs.state.varkeys`;
* :mod:`~abs.state.aggregate_backend`: :class:`AggregateBackend`, columnar while it fits, the
  dict backend after;
* :mod:`~abs.state.capture`: the deltas a capture returns (encoded later);
* :mod:`~abs.state.encoding`: the table encoding shared by both backends.

Descriptors
===========
``ValueState(name, type=None)``, ``ListState(name, element_type=None)``,
``MapState(name, key_type=None, value_type=None)``, ``ReducingState(name, reduce_fn, type=None)``.
A declared Arrow type makes snapshots real Arrow columns (readable by pyarrow and Spark);
without one, values are pickled into a binary column.

The backend and the hot path
============================
:class:`KeyedStateBackend` keeps, per declared state, one ``dict`` (key -> value) per key
group of its :class:`~abs.keygroups.KeyGroupRange` (value states of a fixed-width numeric
type or untyped: a :class:`~abs.columns.Column`), in a list indexed by the *absolute* key
group (slots of key groups outside the range are ``None``).  Before calling user code for a
record, the runtime sets the current key with two plain attribute writes, no method call::

    backend.current_key = key
    backend.current_kg = kg          # key_group(key, max_parallelism)

State handles (``backend.state(name)``) read those two attributes on each call.  What is
checked, and when:

* ``current_kg`` outside the backend's range (or unset) is detected for free: the lookup
  hits a ``None`` slot or the end of the list and the handle raises :class:`StateError`.
  A *negative* ``current_kg`` is not detected (Python list indexing); key groups computed by
  :func:`~abs.keygroups.key_group` are never negative.
* That ``current_kg`` is the key group of ``current_key`` is **not** checked per call; use
  :meth:`KeyedStateBackend.set_current_key` where speed does not matter.
* Values returned by ``value()``/``get()`` of value, reducing and map states are the live
  stored objects: mutate state only through ``update``/``add``/``put``, otherwise the change is
  invisible to dirty tracking and missing from the next incremental checkpoint.
  ``ListState.get()`` returns a copy.

Snapshots
=========
Every write adds the key to the per-key-group *dirty set* of its state (one ``set.add``), or,
in a columnar key group (value states of a fixed-width numeric type or untyped, see
:mod:`abs.columns`), stamps its slot with the current epoch.
:meth:`KeyedStateBackend.capture` (the synchronous part of a snapshot) returns, for every key
group with keys changed since the last **confirmed** checkpoint, a delta table
(``key``, ``value``, ``op``: 0 upsert, 1 delete), values copied into Arrow (or pickled) at once.
Because a delta covers everything since the last confirmed checkpoint ``c`` (the value of
:attr:`KeyedStateBackend.last_confirmed` when it was captured), the state at checkpoint ``n`` is
``chain(b) + delta(n)`` for any *completed* checkpoint ``b`` with ``c <= b < n`` (``c`` itself
always works).  Captured-but-unconfirmed checkpoints may overlap (``max_concurrent > 1``);
:meth:`~KeyedStateBackend.confirm` forgets what was captured by checkpoints ``<= id``; :meth:`~KeyedStateBackend.abort` forgets
nothing.

Table encoding: the key column is ``int64``, ``string`` or ``binary`` when every key of the

Table encoding: see :mod:`abs.state.encoding`; :meth:`KeyedStateBackend.restore` is the
inverse of a capture.
"""
from __future__ import annotations

from .aggregate_backend import AggregateBackend
from .capture import ColumnDelta, PendingDelta, PickledDelta
from .columnar import ColumnarKeyedState
from .descriptors import ListState, MapState, ReducingState, StateDescriptor, ValueState
from .dict_backend import KeyedStateBackend
from .encoding import (
    META_KEY_ENCODING,
    META_STATE_KIND,
    META_VALUE_ENCODING,
    OP_DELETE,
    OP_UPSERT,
    check_restore_table,
)
from .handles import (
    ColumnValueStateHandle,
    ListStateHandle,
    MapStateHandle,
    ReducingStateHandle,
    ValueStateHandle,
)
from .protocol import Delta, KeyedBackend

__all__ = [
    "AggregateBackend",
    "ColumnDelta",
    "ColumnarKeyedState",
    "ColumnValueStateHandle",
    "Delta",
    "KeyedBackend",
    "PendingDelta",
    "PickledDelta",
    "ValueState",
    "ListState",
    "MapState",
    "ReducingState",
    "StateDescriptor",
    "KeyedStateBackend",
    "ValueStateHandle",
    "ListStateHandle",
    "MapStateHandle",
    "ReducingStateHandle",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "META_STATE_KIND",
    "check_restore_table",
]
