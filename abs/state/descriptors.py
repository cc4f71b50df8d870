"""State descriptors: what an operator declares with ``state=[...]``.

``ValueState(name, type=None)``, ``ListState(name, element_type=None)``,
``MapState(name, key_type=None, value_type=None)``, ``ReducingState(name, reduce_fn, type=None)``.
A declared Arrow type makes snapshots real Arrow columns (readable by pyarrow and Spark);
without one, values are pickled into a binary column.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Union

import pyarrow as pa

from abs.errors import ConfigError

__all__ = ["ValueState", "ListState", "MapState", "ReducingState", "StateDescriptor", "KINDS"]


def _check_name(cls: str, name: Any) -> None:
    if not isinstance(name, str) or not name or any(c in name for c in "/\\\0"):
        raise ConfigError(
            f"{cls} name must be a non-empty str without '/', '\\' or NUL (it names storage "
            f"folders), got {name!r}; choose a name like 'count'"
        )


def _check_type(cls: str, name: str, field: str, value: Any) -> None:
    if value is not None and not isinstance(value, pa.DataType):
        raise ConfigError(
            f"{cls}({name!r}): {field} must be a pyarrow DataType or None, got {value!r}; "
            "pass e.g. pyarrow.int64(), or None to store pickled values"
        )


def _type_json(t: pa.DataType | None) -> str | None:
    return None if t is None else str(t)


@dataclass(frozen=True)
class ValueState:
    """One value per key. ``type``: Arrow type of the value, or None (pickled)."""

    name: str
    type: pa.DataType | None = None
    kind: ClassVar[str] = "value"

    def __post_init__(self) -> None:
        _check_name("ValueState", self.name)
        _check_type("ValueState", self.name, "type", self.type)

    def value_arrow_type(self) -> pa.DataType | None:
        """Arrow type of the snapshot's value column; None means pickled binary."""
        return self.type

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "type": _type_json(self.type)}


@dataclass(frozen=True)
class ListState:
    """A list of elements per key. ``element_type``: Arrow type of one element, or None."""

    name: str
    element_type: pa.DataType | None = None
    kind: ClassVar[str] = "list"

    def __post_init__(self) -> None:
        _check_name("ListState", self.name)
        _check_type("ListState", self.name, "element_type", self.element_type)

    def value_arrow_type(self) -> pa.DataType | None:
        return None if self.element_type is None else pa.list_(self.element_type)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "element_type": _type_json(self.element_type)}


@dataclass(frozen=True)
class MapState:
    """A map per key. Give both ``key_type`` and ``value_type`` (typed) or neither (pickled)."""

    name: str
    key_type: pa.DataType | None = None
    value_type: pa.DataType | None = None
    kind: ClassVar[str] = "map"

    def __post_init__(self) -> None:
        _check_name("MapState", self.name)
        _check_type("MapState", self.name, "key_type", self.key_type)
        _check_type("MapState", self.name, "value_type", self.value_type)
        if (self.key_type is None) != (self.value_type is None):
            raise ConfigError(
                f"MapState({self.name!r}): give both key_type and value_type, or neither "
                "(then the map is pickled)"
            )

    def value_arrow_type(self) -> pa.DataType | None:
        if self.key_type is None or self.value_type is None:
            return None
        return pa.map_(self.key_type, self.value_type)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "key_type": _type_json(self.key_type),
            "value_type": _type_json(self.value_type),
        }


@dataclass(frozen=True)
class ReducingState:
    """One value per key folded with ``reduce_fn(accumulated, new)`` on each ``add``."""

    name: str
    reduce_fn: Callable[[Any, Any], Any]
    type: pa.DataType | None = None
    kind: ClassVar[str] = "reducing"

    def __post_init__(self) -> None:
        _check_name("ReducingState", self.name)
        if not callable(self.reduce_fn):
            raise ConfigError(
                f"ReducingState({self.name!r}): reduce_fn must be callable, got "
                f"{self.reduce_fn!r}; pass a function (accumulated, value) -> accumulated"
            )
        _check_type("ReducingState", self.name, "type", self.type)

    def value_arrow_type(self) -> pa.DataType | None:
        return self.type

    def to_json(self) -> dict[str, Any]:
        fn = self.reduce_fn
        qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
        module = getattr(fn, "__module__", None) or type(fn).__module__
        return {
            "kind": self.kind,
            "name": self.name,
            "type": _type_json(self.type),
            "reduce_fn": f"{module}.{qualname}",
        }


StateDescriptor = Union[ValueState, ListState, MapState, ReducingState]
KINDS = {"value": ValueState, "list": ListState, "map": MapState, "reducing": ReducingState}
