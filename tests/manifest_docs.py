"""Editing a stored manifest's JSON in tests (format 7: references are entries of the
reference tables ``files`` and ``ranges``; see "Reference tables" in storage/FORMAT.md)."""
from __future__ import annotations

from typing import Any

from storage.manifest_refs import RANGE_FIELDS


def chain_entries(doc: dict, operator: str, state: str, key_group: int) -> list[list[int]]:
    """The entries of a key group's chain."""
    return doc["keyed"][operator][state][str(key_group)]


def ref_field(doc: dict, entry: list[int], field: str) -> Any:
    """A field of the range an entry references (``path``: the range's file)."""
    rng = doc["ranges"][entry[0]]
    return doc["files"][rng[0]] if field == "path" else rng[RANGE_FIELDS.index(field)]


def set_ref(doc: dict, entry: list[int], **fields: Any) -> None:
    """Edit the range an entry references (every reference to it sees the change; ``path``
    renames the range's file for every range of it)."""
    rng = doc["ranges"][entry[0]]
    for field, value in fields.items():
        if field == "path":
            doc["files"][rng[0]] = value
        else:
            rng[RANGE_FIELDS.index(field)] = value
