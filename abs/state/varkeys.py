"""String and binary keys of the columnar store (:mod:`abs.state.columnar`), kept in Arrow's
layout in numpy arrays: ``offsets`` (key ``i`` is ``data[offsets[i]:offsets[i + 1]]``; int32
while the keys' bytes fit in 2 GiB, as Arrow's ``string`` has them, else int64) and ``data``
(uint8, the UTF-8 or raw bytes of every key, back to back).

* :class:`VarKeys`: an immutable run of such keys (the rows of a capture). Indexing with a
  slice gives keys of their own offsets over a view of the bytes (numpy pickles only the
  bytes a view spans, so a key group's rows sent to the writer process carry only their own
  keys); with an integer array, a gather (an Arrow ``take``: new buffers).
  :meth:`VarKeys.to_arrow` gives the ``string`` (``binary``) column a key group's table has,
  the type the dict backend writes for ``str`` (``bytes``) keys.
* :class:`VarKeyStore`: the store's keys by slot, appended a batch at a time (both arrays
  grow by doubling). Slots never change once written, so views of it stay valid. Its offsets
  are int32 until the bytes pass 2 GiB (then widened to int64 once): a restore of 5 M keys
  writes 20 MB less fresh memory (about 15 ms of the 0.45 s of CPU it takes).

Nothing here loops over keys in Python.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from abs.columns import pack_small_array, unpack_small_array
from abscore.native import NATIVE

__all__ = ["Gathered", "VarKeyStore", "VarKeys", "arrow_buffers", "var_key_kind"]

_INT32_MAX = 2**31 - 1


def var_key_kind(t: pa.DataType) -> str | None:
    """``"string"`` or ``"binary"`` for the Arrow key types the store holds (the dict backend
    turns their values into ``str``/``bytes`` keys), else None."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    return None


def arrow_buffers(arr: pa.Array, *, wide: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(int64 offsets, uint8 data) of a string/binary array (either offset width), without
    copying the bytes; the offsets need not start at 0. ``wide=False``: the offsets in the
    array's own width (int32 or int64), not copied either (5 M keys: 20 ms less)."""
    n = len(arr)
    bufs = arr.buffers()
    width = 8 if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type) else 4
    if bufs[1] is None:
        return np.zeros(n + 1, np.int64), np.zeros(0, np.uint8)
    offsets = np.frombuffer(bufs[1], np.int64 if width == 8 else np.int32, n + 1, arr.offset * width)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return (offsets.astype(np.int64, copy=False) if wide else offsets), data


def _large(kind: str) -> pa.DataType:
    return pa.large_string() if kind == "string" else pa.large_binary()


def _small(kind: str) -> pa.DataType:
    return pa.string() if kind == "string" else pa.binary()


class VarKeys:
    """An immutable run of string (or binary, ``kind``) keys; see the module docstring."""

    __slots__ = ("offsets", "data", "kind")

    def __init__(self, offsets: np.ndarray, data: np.ndarray, kind: str) -> None:
        self.offsets = offsets
        self.data = data
        self.kind = kind

    @classmethod
    def from_arrow(cls, arr: pa.Array, kind: str) -> VarKeys:
        offsets, data = arrow_buffers(arr)
        return cls(offsets, data, kind)

    def __reduce__(self) -> tuple:
        # a few keys (a small key group's) as bytes: numpy's pickling of the two arrays cost
        # ~16 us, most of what such a key group's trip to the writer process costs
        return _var_keys, (pack_small_array(self.offsets), pack_small_array(self.data), self.kind)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, idx: Any) -> VarKeys:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"VarKeys slices take a step of 1, not {step}")
            stop = max(start, stop)
            lo, hi = int(self.offsets[start]), int(self.offsets[stop])
            offsets = self.offsets[start:stop + 1]
            return VarKeys(offsets - lo if lo else offsets, self.data[lo:hi], self.kind)
        return VarKeys.from_arrow(self.arrow_view().take(pa.array(np.asarray(idx))), self.kind)

    def copy(self) -> VarKeys:
        """The keys never change: the copy is the object itself."""
        return self

    def arrow_view(self) -> pa.Array:
        """The keys as an Arrow array over these very buffers: ``string`` (``binary``) over
        int32 offsets, ``large_string`` (``large_binary``) over int64 ones."""
        t = _large(self.kind) if self.offsets.dtype == np.int64 else _small(self.kind)
        return pa.Array.from_buffers(t, len(self), [None, pa.py_buffer(self.offsets), pa.py_buffer(self.data)])

    def to_arrow(self) -> pa.Array:
        """The keys as a ``string`` (``binary``) array (offsets rebased to 0, the bytes shared)."""
        lo, hi = int(self.offsets[0]), int(self.offsets[-1])
        t = _small(self.kind)
        if hi - lo > _INT32_MAX:  # more than 2 GiB of keys: the cast names the overflow
            return self.arrow_view().cast(t)
        offsets = (self.offsets - lo).astype(np.int32, copy=False)
        return pa.Array.from_buffers(t, len(self), [None, pa.py_buffer(offsets), pa.py_buffer(self.data[lo:hi])])

    def tolist(self) -> list:
        """The keys as Python ``str`` (``bytes``) objects."""
        return self.to_arrow().to_pylist()


def _var_keys(offsets: Any, data: Any, kind: str) -> VarKeys:
    return VarKeys(unpack_small_array(offsets), unpack_small_array(data), kind)


class VarKeyStore:
    """The store's keys by slot (see the module docstring): ``store[:n]`` is a :class:`VarKeys`
    view of the first ``n``, ``store[slots]`` a gather."""

    __slots__ = ("offsets", "data", "n", "kind")

    def __init__(self, kind: str, capacity: int = 1024) -> None:
        self.kind = kind
        self.offsets = np.zeros(capacity + 1, np.int32)  # int64 once the bytes pass 2 GiB (_room)
        self.data = np.zeros(max(16, 8 * capacity), np.uint8)
        self.n = 0

    def _room(self, keys: int, nbytes: int, grow: bool) -> None:
        """Arrays of at least ``keys + 1`` offsets and ``nbytes`` bytes (``grow``: doubling);
        int64 offsets from more than 2 GiB of bytes on."""
        n = self.n
        end = int(self.offsets[n])
        wide = self.offsets.dtype == np.int64 or nbytes > _INT32_MAX
        if keys + 1 > len(self.offsets) or (wide and self.offsets.dtype != np.int64):
            size = max(keys + 1, 2 * len(self.offsets) if grow else len(self.offsets))
            grown = np.zeros(size, np.int64 if wide else np.int32)
            grown[:n + 1] = self.offsets[:n + 1]
            self.offsets = grown
        if nbytes > len(self.data):
            grown = np.zeros(max(nbytes, 2 * len(self.data)) if grow else nbytes, np.uint8)
            grown[:end] = self.data[:end]
            self.data = grown

    def append(self, arr: pa.Array) -> None:
        """Append the keys of a null-free string/binary array."""
        offsets, data = arrow_buffers(arr, wide=False)
        m = len(offsets) - 1
        n = self.n
        end = int(self.offsets[n])
        lo, hi = int(offsets[0]), int(offsets[-1])
        if n + m + 1 > len(self.offsets) or end + hi - lo > len(self.data) or end + hi - lo > _INT32_MAX:
            self._room(n + m, end + hi - lo, True)
        self.data[end:end + hi - lo] = data[lo:hi]
        out = self.offsets[n + 1:n + m + 1]
        if out.dtype == offsets.dtype:  # shifted in place, in the store's own width
            np.add(offsets[1:], out.dtype.type(end - lo), out=out)
        else:  # the bytes fit the width checked above
            np.add(offsets[1:], np.int64(end - lo), out=out, casting="unsafe")
        self.n = n + m

    def reserve(self, keys: int, nbytes: int) -> None:
        """Room for ``keys`` keys of ``nbytes`` bytes in all (appends past it still grow)."""
        self._room(keys, nbytes, False)

    def __len__(self) -> int:
        return self.n

    def view(self, n: int | None = None) -> VarKeys:
        """The first ``n`` keys (all by default), sharing the store's arrays."""
        n = self.n if n is None else n
        return VarKeys(self.offsets[:n + 1], self.data[:int(self.offsets[n])], self.kind)

    def __getitem__(self, idx: Any) -> VarKeys:
        return self.view()[idx]

    def arrow_view(self) -> pa.Array:
        """Every key as an Arrow array over the store's arrays (:meth:`VarKeys.arrow_view`; an
        append writes only past its end, or into new arrays: it stays valid)."""
        return self.view().arrow_view()

    def key(self, slot: int) -> Any:
        """The key of one slot as a Python ``str`` (``bytes``)."""
        raw = self.data[int(self.offsets[slot]):int(self.offsets[slot + 1])].tobytes()
        return raw.decode() if self.kind == "string" else raw


class Gathered:
    """``keys[order]`` (``order``: by key group) gathered a slice at a time, each key group's
    keys in ascending byte order: :meth:`sorted_slice` gives ``order[start:end]`` with every
    key group's run sorted by key, and the :class:`VarKeys` it gathers, made on first use and
    kept (a capture cut in chunks gathers each chunk's keys when it is cut; a store keeps this
    for the captures that follow while no key is added). The rows then reach the writer in
    the order storage writes them (``storage.tables.sort_by_key``: Arrow's order of strings
    and binaries), so the writer, which works on the other core while the worker cuts the
    next chunk, does not sort strings."""

    __slots__ = ("keys", "order", "_cut", "_reader")

    def __init__(self, keys: VarKeys, order: np.ndarray) -> None:
        self.keys = keys
        self.order = order
        self._cut: dict[tuple[int, int], tuple[np.ndarray, VarKeys]] = {}
        self._reader: _WordReader | None = None

    def __len__(self) -> int:
        return len(self.order)

    def sorted_slice(self, start: int, stop: int, runs: list[tuple[int, int, int]]) -> tuple[np.ndarray, VarKeys]:
        """``order[start:stop]`` with each of its ``runs`` (``(start, end, key group)``, from
        ``start``) sorted by key, and those keys."""
        got = self._cut.get((start, stop))
        if got is None:
            if self._reader is None:
                self._reader = _WordReader(self.keys)
            sub = self.order[start:stop].copy()  # int32 for a store's order: kept
            words: list | None = []
            lens = []
            for s, e, _ in runs:
                sub[s:e], run_words, run_lens = _sort_run(sub[s:e], self._reader)
                if words is not None and run_words is not None:
                    words.append(run_words)
                    lens.append(run_lens)
                else:
                    words = None
            if words:  # keys of up to 8 bytes: their sorted words are their bytes, no gather
                keys = _from_words(np.concatenate(words), np.concatenate(lens), self.keys.kind)
            else:
                keys = self.keys[sub]
            got = self._cut[(start, stop)] = (sub, keys)
        return got


def _from_words(words: np.ndarray, lens: np.ndarray, kind: str) -> VarKeys:
    """The keys of up to 8 bytes whose big-endian words (zero past their ends, see
    :meth:`_WordReader.words`) and lengths are given: one boolean selection of their bytes
    (a third of the time of Arrow's take of the same keys)."""
    data = words.byteswap().view(np.uint8).reshape(-1, 8)[np.arange(8) < lens[:, None]]
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return VarKeys(offsets, data, kind)


class _WordReader:
    """8 bytes of the keys from any position, as big-endian words (two aligned reads of a
    padded copy of the keys' bytes, shifted by the position modulo 8, as :func:`key_codes`)."""

    def __init__(self, keys: VarKeys) -> None:
        self.offsets = keys.offsets
        self.lo = lo = int(keys.offsets[0])
        size = int(keys.offsets[-1]) - lo
        buf = np.zeros((size + 23) // 8 * 8, np.uint8)  # two words to spare past every key
        buf[:size] = keys.data[lo:lo + size]
        self.aligned = buf.view("<u8")

    def spans(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the keys ``idx`` start (in the copy) and their lengths (int64: a store's
        offsets may be int32)."""
        starts = self.offsets[idx].astype(np.int64)
        lens = self.offsets[idx + 1] - starts
        starts -= self.lo
        return starts, lens

    def words(self, starts: np.ndarray, lens: np.ndarray, at: int) -> np.ndarray:
        """The 8 bytes from byte ``at`` of each key (zero past its end) as big-endian uint64:
        they compare as the bytes do."""
        aligned = self.aligned
        pos = starts + at if at else starts
        q = pos >> 3
        np.minimum(q, len(aligned) - 2, out=q)  # a key ending before ``at``: any word, masked to 0
        shift = pos & 7
        shift <<= 3
        shift = shift.view(np.uint64)
        word = aligned[q]
        word >>= shift
        q += 1
        high = aligned[q]
        high <<= _S1
        np.subtract(_S63, shift, out=shift)
        high <<= shift
        word |= high
        rest = lens - at
        np.clip(rest, 0, 8, out=rest)
        word &= _LOW_BYTES[rest]
        return word.byteswap(inplace=True)


def _sort_run(idx: np.ndarray, reader: _WordReader) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The keys ``idx`` sorted by their bytes, stably; with their first words (None when a
    key is longer than 8 bytes: the words do not hold the whole keys) and lengths in that order.

    A key compares as its bytes zero-padded to whole 8-byte words, then its length (equal
    padded bytes: the shorter key is a prefix of the longer). The bytes every key of the run
    begins with are skipped (``"customer-..."``), the next 8 sorted as big-endian integers,
    and only runs of keys still equal are sorted further, by their next word (then their
    length), in vectorized passes over those runs alone."""
    starts, lens = reader.spans(idx)
    words = reader.words(starts, lens, 0)
    whole = int(lens.max()) <= 8  # the first word tells (then the lengths)
    if not whole:
        skip = _common_prefix(words, lens)
        if skip:
            starts += skip
            lens -= skip
            words = reader.words(starts, lens, 0)
    local = np.argsort(words, kind="stable")  # timsort: fast on keys that came in order
    ordered = words[local]
    tie = ordered[1:] == ordered[:-1]
    if tie.any():
        _break_ties(local, tie, reader, starts, lens)
        ordered = words[local]
    return idx[local], ordered if whole else None, lens[local]


def _common_prefix(words: np.ndarray, lens: np.ndarray) -> int:
    """How many of their first 8 bytes (``words``, see :meth:`_WordReader.words`) all keys
    begin with (the same bytes; at most the shortest key's length)."""
    diff = int((words ^ words[0]).max())
    # big-endian words: the largest difference has the highest first differing bit
    same = 8 if not diff else (64 - diff.bit_length()) // 8
    return min(same, int(lens.min()))


def _break_ties(order: np.ndarray, tie: np.ndarray, reader: _WordReader, starts: np.ndarray,
                lens: np.ndarray) -> None:
    """Sort, in place in ``order`` (indices into ``starts`` and ``lens``), the runs of keys
    whose first words are equal (``tie[i]``: positions ``i`` and ``i + 1`` of ``order`` are),
    by their next words, then their lengths (stably: equal keys keep their order)."""
    at = 8
    pos = np.arange(len(order))  # positions in ``order`` of the keys ``tie`` compares
    while True:
        new = np.ones(len(pos), bool)
        new[1:] = ~tie
        runs = np.cumsum(new)
        tied = np.zeros(len(pos), bool)
        tied[1:] = tie
        tied[:-1] |= tie
        pos, run = pos[tied], runs[tied]
        idx = order[pos]
        longer = lens[idx] > at
        last = not longer.any()
        key = lens[idx] if last else reader.words(starts[idx], lens[idx], at)
        sub = np.lexsort((key, run))  # the runs keep their places: ``run`` is ascending
        order[pos] = idx[sub]
        if last:
            return  # equal words, then the lengths: in order (equal keys: as they came)
        key = key[sub]
        tie = (key[1:] == key[:-1]) & (run[1:] == run[:-1])
        if not tie.any():
            return
        at += 8


# ----------------------------------------------------------------------------- index codes

_LOW_BYTES = np.array([(1 << (8 * i)) - 1 for i in range(9)], np.uint64)  # mask of the first i bytes
_SHORT = 7  # keys up to this many bytes get an exact code
_LEN_SHIFT = np.uint64(56)
_HASHED = np.uint64(1 << 63)
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_S1, _S3, _S29, _S31, _S32, _S63 = (np.uint64(x) for x in (1, 3, 29, 31, 32, 63))


def key_codes(arr: pa.Array, out: np.ndarray | None = None, *, rows: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """The int64 code the store's index holds for each key of a null-free string/binary array,
    and the rows whose code is a hash (None: none is).

    A key of up to 7 bytes is its own code: its bytes (little-endian, in the low 56 bits) and
    its length (in the top byte, 0..7), so two such keys never share a code. A longer key's
    code is a 63-bit hash of its 8-byte words and length (the top bit set, so it never equals
    a short key's code): two long keys may share one, which the caller must check. Computed
    column-wise (a key's ``j``-th word is two aligned 8-byte reads of a copy of the bytes,
    shifted by the key's offset modulo 8), nothing per key in Python. The codes live only in
    memory (the index); nothing on disk depends on them.

    ``out``: a contiguous int64 array of ``len(arr)`` the codes are written to (and returned):
    a restore writes them straight into the store's keys; ``rows=False``: the rows whose code
    is a hash are not wanted (None in their place)."""
    if out is not None and NATIVE is None:  # the column-wise codes below are new arrays
        codes, long = key_codes(arr)
        out[:] = codes
        return out, long
    offsets, data = arrow_buffers(arr, wide=NATIVE is None)  # the C loop reads either width
    n = len(offsets) - 1
    if not n:
        return np.zeros(0, np.int64) if out is None else out, None
    if NATIVE is not None:  # the same codes from one C loop (abscore.native)
        codes = np.empty(n, np.int64) if out is None else out
        if not NATIVE.key_codes(offsets, data, codes) or not rows:
            return codes, None
        return codes, np.diff(offsets) > _SHORT
    lo, hi = int(offsets[0]), int(offsets[-1])
    buf = np.zeros((hi - lo + 23) // 8 * 8, np.uint8)  # aligned, and a word to spare past every key
    buf[:hi - lo] = data[lo:hi]
    aligned = buf.view("<u8")
    starts = offsets[:-1] - lo
    lens = offsets[1:] - offsets[:-1]
    longest = int(lens.max())
    q = starts >> 3
    shift = (starts & 7).astype(np.uint64) << _S3
    back = _S63 - shift  # the next word moves up by 64 - shift bits: by 1, then 63 - shift
    nxt = aligned[q]

    def word() -> np.ndarray:
        nonlocal q, nxt
        cur = nxt
        q = q + 1
        nxt = aligned[np.minimum(q, len(aligned) - 1)]
        return (cur >> shift) | ((nxt << _S1) << back)

    ulens = lens.astype(np.uint64)
    first = word() & _LOW_BYTES[np.minimum(lens, 8)]
    if longest <= _SHORT:
        return (first | (ulens << _LEN_SHIFT)).view(np.int64), None
    h = (ulens + _M1) * _M2
    h ^= first
    h *= _M3
    h ^= h >> _S32
    for j in range(8, longest, 8):
        mixed = h ^ (word() & _LOW_BYTES[np.clip(lens - j, 0, 8)])
        mixed *= _M2
        mixed ^= mixed >> _S29
        going = lens > j  # a key's code must not depend on the other keys' lengths
        if going.all():
            h = mixed
        else:
            np.copyto(h, mixed, where=going)
    h ^= h >> _S31  # finalize (SplitMix64's)
    h *= _M3
    h ^= h >> _S32
    h |= _HASHED
    long = lens > _SHORT
    if long.all():
        return h.view(np.int64), long
    return np.where(long, h, first | (ulens << _LEN_SHIFT)).view(np.int64), long
