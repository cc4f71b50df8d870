"""``abs-snapshot``: inspect and maintain snapshot roots.

Commands dispatch to :mod:`storage` and :mod:`recovery`. Exit codes: 0 success,
1 problems found in the data (verify, corrupt files, GC refused), 2 usage errors and
unreadable / unknown roots or ids, 3 a bug (an unexpected exception). Errors print one
line to stderr, no traceback (``abs-snapshot --traceback COMMAND ...`` shows it for a bug).
Every ID argument also takes ``latest``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Sequence

from storage import (
    CheckpointNotFoundError,
    CorruptManifestError,
    SnapshotStore,
    StateNotFoundError,
    StorageConfigError,
    StorageError,
    StorageUnavailableError,
    UnsupportedFormatError,
)
from storage.format import DEFAULT_DECODE_LIMITS, DecodeLimits
from storage.inspect import corrupt_lines, dump_lines, human_bytes, list_lines, parse_storage_options, show_lines

if TYPE_CHECKING:  # pragma: no cover
    from storage import Manifest

__all__ = ["main", "build_parser"]

_USAGE_ERRORS = (StorageUnavailableError, StorageConfigError, CheckpointNotFoundError, StateNotFoundError)


class _RootMissing(StorageError):
    """The path given as ROOT holds no snapshots. Remedy: check the path / URL."""


LATEST = "latest"


def _checkpoint_id(text: str) -> int | str:
    """An ID argument: a checkpoint id >= 1, or ``latest``."""
    if text.strip().lower() == LATEST:
        return LATEST
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint id; use a number from 'abs-snapshot ls ROOT' "
                                         "or 'latest'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a checkpoint id; ids start at 1 (or use 'latest')")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
               "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def _size(text: str) -> int:
    """A byte count: ``1073741824``, ``512MiB``, ``4GiB``."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a number with KiB, MiB, GiB or TiB")
    return int(match.group(1)) * unit


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="abs-snapshot", description="Inspect and maintain ABS snapshot roots.")
    parser.add_argument("--traceback", action="store_true",
                        help="on an unexpected error, print the Python traceback (for bug reports)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("root", metavar="ROOT", help="snapshot root: path, file://, memory://, s3://bucket/prefix")
    common.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; JSON values; dotted keys nest), "
                             "e.g. endpoint_url=http://127.0.0.1:9000")
    common.add_argument("--quiet", "-q", action="store_true",
                        help="no progress bars (they are drawn only when stderr is a terminal anyway)")
    limits = DEFAULT_DECODE_LIMITS
    common.add_argument("--max-decoded-bytes", type=_size, metavar="SIZE",
                        help=f"how far one state file may expand when decoded (default: {limits.max_ratio:g} times "
                             f"its size, at least {limits.min_bytes >> 20} MiB, at most {limits.max_bytes >> 30} GiB); "
                             "files beyond it are refused as corrupt (e.g. compression bombs); e.g. 32GiB")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("ls", parents=[common], help="list complete checkpoints")

    p = sub.add_parser("show", parents=[common], help="summarise a checkpoint (default: the latest) per state")
    p.add_argument("id", nargs="?", type=_checkpoint_id, metavar="ID", help="a checkpoint id or 'latest' (default)")
    p.add_argument("--key-groups", action="store_true", help="also print every key group's chain")
    p.add_argument("--files", action="store_true", help="also print every key group's chain with its files")

    p = sub.add_parser("dump", parents=[common], help="print the resolved rows of a keyed state")
    p.add_argument("id", type=_checkpoint_id, metavar="ID", help="a checkpoint id or 'latest'")
    p.add_argument("--operator", required=True, metavar="UID")
    p.add_argument("--state", required=True, metavar="NAME")
    p.add_argument("--key-group", type=int, metavar="G", help="one key group (default: all)")
    p.add_argument("--format", choices=("table", "jsonl"), default="table")
    p.add_argument("--limit", type=int, default=100, metavar="N", help="at most N rows (0 = all; default 100)")
    p.add_argument("--unpickle", action="store_true",
                   help="unpickle pickled keys/values (runs code from the snapshot: only for snapshots you trust)")

    p = sub.add_parser("verify", parents=[common], help="check manifests, chains, sizes and checksums")
    p.add_argument("id", nargs="?", type=_checkpoint_id, metavar="ID", help="one checkpoint or 'latest' (default: all)")

    p = sub.add_parser("gc", parents=[common], help="delete checkpoints beyond retention and unreferenced files")
    p.add_argument("--retain", type=int, required=True, metavar="K", help="keep the K newest checkpoints (+ savepoints)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.add_argument("--job-stopped", action="store_true",
                   help="the job is not running: also delete unreferenced files of attempts newer than the newest "
                        "complete checkpoint (never use while the job runs)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not read the kept checkpoints' files first (by default GC verifies them, newest first, "
                        "and also keeps the newest intact checkpoint when every kept one is damaged)")

    p = sub.add_parser("check", parents=[common],
                       help="can a job restore this checkpoint (default: the latest) at a parallelism?")
    p.add_argument("id", nargs="?", type=_checkpoint_id, metavar="ID", help="a checkpoint id or 'latest' (default)")
    p.add_argument("--parallelism", "-p", type=int, metavar="P", help="the parallelism to restore at")
    p.add_argument("--job", metavar="FINGERPRINT.json",
                   help="the job's fingerprint (json.dump of Dataflow.fingerprint()), checked as the job would run "
                        "on ROOT (abs.run(..., storage=ROOT): a job of another name is an error; a savepoint is "
                        "checked as restore=ROOT would take it, where another name is a warning); default: check the "
                        "snapshot against its own _job.json (files, versions, parallelism bounds)")
    p.add_argument("--allow-non-restored-state", action="store_true",
                   help="state the job no longer has is dropped instead of failing the check")
    p.add_argument("--no-verify", action="store_true", help="do not read the files (skip size and checksum checks)")

    p = sub.add_parser("rescale-preview", parents=[common],
                       help="what each subtask would read when restoring at a new parallelism")
    p.add_argument("id", nargs="?", type=_checkpoint_id, metavar="ID", help="a checkpoint id or 'latest' (default)")
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="P", help="the new parallelism")
    p.add_argument("--job", metavar="FINGERPRINT.json", help="plan only the state this job declares")
    p.add_argument("--allow-non-restored-state", action="store_true", help="with --job: drop state the job lost")

    p = sub.add_parser("savepoint", parents=[common], help="copy a checkpoint into a self-contained, pinned savepoint")
    p.add_argument("id", type=_checkpoint_id, metavar="ID", help="a checkpoint id or 'latest'")
    p.add_argument("dest", metavar="DEST", help="destination root: an empty directory, an existing savepoint root, or ROOT itself (a copy of an older checkpoint there becomes its latest)")
    p.add_argument("--dest-storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option of DEST (default: DEST of the same protocol reuses ROOT's file system)")
    _spark_arguments(p, "resolve the key groups on Spark executors (DEST must be a new, empty root)")

    p = sub.add_parser("rekey", parents=[common],
                       help="rewrite a checkpoint into a savepoint with another max_parallelism (number of key groups)")
    p.add_argument("id", type=_checkpoint_id, metavar="ID", help="a checkpoint id or 'latest'")
    p.add_argument("dest", metavar="DEST", help="destination root: a new, empty directory or prefix")
    p.add_argument("--max-parallelism", type=int, required=True, metavar="N",
                   help="the new number of key groups (1..32768); restore with Dataflow(..., max_parallelism=N)")
    p.add_argument("--dest-storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option of DEST (default: DEST of the same protocol uses ROOT's options)")
    _spark_arguments(p, "re-key on Spark executors (default: in this process; every live row passes through memory)")
    p.add_argument("--unpickle", action="store_true",
                   help="allow unpickling pickled keys to hash them again (runs code from the snapshot: only for "
                        "roots you trust); without it a state with pickled keys is refused")

    # --output has no short form: -o is a storage option here as in every other command (_report
    # names --output when given -o FILE, the form this command once took)
    p = sub.add_parser("report", help="write an HTML report of the root's checkpoints (one file, opens offline)")
    p.add_argument("root", metavar="ROOT", help="snapshot root: path, file://, memory://, s3://bucket/prefix")
    p.add_argument("--output", metavar="FILE", help="the HTML file to write (e.g. report.html); required")
    p.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option of ROOT (repeatable; JSON values; dotted keys nest)")
    p.add_argument("--max-decoded-bytes", type=_size, metavar="SIZE", help=argparse.SUPPRESS)
    return parser


def _spark_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--spark", action="store_true", help=what)
    p.add_argument("--master", metavar="URL",
                   help="with --spark: the Spark master (default local[*]); the active SparkSession is used if any")


def _open(args: argparse.Namespace) -> SnapshotStore:
    try:
        options = parse_storage_options(args.storage_option)
    except ValueError as exc:
        raise StorageConfigError(f"{exc}; use --storage-option key=value") from exc
    store = SnapshotStore.open(args.root, options, decode_limits=_decode_limits(args))
    if not store.exists():
        raise _RootMissing(f"{args.root}: holds no snapshots (no _job.json, no manifests); check the path or URL")
    return store


def _decode_limits(args: argparse.Namespace) -> DecodeLimits:
    return DEFAULT_DECODE_LIMITS if args.max_decoded_bytes is None else DecodeLimits.fixed(args.max_decoded_bytes)


def _resolve_id(store: SnapshotStore, args: argparse.Namespace, *, default_latest: bool) -> int | None:
    """``args.id`` as a checkpoint id: ``latest`` (or no ID with ``default_latest``) is the
    newest complete checkpoint."""
    if args.id is None and not default_latest:
        return None
    if args.id is None or args.id == LATEST:
        cid = store.latest_checkpoint()
        if cid is None:
            raise CheckpointNotFoundError(f"{args.root}: holds no complete checkpoint, so 'latest' names none; "
                                          "take a checkpoint first")
        for line in corrupt_lines(store, newer_than=cid):  # newer manifests that do not read: say so
            print(line, file=sys.stderr)
        return cid
    return int(args.id)


def _out(lines: Sequence[str]) -> None:
    for line in lines:
        print(line)


def _ls(args: argparse.Namespace) -> int:
    _out(list_lines(_open(args)))
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _open(args)
    cid = _resolve_id(store, args, default_latest=True)
    assert cid is not None
    manifest = store.read_manifest(cid)
    unreadable: list[str] = []
    images = store.values_images(manifest, unreadable)
    _out(show_lines(manifest, files=args.files, key_groups=args.key_groups, values_images=images, unreadable=unreadable))
    return 0


def _dump(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise StorageConfigError(f"--limit {args.limit}: use N >= 0 (0 = all rows)")
    store = _open(args)
    manifest = store.read_manifest(_resolve_id(store, args, default_latest=True))  # type: ignore[arg-type]
    _out(dump_lines(store, manifest, args.operator, args.state, key_group=args.key_group, fmt=args.format,
                    limit=args.limit or None, unpickle=args.unpickle))
    return 0


def _progress(args: argparse.Namespace) -> Any:
    """Progress bars on stderr for a long command, unless it is not a terminal or --quiet."""
    from abs.observe.progress import terminal_progress

    return terminal_progress(quiet=args.quiet)


def _verify(args: argparse.Namespace) -> int:
    store = _open(args)
    cid = _resolve_id(store, args, default_latest=False)
    try:  # a restore reads the root's job fingerprint first
        store.read_job()
        job_problem = None
    except CorruptManifestError as exc:
        job_problem = f"problem: {exc}"
    with _progress(args) as progress:
        report = store.verify(cid, progress=progress)
    if cid is not None and cid in report.removed:
        raise CheckpointNotFoundError(
            f"{args.root}: checkpoint {cid} was removed while verifying it (deleted by a GC meanwhile, e.g. the "
            "retention of a job writing this root); verify a newer one ('abs-snapshot ls ROOT' lists them)")
    _out(([job_problem] if job_problem else []) + report.lines())
    return 0 if not report.damaged and job_problem is None else 1


def _gc(args: argparse.Namespace) -> int:
    if args.retain < 1:
        raise StorageConfigError(f"--retain {args.retain}: GC keeps at least the newest checkpoint; use K >= 1")
    store = _open(args)
    guard = None
    if args.job_stopped:
        guard = max(store.next_checkpoint_id() - 1, 0)
    retain = args.retain
    if not args.no_verify:
        retain, notes = _intact_retention(store, retain)
        _out(notes)
    with _progress(args) as progress:
        plan = store.gc(retain, protect_newer_than=guard, dry_run=args.dry_run, progress=progress)
    verb = "would delete" if args.dry_run else "deleted"
    _out([f"{verb} {p}" for p in plan.delete_files + plan.delete_manifests])
    _out([("dry run: " if args.dry_run else "") + plan.summary()])
    return 0


def _intact_retention(store: SnapshotStore, retain: int) -> tuple[int, list[str]]:
    """The retention that keeps a checkpoint a restore can use: ``retain`` when one of the
    ``retain`` newest checkpoints verifies (checked newest first, stopping at the first intact
    one), else enough to keep the newest intact checkpoint below them. A GC that kept only
    damaged checkpoints would delete the last one a restore could fall back to. Raises when no
    checkpoint verifies (nothing is deleted then). A checkpoint removed while it is verified
    (a job writing the root dropped it by retention) is not damaged: the checkpoints are
    listed again."""
    for _ in range(_RELISTS):
        try:
            ids = _checkpoint_ids(store)
        except UnsupportedFormatError:
            return retain, []  # the GC itself refuses such a root, naming the manifest
        damaged: list[int] = []
        for at, cid in enumerate(ids):
            try:
                report = store.verify(cid)
            except CheckpointNotFoundError:
                break  # removed since the listing: list again
            if cid in report.removed:
                break  # list again
            if report.ok:
                if at < retain:
                    notes = [f"checkpoint(s) {sorted(damaged)} among the {retain} kept are damaged (abs-snapshot "
                             f"verify {store.url} names the problems); checkpoint {cid} is intact"] if damaged else []
                    return retain, notes
                return at + 1, [
                    f"checkpoint(s) {sorted(damaged)} are damaged (abs-snapshot verify {store.url} names the problems); "
                    f"keeping every checkpoint down to {cid}, the newest intact one, which a restore falls back to "
                    f"(retain {at + 1} instead of {retain})"]
            damaged.append(cid)
        else:
            if not ids:
                return retain, []
            raise StorageError(
                f"{store.url}: no checkpoint is intact (checked {sorted(damaged)}; abs-snapshot verify {store.url} names "
                "the problems); GC refused so that nothing a repair may need is deleted, nothing was deleted; pass "
                "--no-verify to collect garbage anyway"
            )
    raise StorageError(
        f"{store.url}: the checkpoints GC verified were removed meanwhile, {_RELISTS} times over (a job writing the root "
        "drops them by its retention faster than they verify); nothing was deleted; run GC while the job is stopped, or "
        "pass --no-verify")


_RELISTS = 5


def _checkpoint_ids(store: SnapshotStore) -> list[int]:
    """The root's checkpoints of kind ``checkpoint``, newest first (a manifest deleted since
    the listing is left out)."""
    ids = []
    for cid in store.list_checkpoints():
        try:
            if store.read_manifest(cid).kind == "checkpoint":
                ids.append(cid)
        except CheckpointNotFoundError:
            continue
    return sorted(ids, reverse=True)


def _read_job_file(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise StorageConfigError(
            f"--job {path}: cannot read a JSON job fingerprint ({exc}); write it with "
            "json.dump(flow.fingerprint(), f)"
        ) from exc
    import recovery

    try:
        recovery.JobFingerprint.parse(doc, source=f"--job {path}")
    except recovery.FingerprintFormatError as exc:
        raise StorageConfigError(str(exc)) from exc
    return doc


def _check_parallelism_arg(value: int | None) -> None:
    if value is not None and value < 1:
        raise StorageConfigError(f"--parallelism {value}: use P >= 1")


def _check(args: argparse.Namespace) -> int:
    import recovery

    _check_parallelism_arg(args.parallelism)
    job = _read_job_file(args.job)
    store = _open(args)
    cid = _resolve_id(store, args, default_latest=False)
    report = recovery.check(job, store, checkpoint_id=cid, parallelism=args.parallelism,
                            allow_non_restored_state=args.allow_non_restored_state, verify_files=not args.no_verify,
                            storage_root=not _is_savepoint(store, cid))
    _out(report.lines())
    return 0 if report.ok else 1


def _is_savepoint(store: SnapshotStore, cid: int | None) -> bool:
    """Whether the checkpoint ``check`` looks at (``None``: the latest) is a savepoint: a job
    restores it as a savepoint path (restore=ROOT) into a root of its own, where another job
    name is only a warning; a checkpoint is checked as the job would run on ROOT (abs.run(...,
    storage=ROOT)), which refuses a root of another job."""
    cid = store.latest_checkpoint() if cid is None else cid
    if cid is None:
        return False
    try:
        return store.read_manifest(cid).kind == "savepoint"
    except StorageError:
        return False  # check names the problem


def _rescale_preview(args: argparse.Namespace) -> int:
    import recovery

    _check_parallelism_arg(args.parallelism)
    job = _read_job_file(args.job)
    store = _open(args)
    cid = _resolve_id(store, args, default_latest=True)
    assert cid is not None
    plan = recovery.plan_restore(store.read_manifest(cid), job, args.parallelism,
                                 allow_non_restored_state=args.allow_non_restored_state)
    _out(plan.describe().splitlines())
    return 0


def _dest_options(args: argparse.Namespace) -> dict | None:
    if not args.dest_storage_option:
        return None
    try:
        return parse_storage_options(args.dest_storage_option)
    except ValueError as exc:
        raise StorageConfigError(f"{exc}; use --dest-storage-option key=value") from exc


def _root_options(args: argparse.Namespace) -> dict:
    try:
        return parse_storage_options(args.storage_option)
    except ValueError as exc:
        raise StorageConfigError(f"{exc}; use --storage-option key=value") from exc


def _check_master_arg(args: argparse.Namespace) -> None:
    if args.master is not None and not args.spark:
        raise StorageConfigError(f"--master {args.master}: only used with --spark; add --spark or drop --master")


def _resolve_latest(args: argparse.Namespace) -> None:
    """Replace ``args.id == 'latest'`` by the newest complete checkpoint's id."""
    if args.id == LATEST:
        args.id = _resolve_id(_open(args), args, default_latest=True)


def _rewrite_with_spark(args: argparse.Namespace, max_parallelism: int | None) -> "Manifest":
    """Check everything that does not need Spark first, then start (or reuse) a session."""
    import recovery.spark as rspark

    rspark.require_pyspark()
    job = rspark.plan(args.root, args.id, args.dest, max_parallelism=max_parallelism,
                      storage_options=_root_options(args), dest_storage_options=_dest_options(args),
                      unpickle=getattr(args, "unpickle", False), decode_limits=_decode_limits(args))
    with rspark.spark_session(args.master or "local[*]", app_name=f"abs-snapshot {args.command}") as spark:
        with _progress(args) as progress:
            return rspark.execute(spark, job, progress=progress)


def _rewrite_summary(saved: "Manifest") -> str:
    files = saved.files()
    rewrite = saved.stats.get("rewrite", {})
    how = f" with Spark ({rewrite.get('tasks')} task(s), {rewrite.get('seconds')} s)" if rewrite.get("engine") == "spark" else ""
    return f"{len(saved.paths())} file(s), {human_bytes(sum(r.bytes for r in files.values()))}{how}"


def _pinned(args: argparse.Namespace) -> Any:
    """Hold checkpoint ``args.id`` of ROOT against every GC (a job may run on it) while it is
    copied; a root that cannot be pinned is left to the rewrite to report."""
    import contextlib

    try:
        store = SnapshotStore.open(args.root, _root_options(args))
        if store.exists():
            return store.pin(args.id, args.id, holder=f"abs-snapshot {args.command}")
    except (StorageError, ValueError):
        pass
    return contextlib.nullcontext()


def _savepoint(args: argparse.Namespace) -> int:
    _check_master_arg(args)
    _resolve_latest(args)
    if args.spark:
        with _pinned(args):
            saved = _rewrite_with_spark(args, None)
        _out([f"savepoint {saved.checkpoint_id} of checkpoint {args.id} written to {args.dest} "
              f"({_rewrite_summary(saved)}); pinned until deleted; restore with restore={args.dest!r}"])
        return 0
    store = _open(args)
    options = _dest_options(args)
    with _progress(args) as progress:
        saved = store.savepoint(args.id, args.dest, options, progress=progress)
    files = saved.files()
    _out([f"savepoint {saved.checkpoint_id} of checkpoint {args.id} written to {args.dest} "
          f"({len(saved.paths())} file(s), {human_bytes(sum(r.bytes for r in files.values()))}); pinned until deleted; "
          f"restore with restore={args.dest!r}"])
    if saved.checkpoint_id != args.id and store.url.rstrip("/") == SnapshotStore.open(args.dest, options).url.rstrip("/"):
        _out([f"note: it is now the newest checkpoint of {args.dest}: restore='latest' there restores checkpoint "
              f"{args.id}'s state, and a sink that can roll back drops the output committed after it"])
    return 0


def _rekey(args: argparse.Namespace) -> int:
    _check_master_arg(args)
    from recovery.rewrite import check_new_max_parallelism, rekey_local

    check_new_max_parallelism(args.max_parallelism)
    _resolve_latest(args)
    with _pinned(args):
        if args.spark:
            saved = _rewrite_with_spark(args, args.max_parallelism)
        else:
            with _progress(args) as progress:
                saved = rekey_local(args.root, args.id, args.dest, max_parallelism=args.max_parallelism,
                                    storage_options=_root_options(args), dest_storage_options=_dest_options(args),
                                    unpickle=args.unpickle, decode_limits=_decode_limits(args), progress=progress)
    old = saved.stats.get("rewrite", {}).get("max_parallelism_from")
    _out([f"re-keyed checkpoint {args.id} of {args.root} from max_parallelism {old} to {saved.max_parallelism}: "
          f"savepoint {saved.checkpoint_id} written to {args.dest} ({_rewrite_summary(saved)}); restore it into a "
          f"Dataflow(..., max_parallelism={saved.max_parallelism}) with restore={args.dest!r}"])
    return 0


def _report(args: argparse.Namespace) -> int:
    from abs.observe.report import collect_report, render_report

    files = [o for o in args.storage_option if "=" not in o]
    if files:
        raise StorageConfigError(f"report: -o {files[0]} is not a storage option (KEY=VALUE); name the HTML file to "
                                 f"write with --output FILE (e.g. --output {files[0]}); -o KEY=VALUE is a storage "
                                 "option, as in the other commands")
    if args.output is None:
        raise StorageConfigError("report: no output file; name the HTML file to write with --output FILE "
                                 "(e.g. --output report.html)")
    data = collect_report(_open(args))
    page = render_report(data)
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        raise StorageConfigError(f"--output {args.output}: cannot write the report ({exc.strerror or exc}); "
                                 "pick a writable path") from exc
    for cid, why in data.corrupt:
        print(f"note: checkpoint {cid}: manifest does not read ({why}); left out of the report", file=sys.stderr)
    if data.garbage_unknown is not None:
        print(f"note: garbage not counted: {data.garbage_unknown}", file=sys.stderr)
    _out([f"report of {len(data.checkpoints)} checkpoint(s) of job {data.job_name!r} ({data.checkpoints[0].checkpoint_id}"
          f"..{data.newest}) written to {args.output}; open it in a browser (no server, no network needed)"])
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": _ls, "show": _show, "dump": _dump, "verify": _verify, "gc": _gc,
    "check": _check, "rescale-preview": _rescale_preview, "savepoint": _savepoint, "rekey": _rekey,
    "report": _report,
}


def _error(message: object) -> None:
    """One line on stderr (a message spanning lines, e.g. a Spark error, keeps its first
    lines only: the cause comes first)."""
    lines = str(message).strip().splitlines() or ["(no message)"]
    text = " ".join(line.strip() for line in lines[:3]) + (" ..." if len(lines) > 3 else "")
    print(f"abs-snapshot: error: {text}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from abs.errors import AbsError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage message
        return int(exc.code or 0)
    try:
        return _COMMANDS[args.command](args)
    except (_RootMissing, *_USAGE_ERRORS) as exc:
        _error(exc)
        return 2
    except (StorageError, AbsError, ValueError) as exc:
        _error(exc)
        return 1
    except BrokenPipeError:
        return 0
    except MemoryError:
        _error(f"{args.root}: ran out of memory; the snapshot holds more state than fits, or a corrupt file "
               "expands beyond what this machine holds; lower --max-decoded-bytes or run with more memory")
        return 1
    except RecursionError:
        _error(f"{args.root}: a manifest or file is nested too deeply to read; it is corrupt; use another checkpoint")
        return 1
    except Exception as exc:  # noqa: BLE001 - never a traceback to a CLI user, unless asked
        if args.traceback:
            traceback.print_exc()
        _error(f"{args.command} failed unexpectedly ({type(exc).__name__}: {exc}); this is a bug in abs-snapshot: "
               "please report it with the output of --traceback")
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
