"""File-system helpers of the connectors: the one place they resolve a URL to an fsspec file
system and the small store contract their commit protocols rely on.

The file sink (:mod:`abs.connectors.file_sink`), the file source
(:mod:`abs.connectors.file_source`) and the replayable batch log
(:mod:`abs.connectors.batchlog`) all go through here.

Store contract (:class:`Files`)
    - ``put`` writes a whole file so that it is never observed half-written: on local disks a
      temporary file beside the target (``.tmp-<uuid>-<name>``), fsynced, renamed over the
      target, and the directory fsynced; on object stores a single PUT. A ``put`` that fails
      part-way leaves the previous file (if any) whole and no temporary file behind; a process
      killed part-way may leave a temporary file, which :func:`temp_target` recognizes.
    - ``create`` is ``put`` only if the target does not exist yet (``False`` if it did): a link
      on local disks (atomic), ``pipe_file(mode="create")`` where the file system offers it,
      else check-then-write.
    - ``publish(src, dst)`` makes ``dst`` hold ``src``'s bytes and removes ``src``. It is
      idempotent and safe to repeat after a crash at any point, or to run concurrently for
      the same pair: a rename on local disks (atomic), copy-then-delete elsewhere (``dst``
      appears atomically with its full content, and a repeated copy rewrites the same
      bytes). It reports whether ``dst`` exists afterwards.
    - ``read`` returns ``None`` for a missing file; listings and deletes tolerate missing
      directories and files.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any, Mapping

from ..errors import ConfigError, MissingExtraError
from storage.extras import extra_for_url, missing_extra_message, missing_module

__all__ = ["absolute", "open_fs", "check_local_options", "is_local", "fsync_dir", "temp_target", "Files"]

_TEMP = re.compile(r"\.tmp-[0-9a-f]{32}-(.+)", re.S)


def absolute(url: str, what: str | None = None, *, directory: bool = False) -> str:
    """Make a local relative path absolute, so that workers with another working
    directory resolve it the same way (URLs with a protocol are left alone).

    With ``what`` (the connector, for the message), ``url`` is checked first: a non-empty str
    (``""`` would name the working directory); with ``directory`` too, a local path that is
    not a file and lies under no file (every write there would fail with
    ``NotADirectoryError``, at the first commit, after the job did its work)."""
    if what is not None and (not isinstance(url, str) or not url.strip()):
        raise ConfigError(f"{what}: the path must be a non-empty str (a local path or an fsspec URL), got "
                          f"{url!r}; pass e.g. '/data/out' or 's3://bucket/out'")
    if "://" in url or url.startswith("/"):
        path = url
    else:
        path = os.path.abspath(url)
    if directory and ("://" not in path or path.startswith("file://")):
        local = path[len("file://"):] if path.startswith("file://") else path
        at = local
        while at and not os.path.lexists(at):  # the nearest existing path: the path or an ancestor
            parent = os.path.dirname(at)
            at = None if parent == at else parent
        if at and not os.path.isdir(at):
            where = "is a file" if at == local else f"lies under {at}, which is a file"
            raise ConfigError(f"{what} {url!r}: {where}, not a directory; pass the path of a directory, new or existing")
    return path


def open_fs(url: str, options: Mapping[str, Any] | None, *, what: str) -> tuple[Any, str]:
    """``(file system, path)`` for ``url``; the path has no trailing slash.

    A URL whose file system needs an extra that is not installed (``s3://`` without s3fs)
    raises :class:`abs.errors.MissingExtraError` naming ``what`` and the extra to install."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url, **dict(options or {}))
    except ImportError as exc:
        extra = extra_for_url(url)
        if extra is None:
            raise ConfigError(
                f"{what}: no file system for {url!r} ({exc}); install the fsspec implementation of its protocol"
            ) from exc
        raise MissingExtraError(missing_extra_message(f"{what} ({url})", extra, missing_module(exc))) from exc
    if is_local(fs):
        check_local_options(url, options, what=what)
    return fs, path.rstrip("/") or path


def check_local_options(url: str, options: Mapping[str, Any] | None, *, what: str) -> None:
    """Refuse storage options that a local path (no protocol, or ``file://``) would ignore:
    fsspec's local file system takes any keyword and acts on a few only, so credentials or an
    endpoint meant for an object store, or a misspelt key, would pass unnoticed. Other URLs
    are left to their file systems."""
    if not isinstance(url, str) or not options:
        return
    protocol = url.split("://", 1)[0].lower() if "://" in url else None
    if protocol not in (None, "file", "local"):
        return
    unknown = sorted(set(options) - _LOCAL_OPTIONS)
    if unknown:
        raise ConfigError(
            f"{what} {url!r}: unknown storage option(s) {', '.join(map(repr, unknown))} for a local path; a local "
            f"path takes only {', '.join(sorted(_LOCAL_OPTIONS))}; the others (endpoint_url, key, anon, ...) apply "
            "to remote URLs such as s3://bucket/prefix: drop them, or pass the remote URL they are meant for"
        )


_LOCAL_OPTIONS = frozenset({"auto_mkdir", "use_listings_cache", "listings_expiry_time", "max_paths",
                            "skip_instance_cache"})
"""The options fsspec's local file system (and every fsspec file system) acts on."""


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local disk (fsspec's ``LocalFileSystem`` names itself ``file``
    and ``local``; either is enough)."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def fsync_dir(path: str) -> None:
    """Make a rename or delete in local directory ``path`` durable (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_target(name: str) -> str | None:
    """The file name a temporary file left by :meth:`Files.put` was meant to become, or
    ``None`` if ``name`` is not such a temporary file."""
    m = _TEMP.fullmatch(name)
    return m.group(1) if m else None


class Files:
    """The store contract (see the module docstring) on one fsspec file system."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.local = is_local(fs)

    # -- writing
    def _local_temp(self, path: str, data: bytes) -> str:
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _remove(tmp)
            raise
        return tmp

    def put(self, path: str, data: bytes) -> None:
        """Write ``path`` atomically (readers see the old file or the new one, whole)."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        tmp = self._local_temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        fsync_dir(os.path.dirname(path))

    def create(self, path: str, data: bytes) -> bool:
        """Write ``path`` atomically if it does not exist; ``False`` if it already did."""
        if self.local:
            tmp = self._local_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _remove(tmp)
            fsync_dir(os.path.dirname(path))
            return True
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError, ValueError):  # no create-if-absent on this file system
            if self.read(path) is not None:
                return False
            self.fs.pipe_file(path, data)
            return True

    def publish(self, src: str, dst: str) -> bool:
        """Move ``src`` to ``dst`` (idempotent, see the module docstring); whether ``dst`` exists."""
        self.refresh(src)
        self.refresh(dst)
        if self.local:
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                pass  # published before (or by a concurrent writer)
            else:
                fsync_dir(os.path.dirname(dst))
        elif self.exists(src):
            try:
                self.fs.copy(src, dst)
            except FileNotFoundError:
                pass  # a concurrent writer published and deleted it meanwhile
            self.delete(src)
        return self.exists(dst)

    def delete(self, path: str, recursive: bool = False) -> None:
        """Delete a file (or, with ``recursive``, a directory tree); missing is fine."""
        try:
            if recursive:
                self.fs.rm(path, recursive=True)
            elif self.local:
                os.remove(path)
            else:
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    # -- reading
    def read(self, path: str) -> bytes | None:
        """The file's bytes, ``None`` if it does not exist (no listing cache involved)."""
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def read_json(self, path: str) -> Any:
        data = self.read(path)
        return None if data is None else json.loads(data.decode("utf-8"))

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else bool(self.fs.exists(path))

    def refresh(self, path: str) -> None:
        """Forget cached listings under ``path`` (s3fs caches them; others changed files)."""
        if not self.local:
            try:
                self.fs.invalidate_cache(path)
            except Exception:  # noqa: BLE001 - not every file system caches
                pass

    def list_files(self, directory: str) -> list[str]:
        """Sorted names of the files (not directories) directly in ``directory`` (``[]`` if missing)."""
        try:
            if self.local:
                return sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
            infos = self.fs.ls(directory, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(str(i["name"]).rstrip("/").rsplit("/", 1)[-1] for i in infos if i.get("type") == "file")

    def list_names(self, directory: str) -> list[str]:
        """Names of the files and directories directly in ``directory`` (``[]`` if missing),
        listed afresh."""
        self.refresh(directory)
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(directory, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
