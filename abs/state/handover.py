"""Key groups leaving and joining a running subtask's dict backend (live reconfiguration,
:mod:`abs.reconfig`). The aggregate's columnar store does the same in its own form, with the
same tables (:meth:`abs.state.columnar.ColumnarKeyedState.export_key_group` and the two
after it, through :class:`abs.state.aggregate_backend.AggregateBackend`).

* :func:`export_key_group` -- the state of one key group as delta tables (``key``, ``value``,
  ``op``; the encoding of :mod:`abs.state.encoding`): what changed since the last *confirmed*
  checkpoint (the new owner applies it over that checkpoint's chain, which it reads from
  storage), or, with ``full``, every live key (nothing to build on: no storage, or a chain in
  another root);
* :func:`release_key_group` -- the old owner forgets the key group: its data, its dirty keys
  and what its pending captures took of it (those captures still write it: checkpoints
  aligned before the handover hold the key group at its old owner). From then on a record of
  that key group is refused as routed to the wrong subtask;
* :func:`adopt_key_group` -- the new owner loads the key group: the resolved base (the chain
  the export was taken against, folded), then the export's changes in order. Every live key
  counts as changed, so the new owner's next checkpoint writes the key group whole, as a new
  base of its own: its chain never depends on files the old owner wrote, which GC may drop
  once the old owner's checkpoints age out.
"""
from __future__ import annotations

from array import array
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from abs.columns import Column
from abs.errors import StateError

from .capture import ColumnDelta
from .encoding import META_KEY_ENCODING, META_VALUE_ENCODING, OP_DELETE, decode_column, encode

__all__ = ["export_key_group", "release_key_group", "adopt_key_group"]


def _owned(backend: Any, kg: int, what: str) -> None:
    if kg not in backend.key_group_range:
        raise StateError(
            f"operator {backend.operator_uid!r}: {what} key group {kg}, which this subtask does not own "
            f"(it owns {backend.key_group_range}); the reconfiguration plan disagrees with the subtask (a bug)"
        )


def export_key_group(backend: Any, kg: int, *, full: bool) -> dict[str, pa.Table]:
    """State name -> delta table of key group ``kg`` (states with nothing to send are left out)."""
    _owned(backend, kg, "export of")
    out: dict[str, pa.Table] = {}
    for name, slot in backend._slots.items():
        data = slot.data[kg]
        if slot.typecode is not None:
            captured = data.capture(0 if full else backend._confirmed_epoch, full=full)
            if captured is not None:
                out[name] = ColumnDelta(captured, slot.arrow_type, slot.descriptor.kind).to_table()
            continue
        if full:
            keys: Any = list(data)
        else:
            keys = set(slot.dirty[kg])
            for taken in backend._pending.values():
                keys |= taken[name].get(kg, set())
        if keys:
            out[name] = encode(backend.operator_uid, slot, kg, keys, data, with_op=True)
    return out


def release_key_group(backend: Any, kg: int) -> None:
    """Forget key group ``kg`` (see the module docstring)."""
    _owned(backend, kg, "release of")
    for name, slot in backend._slots.items():
        slot.data[kg] = None
        slot.dirty[kg] = None
        slot.deleted.discard(kg)
        forget = getattr(slot.handle, "_forget", None)
        if forget is not None:
            forget()
    for taken in backend._pending.values():
        for by_kg in taken.values():
            by_kg.pop(kg, None)
    for by_name in backend._pending_deletes.values():
        for kgs in by_name.values():
            kgs.discard(kg)
    backend.key_group_range.discard(kg)


def adopt_key_group(backend: Any, kg: int, base: Mapping[str, pa.Table], changes: Mapping[str, pa.Table]) -> None:
    """Load key group ``kg``: ``base`` (state -> resolved table, no deletes) then ``changes``
    (state -> delta table with ``op``), in that order; every live key counts as changed."""
    if kg in backend.key_group_range:
        raise StateError(
            f"operator {backend.operator_uid!r}: key group {kg} arrived at a subtask that already owns it "
            f"({backend.key_group_range}); the reconfiguration plan moved it twice (a bug)"
        )
    unknown = sorted((set(base) | set(changes)) - set(backend._slots))
    if unknown:
        raise StateError(
            f"operator {backend.operator_uid!r}: the state of key group {kg} names states {unknown} this "
            f"operator does not declare ({', '.join(backend._slots)}); both owners must run the same job"
        )
    backend.key_group_range.add(kg)
    for slot in backend._slots.values():
        slot.data[kg] = {} if slot.typecode is None else Column(slot.typecode)
        slot.dirty[kg] = set()
        forget = getattr(slot.handle, "_forget", None)
        if forget is not None:
            forget()
    for name, table in base.items():
        if table.num_rows:
            backend.restore(name, kg, table)
    epoch = backend.epoch
    for name, table in changes.items():
        slot = backend._slots[name]
        where = f"operator {backend.operator_uid!r}, state {name!r}, key group {kg} (handed over)"
        meta = table.schema.metadata or {}
        keys = decode_column(table.column("key"), meta.get(META_KEY_ENCODING), where, "key")
        values = decode_column(table.column("value"), meta.get(META_VALUE_ENCODING), where, "value")
        ops = table.column("op").to_pylist() if "op" in table.schema.names else [0] * len(keys)
        d = slot.data[kg]
        kind = slot.descriptor.kind
        if slot.typecode is not None:
            for k, v, op in zip(keys, values, ops):
                if op == OP_DELETE:
                    d.delete(k, epoch)
                else:
                    backend._column_set(slot, d, k, v, epoch)
            continue
        for k, v, op in zip(keys, values, ops):
            if op == OP_DELETE:
                d.pop(k, None)
            elif kind == "map":
                d[k] = dict(v)
            else:
                d[k] = v
    for slot in backend._slots.values():
        d = slot.data[kg]
        if slot.typecode is None:
            slot.dirty[kg] = set(d)
        else:  # every slot stamped now: the next capture takes the whole column
            d.stamps = array("q", np.full(len(d.stamps), epoch, dtype=np.int64).tobytes())
            d.deleted = {}

