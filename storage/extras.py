"""The optional dependencies of the project (the *extras* of its ``abs-snapshots``
distribution) and the words of the error when one is missing
(:class:`storage.errors.MissingExtraError`, which ``abs`` and ``recovery`` raise too).

The distribution is not published on a package index: it is installed from a checkout of the
project (``pip install '.[spark]'``), so the messages say that, not ``pip install NAME[extra]``.

- ``spark``: pyspark (``abs.SparkExecutor``, the Spark sources, :mod:`storage.spark`,
  :mod:`recovery.spark`);
- ``s3``: s3fs (``s3://`` snapshot roots, file connectors and logs).
"""
from __future__ import annotations

import importlib
from .errors import MissingExtraError

__all__ = ["PACKAGE", "EXTRAS", "install_command", "install_hint", "missing_extra_message", "missing_module",
           "extra_for_url", "require"]

PACKAGE = "abs-snapshots"  # the distribution's name (its metadata), not an index name to pip install
EXTRAS = {"spark": "pyspark", "s3": "s3fs"}  # extra -> the module it provides
_PROTOCOL_EXTRAS = {"s3": "s3", "s3a": "s3"}  # URL protocol -> extra


def install_command(extra: str) -> str:
    """The pip command, run in a checkout of the project, that installs it with ``extra``."""
    return f"pip install '.[{extra}]'"


def install_hint(extra: str) -> str:
    """How to install the project with ``extra``, in words a user can act on."""
    return f"install the project with its '{extra}' extra: {install_command(extra)} in a checkout"


def missing_extra_message(what: str, extra: str, module: str | None = None) -> str:
    """``what`` needs extra ``extra``, which is not installed: what to install."""
    module = module or EXTRAS[extra]
    return (f"{what} needs {module}, which is not installed (the project's optional extra '{extra}'); "
            f"{install_hint(extra)}")


def missing_module(exc: BaseException) -> str | None:
    """The top-level name of the module whose absence caused ``exc`` (an ImportError, maybe
    re-raised by fsspec with its own words), or ``None`` if it does not say."""
    seen: BaseException | None = exc
    while seen is not None:
        name = getattr(seen, "name", None)
        if isinstance(seen, ModuleNotFoundError) and name:
            return str(name).split(".")[0]
        seen = seen.__cause__ or seen.__context__
    return None


def extra_for_url(url: str) -> str | None:
    """The extra whose file system a URL needs (``s3://`` -> ``"s3"``), ``None`` for others."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    return _PROTOCOL_EXTRAS.get(protocol)


def require(extra: str, what: str) -> None:
    """Import the module of ``extra``; if it is not installed, raise
    :class:`storage.errors.MissingExtraError` saying that ``what`` needs it and how to
    install it. Other import failures (a broken installation) propagate unchanged."""
    module = EXTRAS[extra]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if missing_module(exc) != module:
            raise
        raise MissingExtraError(missing_extra_message(what, extra)) from exc
