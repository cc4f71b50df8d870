"""Public names of a package that load on first use (PEP 562): a package's ``__init__`` lists
where each name lives and gets its ``__getattr__`` and ``__dir__`` from :func:`lazy_names`, so
that importing one of its modules (as a worker process does) costs no more than that module."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Mapping, Sequence

__all__ = ["lazy_names"]


def lazy_names(package: str, namespace: dict, homes: Mapping[str, Sequence[str]]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose module dict is ``namespace``;
    ``homes``: relative module -> the public names it defines. A name loads on first use and
    is then kept in ``namespace`` (later look-ups skip ``__getattr__``); a subpackage loads as
    after an eager import."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home_of.get(name)
        if module is None:
            if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
