"""Names and values of the state-file schema (``storage/FORMAT.md``, "Arrow files").

The one place these constants are defined: the storage layer reads and writes files with
them, the runtime encodes state with them, the offline rewrites re-encode with them.
``storage.format`` re-exports the storage ones under their old names.
"""
from __future__ import annotations

__all__ = [
    "KEY_COLUMN",
    "VALUE_COLUMN",
    "OP_COLUMN",
    "OP_UPSERT",
    "OP_DELETE",
    "META_KEY_ENCODING",
    "META_VALUE_ENCODING",
    "ENCODING_ARROW",
    "ENCODING_PICKLE",
    "META_FILE_KIND",
    "META_KEYS_DIGEST",
    "META_STATE_KIND",
]

KEY_COLUMN = "key"
"""The key column of a state file (absent only in a values image)."""

VALUE_COLUMN = "value"
"""The value column the runtime writes for keyed state (a file may have other value columns:
every column but ``key`` and ``op`` is one)."""

OP_COLUMN = "op"
"""int8 column of a delta: :data:`OP_UPSERT` or :data:`OP_DELETE` (absent: all upserts)."""

OP_UPSERT = 0
OP_DELETE = 1

META_KEY_ENCODING = b"abs.key_encoding"
"""Schema metadata: how the key column is encoded, :data:`ENCODING_ARROW` (or absent) or
:data:`ENCODING_PICKLE`."""

META_VALUE_ENCODING = b"abs.value_encoding"
"""Schema metadata: how the value columns are encoded (as :data:`META_KEY_ENCODING`)."""

ENCODING_ARROW = b"arrow"
"""Typed Arrow column."""

ENCODING_PICKLE = b"pickle"
"""Binary column of pickled Python objects."""

META_FILE_KIND = b"abs.file_kind"
"""Written by format 1 only (the manifest and the file name already say the kind); ignored on read."""

META_KEYS_DIGEST = b"abs.keys_digest"
"""Format 4, in a *values image* only: ``<algorithm>:<hex digest>`` of the int64 keys of the
base whose rows it gives the values of."""

META_STATE_KIND = b"abs.state_kind"
"""Schema metadata the runtime writes: the kind of the keyed state (value, list, map, ...);
storage keeps it as given."""
