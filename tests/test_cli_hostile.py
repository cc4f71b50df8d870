"""Hostile input for every ``abs-snapshot`` command: a snapshot root written by a real job,
then mutated (manifests: truncations, bit flips, fields of the wrong type, huge and negative
numbers, missing keys, deep nesting, out-of-range key groups; state files: truncations, bit
flips, compression bombs). Every command on every mutant must end with an exit code and at
most a short message on stderr: never a traceback, never an "unexpected" error, and within
bounded memory (the bombs run in a subprocess under an address-space limit)."""
from __future__ import annotations

import copy
import dataclasses
import json
import mmap
import os
import random
import resource
import shutil
import subprocess
import sys
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.cli import main
from storage.manifest import manifest_checksum
from storage.manifest_refs import RANGE_FIELDS
from storage import SnapshotStore, StoragePaths
from storage.format import WRITE_CHECKSUM_ALGORITHM, EncodedFile, checksum_hex

SEED_COUNT = 240  # mutants per run: each runs every command (~25 s in all on a quiet machine)


# ---------------------------------------------------------------------------- the real root
def count_fn(ctx: Any, row: dict) -> None:
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.state.last.update({"count": c, "tag": ("k", c % 3)})  # untyped: pickled values
    if c % 50 == 0:
        ctx.emit({"key": ctx.key, "count": c})


def job_flow(count: int) -> abs.Dataflow:
    flow = abs.Dataflow("hostile", max_parallelism=8)
    src = flow.source("events", abs.GeneratorSource(count, num_keys=300, num_splits=2, batch_size=500))
    src.key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64()), abs.ValueState("last")]
                              ).sink("out", abs.CollectSink())
    return flow


@pytest.fixture(scope="module")
def job_root(tmp_path_factory) -> str:
    """Two checkpoints of a real job (the second after a restore), packed state files."""
    root = str(tmp_path_factory.mktemp("hostile") / "root")
    config = abs.CheckpointConfig(interval=60.0)
    first = abs.run(job_flow(6000), parallelism=2, checkpoint=config, storage=root)
    second = abs.run(job_flow(9000), parallelism=2, checkpoint=config, storage=root, restore="latest")
    assert first.status == second.status == "FINISHED"
    store = SnapshotStore.open(root)
    assert len(store.list_checkpoints()) >= 2
    assert any(ref.packed for ref in store.read_manifest(store.latest_checkpoint()).iter_refs())
    return root


def commands(root: str, dest: str) -> list[list[str]]:
    """Every command, as a user would type it on ``root``."""
    return [
        ["ls", root],
        ["show", root],
        ["show", root, "latest", "--files"],
        ["show", root, "1", "--key-groups"],
        ["dump", root, "latest", "--operator", "count", "--state", "n", "--limit", "5"],
        ["dump", root, "latest", "--operator", "count", "--state", "last", "--format", "jsonl"],
        ["dump", root, "1", "--operator", "count", "--state", "n", "--key-group", "3", "--limit", "0"],
        ["verify", root],
        ["gc", root, "--retain", "1", "--dry-run"],
        ["check", root],
        ["check", root, "latest", "-p", "3"],
        ["rescale-preview", root, "-p", "3"],
        ["savepoint", root, "latest", os.path.join(dest, "sp")],
        ["rekey", root, "latest", os.path.join(dest, "rk"), "--max-parallelism", "5"],
    ]


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def problem(argv: list[str], code: int, out: str, err: str) -> str | None:
    """What is wrong with how a command ended on hostile input, or ``None``."""
    if code not in (0, 1, 2):
        return f"exit code {code}; stderr: {err[-300:]}"
    if "Traceback" in err or "failed unexpectedly" in err:
        return err[-300:]
    if len(err.splitlines()) > 3:
        return f"a message of {len(err.splitlines())} lines: {err[:300]}"
    if code and not err.startswith(("abs-snapshot: error: ", "usage:")):
        if argv[0] in ("verify", "check") and out.strip():
            return None  # a report of problems on stdout: the documented way these two say "broken"
        return f"exit {code} without a message: stderr {err!r}"
    if code and len(err.strip()) < len("abs-snapshot: error: ") + 10:
        return f"an empty message: {err!r}"
    return None


# ---------------------------------------------------------------------------- mutations
HOSTILE_VALUES: list[Any] = [
    10**18, 2**63, 2**64 + 7, 10**30, -1, -(2**63), 0, 1.5, 1e308, float("inf"), "x", "", None, True, [], {},
    [1, 2], {"a": 1}, "../../etc/passwd", "9" * 400,
]


def _paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path to a value inside a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _parent(doc: Any, path: tuple) -> Any:
    for step in path[:-1]:
        doc = doc[step]
    return doc


def sealed(doc: Any) -> bytes:
    """``doc`` as JSON with its manifest checksum recomputed: a hostile edit that a careful
    attacker (or a tool) sealed, which the readers' own bounds must stop, not the checksum."""
    if isinstance(doc, dict) and isinstance(doc.get("checksum"), str) and isinstance(doc.get("checksum_algorithm"), str):
        try:
            doc = dict(doc, checksum=manifest_checksum(doc, doc["checksum_algorithm"]))
        except Exception:  # noqa: BLE001 - a value the canonical encoding refuses: leave it unsealed
            pass
    return json.dumps(doc).encode()


def manifest_mutation(rng: random.Random, doc: dict) -> tuple[str, bytes]:
    """A hostile version of a manifest's text, and what was done."""
    text = json.dumps(doc, indent=1).encode()
    choice = rng.randrange(9)
    if choice == 0:
        cut = rng.randrange(len(text))
        return f"truncated at {cut}", text[:cut]
    if choice == 1:
        at = rng.randrange(len(text))
        flipped = bytearray(text)
        flipped[at] ^= 1 << rng.randrange(8)
        return f"bit flip at {at}", bytes(flipped)
    doc = copy.deepcopy(doc)
    paths = list(_paths(doc))
    if choice == 2:  # any field: a hostile value
        path = rng.choice(paths)
        value = rng.choice(HOSTILE_VALUES)
        _parent(doc, path)[path[-1]] = value
        return f"{'/'.join(map(str, path))} = {str(value)[:30]}", sealed(doc)
    if choice == 3:  # a missing key
        path = rng.choice([p for p in paths if isinstance(p[-1], str)])
        del _parent(doc, path)[path[-1]]
        return f"{'/'.join(map(str, path))} deleted", sealed(doc)
    refs = [p for p in paths if isinstance(p[-1], str) and p[-1] in ("bytes", "offset", "rows", "key_group",
                                                                     "checkpoint_id")]
    # format 7: a range's offset, bytes, rows; a reference's range index, row offset, rows
    refs += [p for p in paths if (p[0] == "ranges" and len(p) == 3 and p[2] in (2, 3, 4))
             or (p[0] == "keyed" and len(p) == 6)]
    if choice in (4, 5) and refs:  # a file reference's numbers
        path = rng.choice(refs)
        value = rng.choice([10**18, 2**63 - 1, 2**40, 10**12 + 3, -5, 7, 123456789])
        _parent(doc, path)[path[-1]] = value
        return f"{'/'.join(map(str, path))} = {value}", sealed(doc)
    if choice == 6 and doc.get("keyed"):  # a key group out of range (or not a number)
        op = rng.choice(sorted(doc["keyed"]))
        st = rng.choice(sorted(doc["keyed"][op]))
        chains = doc["keyed"][op][st]
        kg = rng.choice(sorted(chains))
        new = rng.choice(["8", "9", "999999", "-1", "1e3", "00", str(2**70)])
        chains[new] = chains.pop(kg)
        return f"keyed/{op}/{st}: key group {kg} -> {new}", sealed(doc)
    if choice == 7:  # deep nesting somewhere
        path = rng.choice(paths)
        depth = rng.choice([50, 5000, 200000])
        _parent(doc, path)[path[-1]] = "__deep__"
        text = json.dumps(doc).replace('"__deep__"', "[" * depth + "0" + "]" * depth)
        return f"{'/'.join(map(str, path))} nested {depth} deep", text.encode()
    value = rng.choice([0, 1, 3, 2**31, 10**15, -3])
    doc["max_parallelism"] = value
    return f"max_parallelism = {value}", sealed(doc)


def file_mutation(rng: random.Random, root: str) -> str:
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "state")) for f in fs)
    victim = rng.choice(files)
    data = open(victim, "rb").read()
    if rng.random() < 0.5:
        cut = rng.randrange(len(data))
        data, what = data[:cut], f"truncated at {cut}"
    else:
        at = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        data, what = bytes(flipped), f"bit flip at {at}"
    with open(victim, "wb") as f:
        f.write(data)
    return f"{os.path.relpath(victim, root)} {what}"


def make_mutant(seed: int, source: str, target: str) -> str:
    """Copy ``source`` to ``target`` and damage it as ``seed`` says; returns what was done."""
    shutil.copytree(source, target)
    rng = random.Random(seed)
    dice = rng.random()
    if dice < 0.25:
        return file_mutation(rng, target)
    if dice < 0.35:
        path = os.path.join(target, "_job.json")
        what, text = manifest_mutation(rng, json.load(open(path)))
        with open(path, "wb") as f:
            f.write(text)
        return f"_job.json: {what}"
    manifests = sorted(os.listdir(os.path.join(target, "checkpoints")))
    name = rng.choice(manifests)
    path = os.path.join(target, "checkpoints", name)
    what, text = manifest_mutation(rng, json.load(open(path)))
    with open(path, "wb") as f:
        f.write(text)
    return f"{name}: {what}"


@pytest.mark.parametrize("chunk", range(8))
def test_every_command_on_hostile_roots_ends_with_a_short_message(capsys, job_root, tmp_path, chunk):
    """SEED_COUNT seeded mutants, in 8 chunks; each mutant gets every command."""
    failures: list[str] = []
    for seed in range(chunk, SEED_COUNT, 8):
        mutant = str(tmp_path / f"m{seed}")
        what = f"seed {seed} ({make_mutant(seed, job_root, mutant)})"
        dest = str(tmp_path / f"d{seed}")
        os.makedirs(dest)
        for argv in commands(mutant, dest):
            code, out, err = run_cli(capsys, argv)
            wrong = problem(argv, code, out, err)
            if wrong is not None:
                failures.append(f"{what}: abs-snapshot {argv[0]} {' '.join(argv[2:])}: {wrong}")
    assert not failures, f"{len(failures)} command(s) misbehaved:\n" + "\n".join(failures[:20])


def test_the_unmutated_root_passes_every_command(capsys, job_root, tmp_path):
    """The control: on the intact root every command succeeds (so the mutants' errors are theirs)."""
    for argv in commands(job_root, str(tmp_path)):
        code, out, err = run_cli(capsys, argv)
        assert code == 0 and err == "", f"abs-snapshot {' '.join(argv)}: exit {code}: {err}"


# ---------------------------------------------------------------------------- targeted cases
def rewrite_latest(root: str, edit: Callable[[dict], None]) -> str:
    store = SnapshotStore.open(root)
    path = os.path.join(root, StoragePaths.manifest(store.latest_checkpoint()))
    doc = json.load(open(path))
    edit(doc)
    with open(path, "wb") as f:
        f.write(sealed(doc))
    return path


def first_packed_range(doc: dict) -> list:
    """The entry in ``ranges`` of the first reference to a range of a packed file (format 7)."""
    for states in doc["keyed"].values():
        for chains in states.values():
            for chain in chains.values():
                for entry in chain:
                    rng = doc["ranges"][entry[0]]
                    if "/packed/" in doc["files"][rng[0]]:
                        return rng
    raise AssertionError("no packed reference")


@pytest.mark.parametrize("field,value", [("bytes", 10**15), ("bytes", 2**62), ("offset", 10**15), ("offset", 2**62)])
def test_a_range_past_the_end_of_its_file_is_refused_naming_the_file(capsys, job_root, tmp_path, field, value):
    root = str(tmp_path / "r")
    shutil.copytree(job_root, root)
    target: dict = {}

    def edit(doc: dict) -> None:
        rng = first_packed_range(doc)  # a key group in a shared range reads the whole range
        rng[RANGE_FIELDS.index(field)] = value
        target["path"] = doc["files"][rng[0]]

    rewrite_latest(root, edit)
    code, _, err = run_cli(capsys, ["dump", root, "latest", "--operator", "count", "--state", "n", "--limit", "0"])
    assert code == 1 and "Traceback" not in err and len(err.splitlines()) == 1
    assert target["path"] in err and "points past its end" in err


@pytest.mark.parametrize("key_group", ["8", "999999", str(2**70)])
def test_a_key_group_out_of_range_is_named_by_every_command_that_reads_it(capsys, job_root, tmp_path, key_group):
    root = str(tmp_path / "r")
    shutil.copytree(job_root, root)

    def edit(doc: dict) -> None:
        chains = doc["keyed"]["count"]["n"]
        chains[key_group] = chains.pop("3")

    path = rewrite_latest(root, edit)
    if int(key_group) >= 2**63:  # past what a manifest may hold at all: the manifest itself reads as corrupt
        cid = int(os.path.basename(path)[4:12])
        code, out, err = run_cli(capsys, ["show", root, str(cid)])
        assert problem(["show"], code, out, err) is None and code == 1, err
        assert f"checkpoint {cid}" in err and "key group" in err, err
        return
    for argv in (["rescale-preview", root, "-p", "3"], ["rekey", root, "latest", str(tmp_path / "rk"),
                                                         "--max-parallelism", "4"],
                 ["savepoint", root, "latest", str(tmp_path / "sp")]):
        code, out, err = run_cli(capsys, argv)
        assert problem(argv, code, out, err) is None, err
        if argv[0] != "savepoint":  # a savepoint copies the chain as it is, key group and all
            assert code == 1 and f"key group {key_group}" in err and "outside [0, 8)" in err, err


# ---------------------------------------------------------------------------- compression bombs
BOMB_ROWS = (2 << 30) // 8  # a 2 GiB int64 column of zeros: ~65 KiB of zstd


def bomb_bytes(rows: int = BOMB_ROWS, batch_rows: int | None = None) -> bytes:
    """An encoded base whose one column decodes to ``rows * 8`` bytes, made without holding
    them: the column is a read-only anonymous mapping (the kernel's zero page)."""
    zeros = mmap.mmap(-1, rows * 8, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    table = pa.table({"key": pa.array(np.frombuffer(zeros, dtype=np.int64))})
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1))
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return sink.getvalue().to_pybytes()


def plant_bomb(root: str, data: bytes, rows: int) -> int:
    """A new checkpoint of ``root`` whose state count/n key group 0 is the bomb (committed the
    way the runtime commits, so the manifest is as valid as any)."""
    store = SnapshotStore.open(root)
    latest = store.read_manifest(store.latest_checkpoint())
    cid = store.next_checkpoint_id()
    encoded = EncodedFile(data=data, rows=rows, checksum=checksum_hex(data, WRITE_CHECKSUM_ALGORITHM),
                          checksum_algorithm=WRITE_CHECKSUM_ALGORITHM)
    ref = store._put(StoragePaths.state_file(cid, "count", "n", 0, "base"), encoded, "base", cid)
    keyed = copy.deepcopy(latest.keyed)
    keyed["count"]["n"][0] = [ref]
    store.commit(dataclasses.replace(latest, checkpoint_id=cid, keyed=keyed, stats={}))
    return cid


AS_LIMIT = 1 << 30  # the commands run in ~350 MB of address space; the bomb needs 2 GiB more


def run_limited(argv: list[str]) -> subprocess.CompletedProcess:
    """``abs-snapshot argv`` in a subprocess that may map at most AS_LIMIT bytes."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    code = "import sys; from abs.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system")  # malloc: address space as used
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit, env=env)


@pytest.fixture(scope="module")
def bomb_root(job_root, tmp_path_factory) -> tuple[str, int]:
    root = str(tmp_path_factory.mktemp("bomb") / "root")
    shutil.copytree(job_root, root)
    return root, plant_bomb(root, bomb_bytes(batch_rows=1 << 20), BOMB_ROWS)


def test_the_address_space_limit_is_low_enough_to_catch_a_bomb():
    """The mutant check: without the decode limit the bomb does exhaust the limited process."""
    data = bomb_bytes(rows=(1536 << 20) // 8)
    code = ("import sys, pyarrow as pa; data = sys.stdin.buffer.read(); "
            "pa.ipc.open_stream(pa.BufferReader(data)).read_all(); print('decoded')")
    proc = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT)),
                          env=dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system"))
    assert proc.returncode != 0 and b"decoded" not in proc.stdout


@pytest.mark.parametrize("command", ["dump", "savepoint", "rekey", "check"])
def test_a_compression_bomb_is_refused_naming_the_file_in_bounded_memory(bomb_root, tmp_path, command):
    root, cid = bomb_root
    argv = {
        "dump": ["dump", root, str(cid), "--operator", "count", "--state", "n", "--key-group", "0", "--limit", "5"],
        "savepoint": ["savepoint", root, str(cid), str(tmp_path / "sp")],
        "rekey": ["rekey", root, str(cid), str(tmp_path / "rk"), "--max-parallelism", "4"],
        "check": ["check", root, str(cid)],
    }[command]
    proc = run_limited(argv)
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr
    # check decodes nothing: it reports the file its verification finds a restore would refuse
    said = proc.stdout if command == "check" else proc.stderr
    assert proc.returncode == 1 and len(said.splitlines()) == (2 if command == "check" else 1), said
    assert f"{cid:08d}-base-" in said and "would decode to 2147483648 bytes" in said
    assert "--max-decoded-bytes" in said


def test_dump_with_the_limit_raised_decodes_only_the_batches_it_prints(bomb_root):
    """Raised past the bomb's size, dump --limit 5 still fits: it decodes one 8 MiB batch of
    the 2 GiB file and stops."""
    root, cid = bomb_root
    proc = run_limited(["dump", root, str(cid), "--operator", "count", "--state", "n", "--key-group", "0",
                        "--limit", "5", "--format", "jsonl", "--max-decoded-bytes", "4GiB"])
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [{"key_group": 0, "key": 0}] * 5


def test_decoded_size_is_read_from_headers_exactly():
    from storage.format import decode_table, decoded_size, encode_table

    for table in [pa.table({"key": pa.array(range(1000)), "v": ["x"] * 1000}),
                  pa.table({"key": pa.array([b"a", b"b"]), "v": [None, 1]}),
                  pa.table({"key": pa.array([], pa.int64())})]:
        data = encode_table(table, "base").data
        decoded = decode_table(data, source="t")
        buffers = sum(b.size for col in decoded.columns for chunk in col.chunks for b in chunk.buffers() if b is not None)
        assert decoded_size(data, source="t") == buffers
    assert decoded_size(bomb_bytes(rows=1 << 20), source="t") == 8 << 20


def test_rows_without_buffers_count_against_the_decode_limit():
    """A null-typed column has rows but no bytes: a file claiming 2**40 of them is refused
    before a reader walks them."""
    from storage.errors import CorruptFileError
    from storage.format import DecodeLimits, decode_table, decoded_size

    sink = pa.BufferOutputStream()
    table = pa.table({"key": pa.nulls(1 << 20)})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    assert decoded_size(data, source="t") == 1 << 20
    with pytest.raises(CorruptFileError, match="would decode to 1048576 bytes"):
        decode_table(data, source="t", limits=DecodeLimits.fixed(1 << 19))


@pytest.mark.parametrize("command", ["dump", "savepoint", "rekey"])
def test_max_decoded_bytes_reaches_every_reader(capsys, job_root, tmp_path, command):
    """A limit below the real files' size refuses them: the option reaches the store each
    command decodes with (the re-key's tasks open their own)."""
    argv = {"dump": ["dump", job_root, "latest", "--operator", "count", "--state", "n"],
            "savepoint": ["savepoint", job_root, "latest", str(tmp_path / "sp")],
            "rekey": ["rekey", job_root, "latest", str(tmp_path / "rk"), "--max-parallelism", "4", "--unpickle"]}[command]
    code, _, err = run_cli(capsys, argv + ["--max-decoded-bytes", "100"])
    assert code == 1 and "beyond the decode limit of 100 bytes" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["savepoint", "rekey"])
@pytest.mark.parametrize("under", [False, True], ids=["dest-is-a-file", "dest-under-a-file"])
def test_a_destination_that_is_a_file_is_named_as_such(capsys, job_root, tmp_path, command, under):
    """DEST a regular file (or a path below one): the error says so, as a usage error,
    instead of a NotADirectoryError blamed on the URL, credentials, network or free space."""
    blocker = tmp_path / "dest"
    blocker.write_text("not a directory")
    dest = str(blocker / "sp" if under else blocker)
    extra = ["--max-parallelism", "4", "--unpickle"] if command == "rekey" else []
    code, _, err = run_cli(capsys, [command, job_root, "latest", dest, *extra])
    where = f"lies under {blocker}, which is a file" if under else "is a file"
    assert code == 2 and f"{dest}: {where}, not a directory;" in err and err.count("\n") == 1, err
    assert "NotADirectoryError" not in err and "credentials" not in err
    assert blocker.read_text() == "not a directory"
