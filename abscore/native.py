"""The optional C module :mod:`abscore._native` and its switch.

The per-element loops of the hot paths (the key-group hash of binary and string keys, the
columnar store's key codes and its hash index) have two implementations: numpy code that
makes one pass per byte position or probe step over a whole batch, and C loops in
``abscore/_native.c`` that make one pass over the batch in all. Both give the same results
bit for bit (tests/test_native.py holds them side by side), so a snapshot, a routing decision
or a key group never depends on which ran. ``NATIVE`` is the C module, or None where it was
not built (``setup.py`` builds it when a C compiler and Python's headers are there, and goes
on without it otherwise) or where ``ABS_NATIVE=0`` is set in the environment (which the
fallback's tests use); the callers test it once per call."""
from __future__ import annotations

import os
from types import ModuleType

__all__ = ["NATIVE"]


def _load() -> ModuleType | None:
    if os.environ.get("ABS_NATIVE", "1") == "0":
        return None
    try:
        from abscore import _native
    except ImportError:
        return None
    return _native


NATIVE = _load()
