"""The floor package ``abscore``: one implementation of the key-group math (ranges that
partition the key groups, owners that agree with them, the hash the snapshots on disk were laid
out by), one error root that every error the toolkit exports derives from, and the layering
abscore <- storage <- recovery <- abs without import cycles."""
from __future__ import annotations

import ast
import importlib
import inspect
import math
import os
import pkgutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abs
import abscore
import recovery
import storage
from abscore.errors import AbsError, ConfigError, ParallelismError
from abscore.keygroups import (
    MAX_MAX_PARALLELISM,
    KeyGroupRange,
    check_max_parallelism,
    check_parallelism,
    key_group,
    key_group_range,
    key_groups,
    routing_table,
    subtask_for_key_group,
)

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("abscore", "storage", "recovery", "abs")  # the layers, lowest first

# m, p with 1 <= p <= m <= 32768
m_and_p = st.integers(1, MAX_MAX_PARALLELISM).flatmap(lambda m: st.tuples(st.just(m), st.integers(1, m)))


# ============================================================================ ranges and owners
def _ranges(m: int, p: int) -> list[KeyGroupRange]:
    return [key_group_range(m, p, i) for i in range(p)]


def _assert_partition(m: int, p: int) -> None:
    ranges = _ranges(m, p)
    assert [kg for r in ranges for kg in r] == list(range(m)), f"M={m} P={p}: not a partition in order"
    assert all(len(r) >= 1 for r in ranges), f"M={m} P={p}: a subtask owns no key group"
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1, f"M={m} P={p}: ranges are not balanced"
    for i, r in enumerate(ranges):  # Flink's formula, in exact integers
        assert (r.start, r.end) == (math.ceil(i * m / p), ((i + 1) * m - 1) // p)


@pytest.mark.parametrize("m", range(1, 65))
def test_ranges_partition_the_key_groups_for_every_parallelism_of_small_max_parallelisms(m):
    for p in range(1, m + 1):
        _assert_partition(m, p)


@settings(max_examples=300, deadline=None)
@given(m_and_p)
def test_ranges_partition_the_key_groups_for_any_parallelism(mp):
    _assert_partition(*mp)


@settings(max_examples=300, deadline=None)
@given(m_and_p, st.data())
def test_the_owner_of_a_key_group_is_the_subtask_whose_range_holds_it(mp, data):
    m, p = mp
    kg = data.draw(st.integers(0, m - 1), label="key group")
    owner = subtask_for_key_group(m, p, kg)
    assert 0 <= owner < p
    assert kg in key_group_range(m, p, owner)
    assert all(kg not in key_group_range(m, p, i) for i in {0, owner - 1, owner + 1, p - 1} - {owner} if 0 <= i < p)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2048).flatmap(lambda m: st.tuples(st.just(m), st.integers(1, m))))
def test_the_routing_table_lists_every_key_groups_owner(mp):
    m, p = mp
    table = routing_table(m, p)
    assert len(table) == m
    for i, r in enumerate(_ranges(m, p)):
        assert {table[kg] for kg in r} == {i}


# ============================================================================ the hash on disk
# Keys and their key groups for max_parallelism 1, 7, 128, 1000 and 32768, taken from the
# implementation the existing snapshots were written with. Snapshots are laid out by key group:
# if this table has to change, every snapshot on disk becomes unreadable by a restore.
MAX_PARALLELISMS = (1, 7, 128, 1000, 32768)
KEY_GROUP_VECTOR = [
    (0, [0, 0, 0, 0, 0]),
    (1, [0, 0, 44, 604, 19244]),
    (-1, [0, 5, 33, 289, 24353]),
    (2, [0, 5, 103, 447, 999]),
    (42, [0, 3, 76, 340, 22988]),
    (127, [0, 5, 35, 979, 18595]),
    (128, [0, 2, 102, 910, 6886]),
    (1000003, [0, 6, 76, 252, 26956]),
    (-987654321, [0, 0, 64, 384, 18752]),
    (9223372036854775807, [0, 3, 106, 930, 28138]),
    (-9223372036854775808, [0, 0, 19, 707, 9363]),
    (18446744073709551616, [0, 6, 123, 251, 21115]),
    (-1180591620717411303424, [0, 0, 55, 79, 5815]),
    (True, [0, 0, 44, 604, 19244]),
    (False, [0, 0, 0, 0, 0]),
    (0.5, [0, 2, 37, 613, 18725]),
    (-2.25, [0, 3, 27, 795, 7451]),
    (1e-300, [0, 2, 88, 48, 21464]),
    (float("inf"), [0, 5, 63, 271, 9279]),
    (float("-inf"), [0, 6, 121, 849, 11513]),
    (float("nan"), [0, 1, 5, 109, 15237]),
    (3.0, [0, 2, 78, 222, 22734]),
    (-0.0, [0, 0, 0, 0, 0]),
    (1e+20, [0, 6, 0, 616, 18688]),
    ('', [0, 0, 0, 0, 0]),
    ('a', [0, 3, 38, 806, 18470]),
    ('abc', [0, 1, 8, 464, 29704]),
    ('user-17', [0, 4, 76, 196, 18380]),
    ('Zürich', [0, 1, 12, 852, 268]),
    ('日本', [0, 2, 17, 633, 31249]),
    ('\ud800', [0, 1, 36, 140, 31268]),
    ('aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa', [0, 1, 125, 285, 13565]),
    (b'', [0, 0, 0, 0, 0]),
    (b'\x00', [0, 4, 41, 521, 17705]),
    (b'key', [0, 3, 99, 411, 7523]),
    (b'\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff', [0, 1, 90, 498, 16730]),
    (None, [0, 1, 53, 509, 28213]),
    ((), [0, 6, 19, 795, 16915]),
    ((1,), [0, 3, 99, 539, 28899]),
    ((1, 'a'), [0, 5, 116, 204, 23028]),
    (('a', 1), [0, 4, 94, 422, 15326]),
    ((None, b'x', 2.5), [0, 1, 40, 88, 31656]),
    (((1, 2), (3,)), [0, 5, 98, 858, 29922]),
]


@pytest.mark.parametrize("key,expected", KEY_GROUP_VECTOR, ids=repr)
def test_key_groups_are_those_the_snapshots_on_disk_use(key, expected):
    assert [key_group(key, m) for m in MAX_PARALLELISMS] == expected


@pytest.mark.parametrize("m", MAX_PARALLELISMS)
def test_vectorised_key_groups_are_those_the_snapshots_on_disk_use(m):
    at = MAX_PARALLELISMS.index(m)
    keys = [key for key, _ in KEY_GROUP_VECTOR]
    assert key_groups(keys, m).tolist() == [expected[at] for _, expected in KEY_GROUP_VECTOR]
    ints = [k for k in keys if type(k) is int and -(2**63) <= k < 2**63]  # the Arrow int64 path
    assert key_groups(ints, m).tolist() == [key_group(k, m) for k in ints]
    strs = [k for k in keys if type(k) is str and k != "\ud800"]  # the Arrow string path
    assert key_groups(strs, m).tolist() == [key_group(k, m) for k in strs]


def test_runtime_restore_planner_and_rekey_share_one_implementation():
    import abs.keygroups
    import recovery.plan
    import recovery.rewrite

    for name in abs.keygroups.__all__:
        assert getattr(abs.keygroups, name) is getattr(abscore.keygroups, name), name
    assert recovery.key_group_range is key_group_range and recovery.routing_table is routing_table
    assert recovery.KeyGroupRange is KeyGroupRange
    assert recovery.plan.check_parallelism is check_parallelism
    assert recovery.rewrite.stable_hashes is abscore.keygroups.stable_hashes  # the re-key's hash


# ============================================================================ one error class
@pytest.mark.parametrize("call,match", [
    (lambda: check_max_parallelism(0), "between 1 and 32768. Found: 0"),
    (lambda: check_max_parallelism(32769), "Found: 32769"),
    (lambda: check_max_parallelism(True), "Found: True"),
    (lambda: check_parallelism(8, 0), "Parallelism must be a positive int"),
    (lambda: key_group_range(8, 9, 0), r"Maximum parallelism \(8\) must not be smaller than parallelism \(9\)"),
    (lambda: key_group_range(8, 3, 3), "Subtask index 3 is out of range for parallelism 3"),
    (lambda: subtask_for_key_group(8, 3, 8), "Key group 8 is out of range"),
    (lambda: routing_table(0, 1), "Maximum parallelism"),
    (lambda: key_groups([1], 0), "Maximum parallelism"),
    (lambda: KeyGroupRange(3, 1), r"KeyGroupRange\(start=3, end=1\) is invalid"),
])
def test_every_precondition_of_the_key_group_math_raises_the_one_parallelism_error(call, match):
    with pytest.raises(ParallelismError, match=match) as info:
        call()
    # caught alike by the runtime's, the recovery layer's and the built-in names
    assert isinstance(info.value, abs.ConfigError)
    assert isinstance(info.value, recovery.ParallelismError)
    assert isinstance(info.value, ValueError) and isinstance(info.value, abs.AbsError)


def test_empty_ranges_print_as_empty():
    assert str(KeyGroupRange(4, 3)) == "[]" and len(KeyGroupRange(4, 3)) == 0
    assert str(KeyGroupRange(4, 7)) == "[4, 7]"


# ============================================================================ one error root
def _modules(package: str):
    yield importlib.import_module(package)
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        yield importlib.import_module(info.name)


# Exception classes that modules export but that never reach a user: each is caught inside the
# runtime (or stands for a file system's own error in fault-injection tests).
INTERNAL = {
    "abs.runtime.channels.GateClosed": "a closed gate ends a task's loop; never leaves the worker",
    "abs.runtime.operator_base.UserFunctionError": "carries a user function's error to the task, "
                                               "which reports it as abs.OperatorError",
    "abs.runtime.writer.WriterHungError": "the worker declines the checkpoint and writes in-thread",
    "storage.testing.InjectedFaultError": "test helper: stands for an OSError of the file system",
}


def _exported_error_classes() -> dict[str, type]:
    found = {}
    for package in PACKAGES:
        for module in _modules(package):
            for name in getattr(module, "__all__", ()):
                obj = getattr(module, name, None)
                if inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exported_error_class_derives_from_the_one_root():
    classes = _exported_error_classes()
    # the tree the brief promises: the three layers' roots and their best-known members
    for name in ("abscore.errors.AbsError", "storage.errors.StorageError", "recovery.errors.RecoveryError",
                 "storage.errors.CorruptFileError", "recovery.errors.IncompatibleSnapshotError",
                 "abs.errors.JobFailedError", "abscore.errors.ParallelismError",
                 "recovery.errors.MaxParallelismError"):
        assert name in classes, f"{name} is not exported"
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, AbsError) and name not in INTERNAL)
    assert outside == [], f"exported errors outside abs.AbsError: {outside}"
    assert abs.AbsError is AbsError and abs.errors.AbsError is AbsError and abscore.AbsError is AbsError
    assert issubclass(storage.StorageError, AbsError) and issubclass(recovery.RecoveryError, storage.StorageError)
    assert abs.ConfigError is ConfigError and recovery.ParallelismError is ParallelismError


def test_except_abs_error_catches_storage_and_recovery_errors(tmp_path):
    from recovery.errors import FingerprintFormatError
    from recovery.fingerprint import JobFingerprint

    store = storage.SnapshotStore.open(str(tmp_path / "root"))
    caught = []
    for fail in (lambda: store.read_manifest(7),  # storage: no such checkpoint
                 lambda: JobFingerprint.parse({"name": 3}),  # recovery: a malformed fingerprint
                 lambda: recovery.key_group_range(4, 5, 0)):  # the floor: parallelism above max
        try:
            fail()
        except abs.AbsError as exc:
            caught.append(type(exc))
    assert caught[0] is storage.CheckpointNotFoundError
    assert caught[1] is FingerprintFormatError
    assert caught[2] is ParallelismError


# ============================================================================ layers and cycles
def _py_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports (at the top, in functions, under TYPE_CHECKING), absolute,
    with ``from X import name`` resolved to ``X.name`` where that is a module of the project."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append(target)
            out.extend(f"{target}.{alias.name}" for alias in node.names)
    return out


def _project_files() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in _py_files(pkg)}


def test_no_package_imports_a_layer_above_it():
    upward = []
    for module, path in _project_files().items():
        layer = PACKAGES.index(module.split(".")[0])
        for target in _imports(path):
            top = target.split(".")[0]
            if top in PACKAGES and PACKAGES.index(top) > layer:
                upward.append(f"{path.relative_to(REPO)} imports {target}")
    assert upward == [], "imports that run up the layers abscore <- storage <- recovery <- abs: " + "; ".join(upward)


def test_abscore_imports_nothing_of_the_project_in_a_fresh_process():
    import subprocess
    import sys

    code = ("import sys, abscore, abscore.keygroups, abscore.schema, abscore.ids, abscore.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('abs', 'storage', 'recovery')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _file_graph() -> dict[str, set[str]]:
    files = _project_files()
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    # an import of a package's __init__ (its face) is not an edge between files
    return {m: {t for t in _imports(p) if t in files and t not in packages and t != m}
            for m, p in files.items()}


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_files():
    cycles = _cycles(_file_graph())
    assert cycles == [], f"import cycles between files: {cycles}"


def test_gc_paused_turns_collection_off_inside_and_back_on_after_the_last_pause_only_if_it_was_on():
    import gc
    import threading

    from abscore.gcpause import gc_paused

    assert gc.isenabled()
    try:
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # an inner pause ending leaves the outer one on
            other = gc_paused()
            inner = threading.Thread(target=other.__enter__)
            inner.start()
            inner.join(5)
        assert not gc.isenabled()  # another thread's pause still runs
        other.__exit__(None, None, None)
        assert gc.isenabled()  # the last pause ended
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: stays off
        with pytest.raises(ValueError):
            with gc_paused():
                raise ValueError("the step failed")
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(ValueError):
            with gc_paused():
                raise ValueError("the step failed")
        assert gc.isenabled()  # back on after a failure too
    finally:
        gc.enable()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_during_a_pause_collects_its_garbage():
    """The driver forks workers: a fork while another thread (or the forking one) is inside a
    pause gives a child whose collection is on, and stays on after the child leaves a pause
    it was forked in."""
    import gc
    import threading

    from abscore.gcpause import gc_paused

    def child_collects(inside_too: bool) -> int:
        pid = os.fork()
        if pid == 0:
            ok = gc.isenabled()
            if inside_too:
                with gc_paused():
                    ok = ok and not gc.isenabled()
                ok = ok and gc.isenabled()
            os._exit(0 if ok else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with gc_paused():
            entered.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(10) and not gc.isenabled()
        assert child_collects(inside_too=True) == 0  # another thread's pause
        with gc_paused():
            pid = os.fork()  # this thread's own pause: the child leaves the block itself
            if pid == 0:
                os._exit(0 if gc.isenabled() else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        leave.set()
        holder.join(10)
    assert gc.isenabled()
