"""Opening a snapshot root: the fsspec file system for a URL and its storage options, the
errors of a bad URL or missing extra, and the probe that proves a root is shared.

Part of :class:`storage.store.SnapshotStore`: :meth:`SnapshotStore.open` builds its
:class:`RootIO` with :func:`open_root`; its probe methods call the functions here.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

from .backend import RootIO
from .errors import MissingExtraError, RootNotSharedError, StorageConfigError
from .extras import extra_for_url, missing_extra_message, missing_module
from .paths import StoragePaths, new_token

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["open_root", "write_probe", "check_probe", "delete_probe"]


def local_root(url: str) -> str | None:
    """The absolute path of a local root named by a plain path or a ``file://`` URL, as
    fsspec's local file system resolves it (relative to the working directory, ``~``
    expanded, no trailing ``/``); None for any other URL (another protocol, an fsspec chain)
    and on platforms whose paths are not POSIX."""
    if os.sep != "/" or "::" in url:
        return None
    if url.startswith("file://"):
        path = url[len("file://"):]
    elif "://" in url or url.startswith(("file:", "local:", "data:")):
        return None
    else:
        path = url
    if path.startswith("~"):
        path = os.path.expanduser(path)
    if not path.startswith("/"):
        path = f"{os.getcwd()}/{path[2:] if path.startswith('./') else '' if path == '.' else path}"
    return path.rstrip("/") or "/"


def _local_options_error(url: str, options: Mapping[str, Any]) -> StorageConfigError:
    """The error for storage options given with a local root: it takes none (it is read and
    written with plain file calls), so an option there is a mistake (e.g. credentials meant
    for an object store, or a misspelt key) that would otherwise be ignored."""
    names = ", ".join(repr(str(k)) for k in options)
    return StorageConfigError(
        f"{url}: unknown storage option(s) {names} for a local root; a local root (a path or file:// URL) takes no "
        "storage options: they apply to remote URLs such as s3://bucket/prefix (endpoint_url, key, secret, ...); "
        "drop them, or pass the remote URL they are meant for"
    )


def _file_in_the_way(url: str, root: str) -> StorageConfigError | None:
    """The error for a local root that is a regular file, or lies under one: every read and
    write there would fail with ``NotADirectoryError``, which names no remedy."""
    at = root
    while not os.path.lexists(at):  # the nearest existing path: the root or an ancestor
        parent = os.path.dirname(at)
        if parent == at:
            return None
        at = parent
    if os.path.isdir(at):
        return None
    where = "is a file" if at == root else f"lies under {at}, which is a file"
    return StorageConfigError(f"{url}: {where}, not a directory; a snapshot root (or a savepoint's destination) is "
                              "a directory; pass the path of a directory, new or existing")


def open_root(url: str, storage_options: Mapping[str, Any] | None, *, fs: AbstractFileSystem | None,
              fsync: bool, check: bool) -> RootIO:
    """The :class:`RootIO` of ``url`` (see :meth:`SnapshotStore.open` for the arguments)."""
    if not isinstance(url, str) or not url:
        raise StorageConfigError(f"snapshot root {url!r} is not a URL or path; pass e.g. /data/ckpt or s3://bucket/prefix")
    options = dict(storage_options or {})
    root = local_root(url) if fs is None else None
    if root is not None and options:
        raise _local_options_error(url, options)
    if root is not None:  # plain os calls: fsspec is not even imported (see storage.backend)
        io = RootIO(None, root, url, fsync=fsync)
        if check:
            problem = _file_in_the_way(url, root)
            if problem is not None:
                raise problem
            io.list(StoragePaths.CHECKPOINTS_DIR)
        return io
    import fsspec.core

    try:
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
        else:
            root = fs._strip_protocol(url)
    except (ValueError, TypeError, ImportError, KeyError) as exc:
        extra = extra_for_url(url) if isinstance(exc, ImportError) else None
        if extra is not None:  # s3:// without s3fs
            raise MissingExtraError(missing_extra_message(f"snapshot root {url}", extra, missing_module(exc))) from exc
        raise StorageConfigError(
            f"{url}: cannot build a file system for this URL and storage options ({type(exc).__name__}: {exc}); "
            "check the URL scheme and the storage options"
        ) from exc
    if isinstance(root, list):
        raise StorageConfigError(f"{url}: names several paths; a snapshot root is one directory or prefix")
    io = RootIO(fs, root, url, fsync=fsync)
    if check:
        problem = _file_in_the_way(url, root) if io.local else None
        if problem is not None:
            raise problem
        try:
            io.list(StoragePaths.CHECKPOINTS_DIR)
        except (TypeError, ValueError, AttributeError) as exc:
            # some clients validate options lazily, on first use: s3fs/botocore raise ValueError
            # for an endpoint_url without its scheme and AttributeError for a config_kwargs or
            # client_kwargs that is not a mapping (e.g. JSON that did not parse, kept as a string)
            raise StorageConfigError(
                f"{url}: the storage options were rejected ({type(exc).__name__}: {exc}); fix them (e.g. "
                "--storage-option key=value; for s3://, an endpoint_url with its scheme, http://host:port, and "
                "config_kwargs and client_kwargs as JSON objects)"
            ) from exc
    return io


def write_probe(io: RootIO) -> str:
    """:meth:`SnapshotStore.write_probe`: write a probe file with a fresh token; returns it."""
    token = new_token()
    io.put(StoragePaths.probe(token), token.encode())
    return token


def check_probe(io: RootIO, token: str, *, who: str) -> None:
    """:meth:`SnapshotStore.check_probe`: :class:`RootNotSharedError` unless ``token`` reads here."""
    try:
        seen = io.get(StoragePaths.probe(token))
    except FileNotFoundError:
        seen = None
    if seen != token.encode():
        what = "is missing" if seen is None else "holds another token"
        raise RootNotSharedError(
            f"{who} does not see the snapshot root {io.url!r} the driver writes to (the driver's probe file "
            f"{StoragePaths.probe(token)} {what} there); use storage that the driver and every worker share: "
            "an object store URL (s3://bucket/prefix) or a path mounted at the same place on every host"
        )


def delete_probe(io: RootIO, token: str) -> None:
    """:meth:`SnapshotStore.delete_probe`: remove the probe file (idempotent)."""
    io.delete(StoragePaths.probe(token))
