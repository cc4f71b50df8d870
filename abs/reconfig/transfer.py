"""The state of a key group as it travels from its old owner to its new one: one Arrow IPC
stream per state (the delta tables of :mod:`abs.state.handover`), zstd-compressed as the
snapshot files are, so that what a handover moves is measured in bytes comparable to what a
checkpoint writes, and decoded without pickle."""
from __future__ import annotations

from typing import Mapping

import pyarrow as pa

__all__ = ["pack", "unpack"]


_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


def pack(tables: Mapping[str, pa.Table]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, table in tables.items():
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema, options=_OPTIONS) as writer:
            writer.write_table(table)
        out[name] = sink.getvalue().to_pybytes()
    return out


def unpack(streams: Mapping[str, bytes]) -> dict[str, pa.Table]:
    return {name: pa.ipc.open_stream(pa.py_buffer(data)).read_all() for name, data in streams.items()}
