"""Options of the ``abs-snapshot`` data source: parsed and checked once, on the driver, into
an :class:`_Options` value (see :mod:`storage.spark` for what each option means)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .backend import absolute_url
from .errors import StorageConfigError
from .inspect import parse_storage_options

SOURCE_NAME = "abs-snapshot"
_KNOWN_OPTIONS = {"path", "table", "checkpoint", "operator", "state", "keygroupsperpartition", "keygroups",
                  "storageoptions"}
_STORAGE_PREFIX = "storage."


@dataclass(frozen=True)
class _Options:
    root: str
    table: str
    checkpoint: int | None
    operator: str | None
    state: str | None
    key_groups_per_partition: int | None  # None = auto
    key_groups: frozenset[int] | None
    storage_options: dict[str, Any]


def _parse_options(raw: Mapping[str, Any]) -> _Options:
    opts = {str(k).lower(): v for k, v in raw.items()}
    storage_pairs = [f"{k[len(_STORAGE_PREFIX):]}={v}" for k, v in opts.items() if k.startswith(_STORAGE_PREFIX)]
    unknown = sorted(k for k in opts if k not in _KNOWN_OPTIONS and not k.startswith(_STORAGE_PREFIX))
    if unknown:
        raise StorageConfigError(
            f"{SOURCE_NAME}: unknown option(s) {unknown}; known: table, checkpoint, operator, state, "
            "keyGroupsPerPartition, keyGroups, storageOptions and storage.<fsspec option>"
        )
    root = opts.get("path")
    if not root:
        raise StorageConfigError(f"{SOURCE_NAME}: no snapshot root; pass it to load(), e.g. .load('/data/ckpt')")
    table = str(opts.get("table", "state")).strip().lower()
    if table not in ("state", "checkpoints"):
        raise StorageConfigError(f"{SOURCE_NAME}: option table={opts['table']!r}; use 'state' (default) or 'checkpoints'")

    checkpoint: int | None = None
    raw_cid = opts.get("checkpoint")
    if raw_cid is not None and str(raw_cid).strip().lower() not in ("", "latest"):
        try:
            checkpoint = int(str(raw_cid).strip())
        except ValueError:
            checkpoint = -1
        if checkpoint < 1:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option checkpoint={raw_cid!r}; use a checkpoint id (integer >= 1) or 'latest'"
            )

    per_partition: int | None = None
    raw_per = opts.get("keygroupsperpartition")
    if raw_per is not None and str(raw_per).strip().lower() != "auto":
        try:
            per_partition = int(str(raw_per).strip())
        except ValueError:
            per_partition = 0
        if per_partition < 1:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option keyGroupsPerPartition={raw_per!r}; use an integer >= 1 or 'auto'"
            )

    key_groups = _parse_key_groups(opts["keygroups"]) if opts.get("keygroups") not in (None, "") else None

    storage_options: dict[str, Any] = {}
    if opts.get("storageoptions") not in (None, ""):
        try:
            storage_options = json.loads(opts["storageoptions"])
        except ValueError as exc:
            raise StorageConfigError(f"{SOURCE_NAME}: option storageOptions is not JSON ({exc}); pass a JSON object") from exc
        if not isinstance(storage_options, dict):
            raise StorageConfigError(f"{SOURCE_NAME}: option storageOptions must be a JSON object, got {storage_options!r}")
    try:
        _merge(storage_options, parse_storage_options(storage_pairs))
    except ValueError as exc:
        raise StorageConfigError(f"{SOURCE_NAME}: {exc}; use .option('storage.<name>', value)") from exc

    operator = opts.get("operator")
    state = opts.get("state")
    # a relative path (given to spark.read...load() itself) is resolved where Spark plans the
    # read, so that the executors, in their own working directories, read the same root
    return _Options(root=absolute_url(str(root)), table=table, checkpoint=checkpoint,
                    operator=None if operator is None else str(operator),
                    state=None if state is None else str(state),
                    key_groups_per_partition=per_partition, key_groups=key_groups,
                    storage_options=storage_options)


def _merge(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _parse_key_groups(text: Any) -> frozenset[int]:
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            a, b = -1, -2
        if a < 0 or b < a:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option keyGroups={text!r}: {part!r} is not a key group or range; use e.g. '0-9,17'"
            )
        out.update(range(a, b + 1))
    if not out:
        raise StorageConfigError(
            f"{SOURCE_NAME}: option keyGroups={text!r} names no key group; use e.g. '0-9,17', or leave the option "
            "out to read them all"
        )
    return frozenset(out)
