"""Values images (format 4): a delta without ``key`` that gives new values for the rows of
its chain's base, positionally, with :data:`META_KEYS_DIGEST` naming the base's keys."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from abscore.schema import KEY_COLUMN, META_KEYS_DIGEST, OP_COLUMN

from .checksums import WRITE_CHECKSUM_ALGORITHM, checksum_hex
from .tables import has_deletes, sort_by_key

__all__ = [
    "keys_digest",
    "strictly_increasing",
    "is_values_image",
    "values_image",
]


def keys_digest(keys: pa.ChunkedArray | pa.Array, algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> str | None:
    """``<algorithm>:<hex digest>`` of an int64 key column without nulls (its values as
    little-endian 8-byte integers), or ``None`` for any other column."""
    if not pa.types.is_int64(keys.type) or keys.null_count:
        return None
    data = np.ascontiguousarray(keys.to_numpy(), dtype="<i8")
    return f"{algorithm}:{checksum_hex(memoryview(data).cast('B'), algorithm)}"


def strictly_increasing(k: np.ndarray) -> bool:
    """Whether the integer array ``k`` strictly increases. Counting violations, not
    ``np.all()``: no numpy reduction, whose Python-level wrapper costs several times the
    comparison on a key group's few thousand keys."""
    return not np.count_nonzero(k[1:] <= k[:-1])


def is_values_image(table: pa.Table) -> bool:
    """Whether a state file's table is a values image: a delta without a ``key`` column."""
    return KEY_COLUMN not in table.schema.names


def values_image(image: pa.Table) -> pa.Table | None:
    """The table a *values image* stores for ``image``, a key group's full image (``key``,
    value columns, ``op`` absent or all upserts) whose keys are exactly those of the chain's
    base: the value columns alone, rows in ascending key order, so that row ``i`` holds the
    values of the base's row ``i``, and :data:`META_KEYS_DIGEST` naming those keys.

    Why: a state whose keys stay the same while every value changes (counters of a fixed key
    set) would otherwise write the same keys again at every checkpoint; the keys are about
    half of such a file's bytes and of the zstd work. ``None`` when the image does not
    qualify: keys not int64, not unique, or null."""
    if OP_COLUMN in image.schema.names:
        if has_deletes(image.column(OP_COLUMN)):
            return None
        image = image.drop_columns([OP_COLUMN])
    keys = image.column(KEY_COLUMN)
    if not pa.types.is_int64(keys.type) or keys.null_count:
        return None
    if not strictly_increasing(keys.to_numpy()):  # the writer's images come sorted
        image = sort_by_key(image)
        keys = image.column(KEY_COLUMN)
        if not strictly_increasing(keys.to_numpy()):
            return None  # repeated keys: rows cannot stand for the base's rows one to one
    digest = keys_digest(keys)
    if digest is None:
        return None
    meta = dict(image.schema.metadata or {})
    meta[META_KEYS_DIGEST] = digest.encode()
    return image.drop_columns([KEY_COLUMN]).replace_schema_metadata(meta)
