"""The optional C module :mod:`abscore._native` and its switch.

The per-element loops of the hot paths have two implementations: numpy or Python code, and C
in ``abscore/_native.c``. The key-group hash of binary and string keys, a ``key_by`` writer's
grouping of rows by channel, the columnar store's key codes and its hash index: numpy makes a
pass per byte position or probe step over a whole batch, C one pass in all. ``value()`` and
``update()`` of a typed ValueState's handle: Python pays a method call and attribute lookups
per record, C reads the slots directly (``abs.state.handles``). A snapshot's list of ``str``
keys as an Arrow array (``abs.columns``): pyarrow's converter costs ~0.2 us a key, C copies
each key's UTF-8 bytes. A values image's byte-stream split (``storage.values_images``): numpy
copies a strided view byte by byte, C transposes 16 values at a time in SSE2 registers. A
restored key group (``abs.state.restored``): Python builds a key object and a dict entry per
key, C an index over the restored Arrow or int64 keys that the C handle probes
(``RestoredIndex``; without the module, the key group is built as before). Both
give the same results bit for bit (tests/test_native.py holds them side by side), so a
snapshot, a routing decision or a key group never depends on which ran. ``NATIVE`` is the C module, or None where it was not
built (``setup.py`` builds it when a C compiler and Python's headers are there, and goes on
without it otherwise) or where ``ABS_NATIVE=0`` is set in the environment; the callers choose
once per call (the handle class once, at import)."""
from __future__ import annotations

import os
from types import ModuleType

__all__ = ["NATIVE"]


API = 4
"""What the C functions' arguments mean, as the module built from ``abscore/_native.c`` says
(its ``API``): a module built from an older source, whose functions have the same names but
read their arguments otherwise (before 2 the index took a shift, not its number of home
positions; before 3 ``configure_value_handles`` took two classes; before 4 the index's rows
were 16 bytes), is not used."""

_NAMES = ("bytes_hashes", "key_codes", "index_lookup", "index_insert", "index_fill", "partition",
          "ValueHandle", "configure_value_handles", "text_array", "byte_streams", "text_index", "int_index", "RestoredIndex")


def _load() -> ModuleType | None:
    if os.environ.get("ABS_NATIVE", "1") == "0":
        return None
    try:
        from abscore import _native
    except ImportError:
        return None
    if not all(hasattr(_native, name) for name in _NAMES) or getattr(_native, "API", 1) != API:
        return None  # built from an older abscore/_native.c: reinstall (pip install -e .) to rebuild it
    return _native


NATIVE = _load()
