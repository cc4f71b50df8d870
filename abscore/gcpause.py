"""Pausing Python's cyclic garbage collector while a bulk of long-lived objects is made.

Reading a manifest of 32,768 key groups, encoding one, or restoring that many key groups makes
objects by the hundred thousand (references, lists, columns), none of them garbage; the
collections their allocations set off scan the whole heap again and again, a third to half of
the time of such a step. :func:`gc_paused` turns collection off for the step and back on after
it, if it was on. Pauses nest and may overlap across threads: collection comes back on when the
last one ends, and only if it was on when the first began. A process forked while another thread
is inside a pause (the driver forks workers) starts with collection as it was before the pause:
the pause's thread, which would have turned it back on, does not exist in the child.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
from typing import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the ``with`` block (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            if _depth:  # 0: a child forked inside this pause (reset at the fork)
                _depth -= 1
                if _depth == 0 and _was_enabled:
                    gc.enable()


def _after_fork_in_child() -> None:
    global _lock, _depth
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _depth and _was_enabled:
        gc.enable()
    _depth = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
