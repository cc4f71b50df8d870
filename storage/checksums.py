"""Checksums of state files and manifests: the algorithms a manifest may name, the one new
files are written with, and hex digests.

Format 1 files are checksummed with SHA-256 (their manifests name no algorithm); format 2 and
later name the algorithm in each file reference (:data:`CHECKSUM_ALGORITHMS`).
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable

from .errors import StorageConfigError

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "WRITE_CHECKSUM_ALGORITHM",
    "checksum_hex",
    "is_checksum",
    "sha256_hex",
]


def _xxh3_128() -> Callable[[bytes | memoryview], str] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_128_hexdigest


_XXH3_128 = _xxh3_128()

CHECKSUM_ALGORITHMS: dict[str, int] = {"sha256": 64, "blake2b_256": 64, "xxh3_128": 32}
"""Checksum algorithms a manifest may name, with the length of their lower-case hex digest."""

WRITE_CHECKSUM_ALGORITHM = "xxh3_128" if _XXH3_128 is not None else "blake2b_256"
"""What new files are checksummed with: XXH3-128 (~30x faster than SHA-256) when the
``xxhash`` package is installed, else BLAKE2b-256 from the standard library (~2-3x faster)."""


def checksum_hex(data: bytes | memoryview, algorithm: str) -> str:
    """Lower-case hex digest of ``data`` with ``algorithm`` (a key of :data:`CHECKSUM_ALGORITHMS`)."""
    if algorithm == "xxh3_128":
        if _XXH3_128 is None:
            raise StorageConfigError(
                "this file's checksum is XXH3-128, and the 'xxhash' package is not installed; "
                "pip install xxhash to verify it"
            )
        return _XXH3_128(data)
    if algorithm == "blake2b_256":
        return hashlib.blake2b(data, digest_size=32).hexdigest()
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise StorageConfigError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(CHECKSUM_ALGORITHMS)}")


def is_checksum(value: object, algorithm: object) -> bool:
    """True when ``value`` is a well-formed hex digest of the named algorithm."""
    length = CHECKSUM_ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    return (length is not None and isinstance(value, str) and len(value) == length
            and _LOWER_HEX.fullmatch(value) is not None)


_LOWER_HEX = re.compile(r"[0-9a-f]*")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
