"""The small file-system contract the store relies on, over any fsspec file system.

``RootIO`` is the only code that touches the file system. Its guarantees:

- :meth:`RootIO.put` writes a file under a *fresh unique* name. A crash may leave a partial
  file; that is harmless because no manifest names it yet, and checksums catch it otherwise.
- :meth:`RootIO.put_new` is the commit primitive: readers see the file whole or not at all,
  and it fails with ``FileExistsError`` when the name exists.

  * object stores (``s3``): one ``PUT`` with ``If-None-Match: *`` (``pipe_file(mode="create")``),
    a true atomic create-if-absent;
  * local disk: write + fsync a temporary file, ``link()`` it to the final name (atomic,
    fails if the name exists), unlink the temporary, fsync the directory;
  * any other file system (memory, wrappers): temporary file, existence check, rename. The
    rename makes the content appear at once, but two writers racing for the same name are
    not excluded (check-then-rename). Only the coordinator commits, so this is acceptable.
- :meth:`RootIO.delete` is idempotent.
- A local root opened from a plain path or ``file://`` URL (which takes no storage options:
  :func:`storage.store_root.open_root` refuses any, naming them) has no fsspec file system: every operation uses ``os`` and ``open`` directly, and fsspec is not
  even imported (its import, asyncio's among its modules, costs a process ~10 MB, counted in
  the driver and in every worker and snapshot writer forked from it). :attr:`RootIO.fs`
  builds fsspec's local file system the first time a caller asks for it.
- Errors of the file system become :class:`StorageUnavailableError` naming the root;
  ``FileNotFoundError`` / ``FileExistsError`` pass through for the caller to interpret.
"""
from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import threading
from typing import TYPE_CHECKING, Any, Iterator

from .errors import CorruptManifestError, StorageUnavailableError
from .paths import validate_relative_path

if TYPE_CHECKING:  # a RootIO is built over a file system the caller made: fsspec is loaded by then
    from fsspec import AbstractFileSystem

__all__ = ["RootIO", "OBJECT_STORE_PROTOCOLS", "protocols_of", "absolute_url"]

OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def protocols_of(fs: AbstractFileSystem) -> set[str]:
    """The protocol names an fsspec file system answers to."""
    proto = fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)


def absolute_url(url: str) -> str:
    """``url`` with a local path made absolute against this process's working directory.

    A plain path (``./snapshots``, ``~/ckpt``) or a ``file://`` URL is resolved here, in the
    process that names it (the driver), so that processes started elsewhere (Spark
    executors run in their own work directories) do not resolve it against theirs. Every
    other URL (``s3://``, ``memory://``, ...) is returned unchanged.
    """
    if not isinstance(url, str) or not url:
        return url
    if url.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(url[len("file://"):]))
    if "://" in url or "::" in url:  # another protocol, or an fsspec chain
        return url
    return os.path.abspath(os.path.expanduser(url))


def _is_foreign_error(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "urllib3")


class RootIO:
    """File operations relative to one snapshot root."""

    def __init__(self, fs: AbstractFileSystem | None, root: str, url: str, *, fsync: bool = True) -> None:
        """``fs`` None: a local root without fsspec (see the module docstring), ``root`` an
        absolute path."""
        self._fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.fsync = fsync
        self.object_store = fs is not None and bool(protocols_of(fs) & OBJECT_STORE_PROTOCOLS)
        if fs is None:
            self.local = True
        else:
            from fsspec.implementations.local import LocalFileSystem

            self.local = isinstance(fs, LocalFileSystem)
        self._made_dirs: set[str] = set()
        self._lock = threading.Lock()

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec file system of the root (for a local root without one, fsspec's local
        file system, made on first use)."""
        if self._fs is None:
            from fsspec.implementations.local import LocalFileSystem

            self._fs = LocalFileSystem()
        return self._fs

    # ------------------------------------------------------------------ helpers
    def full(self, rel: str) -> str:
        validate_relative_path(rel)
        return f"{self.root}/{rel}" if self.root else rel

    def rel(self, full: str) -> str | None:
        prefix = f"{self.root}/" if self.root else ""
        if not full.startswith(prefix):
            return None
        return full[len(prefix):]

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Map file-system failures to :class:`StorageUnavailableError` naming the root."""
        try:
            yield
        except (FileNotFoundError, FileExistsError):
            raise
        except StorageUnavailableError:
            raise
        except OSError as exc:
            raise StorageUnavailableError(
                f"{self.url}: {what} failed ({type(exc).__name__}: {exc}); storage refused or failed the request; "
                "check the URL, credentials, network and free space, then retry"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - only client-library errors are translated
            if not _is_foreign_error(exc):
                raise
            raise StorageUnavailableError(
                f"{self.url}: {what} failed ({type(exc).__name__}: {exc}); the storage endpoint is unreachable "
                "or refused the request; check the endpoint URL, credentials and network, then retry"
            ) from exc

    def _ensure_parent(self, full: str) -> None:
        if self.object_store:
            return
        parent = posixpath.dirname(full)
        with self._lock:
            if parent in self._made_dirs:
                return
        if self._fs is None:
            os.makedirs(parent, exist_ok=True)
        else:
            self.fs.makedirs(parent, exist_ok=True)
        with self._lock:
            self._made_dirs.add(parent)

    # ------------------------------------------------------------------ operations
    def put(self, rel: str, data: bytes) -> None:
        """Write a file under a fresh unique name (see module docstring)."""
        full = self.full(rel)
        with self.errors(f"writing {rel}"):
            self._ensure_parent(full)
            if self.local:
                self._local_write(full, data, exclusive=False)
            else:
                self.fs.pipe_file(full, data)

    def put_new(self, rel: str, data: bytes, tmp_rel: str) -> None:
        """Atomically create ``rel`` with ``data``; ``FileExistsError`` if it exists."""
        full = self.full(rel)
        with self.errors(f"committing {rel}"):
            if self.object_store:
                self.fs.pipe_file(full, data, mode="create")
                return
            self._ensure_parent(full)
            tmp = self.full(tmp_rel)
            if self.local:
                try:
                    self._local_write(tmp, data, exclusive=True)
                    os.link(tmp, full)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                self._fsync_dir(posixpath.dirname(full))
                return
            try:
                self.fs.pipe_file(tmp, data)
                if self.fs.exists(full):
                    raise FileExistsError(full)
                self.fs.mv(tmp, full)
                if not self.fs.exists(full):
                    raise StorageUnavailableError(
                        f"{self.url}: renaming the temporary file to {rel} reported success but {rel} does not exist; "
                        "the file system lost the rename; the commit did not happen; retry"
                    )
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(tmp)
                raise

    def get(self, rel: str) -> bytes:
        full = self.full(rel)
        with self.errors(f"reading {rel}"):
            if self.local:  # plain open(): a third of the per-file cost of fsspec's cat_file
                with open(full, "rb") as f:
                    return f.read()
            return bytes(self.fs.cat_file(full))

    def get_document(self, rel: str, limit: int, *, source: str | None = None) -> bytes:
        """A whole small document (manifest, ``_job.json``, pin) of at most ``limit`` bytes; a
        larger file is read only to ``limit + 1`` bytes (the parser then refuses it), and on
        local disk not at all. ``source`` names it in the error."""
        if self.local:
            with self.errors(f"reading {rel}"), open(self.full(rel), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise CorruptManifestError(
                        f"{source or f'{self.url}: {rel}'}: {size} bytes, more than the {limit} it may have; refusing to read it; "
                        "it is corrupt; restore from another checkpoint", reason=f"larger than {limit} bytes")
                return f.read(size + 1)
        return self.get_range(rel, 0, limit + 1)

    def get_range(self, rel: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of a file (fewer when the file ends sooner)."""
        full = self.full(rel)
        with self.errors(f"reading {rel}"):
            if self.local:
                with open(full, "rb") as f:
                    # clamp to the file's real size first: pread allocates the length it is asked
                    # for, and a corrupt or hostile reference may ask for petabytes
                    length = max(0, min(length, os.fstat(f.fileno()).st_size - offset))
                    return os.pread(f.fileno(), length, offset) if length else b""
            try:
                return bytes(self.fs.cat_file(full, start=offset, end=offset + length))
            except OSError as exc:
                # S3 answers a range that starts past the end with 416, which s3fs raises as
                # EINVAL: the file is shorter than the reference says (the caller reports it)
                if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                    return b""
                raise

    def size(self, rel: str) -> int:
        """The size of a file in bytes (``FileNotFoundError`` if it does not exist)."""
        full = self.full(rel)
        with self.errors(f"checking the size of {rel}"):
            if self.local:
                return os.stat(full).st_size
            return int(self.fs.size(full))

    def exists(self, rel: str) -> bool:
        full = self.full(rel)
        with self.errors(f"checking {rel}"):
            if self._fs is None:
                return os.path.exists(full)
            return bool(self.fs.exists(full))

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every file under ``prefix`` (relative; ``""`` = the whole root): relative path -> size."""
        base = self.full(prefix) if prefix else self.root
        if self._fs is None:
            with self.errors(f"listing {prefix or 'the root'}"):
                return self._local_list(base)
        with self.errors(f"listing {prefix or 'the root'}"):
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(base)
            try:
                found: dict[str, Any] = self.fs.find(base, detail=True)
            except FileNotFoundError as exc:
                if self.object_store:
                    raise StorageUnavailableError(
                        f"{self.url}: the bucket does not exist ({exc}); create it or fix the URL, then retry"
                    ) from exc
                return {}
        out: dict[str, int] = {}
        for full, info in found.items():
            if info.get("type", "file") != "file":
                continue
            rel = self.rel(full)
            if rel:
                out[rel] = int(info.get("size") or 0)
        return out

    def delete(self, rel: str) -> bool:
        """Delete a file; ``False`` if it was already gone (idempotent)."""
        full = self.full(rel)
        with self.errors(f"deleting {rel}"):
            try:
                if self._fs is None:
                    os.unlink(full)
                else:
                    self.fs.rm_file(full)
            except FileNotFoundError:
                return False
            return True

    # ------------------------------------------------------------------ local disk
    def _local_list(self, base: str) -> dict[str, int]:
        """:meth:`list` of a root without fsspec: the files under ``base`` (none when it does
        not exist), in path order, as fsspec's ``find`` lists them."""
        if os.path.isfile(base):
            rel = self.rel(base)
            return {rel: os.stat(base).st_size} if rel else {}
        found: dict[str, int] = {}

        def walk(directory: str) -> None:
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                return  # gone meanwhile (a concurrent GC): as fsspec's find, nothing there
            for entry in entries:
                try:
                    if entry.is_dir():
                        walk(entry.path)
                    elif entry.is_file():
                        found[entry.path] = entry.stat().st_size
                except FileNotFoundError:
                    continue
        walk(base)
        out: dict[str, int] = {}
        for full in sorted(found):
            rel = self.rel(full)
            if rel:
                out[rel] = found[full]
        return out

    def _local_write(self, full: str, data: bytes, *, exclusive: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        fd = os.open(full, flags, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_dir(self, directory: str) -> None:
        if not self.fsync:
            return
        with contextlib.suppress(OSError):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
