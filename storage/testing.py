"""Fault injection for storage: an fsspec file system that wraps another and misbehaves on
schedule.

Example::

    fs = FaultyFileSystem(fsspec.filesystem("memory"), faults=[
        Fault(op="write", nth=3, action="tear", path_glob="*/state/*"),
        Fault(op="read", nth=1, action="fail"),
    ])
    store = SnapshotStore.open("memory://job", fs=fs)
    ...
    fs.counts["write"], fs.injected        # what happened

Operations are counted per type (``read``, ``write``, ``rename``, ``delete``). A fault fires
on the ``nth`` operation of its type whose full path matches ``path_glob`` (``fnmatch``;
``None`` matches all), and on the ``times - 1`` matching operations after it
(``times=None``: every later one). The first matching fault of the schedule acts.

Actions:

=============== ======================================================================
``fail``        raise ``OSError`` (EIO); nothing happens
``tear``        write / rename: a prefix (``keep_fraction`` of the bytes) reaches the
                destination, then ``OSError`` is raised
``tear_silent`` write / rename: a prefix reaches the destination and success is reported;
                read: a prefix of the file is returned
``lose``        write / rename / delete: report success, do nothing;
                read: ``FileNotFoundError`` (the file seems gone)
``delay``       sleep ``seconds`` (through the injected ``sleep``), then act normally
=============== ======================================================================

Listing, ``info``, ``exists`` and directory operations pass through unchanged.
"""
from __future__ import annotations

import errno
import fnmatch
import io
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

from fsspec import AbstractFileSystem

__all__ = [
    "Fault", "FaultOp", "FaultAction", "InjectedFault", "FaultyFileSystem", "FaultyProtocolFileSystem",
    "InjectedFaultError", "register_faulty_protocol",
]

FaultOp = Literal["read", "write", "rename", "delete"]
FaultAction = Literal["fail", "tear", "tear_silent", "lose", "delay"]

_SUPPORTED: dict[str, frozenset[str]] = {
    "write": frozenset({"fail", "tear", "tear_silent", "lose", "delay"}),
    "rename": frozenset({"fail", "tear", "tear_silent", "lose", "delay"}),
    "read": frozenset({"fail", "tear_silent", "lose", "delay"}),
    "delete": frozenset({"fail", "lose", "delay"}),
}


class InjectedFaultError(OSError):
    """Raised by :class:`FaultyFileSystem` for an injected ``fail`` or ``tear``; an ``OSError``
    like a real I/O failure. Remedy: none, it is a test fault; the code under test must cope."""


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; see the module docstring for the semantics."""

    op: FaultOp
    nth: int = 1
    action: FaultAction = "fail"
    path_glob: str | None = None
    times: int | None = 1
    keep_fraction: float = 0.5
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.op not in _SUPPORTED:
            raise ValueError(f"Fault.op={self.op!r}: use one of {sorted(_SUPPORTED)}")
        if self.action not in _SUPPORTED[self.op]:
            raise ValueError(f"Fault action {self.action!r} is not defined for op {self.op!r}; use one of {sorted(_SUPPORTED[self.op])}")
        if not isinstance(self.nth, int) or self.nth < 1:
            raise ValueError(f"Fault.nth={self.nth!r}: operations are counted from 1")
        if self.times is not None and self.times < 1:
            raise ValueError(f"Fault.times={self.times!r}: use an integer >= 1 or None (every later operation)")
        if not 0.0 <= self.keep_fraction < 1.0:
            raise ValueError(f"Fault.keep_fraction={self.keep_fraction!r}: must be in [0, 1)")
        if self.seconds < 0:
            raise ValueError(f"Fault.seconds={self.seconds!r}: must be >= 0")


@dataclass(frozen=True)
class InjectedFault:
    """Record of a fault that fired: which schedule entry, on which operation and path."""

    index: int
    fault: Fault
    op: FaultOp
    path: str
    count: int


class _WriteBuffer(io.BytesIO):
    """File object for write modes: collects bytes, hands them to the wrapper on close."""

    def __init__(self, fs: "FaultyFileSystem", path: str, mode: str) -> None:
        super().__init__()
        self._fs, self._path, self._mode = fs, path, mode
        self._done = False

    def close(self) -> None:
        if not self._done:
            self._done = True
            data = self.getvalue()
            super().close()
            self._fs._write(self._path, data, "create" if "x" in self._mode else "overwrite")
        else:
            super().close()


class FaultyFileSystem(AbstractFileSystem):
    """Wraps any fsspec file system and injects the scheduled faults.

    ``counts[op]`` counts every operation of each type; ``injected`` lists the faults that
    fired. ``sleep`` is used for ``delay`` faults (inject a fake to keep tests fast).
    """

    cachable = False  # never share instances (and their counters) through fsspec's cache

    def __init__(self, inner: AbstractFileSystem, faults: Iterable[Fault] = (), *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__()
        self.inner = inner
        self.protocol = inner.protocol
        self.faults: list[Fault] = list(faults)
        self.counts: Counter[str] = Counter()
        self.injected: list[InjectedFault] = []
        self._matches: Counter[int] = Counter()
        self._sleep = sleep
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ schedule
    def add_fault(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def clear_faults(self) -> None:
        """Remove every scheduled fault (counters are kept)."""
        with self._lock:
            self.faults.clear()
            self._matches.clear()

    def _decide(self, op: FaultOp, path: str) -> Fault | None:
        with self._lock:
            self.counts[op] += 1
            chosen: Fault | None = None
            for i, fault in enumerate(self.faults):
                if fault.op != op or (fault.path_glob is not None and not fnmatch.fnmatchcase(path, fault.path_glob)):
                    continue
                self._matches[i] += 1
                n = self._matches[i]
                fires = n >= fault.nth and (fault.times is None or n < fault.nth + fault.times)
                if fires and chosen is None:
                    chosen = fault
                    self.injected.append(InjectedFault(i, fault, op, path, self.counts[op]))
        if chosen is not None and chosen.action == "delay":
            self._sleep(chosen.seconds)
            return None
        return chosen

    @staticmethod
    def _error(fault: Fault, op: str, path: str) -> InjectedFaultError:
        return InjectedFaultError(errno.EIO, f"injected {fault.action} on {op} {path}")

    # ------------------------------------------------------------------ writes
    def _write(self, path: str, data: bytes, mode: str = "overwrite") -> None:
        fault = self._decide("write", path)
        if fault is None:
            self.inner.pipe_file(path, data, mode=mode)
            return
        if fault.action == "lose":
            return
        if fault.action in ("tear", "tear_silent"):
            self.inner.pipe_file(path, data[: int(len(data) * fault.keep_fraction)], mode=mode)
            if fault.action == "tear_silent":
                return
        raise self._error(fault, "write", path)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._write(self._strip_protocol(path), bytes(value), mode)

    def put_file(self, lpath: str, rpath: str, callback: Any = None, mode: str = "overwrite", **kwargs: Any) -> None:
        with open(lpath, "rb") as f:
            self._write(self._strip_protocol(rpath), f.read(), mode)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._write(self._strip_protocol(path2), self.inner.cat_file(path1))

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if any(c in mode for c in "wxa"):
            if "a" in mode:
                buf = _WriteBuffer(self, path, "wb")
                if self.inner.exists(path):
                    buf.write(self.inner.cat_file(path))
                return buf
            return _WriteBuffer(self, path, mode)
        data = self.cat_file(path)
        return io.BytesIO(data)

    # ------------------------------------------------------------------ reads
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        fault = self._decide("read", path)
        if fault is None:
            return self.inner.cat_file(path, start=start, end=end, **kwargs)
        if fault.action == "lose":
            raise FileNotFoundError(errno.ENOENT, f"injected lost read: {path}", path)
        if fault.action == "tear_silent":
            data = self.inner.cat_file(path, start=start, end=end, **kwargs)
            return data[: int(len(data) * fault.keep_fraction)]
        raise self._error(fault, "read", path)

    def get_file(self, rpath: str, lpath: str, callback: Any = None, outfile: Any = None, **kwargs: Any) -> None:
        data = self.cat_file(rpath)
        if outfile is not None:
            outfile.write(data)
            return
        with open(lpath, "wb") as f:
            f.write(data)

    # ------------------------------------------------------------------ renames
    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        fault = self._decide("rename", src)
        if fault is None:
            self.inner.mv(src, dst, recursive=recursive, maxdepth=maxdepth, **kwargs)
            return
        if fault.action == "lose":
            return
        if fault.action in ("tear", "tear_silent"):
            data = self.inner.cat_file(src)
            self.inner.pipe_file(dst, data[: int(len(data) * fault.keep_fraction)])
            if fault.action == "tear_silent":
                self.inner.rm_file(src)
                return
        raise self._error(fault, "rename", src)

    def rename(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.mv(path1, path2, **kwargs)

    # ------------------------------------------------------------------ deletes
    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        fault = self._decide("delete", path)
        if fault is None:
            self.inner.rm_file(path)
            return
        if fault.action == "lose":
            return
        raise self._error(fault, "delete", path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = self.inner.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        dirs = []
        for p in reversed(paths):
            if self.inner.isdir(p):
                dirs.append(p)
            else:
                self.rm_file(p)
        for d in dirs:
            try:
                self.inner.rmdir(d)
            except (OSError, NotImplementedError):
                pass

    # ------------------------------------------------------------------ pass-through
    def _strip_protocol(self, path: Any) -> Any:  # type: ignore[override]
        return self.inner._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return self.inner.unstrip_protocol(name)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.inner.ls(path, detail=detail, **kwargs)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any) -> Any:
        return self.inner.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.inner.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.inner.exists(path, **kwargs)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.inner.isfile(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.inner.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.inner.mkdir(path, create_parents=create_parents, **kwargs)

    def rmdir(self, path: str) -> None:
        self.inner.rmdir(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.inner.invalidate_cache(path)

    def created(self, path: str) -> Any:
        return self.inner.created(path)

    def modified(self, path: str) -> Any:
        return self.inner.modified(path)


class FaultyProtocolFileSystem(FaultyFileSystem):
    """The fault-injecting file system as an fsspec protocol, ``faulty://``, so that a
    snapshot root in *other processes* (the workers of a job) can be faulty too::

        abs.run(flow, storage="faulty:///tmp/snapshots", storage_options={
            "target_protocol": "file",
            "faults": [{"op": "write", "nth": 5, "path_glob": "*/state/*"}],
        })

    Each process counts its own operations. ``faults`` are :class:`Fault` objects or dicts
    of their fields; ``target_options`` are passed to the wrapped file system. The protocol
    is known only where :func:`register_faulty_protocol` made it known (importing
    ``storage`` does not).
    """

    protocol = "faulty"

    def __init__(self, target_protocol: str = "file", target_options: dict | None = None,
                 faults: Iterable[Any] = (), **kwargs: Any) -> None:
        import fsspec

        inner = fsspec.filesystem(target_protocol, **(target_options or {}))
        super().__init__(inner, [f if isinstance(f, Fault) else Fault(**f) for f in faults])
        self.protocol = "faulty"

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return path.rstrip("/") or "/"


FAULTY_PLUGIN = "abs_faulty_fs_plugin"  # the distribution name register_faulty_protocol writes


def register_faulty_protocol(plugin_dir: str | None = None) -> str | None:
    """Make ``faulty://`` (:class:`FaultyProtocolFileSystem`) known to fsspec: in this process
    now, and in the processes it starts (the workers of a job, a CLI run in a subprocess)
    when ``plugin_dir`` is given.

    fsspec learns protocols in two ways only: ``fsspec.register_implementation`` (this
    process) and the ``fsspec.specs`` entry points of the distributions on ``sys.path``, read
    when a process imports fsspec (the ``FSSPEC_<PROTOCOL>`` variables set options, not
    implementations). So with ``plugin_dir`` this writes there the metadata of a distribution
    that declares the one entry point (``<plugin_dir>/abs_faulty_fs_plugin-0.dist-info``; no
    code, nothing installed) and returns ``plugin_dir``: put it on ``sys.path`` (a local
    job's workers inherit the driver's ``sys.path``) and on ``PYTHONPATH`` (other
    subprocesses). Used by the test suite's ``conftest.py``; the product never registers it.
    """
    import os

    import fsspec

    cls = f"{__name__}.FaultyProtocolFileSystem"
    fsspec.register_implementation("faulty", cls, clobber=True)
    if plugin_dir is None:
        return None
    info = os.path.join(plugin_dir, f"{FAULTY_PLUGIN}-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {FAULTY_PLUGIN}\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[fsspec.specs]\nfaulty = {__name__}:FaultyProtocolFileSystem\n")
    return plugin_dir
