"""Key groups: the documented stable hash (golden values, a reference implementation),
vectorised hashing equal to the scalar one, and Flink's key-group ranges."""
from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import struct
import subprocess
import sys
from array import array
from datetime import datetime
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.errors import ConfigError
from abs.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    NONE_HASH,
    KeyGroupRange,
    check_max_parallelism,
    fmix64,
    key_group,
    key_group_range,
    key_groups,
    routing_table,
    stable_hash,
    stable_hashes,
    subtask_for_key_group,
)

M = DEFAULT_MAX_PARALLELISM

# ---------------------------------------------------------------- reference implementation
# Written from the module docstring only: its own CRC-32 (bit by bit from the polynomial),
# its own fmix64, big-endian struct for the float bit pattern.


def ref_crc32(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def ref_fmix64(x: int) -> int:
    x %= 2**64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) % 2**64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) % 2**64
    x ^= x >> 33
    return x


def ref_bytes(b: bytes) -> int:
    return ref_fmix64((ref_crc32(b) << 32) | (len(b) % 2**32))


def ref_int(k: int) -> int:
    if -(2**63) <= k < 2**63:
        return ref_fmix64(k % 2**64)
    return ref_bytes(str(k).encode("ascii"))


def ref_hash(k) -> int:
    if k is None:
        return ref_fmix64(int.from_bytes(b"None", "big"))
    if isinstance(k, bool):
        return ref_int(int(k))
    if isinstance(k, int):
        return ref_int(k)
    if isinstance(k, float):
        if k != k:
            return ref_fmix64(0x7FF8000000000000)
        if k not in (float("inf"), float("-inf")) and k == int(k):
            return ref_int(int(k))
        return ref_fmix64(struct.unpack(">Q", struct.pack(">d", k))[0])
    if isinstance(k, str):
        return ref_bytes(k.encode("utf-8"))
    if isinstance(k, (bytes, bytearray)):
        return ref_bytes(bytes(k))
    if isinstance(k, tuple):
        h = 0x243F6A8885A308D3
        for e in k:
            h = ref_fmix64(h ^ ((ref_hash(e) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) % 2**64))
        return ref_fmix64(h ^ len(k))
    raise TypeError(type(k))


def test_reference_crc32_matches_the_standard_check_value():
    assert ref_crc32(b"123456789") == 0xCBF43926


# ---------------------------------------------------------------- golden values
# (key, stable_hash, key group for M=128), computed once with the reference above and
# pinned: a change here breaks every stored snapshot's key-group layout.

GOLDEN_INT = [
    (0, 0x0000000000000000, 0),
    (1, 0xB456BCFC34C2CB2C, 44),
    (-1, 0x64B5720B4B825F21, 33),
    (2, 0x3ABF2A20650683E7, 103),
    (7, 0x740729CBE468D1DD, 93),
    (42, 0x810879608E4259CC, 76),
    (127, 0x8ABCB2AF1B4948A3, 35),
    (128, 0x717F5C0E8B9C9AE6, 102),
    (1000, 0xAF002C114878DA41, 65),
    (-1000, 0xCEC5AE53E341A34C, 76),
    (123456789, 0x8F7C29206384F886, 6),
    (-987654321, 0xFBA9F484A0794940, 64),
    (2147483647, 0x8A662C1A93A26B91, 17),
    (2147483648, 0xE3BECA1F9A7E4886, 6),
    (4294967296, 0xBA3A9E160A5F1419, 25),
    (9007199254740993, 0x8E42BDEC3C281F79, 121),
    (9223372036854775807, 0xABB93DF0A930EDEA, 106),
    (-9223372036854775808, 0x8F780810AF31A493, 19),
    (1000000000000000, 0x7214C79F1439D322, 34),
    (31337, 0x43F9A6B665BC649B, 27),
]
GOLDEN_BIG_INT = [
    (9223372036854775808, 0x6237C278228502B2, 50),
    (-9223372036854775809, 0xE8FECE28283834A1, 33),
    (18446744073709551616, 0x2D440CD814BE527B, 123),
    (18446744073709551615, 0x67BDC9F29E0624E9, 105),
    (100000000000000000000, 0x8217179017914900, 0),
    (-1000000000000000000000000000000, 0x55D73CC816AA83E0, 96),
    (1267650600228229401496703205376, 0x4F152530A60A66FB, 123),
    (12345678901234567890123, 0x23C2664EA854A1F5, 117),
]
GOLDEN_BOOL = [
    (True, 0xB456BCFC34C2CB2C, 44),
    (False, 0x0000000000000000, 0),
]
GOLDEN_FLOAT = [
    (0.5, 0xB4C9FA8A0E054925, 37),
    (-0.5, 0x3E65EDEAB567B7BB, 59),
    (1.25, 0x243408AA1D840671, 113),
    (3.141592653589793, 0x45055867028FD9E1, 97),
    (-2.718281828459045, 0x85F2F19047DDE5DC, 92),
    (1e-300, 0xDB6E308B784953D8, 88),
    (1e+300, 0x66618E34A296CAAA, 42),
    (0.1, 0x34DBB082ADD277C2, 66),
    (5e-324, 0xB456BCFC34C2CB2C, 44),
    (float("inf"), 0xD58A530C45F9A43F, 63),
    (float("-inf"), 0x89EF6CBC29D7ACF9, 121),
    (float("nan"), 0xE290595F58053B85, 5),
    (123.456, 0xB743CE8FF610973A, 58),
    (-1e-05, 0xC57EA18F66F3951C, 28),
    (6.02214076e+23, 0xD2D6EFB7490DDAC9, 73),
    (2.5e-10, 0x1A32DC653C385C24, 36),
    (9.999, 0x8944515447C2EFC5, 69),
    (0.3, 0xD5473549F89FFFCD, 77),
    (1.5, 0x885DCC874E75B6F0, 112),
    (-7.75, 0x39086AF5A917813D, 61),
]
GOLDEN_INTEGRAL_FLOAT = [
    (0.0, 0x0000000000000000, 0),
    (-0.0, 0x0000000000000000, 0),
    (1.0, 0xB456BCFC34C2CB2C, 44),
    (-1.0, 0x64B5720B4B825F21, 33),
    (128.0, 0x717F5C0E8B9C9AE6, 102),
    (4.611686018427388e+18, 0x6554A70955A989A0, 32),
    (-9.223372036854776e+18, 0x8F780810AF31A493, 19),
    (9.223372036854776e+18, 0x6237C278228502B2, 50),
    (1e+20, 0x8217179017914900, 0),
    (4503599627370496.0, 0x85CA78479C342EC1, 65),
]
GOLDEN_STR = [
    ('', 0x0000000000000000, 0),
    ('a', 0xB3525445533DC826, 38),
    ('b', 0xAAAD3583A74222AB, 43),
    ('ab', 0x266782447E14829C, 28),
    ('abc', 0x6510BD5BFD75F408, 8),
    ('hello', 0xCE29B0DD7A049A7C, 124),
    ('Hello, World!', 0x9BCDEF80BECEFC0F, 15),
    ('user-1', 0x459638B0F679DB3A, 58),
    ('user-2', 0x8952906FB203B2BB, 59),
    ('user-100000', 0x23CA8C8695031B10, 16),
    ('key', 0x26D9F4598D861D63, 99),
    ('ä', 0xE93B8DF5D1864D19, 25),
    ('日本語', 0xEB8C4584D1661989, 9),
    ('emoji 🙂', 0xB134E04DBC6B64DA, 90),
    ('tab\tnew\nline', 0x19E8923D85144984, 4),
    ('0', 0x66B82CCEBF300F7B, 123),
    ('1', 0x1A5FD6F9D2ED91FF, 127),
    ('None', 0x45EC75CAF65C07E0, 96),
    (' ', 0x7A7CABE6A3DDA742, 66),
    ("a" * 100, 0x9B8ABD8FDBE734FD, 125),
]
GOLDEN_BYTES = [
    (b'', 0x0000000000000000, 0),
    (b'a', 0xB3525445533DC826, 38),
    (b'\x00', 0xA7F560C60DEFC529, 41),
    (b'\x00\x00', 0x6A30E0402D34DBD5, 85),
    (b'\xff', 0xB72C7B9DE0D6666D, 109),
    (b'\xff\xff\xff\xff\xff\xff\xff\xff', 0x889E74C890144A55, 85),
    (b'abc', 0x6510BD5BFD75F408, 8),
    (b'hello', 0xCE29B0DD7A049A7C, 124),
    (b'\x01\x02\x03\x04', 0xD4E7EC547D1D75D5, 85),
    (b'user-1', 0x459638B0F679DB3A, 58),
    (bytes(range(256)), 0x02DE31B908291597, 23),
    (b'\x80', 0xE97653B7D0BD3CF5, 117),
    (b'None', 0x45EC75CAF65C07E0, 96),
    (b'0', 0x66B82CCEBF300F7B, 123),
    (b"z" * 1000, 0x7A07AC2B94F4F737, 55),
    (b'\xde\xad\xbe\xef', 0x7BE74572B5C77A46, 70),
    (b'ab', 0x266782447E14829C, 28),
    (b'ba', 0xD8B2DF0599A79B62, 98),
    (b'\n', 0xAD6929ED950C86B7, 55),
    (b'key', 0x26D9F4598D861D63, 99),
]
GOLDEN_TUPLE = [
    ((), 0x7ACDBB98B1344213, 19),
    ((1,), 0x2E4238BDE4B1F0E3, 99),
    ((1, 2), 0x58F59B9087E31FE7, 103),
    ((2, 1), 0x3B7C7CA221FB7EF2, 114),
    (('a',), 0x918D52BEF1D4CA3C, 60),
    (('a', 'b'), 0x36721C7079420160, 96),
    (('b', 'a'), 0xD2D4DD7EA8D87EA3, 35),
    ((1, 'a'), 0x88F46BAD7C1659F4, 116),
    (('a', 1), 0x7904CEC7BD573BDE, 94),
    ((None,), 0x667879C1711DE384, 4),
    ((None, None), 0x8B3652689364365C, 92),
    (((),), 0x897F41EC77615ABB, 59),
    (((1,), 2), 0x7C18B2E0EB009595, 21),
    ((1, (2,)), 0xD7225121138A6051, 81),
    ((b'x', 1.5), 0xF5C80427578921AE, 46),
    ((True, False), 0x48CF1B3970CE9534, 52),
    ((1, 2, 3), 0xF4DE8603B9E5D137, 55),
    (('user', 42), 0x9EE6107486922110, 16),
    ((1180591620717411303424, 'big'), 0x15BB7253B2D148C7, 71),
    ((('n', ('e', ('s', 't'))),), 0xC7139D1E8FAA0176, 118),
]
GOLDEN_NONE = [(None, 0x8AB1B3B56552EE35, 53)]

ALL_GOLDEN = (
    GOLDEN_INT
    + GOLDEN_BIG_INT
    + GOLDEN_BOOL
    + GOLDEN_FLOAT
    + GOLDEN_INTEGRAL_FLOAT
    + GOLDEN_STR
    + GOLDEN_BYTES
    + GOLDEN_TUPLE
    + GOLDEN_NONE
)


@pytest.mark.parametrize("key,expected_hash,expected_kg", ALL_GOLDEN, ids=repr)
def test_stable_hash_matches_golden_values(key, expected_hash, expected_kg):
    assert stable_hash(key) == expected_hash
    assert key_group(key, M) == expected_kg
    assert expected_hash % M == expected_kg


@pytest.mark.parametrize("key,expected_hash,expected_kg", ALL_GOLDEN, ids=repr)
def test_golden_values_follow_the_documented_formula(key, expected_hash, expected_kg):
    assert ref_hash(key) == expected_hash


def test_golden_tables_cover_twenty_keys_per_main_type():
    for table in (GOLDEN_INT, GOLDEN_FLOAT, GOLDEN_STR, GOLDEN_BYTES, GOLDEN_TUPLE):
        assert len(table) == 20


def test_fmix64_known_values_and_reduction_mod_2_64():
    assert fmix64(0) == 0
    assert fmix64(1) == 0xB456BCFC34C2CB2C
    assert fmix64(-1) == fmix64(2**64 - 1)
    assert fmix64(2**64 + 5) == fmix64(5)


def test_none_hash_constant():
    assert NONE_HASH == stable_hash(None) == ref_fmix64(0x4E6F6E65) == 0x8AB1B3B56552EE35


def test_equal_python_keys_hash_equal():
    assert stable_hash(1) == stable_hash(1.0) == stable_hash(True)
    assert stable_hash(0) == stable_hash(0.0) == stable_hash(-0.0) == stable_hash(False)
    assert stable_hash(10**20) == stable_hash(1e20)
    assert stable_hash(2**63) == stable_hash(2.0**63)
    assert stable_hash((1, "a")) == stable_hash((1.0, "a")) == stable_hash((True, "a"))


def test_every_nan_payload_hashes_the_same():
    other_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000123))[0]
    assert other_nan != other_nan
    assert stable_hash(other_nan) == stable_hash(float("nan")) == ref_fmix64(0x7FF8000000000000)
    assert stable_hash(-float("nan")) == stable_hash(float("nan"))


def test_bytes_like_keys_hash_their_raw_bytes():
    assert stable_hash(bytearray(b"abc")) == stable_hash(b"abc")
    assert stable_hash(memoryview(b"abc")) == stable_hash(b"abc")
    ints = array("i", [1, 2, 3])
    assert stable_hash(memoryview(ints)) == stable_hash(ints.tobytes())


def test_numpy_scalars_and_int_subclasses_hash_as_their_python_value():
    class Color(enum.IntEnum):
        RED = 7

    assert stable_hash(np.int64(-5)) == stable_hash(-5)
    assert stable_hash(np.uint64(2**64 - 1)) == stable_hash(2**64 - 1)
    assert stable_hash(np.int8(3)) == stable_hash(3)
    assert stable_hash(np.float32(0.5)) == stable_hash(0.5)
    assert stable_hash(np.float64(2.0)) == stable_hash(2)
    assert stable_hash(np.bool_(True)) == stable_hash(1)
    assert stable_hash(np.str_("abc")) == stable_hash("abc")
    assert stable_hash(np.bytes_(b"abc")) == stable_hash(b"abc")
    assert stable_hash(Color.RED) == stable_hash(7)


@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, {1}, datetime(2024, 1, 1), Decimal("1.5"), object()])
def test_unhashable_key_types_raise_type_error_naming_the_type(bad):
    with pytest.raises(TypeError) as info:
        stable_hash(bad)
    message = str(info.value)
    assert type(bad).__qualname__ in message
    assert "int, str, bytes or a tuple" in message
    with pytest.raises(TypeError):
        stable_hash((1, bad))


def test_hash_is_identical_in_a_process_with_another_hash_seed():
    keys = [k for k, _, _ in ALL_GOLDEN]
    code = (
        "import pickle; from abs.keygroups import stable_hash; "
        f"print([stable_hash(k) for k in pickle.loads(bytes.fromhex({pickle.dumps(keys).hex()!r}))])"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    ).stdout
    assert eval(out) == [stable_hash(k) for k in keys]


# ---------------------------------------------------------------- hypothesis: scalar rules

keys_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
keys_any = st.recursive(keys_scalar, lambda inner: st.tuples(inner, inner) | st.tuples(inner), max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(keys_any)
def test_stable_hash_equals_the_reference_implementation(key):
    assert stable_hash(key) == ref_hash(key)
    assert 0 <= stable_hash(key) < 2**64
    assert key_group(key, M) == ref_hash(key) % M


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_integral_floats_hash_as_ints(f):
    if f.is_integer():
        assert stable_hash(f) == stable_hash(int(f))


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=32768), keys_any)
def test_key_group_is_in_range(max_parallelism, key):
    assert 0 <= key_group(key, max_parallelism) < max_parallelism


# ---------------------------------------------------------------- vectorised


def scalar_groups(values, m=M):
    return [key_group(v, m) for v in values]


INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]


@pytest.mark.parametrize("arrow_type", INT_TYPES, ids=str)
def test_key_groups_of_integer_arrays_equal_scalar(arrow_type):
    lo, hi = (0, 255) if arrow_type.bit_width == 8 else (0, 2**(arrow_type.bit_width) - 1)
    if pa.types.is_signed_integer(arrow_type):
        lo, hi = -(2 ** (arrow_type.bit_width - 1)), 2 ** (arrow_type.bit_width - 1) - 1
    values = [lo, hi, 0, 1, None, lo + 1, hi - 1, 5, None, 100]
    arr = pa.array(values, type=arrow_type)
    got = key_groups(arr, M)
    assert got.dtype == np.int32
    assert got.tolist() == scalar_groups(values)


def test_uint64_values_beyond_int64_use_the_big_int_rule():
    values = [2**63, 2**64 - 1, 3, None]
    assert key_groups(pa.array(values, pa.uint64()), M).tolist() == scalar_groups(values)
    assert key_groups(np.array(values[:3], dtype=np.uint64), M).tolist() == scalar_groups(values[:3])


@pytest.mark.parametrize("arrow_type", [pa.float16(), pa.float32(), pa.float64()], ids=str)
def test_key_groups_of_float_arrays_equal_scalar(arrow_type):
    values = [0.5, -0.0, 1.0, 2.0**62, -(2.0**63), 2.0**63, 1e20, float("inf"), float("-inf"), float("nan"), None, 3.25]
    if arrow_type != pa.float64():
        values = [0.5, -0.0, 1.0, 2.0, float("inf"), float("nan"), None, 3.25, 1024.0]
    arr = pa.array(values, pa.float64()).cast(arrow_type)
    assert key_groups(arr, M).tolist() == scalar_groups(values)


@pytest.mark.parametrize("arrow_type", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()], ids=str)
def test_key_groups_of_string_and_binary_arrays_equal_scalar(arrow_type):
    words = ["", "a", "ä", "日本語", "a", None, "user-1", "", None, "user-1"]
    values = [w.encode() if (w is not None and "binary" in str(arrow_type)) else w for w in words]
    arr = pa.array(values, type=arrow_type)
    assert key_groups(arr, M).tolist() == scalar_groups(values)
    # Sliced arrays (non-zero offset) too.
    assert key_groups(arr.slice(3, 5), M).tolist() == scalar_groups(values[3:8])


def test_key_groups_of_other_arrow_layouts():
    values = ["x", "y", None, "x", "z"]
    dict_arr = pa.array(values).dictionary_encode()
    assert key_groups(dict_arr, M).tolist() == scalar_groups(values)
    chunked = pa.chunked_array([pa.array([1, 2, None]), pa.array([3, 2**40])])
    assert key_groups(chunked, M).tolist() == scalar_groups([1, 2, None, 3, 2**40])
    one_chunk = pa.chunked_array([pa.array(["a", "b"])])
    assert key_groups(one_chunk, M).tolist() == scalar_groups(["a", "b"])
    assert key_groups(pa.array([None, None]), M).tolist() == scalar_groups([None, None])
    assert key_groups(pa.array([True, False, None]), M).tolist() == scalar_groups([True, False, None])
    fixed = pa.array([b"ab", b"cd"], pa.binary(2))
    assert key_groups(fixed, M).tolist() == scalar_groups([b"ab", b"cd"])
    for t in (pa.int64(), pa.string(), pa.float64(), pa.binary()):
        assert key_groups(pa.array([], t), M).tolist() == []
    assert key_groups(pa.array(["a", None], pa.string()).slice(1), M).tolist() == scalar_groups([None])
    assert key_groups(pa.chunked_array([], pa.int64()), M).tolist() == []
    if hasattr(pa, "string_view"):
        views = pa.array(["a", None, "bc"]).cast(pa.string_view())
        assert key_groups(views, M).tolist() == scalar_groups(["a", None, "bc"])
        views = pa.array([b"a", None]).cast(pa.binary_view())
        assert key_groups(views, M).tolist() == scalar_groups([b"a", None])


def test_key_groups_of_numpy_arrays_and_python_iterables():
    assert key_groups(np.arange(-5, 5, dtype=np.int16), 7).tolist() == scalar_groups(range(-5, 5), 7)
    assert key_groups(np.array([True, False]), M).tolist() == scalar_groups([True, False])
    assert key_groups(np.array(["a", "bb", "ä"]), M).tolist() == scalar_groups(["a", "bb", "ä"])
    assert key_groups(np.array([b"a", b"bb"]), M).tolist() == scalar_groups([b"a", b"bb"])
    mixed = [1, "a", None, (1, 2), 2.5, b"x", 2**70, True]
    assert key_groups(np.array(mixed, dtype=object), M).tolist() == scalar_groups(mixed)
    assert key_groups(mixed, M).tolist() == scalar_groups(mixed)
    assert key_groups((k for k in ["a", "b"]), M).tolist() == scalar_groups(["a", "b"])
    assert key_groups([2**70, 1], M).tolist() == scalar_groups([2**70, 1])
    assert key_groups(["\ud800", "a"], M).tolist() == scalar_groups(["\ud800", "a"])  # lone surrogate
    assert key_groups([1.5, None, 2.0], M).tolist() == scalar_groups([1.5, None, 2.0])
    assert key_groups([], M).tolist() == []
    assert stable_hashes([1, "a"]).dtype == np.uint64


def test_key_groups_rejects_unsupported_inputs():
    with pytest.raises(TypeError, match="Arrow type timestamp"):
        key_groups(pa.array([datetime(2024, 1, 1)]), M)
    with pytest.raises(ValueError, match="1-D"):
        key_groups(np.zeros((2, 2)), M)
    with pytest.raises(TypeError, match="datetime64"):
        key_groups(np.array(["2024-01-01"], dtype="datetime64[D]"), M)
    with pytest.raises(TypeError, match="list"):
        key_groups([[1], [2]], M)
    with pytest.raises(ConfigError, match="Maximum parallelism"):
        key_groups([1], 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1)), max_size=50),
    st.integers(min_value=1, max_value=32768),
)
def test_vectorised_int64_equals_scalar(values, max_parallelism):
    expected = scalar_groups(values, max_parallelism)
    assert key_groups(pa.array(values, pa.int64()), max_parallelism).tolist() == expected
    assert key_groups(values, max_parallelism).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats()), max_size=40))
def test_vectorised_float64_equals_scalar(values):
    assert key_groups(pa.array(values, pa.float64()), M).tolist() == scalar_groups(values)
    dense = [v for v in values if v is not None]
    assert key_groups(np.array(dense, dtype=np.float64), M).tolist() == scalar_groups(dense)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=6)), max_size=40), st.booleans())
def test_vectorised_strings_equal_scalar(values, large):
    arr = pa.array(values, pa.large_string() if large else pa.string())
    assert key_groups(arr, M).tolist() == scalar_groups(values)
    chunked = pa.chunked_array([arr, arr])
    assert key_groups(chunked, M).tolist() == scalar_groups(values + values)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.none(), st.binary(max_size=80)), max_size=40), st.integers(0, 5),
       st.sampled_from([pa.binary(), pa.large_binary()]))
def test_column_wise_crc_of_values_around_its_length_limit_equals_zlib(values, start, arrow_type):
    """Values up to 64 bytes are hashed column-wise with numpy, an array with a longer one
    through zlib: the 64-bit hashes are the scalar ones either way, sliced arrays too."""
    arr = pa.array(values, arrow_type)
    expected = [stable_hash(v) for v in values]
    assert stable_hashes(arr).tolist() == expected
    assert stable_hashes(arr.slice(start)).tolist() == expected[start:]
    text = pa.array([None if v is None else v.hex() for v in values], pa.string())
    assert stable_hashes(text).tolist() == [stable_hash(None if v is None else v.hex()) for v in values]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.binary(max_size=6)), max_size=40))
def test_vectorised_binary_equals_scalar(values):
    assert key_groups(pa.array(values, pa.binary()), M).tolist() == scalar_groups(values)


@settings(max_examples=40, deadline=None)
@given(st.lists(keys_any, max_size=30))
def test_vectorised_python_lists_equal_scalar(values):
    assert key_groups(values, M).tolist() == scalar_groups(values)


# ---------------------------------------------------------------- ranges


def flink_range(m, p, i):
    # KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex, Java int arithmetic
    # (all operands non-negative, so Java's truncating division equals floor division).
    start = (i * m + p - 1) // p
    end = ((i + 1) * m - 1) // p
    return start, end


@pytest.mark.parametrize("m", [1, 7, 128, 1000])
def test_ranges_equal_flink_partition_and_agree_with_routing(m):
    for p in range(1, m + 1):
        ranges = [key_group_range(m, p, i) for i in range(p)]
        bounds = [(r.start, r.end) for r in ranges]
        assert bounds == [flink_range(m, p, i) for i in range(p)]
        # contiguous, non-empty, covering [0, m)
        assert bounds[0][0] == 0 and bounds[-1][1] == m - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(bounds, bounds[1:]))
        assert all(len(r) >= 1 for r in ranges)
        expected = [i for i, (start, end) in enumerate(bounds) for _ in range(end - start + 1)]
        assert list(routing_table(m, p)) == expected
        if p in (1, 2, 3, m // 2 or 1, m):
            assert [subtask_for_key_group(m, p, kg) for kg in range(m)] == expected


def test_range_bounds_match_ceil_and_floor_exactly():
    from fractions import Fraction
    import math

    for m, p in [(128, 3), (1000, 7), (32768, 999), (5, 5), (32768, 32768)]:
        for i in (0, 1, p // 2, p - 1):
            r = key_group_range(m, p, i)
            assert r.start == math.ceil(Fraction(i * m, p))
            assert r.end == math.floor(Fraction((i + 1) * m - 1, p))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_every_key_lands_in_its_subtasks_range(data):
    m = data.draw(st.integers(min_value=1, max_value=32768))
    p = data.draw(st.integers(min_value=1, max_value=min(m, 500)))
    key = data.draw(keys_any)
    kg = key_group(key, m)
    subtask = subtask_for_key_group(m, p, kg)
    assert 0 <= subtask < p
    assert kg in key_group_range(m, p, subtask)


def test_key_group_range_type():
    r = KeyGroupRange(3, 5)
    assert len(r) == 3 and list(r) == [3, 4, 5]
    assert 3 in r and 5 in r and 6 not in r and 2 not in r and "3" not in r
    empty = KeyGroupRange(4, 3)
    assert len(empty) == 0 and list(empty) == [] and 4 not in empty
    with pytest.raises(ConfigError):
        KeyGroupRange(5, 3)
    with pytest.raises(ConfigError):
        KeyGroupRange(-1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.start = 1


def test_preconditions_raise_config_errors_with_flink_like_messages():
    with pytest.raises(ConfigError, match=r"Maximum parallelism \(4\) must not be smaller than parallelism \(8\)\."):
        key_group_range(4, 8, 0)
    with pytest.raises(ConfigError, match="between 1 and 32768. Found: 0"):
        key_group_range(0, 1, 0)
    with pytest.raises(ConfigError, match="Found: 32769"):
        routing_table(32769, 1)
    with pytest.raises(ConfigError, match="Parallelism must be a positive int"):
        routing_table(8, 0)
    with pytest.raises(ConfigError, match=r"Subtask index 3 is out of range for parallelism 3"):
        key_group_range(8, 3, 3)
    with pytest.raises(ConfigError, match="Key group 8 is out of range"):
        subtask_for_key_group(8, 2, 8)
    with pytest.raises(ConfigError):
        check_max_parallelism(True)
    check_max_parallelism(1)
    check_max_parallelism(32768)
