"""The documented stable hash of keys: identical in every process, machine and Python.

Key groups (:mod:`abscore.keygroups`) are ``stable_hash(key) mod max_parallelism``; snapshots
on disk are laid out by them, so this hash must never change (``tests/test_abscore.py`` holds
a fixed vector of keys and their key groups, ``tests/test_keygroups.py`` golden hashes and a
reference implementation).

The stable hash
===============

``stable_hash(key)`` is an unsigned 64-bit integer that is identical in every process, on
every machine and under every Python version (Python's own ``hash()`` is salted per process
for ``str``/``bytes`` and must never be used).  It is specified here precisely enough to be
re-implemented in another language (a pure-Python reference lives in
``tests/test_keygroups.py``).  All arithmetic is on unsigned 64-bit integers (mod 2**64).

``fmix64(x)``, the MurmurHash3 64-bit finalizer::

    x ^= x >> 33
    x  = x * 0xFF51AFD7ED558CCD  (mod 2**64)
    x ^= x >> 33
    x  = x * 0xC4CEB9FE1A85EC53  (mod 2**64)
    x ^= x >> 33

``bytes rule(b)`` for a byte string ``b``::

    fmix64((crc32(b) << 32) | (len(b) & 0xFFFFFFFF))

where ``crc32`` is CRC-32/ISO-HDLC as computed by zlib (reflected polynomial 0xEDB88320,
init and xor-out 0xFFFFFFFF; the same as Java's ``java.util.zip.CRC32`` and Go's
``crc32.ChecksumIEEE``), an unsigned 32-bit value.

Rules, by the type of the key (``bool`` counts as the integer 0 or 1, like Python does):

* **int** ``k`` with ``-2**63 <= k < 2**63``: ``fmix64(k mod 2**64)`` (two's complement).
* **int** outside that range: the bytes rule on the ASCII decimal ``str(k)``
  (e.g. ``b"-9223372036854775809"``).
* **float** ``f`` that is finite and integral (``f == floor(f)``, including ``-0.0``): hashed
  exactly as the int ``int(f)`` (so ``1.0`` and ``1`` agree, as they do as dict keys; this
  holds at every magnitude: ``1e20`` hashes like ``10**20``).  NaN: ``fmix64(0x7FF8000000000000)``
  (every NaN payload is canonicalised).  Any other float (fractional, ``inf``, ``-inf``):
  ``fmix64`` of its IEEE-754 binary64 bit pattern read as an unsigned 64-bit integer.
* **str**: the bytes rule on its UTF-8 encoding (lone surrogates encoded with
  ``surrogatepass``).  A ``str`` and the ``bytes`` of its UTF-8 encoding therefore collide,
  which is harmless: equal hashes only put keys in the same key group.
* **bytes**, **bytearray**, **memoryview**: the bytes rule on the raw bytes.
* **None**: the constant ``NONE_HASH = fmix64(0x4E6F6E65)`` (``0x4E6F6E65`` is ``b"None"``
  read big-endian), i.e. ``0x8AB1B3B56552EE35``.  Nulls in Arrow arrays hash the same.
* **tuple** ``(e_1, ..., e_n)``::

      h = TUPLE_SEED                               # 0x243F6A8885A308D3
      for e in elements:
          h = fmix64(h ^ ((stable_hash(e) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) mod 2**64))
      h = fmix64(h ^ n)

  Elements are hashed recursively by these same rules, so tuples nest.
* numpy scalars are hashed as the Python value they stand for (``numpy.int64(3)`` as ``3``,
  ``numpy.float32(0.5)`` as ``0.5``, ``numpy.bool_`` as 0/1).
* Anything else (list, dict, datetime, Decimal, custom objects...) raises ``TypeError``: convert
  the key to an int, str, bytes or a tuple of those first.

Vectorised hashing (:func:`stable_hashes`, and :func:`abscore.keygroups.key_groups` on it) gives
exactly the same values; integer arrays are hashed with numpy ``uint64`` arithmetic, string and
binary arrays of values up to 64 bytes column-wise with numpy too (CRC-32 by its byte table,
one pass per byte position), longer ones by dictionary-encoding them and hashing each distinct
value once with zlib.
"""
from __future__ import annotations

import struct
import sys
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from .native import NATIVE

__all__ = ["NONE_HASH", "TUPLE_SEED", "fmix64", "stable_hash", "stable_hashes"]

_MASK64 = 0xFFFFFFFFFFFFFFFF
_MASK32 = 0xFFFFFFFF
_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
_GOLDEN = 0x9E3779B97F4A7C15
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_CANONICAL_NAN_BITS = 0x7FF8000000000000
TUPLE_SEED = 0x243F6A8885A308D3
"""Initial value of the tuple fold (the first 64 fraction bits of pi)."""

_crc32 = zlib.crc32
_pack_double = struct.Struct("<d").pack
_unpack_u64 = struct.Struct("<Q").unpack


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer of ``x mod 2**64``; a bijection on uint64."""
    x &= _MASK64
    x ^= x >> 33
    x = (x * _C1) & _MASK64
    x ^= x >> 33
    x = (x * _C2) & _MASK64
    x ^= x >> 33
    return x


NONE_HASH = fmix64(0x4E6F6E65)
"""``stable_hash(None)``; also the hash of a null in an Arrow array."""

def _bytes_rule(b: bytes | bytearray) -> int:
    return fmix64((_crc32(b) << 32) | (len(b) & _MASK32))


def _int_rule(k: int) -> int:
    if _INT64_MIN <= k <= _INT64_MAX:
        return fmix64(k)
    return _bytes_rule(str(k).encode("ascii"))


def _float_rule(f: float) -> int:
    if f.is_integer():
        return _int_rule(int(f))
    if f != f:
        return fmix64(_CANONICAL_NAN_BITS)
    return fmix64(_unpack_u64(_pack_double(f))[0])


def _tuple_rule(t: tuple) -> int:
    h = TUPLE_SEED
    for e in t:
        h = fmix64(h ^ ((stable_hash(e) + _GOLDEN + (h << 6) + (h >> 2)) & _MASK64))
    return fmix64(h ^ len(t))


def stable_hash(key: Any) -> int:
    """The documented stable 64-bit hash of ``key`` (see the module docstring).

    Raises ``TypeError`` for keys that are not int, float, str, bytes-like, None or a tuple of
    those.
    """
    t = type(key)
    if t is int:
        if _INT64_MIN <= key <= _INT64_MAX:
            return fmix64(key)
        return _bytes_rule(str(key).encode("ascii"))
    if t is str:
        b = key.encode("utf-8", "surrogatepass")
        return fmix64((_crc32(b) << 32) | (len(b) & _MASK32))
    if t is bytes:
        return fmix64((_crc32(key) << 32) | (len(key) & _MASK32))
    if t is tuple:
        return _tuple_rule(key)
    if t is float:
        return _float_rule(key)
    if key is None:
        return NONE_HASH
    return _stable_hash_other(key)


def _stable_hash_other(key: Any) -> int:
    # Slow path: subclasses, bool, numpy scalars, bytearray/memoryview.
    if isinstance(key, (bool, np.bool_)):
        return fmix64(1 if key else 0)
    if isinstance(key, (int, np.integer)):
        return _int_rule(int(key))
    if isinstance(key, (float, np.floating)):
        return _float_rule(float(key))
    if isinstance(key, str):
        return _bytes_rule(str.encode(key, "utf-8", "surrogatepass"))
    if isinstance(key, (bytes, bytearray)):
        return _bytes_rule(key)
    if isinstance(key, memoryview):
        return _bytes_rule(key.tobytes())
    if isinstance(key, tuple):
        return _tuple_rule(key)
    raise TypeError(
        f"key {key!r} of type {type(key).__module__}.{type(key).__qualname__} has no stable "
        "hash; use a key of type int, str, bytes or a tuple of those (convert it in the "
        "key function)"
    )


# --------------------------------------------------------------------------- vectorised


_U33 = np.uint64(33)
_UC1 = np.uint64(_C1)
_UC2 = np.uint64(_C2)


def _fmix64_np(x: np.ndarray) -> np.ndarray:
    """fmix64 in place on a uint64 array (numpy uint64 multiplication wraps mod 2**64)."""
    x ^= x >> _U33
    x *= _UC1
    x ^= x >> _U33
    x *= _UC2
    x ^= x >> _U33
    return x


def _hash_int64_np(v: np.ndarray) -> np.ndarray:
    return _fmix64_np(v.astype(np.int64, copy=True).view(np.uint64))


def _hash_uint64_np(v: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(v, dtype=np.uint64)
    out = _fmix64_np(v.copy())
    big = v > np.uint64(_INT64_MAX)
    if big.any():
        idx = np.flatnonzero(big)
        out[idx] = np.fromiter(
            (_int_rule(int(x)) for x in v[idx]), dtype=np.uint64, count=len(idx)
        )
    return out


def _hash_float64_np(v: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(v, dtype=np.float64)
    out = v.copy().view(np.uint64)
    with np.errstate(invalid="ignore"):
        integral = np.isfinite(v) & (np.floor(v) == v)
        in_range = integral & (v >= -(2.0**63)) & (v < 2.0**63)
    out[np.isnan(v)] = np.uint64(_CANONICAL_NAN_BITS)
    out[in_range] = v[in_range].astype(np.int64).view(np.uint64)
    _fmix64_np(out)
    big = integral & ~in_range
    if big.any():
        idx = np.flatnonzero(big)
        out[idx] = np.fromiter(
            (_int_rule(int(x)) for x in v[idx]), dtype=np.uint64, count=len(idx)
        )
    return out


def _hash_numeric_np(v: np.ndarray) -> np.ndarray:
    kind = v.dtype.kind
    if kind == "b":
        return _fmix64_np(v.astype(np.uint64))
    if kind == "i":
        return _hash_int64_np(v)
    if kind == "u":
        if v.dtype.itemsize < 8:
            return _fmix64_np(v.astype(np.uint64))
        return _hash_uint64_np(v)
    if kind == "f":
        return _hash_float64_np(v)
    raise AssertionError(kind)  # pragma: no cover


def _crc32_table() -> np.ndarray:
    """The byte-wise table of CRC-32/ISO-HDLC (reflected polynomial 0xEDB88320), as zlib's."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint32(1)) ^ np.uint32(0xEDB88320), t >> np.uint32(1))
    return t


_CRC32_TABLE = _crc32_table()
# Values up to this many bytes are hashed column-wise with numpy (one pass per byte
# position over the values that long); longer ones with zlib, one Python call each.
_VECTOR_CRC_MAX_LEN = 64
_LOW_BYTE = 0 if sys.byteorder == "little" else 3  # of a uint32 in memory


def _hash_distinct_bytes(values: pa.Array) -> np.ndarray:
    """Bytes rule on each value of a (null-free) binary/large_binary array."""
    got = _hash_short_bytes(values)
    if got is not None:
        return got
    crc = _crc32
    return _fmix64_np(
        np.fromiter(
            ((crc(b) << 32) | (len(b) & _MASK32) for b in values.to_pylist()),
            dtype=np.uint64,
            count=len(values),
        )
    )


def _hash_short_bytes(values: pa.Array) -> np.ndarray | None:
    """Bytes rule on each value slot of a binary/large_binary array, computed column-wise
    (CRC-32 with its byte table, one numpy pass per byte position over the values at least
    that long); ``None`` when a slot is longer than ``_VECTOR_CRC_MAX_LEN`` bytes. A null
    slot gets the hash of the bytes it spans (the caller overwrites it). With the C module
    (:mod:`abscore.native`): one loop over the bytes, any length (~2 ns a byte).

    The values are put longest first (a radix sort of their lengths; none when they are all
    as long), so that the values still going at each byte position are a prefix; each pass
    works in place on that prefix: the CRC's low byte read through a byte view, the byte of
    each value taken at its running position (8192 keys of 6 bytes: ~30 ns a key, from ~45
    with a comparison sort and a new array per operation)."""
    n = len(values)
    width = 8 if pa.types.is_large_binary(values.type) else 4
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64 if width == 8 else np.int32,
                            count=n + 1, offset=values.offset * width) if n else np.zeros(1, np.int64)
    if NATIVE is not None and n:  # the same hashes from one C loop (abscore.native)
        out = np.empty(n, np.uint64)
        data_buffer = values.buffers()[2]
        NATIVE.bytes_hashes(offsets, data_buffer if data_buffer is not None else b"", out)
        return out
    lengths = np.diff(offsets)
    longest = int(lengths.max()) if n else 0
    if longest > _VECTOR_CRC_MAX_LEN:
        return None
    data_buffer = values.buffers()[2] if n else None
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    if n == 0 or int(lengths.min()) == longest:
        order = None
        pos = offsets[:-1].astype(np.intp)  # each value's next byte
        longer = np.full(longest + 1, n, dtype=np.intp)
    else:
        order = np.argsort((longest - lengths).astype(np.uint8), kind="stable")  # lengths <= 64: a radix sort
        pos = offsets[:-1].astype(np.intp)[order]
        longer = np.cumsum(np.bincount(lengths, minlength=longest + 1)[::-1])[::-1]  # longer[j]: values >= j bytes
    crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    low = crc.view(np.uint8)[_LOW_BYTE::4]  # the low byte of each CRC
    table = _CRC32_TABLE
    for j in range(longest):
        k = int(longer[j + 1])
        c, p = crc[:k], pos[:k]
        step = table.take(low[:k] ^ data.take(p))
        c >>= np.uint32(8)
        c ^= step
        p += 1
    crc ^= np.uint32(0xFFFFFFFF)
    packed = crc.astype(np.uint64)
    packed <<= np.uint64(32)
    if order is None:
        out = packed
    else:
        out = np.empty(n, dtype=np.uint64)
        out[order] = packed
    out |= lengths.astype(np.uint64)
    return _fmix64_np(out)


def _hash_arrow_dictionary(arr: pa.Array) -> np.ndarray:
    dict_hashes = _hash_arrow(arr.dictionary)
    indices = arr.indices
    idx = indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.intp, copy=False)
    if len(dict_hashes) == 0:
        return np.full(len(arr), NONE_HASH, dtype=np.uint64)
    return dict_hashes[idx]


def _hash_arrow(arr: pa.Array) -> np.ndarray:
    """uint64 hashes of a pyarrow Array; nulls get NONE_HASH."""
    t = arr.type
    n = len(arr)
    if pa.types.is_dictionary(t):
        out = _hash_arrow_dictionary(arr)
    elif pa.types.is_null(t):
        return np.full(n, NONE_HASH, dtype=np.uint64)
    elif (
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    ):
        if pa.types.is_floating(t) and not pa.types.is_float64(t):
            arr = arr.cast(pa.float64())
        filled = arr.fill_null(False if pa.types.is_boolean(arr.type) else 0) if arr.null_count else arr
        out = _hash_numeric_np(filled.to_numpy(zero_copy_only=False))
    elif (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or _is_type(t, "is_string_view")
        or _is_type(t, "is_binary_view")
    ):
        if pa.types.is_fixed_size_binary(t) or _is_type(t, "is_binary_view"):
            arr = arr.cast(pa.binary())
        elif _is_type(t, "is_string_view"):
            arr = arr.cast(pa.string())
        large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
        target = pa.large_binary() if large else pa.binary()
        direct = _hash_short_bytes(arr.cast(target))  # short values: every slot, no dictionary
        if direct is not None:
            out = direct
        else:
            encoded = arr.dictionary_encode()
            dict_hashes = _hash_distinct_bytes(encoded.dictionary.cast(target))
            if len(dict_hashes) == 0:
                return np.full(n, NONE_HASH, dtype=np.uint64)
            idx = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
            out = dict_hashes[idx.astype(np.intp, copy=False)]
    else:
        raise TypeError(
            f"key column of Arrow type {t} has no stable hash; cast it to int64, string or "
            "binary (or a struct's fields to a tuple) before keying"
        )
    if arr.null_count:
        out[arr.is_null().to_numpy(zero_copy_only=False)] = np.uint64(NONE_HASH)
    return out


def _is_type(t: pa.DataType, predicate: str) -> bool:
    """``pa.types.<predicate>(t)``, False on pyarrow versions without that predicate."""
    check = getattr(pa.types, predicate, None)
    return bool(check is not None and check(t))


def _hash_python_list(keys: list) -> np.ndarray:
    types = set(map(type, keys))
    types.discard(type(None))
    arrow_type = None
    if len(types) == 1:
        (only,) = types
        arrow_type = {
            int: pa.int64(),
            str: pa.string(),
            bytes: pa.binary(),
            float: pa.float64(),
            bool: pa.bool_(),
        }.get(only)
    if arrow_type is not None:
        try:
            return _hash_arrow(pa.array(keys, type=arrow_type))
        except (OverflowError, UnicodeEncodeError, pa.ArrowInvalid, pa.ArrowTypeError):
            pass  # ints beyond int64, lone surrogates: hash element by element below
    return np.fromiter(map(stable_hash, keys), dtype=np.uint64, count=len(keys))


def stable_hashes(keys: Any) -> np.ndarray:
    """``stable_hash`` of every key, as a ``numpy.uint64`` array, vectorised.

    ``keys`` may be a pyarrow ``Array`` or ``ChunkedArray`` (integer, unsigned, floating,
    boolean, string, large_string, binary, large_binary, dictionary of those; nulls hash as
    ``None``), a 1-D numpy array, or any iterable of keys (lists of a single type are converted
    to Arrow; mixed lists are hashed element by element).
    """
    if isinstance(keys, pa.ChunkedArray):
        if keys.num_chunks == 1:
            return _hash_arrow(keys.chunk(0))
        return _hash_arrow(keys.combine_chunks())
    if isinstance(keys, pa.Array):
        return _hash_arrow(keys)
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ValueError(
                f"key array has shape {keys.shape}; key_groups needs a 1-D array of keys"
            )
        kind = keys.dtype.kind
        if kind in "biuf":
            return _hash_numeric_np(keys)
        if kind in "US":
            return _hash_arrow(pa.array(keys))
        if kind == "O":
            return _hash_python_list(keys.tolist())
        raise TypeError(
            f"numpy key array of dtype {keys.dtype} has no stable hash; convert it to "
            "int64, str or bytes first"
        )
    if not isinstance(keys, list):
        keys = list(keys)
    return _hash_python_list(keys)
