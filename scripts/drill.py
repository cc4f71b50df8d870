"""Fault drill: random, seed-reproducible fault schedules against an exactly-once job.

The job: a GeneratorSource (each event: key ``i % keys``, value 1) keyed by ``key`` into a
running sum per key (``process`` + ``ValueState``), whose every output record goes to a
``FileSink`` (jsonl). The driver runs in a subprocess (so it can be killed); the drill injects
one fault per schedule, waits for the job, then compares

* the sink's committed output with the multiset ``{(k, 1), (k, 2), ..., (k, n_k)}``
  computed from the generator's events, and
* the state of the last checkpoint (read with ``storage.SnapshotStore``) with ``n_k``.

Classes: exact, lost, duplicated, stuck, failed with restarts left, failed with restarts
exhausted (allowed, counted apart). Exit code 1 when any schedule is lost, duplicated,
stuck or failed with restarts left.

Lives in ``scripts/`` (not ``abs/``): it is an operator's tool with process-tree and mount
tricks, not API a job imports. Run through ``scripts/drill``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    "kill_worker",      # kill -9 of a worker process
    "kill_writer",      # kill -9 of a worker's snapshot-writer process (child of a worker)
    "kill_driver",      # kill -9 of the driver, then restore="latest" in a new driver
    "start_fault",      # a worker kills or hangs itself while workers connect (first run or restart)
    "restore_fault",    # kill a worker, then a worker kills or hangs itself while restoring state
    "sigstop_worker",   # SIGSTOP of a worker past the heartbeat timeout
    "disk_full",        # root on a small tmpfs, filled up for a while during the job
    "s3_outage",        # root on S3 (moto), server stopped and restarted during the job
    "corrupt_between",  # kill -9 driver; truncate / bit-flip / delete a file; restore
)
DRILL_ERROR = "drill error"
BAD = ("lost", "duplicated", "stuck", "failed with restarts left", DRILL_ERROR)
REFUSED = "refused: no intact checkpoint"
CLASSES = ("exact",) + BAD + ("failed, restarts exhausted", REFUSED, "skipped")

OP, STATE, SINK = "sum", "total", "out"


# --------------------------------------------------------------------------- the job (driver side)


def _sum(ctx: Any, event: dict) -> None:
    s = ctx.state.total
    v = (s.value() or 0) + event["value"]
    s.update(v)
    ctx.emit({"key": ctx.key, "sum": v})


def _driver_main(cfg: dict) -> int:
    """Runs in the driver subprocess: the job, then a result line on the result file."""
    import pyarrow as pa

    import abs
    from abs.faults import Fault
    from abs.connectors.file_sink import FileSink

    flow = abs.Dataflow("drill", max_parallelism=64)
    src = abs.GeneratorSource(cfg["events"], num_keys=cfg["keys"], num_splits=4, batch_size=512, rate=cfg["rate"])
    flow.source("events", src).key_by("key").process(OP, _sum, state=[abs.ValueState(STATE, pa.int64())]).sink(
        SINK, FileSink(cfg["out"], format="jsonl", storage_options=cfg["options"] or None)
    )
    out: dict = {"status": None, "restarts": None, "error": None}
    try:
        result = abs.run(
            flow,
            parallelism=cfg["p"],
            checkpoint=abs.CheckpointConfig(interval=0.2, timeout=cfg["checkpoint_timeout"], tolerable_failures=1000),
            storage=cfg["root"],
            storage_options=cfg["options"] or None,
            restore=cfg["restore"],
            restart=abs.RestartStrategy(max_restarts=cfg["max_restarts"], delay=0.2),
            runtime=abs.RuntimeOptions(heartbeat_timeout=cfg["heartbeat"], faults=tuple(Fault(*f) for f in cfg["faults"])),
        )
        out.update(status=result.status, restarts=len(result.restarts))
    except abs.AbsError as exc:
        res = getattr(exc, "result", None)
        out.update(status="FAILED", error=f"{type(exc).__name__}: {exc}"[:500],
                   restarts=None if res is None else len(res.restarts))
    except Exception as exc:  # noqa: BLE001 - reported, classified by the drill
        out.update(status="FAILED", error=f"{type(exc).__name__}: {exc}"[:500])
    with open(cfg["result"], "w") as f:
        json.dump(out, f)
    return 0


# --------------------------------------------------------------------------- process tree


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(d))
    return sorted(kids)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _workers(driver: int) -> list[int]:
    return [c for c in _children(driver) if "abs" in _cmdline(c) or "python" in _cmdline(c)]


def _writers(driver: int) -> list[int]:
    return [g for w in _workers(driver) for g in _children(w)]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# --------------------------------------------------------------------------- schedules


@dataclass
class Schedule:
    seed: int
    kind: str
    p: int
    root_kind: str
    at: float  # seconds after start when the external fault happens
    detail: dict = field(default_factory=dict)


def draw_kind(seed: int, kinds: tuple[str, ...] = KINDS) -> str:
    """The fault kind of ``seed`` among ``kinds`` (its own random stream, so the details
    of a schedule depend on the seed and the kind alone)."""
    return kinds[random.Random(f"kind:{seed}").randrange(len(kinds))]


def make_schedule(seed: int, p: int, root_kind: str, kind: str) -> Schedule:
    """A pure function of its arguments: the same seed and kind give the same schedule."""
    rng = random.Random(seed)
    s = Schedule(seed, kind, p, "s3" if kind == "s3_outage" else root_kind, at=round(rng.uniform(0.3, 2.0), 3))
    d = s.detail
    d["victim"] = rng.randrange(p)
    if kind == "start_fault":
        d["attempt"] = rng.choice([0, 1])
        d["point"] = rng.choice(["before_connect", "after_connect"])
        d["action"] = rng.choice(["kill", "hang"])
    elif kind == "restore_fault":
        d["nth"] = 1
        d["action"] = rng.choice(["kill", "hang"])
    elif kind == "sigstop_worker":
        d["stopped_for"] = "forever"
    elif kind == "disk_full":
        d["full_for"] = round(rng.uniform(0.5, 2.0), 3)
    elif kind == "s3_outage":
        d["down_for"] = round(rng.uniform(0.5, 3.0), 3)
    elif kind == "corrupt_between":
        d["damage"] = rng.choice(["truncate", "bitflip", "delete"])
        d["target"] = rng.choice(["manifest", "state", "any"])
        d["pick"] = rng.random()
        d["offset"] = rng.random()
    elif kind == "kill_driver":
        d["second_kill"] = rng.random() < 0.3
        d["at2"] = round(rng.uniform(0.3, 1.5), 3)
    return s


@dataclass
class Outcome:
    cls: str
    note: str
    missed: bool = False  # the fault did not land (the job ended first, or needed no restart)


class _S3:
    """A moto server on loopback, stoppable and restartable on the same port (its data lives
    in this process, so it survives a restart)."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.options = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": f"http://{self.host}:{self.port}",
            "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 2},
        }
        import fsspec

        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.options)
        self.fs.mkdir("drill")

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        for _ in range(50):
            try:
                self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
                self.server.start()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"drill: the S3 server could not be restarted on port {self.port}")

    def close(self) -> None:
        try:
            self.server.stop()
        except Exception:  # noqa: BLE001
            pass


class Drill:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = tempfile.mkdtemp(prefix="abs-drill-")
        self._s3: _S3 | None = None
        self.tmpfs_ok: bool | None = None

    # ---- environment
    def s3(self) -> _S3:
        if self._s3 is None:
            self._s3 = _S3()
        return self._s3

    def tmpfs(self, name: str) -> str | None:
        d = os.path.join(self.base, name)
        os.makedirs(d, exist_ok=True)
        if self.tmpfs_ok is False:
            return None
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", d], capture_output=True, text=True)
        self.tmpfs_ok = r.returncode == 0
        if not self.tmpfs_ok:
            print(f"note: disk_full schedules skipped: cannot mount a tmpfs ({r.stderr.strip() or 'mount failed'}); run as root to include them")
            return None
        return d

    def keep(self, sch: Schedule) -> str:
        """Move a schedule's directory (its drivers' logs and, for local roots, its data) out
        of the drill's temporary directory, which ``close`` deletes."""
        src = os.path.join(self.base, f"s{sch.seed}")
        dst = tempfile.mkdtemp(prefix=f"abs-drill-seed{sch.seed}-")
        for name in os.listdir(src):
            shutil.move(os.path.join(src, name), dst)
        return dst

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.close()
        for d in os.listdir(self.base):
            subprocess.run(["umount", os.path.join(self.base, d)], capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)

    # ---- one driver run
    def _launch(self, cfg: dict) -> subprocess.Popen:
        path = os.path.join(cfg["dir"], f"cfg-{cfg['run']}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        log = open(os.path.join(cfg["dir"], f"driver-{cfg['run']}.log"), "w")
        # the checkout this script belongs to comes first (whatever the interpreter has installed)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here] + [p for p in sys.path if p]))
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_driver", path], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _reap(self, proc: subprocess.Popen) -> None:
        """Kill whatever the run left behind (orphaned workers of a killed driver)."""
        for pid in _descendants(proc.pid):
            _kill(pid)
        _kill(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def run(self, sch: Schedule) -> Outcome:
        a = self.args
        d = sch.detail
        sdir = os.path.join(self.base, f"s{sch.seed}")
        os.makedirs(sdir, exist_ok=True)
        options: dict = {}
        if sch.kind == "disk_full":
            mnt = self.tmpfs(f"t{sch.seed}")
            if mnt is None:
                return Outcome("skipped", "tmpfs mount not permitted")
            root, out = os.path.join(mnt, "snap"), os.path.join(mnt, "out")
        elif sch.root_kind == "s3":
            s3 = self.s3()
            options = s3.options
            root, out = f"s3://drill/s{sch.seed}/snap", f"s3://drill/s{sch.seed}/out"
        else:
            root, out = os.path.join(sdir, "snap"), os.path.join(sdir, "out")
        faults: list = []
        if sch.kind == "start_fault":
            faults.append([d["point"], f"task0#{d['victim']}", 1, d["attempt"], d["action"]])
        elif sch.kind == "restore_fault":
            faults.append(["restore", "*", d["nth"], 1, d["action"]])
        cfg = dict(dir=sdir, run=0, events=a.events, keys=a.keys, rate=a.events / 4 / a.duration, out=out,
                   options=options, p=sch.p, root=root, restore=None, max_restarts=a.max_restarts,
                   heartbeat=a.heartbeat, checkpoint_timeout=10.0, faults=faults,
                   result=os.path.join(sdir, "result-0.json"))
        deadline = time.monotonic() + a.stuck_after
        notes: list[str] = []
        missed = False
        proc = self._launch(cfg)
        t0 = time.monotonic()
        try:
            runs_left = 3
            while True:
                killed_driver = False
                external = (sch.kind in ("kill_worker", "kill_writer", "restore_fault", "sigstop_worker",
                                         "disk_full", "s3_outage")
                            or (sch.kind == "start_fault" and d["attempt"] == 1)) and cfg["run"] == 0
                driver_kill = sch.kind in ("kill_driver", "corrupt_between") and (
                    cfg["run"] == 0 or (cfg["run"] == 1 and d.get("second_kill")))
                at = sch.at if cfg["run"] == 0 else d.get("at2", 1.0)
                if external or driver_kill:
                    # the fault's time counts from the moment every worker runs (with its
                    # writer process), not from the driver's start, which load stretches
                    t0 = self._wait_ready(proc, sch.p, deadline) or t0
                    if self._wait(proc, t0 + at, deadline):
                        external = driver_kill = False  # finished before the fault's time
                        missed = True
                        notes.append(f"the job ended before the fault's time ({at}s)")
                if external:
                    notes.append(self._external(sch, proc, mnt if sch.kind == "disk_full" else None))
                if driver_kill:
                    _kill(proc.pid)
                    proc.wait()
                    killed_driver = True
                    notes.append(f"driver killed at {at}s (run {cfg['run']})")
                if not killed_driver:
                    if not self._wait(proc, None, deadline):
                        self._reap(proc)
                        return Outcome("stuck", "; ".join(notes + [f"no end within {a.stuck_after:.0f} s"]))
                self._reap(proc)
                if killed_driver:
                    if sch.kind == "corrupt_between":
                        notes.append(self._damage(sch, root, options))
                    runs_left -= 1
                    if runs_left == 0:
                        break
                    cfg = dict(cfg, run=cfg["run"] + 1, restore="latest-if-any", faults=[],
                               result=os.path.join(sdir, f"result-{cfg['run'] + 1}.json"))
                    proc = self._launch(cfg)
                    t0 = time.monotonic()
                    continue
                break
        finally:
            self._reap(proc)
        outcome = self._check(sch, cfg, root, out, options, notes)
        if sch.kind in ("start_fault", "restore_fault") and "restarts 0" in outcome.note:
            missed = True  # the fault point was never reached in the attempt it names
        outcome.missed = missed
        return outcome

    def _wait_ready(self, proc: subprocess.Popen, p: int, deadline: float) -> float | None:
        """The time at which ``p`` workers of ``proc`` run, each with its writer process
        (None: ``proc`` ended, or the deadline passed, first)."""
        while time.monotonic() < deadline and proc.poll() is None:
            workers = _workers(proc.pid)
            if len(workers) >= p and all(_children(w) for w in workers):
                return time.monotonic()
            time.sleep(0.02)
        return None

    def _wait(self, proc: subprocess.Popen, until: float | None, deadline: float) -> bool:
        """True when ``proc`` ended before ``until`` (None: before the deadline)."""
        end = deadline if until is None else min(until, deadline)
        while time.monotonic() < end:
            if proc.poll() is not None:
                return True
            time.sleep(0.02)
        return proc.poll() is not None

    def _external(self, sch: Schedule, proc: subprocess.Popen, mnt: str | None) -> str:
        d = sch.detail
        workers = _workers(proc.pid)
        if sch.kind in ("kill_worker", "restore_fault", "start_fault"):
            if not workers:
                return "no worker to kill"
            w = workers[d["victim"] % len(workers)]
            _kill(w)
            return f"worker pid {w} killed at {sch.at}s"
        if sch.kind == "kill_writer":
            writers = _writers(proc.pid)
            if not writers:
                return "no writer process found"
            w = writers[d["victim"] % len(writers)]
            _kill(w)
            return f"writer pid {w} killed at {sch.at}s"
        if sch.kind == "sigstop_worker":
            if not workers:
                return "no worker to stop"
            w = workers[d["victim"] % len(workers)]
            _kill(w, signal.SIGSTOP)
            return f"worker pid {w} stopped at {sch.at}s"
        if sch.kind == "disk_full":
            filler = os.path.join(mnt, "filler")
            try:  # the job may have filled it already: then opening fails too
                with open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * (1 << 16))
            except OSError:
                pass
            time.sleep(d["full_for"])
            if os.path.exists(filler):
                os.unlink(filler)
            return f"tmpfs full for {d['full_for']}s at {sch.at}s"
        if sch.kind == "s3_outage":
            s3 = self.s3()
            s3.stop()
            time.sleep(d["down_for"])
            s3.start()
            return f"S3 down for {d['down_for']}s at {sch.at}s"
        raise AssertionError(sch.kind)

    def _damage(self, sch: Schedule, root: str, options: dict) -> str:
        import fsspec

        d = sch.detail
        fs, path = fsspec.core.url_to_fs(root, **options)
        files = sorted(f for f in fs.find(path) if not f.endswith("_job.json"))
        if d["target"] == "manifest":
            cand = [f for f in files if "/checkpoints/chk-" in f and f.endswith(".json")]
            cand = cand[-1:]  # the newest
        elif d["target"] == "state":
            cand = [f for f in files if f.endswith(".arrow")]
        else:
            cand = files
        if not cand:
            return f"{d['damage']}: no {d['target']} file to damage"
        victim = cand[int(d["pick"] * len(cand)) % len(cand)]
        rel = victim[len(path.rstrip("/")) + 1:]
        if d["damage"] == "delete":
            fs.rm(victim)
        else:
            data = fs.cat_file(victim)
            if d["damage"] == "truncate":
                data = data[: int(len(data) * d["offset"])]
            elif data:
                i = int(len(data) * d["offset"]) % len(data)
                data = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
            with fs.open(victim, "wb") as f:
                f.write(data)
        return f"{d['damage']} {rel}"

    def _check(self, sch: Schedule, cfg: dict, root: str, out: str, options: dict, notes: list[str]) -> Outcome:
        a = self.args
        try:
            with open(cfg["result"]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"status": "FAILED", "error": "the driver wrote no result (it died)", "restarts": None}
        if res["status"] != "FINISHED":
            err = res.get("error") or res["status"]
            if sch.kind == "corrupt_between" and err.startswith("NoUsableCheckpointError"):
                # the damage broke every checkpoint the root holds: refusing to restore (and
                # to start fresh over them) is the right answer; the drill checks the verdict
                # against the root itself
                verdict = self._nothing_intact(root, options)
                if verdict is None:
                    return Outcome(REFUSED, "; ".join(notes + [err[:200]]))
                return Outcome("failed with restarts left", "; ".join(notes + [err, f"but {verdict}"]))
            if res.get("restarts") is not None and res["restarts"] >= a.max_restarts:
                return Outcome("failed, restarts exhausted", "; ".join(notes + [err]))
            return Outcome("failed with restarts left", "; ".join(notes + [f"restarts {res.get('restarts')}", err]))
        expected = collections.Counter(i % a.keys for i in range(a.events))
        from abs.connectors.file_sink import read_output

        try:
            table = read_output(out, format="jsonl", storage_options=options or None)
        except Exception as exc:  # noqa: BLE001
            return Outcome("lost", "; ".join(notes + [f"output unreadable: {type(exc).__name__}: {exc}"[:300]]))
        got = collections.Counter(zip(table.column("key").to_pylist(), table.column("sum").to_pylist())) if table.num_rows else collections.Counter()
        want = collections.Counter((k, s) for k, n in expected.items() for s in range(1, n + 1))
        missing = sum((want - got).values())
        extra = sum((got - want).values())
        state_note = ""
        try:
            state = self._final_state(root, options)
            bad_state = {k: (state.get(k), n) for k, n in expected.items() if state.get(k) != n}
            if bad_state:
                lo = sum(1 for k, (s, n) in bad_state.items() if s is None or s < n)
                hi = len(bad_state) - lo
                state_note = f"state wrong for {len(bad_state)} keys ({lo} short, {hi} over)"
                if hi and not extra:
                    extra = -1
                if lo and not missing:
                    missing = -1
        except Exception as exc:  # noqa: BLE001
            state_note = f"final state unreadable: {type(exc).__name__}: {exc}"[:300]
            missing = missing or -1
        info = notes + [f"restarts {res.get('restarts')}"]
        if missing:
            return Outcome("lost", "; ".join(info + [f"{max(missing, 0)} records missing", state_note]))
        if extra:
            return Outcome("duplicated", "; ".join(info + [f"{max(extra, 0)} records repeated", state_note]))
        return Outcome("exact", "; ".join(info))

    @staticmethod
    def _nothing_intact(root: str, options: dict) -> str | None:
        """None when no checkpoint of ``root`` verifies (manifest, checksums, every file and
        its rows: ``SnapshotStore.verify``) and reads back whole; else which one does."""
        from storage import SnapshotStore

        store = SnapshotStore.open(root, options or None)
        for cid in store.list_checkpoints():
            try:
                if not store.verify(int(cid)).ok:
                    continue
                m = store.read_manifest(int(cid))
                for kg in m.chains(OP, STATE):
                    store.read_key_group(m, OP, STATE, kg)
            except Exception:  # noqa: BLE001 - any failure to read makes it unusable
                continue
            return f"checkpoint {int(cid)} verifies and reads back whole"
        return None

    @staticmethod
    def _final_state(root: str, options: dict) -> dict:
        from storage import SnapshotStore

        store = SnapshotStore.open(root, options or None)
        cid = store.latest_checkpoint()
        if cid is None:
            raise RuntimeError(f"{root}: no checkpoint")
        m = store.read_manifest(int(cid))
        state: dict = {}
        for kg in sorted(m.chains(OP, STATE)):
            t = store.read_key_group(m, OP, STATE, kg)
            state.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        return state


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/drill",
        description=(
            "Run random fault schedules against an exactly-once job (FileSink + keyed running sum, "
            "local workers, RestartStrategy) and check its output and final state. Fault kinds: "
            + ", ".join(KINDS) + ". Each schedule is a pure function of its seed. Exit code 1 when any "
            "schedule is lost, duplicated, stuck or failed with restarts left."
        ),
    )
    ap.add_argument("--schedules", type=int, default=20, help="number of schedules (seeds SEED .. SEED+N-1; default 20)")
    ap.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    ap.add_argument("--replay", type=int, metavar="SEED", help="run the one schedule of SEED, printing its details")
    ap.add_argument("--p", type=int, default=2, help="parallelism, >= 2 (default 2)")
    ap.add_argument("--root", choices=("file", "s3"), default="file",
                    help="where snapshots and sink output go: local files (default) or an S3 server (moto on loopback); "
                         "s3_outage schedules always use S3, disk_full always a tmpfs")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from (default: all)")
    ap.add_argument("--cover", action="store_true", help="cycle through the kinds in order instead of drawing them (CI)")
    ap.add_argument("--events", type=int, default=100_000, help="events per job (default 100000)")
    ap.add_argument("--keys", type=int, default=300, help="distinct keys (default 300)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds the source takes for its events (default 3)")
    ap.add_argument("--max-restarts", type=int, default=4, help="RestartStrategy.max_restarts (default 4)")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat timeout, seconds (default 2)")
    ap.add_argument("--stuck-after", type=float, default=90.0, help="seconds after which a schedule counts as stuck (default 90)")
    ap.add_argument("--json", metavar="FILE", help="also write the table and the outcomes as JSON to FILE")
    args = ap.parse_args(argv)
    if args.p < 2:
        ap.error(f"--p {args.p}: the drill needs parallelism >= 2")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        ap.error(f"--kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; use some of {', '.join(KINDS)}")
    args.kinds = kinds
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--_driver"]:
        with open(argv[1]) as f:
            return _driver_main(json.load(f))
    args = parse_args(argv)
    seeds = [args.replay] if args.replay is not None else list(range(args.seed, args.seed + args.schedules))
    drill = Drill(args)
    rows: list[tuple[Schedule, Outcome]] = []
    try:
        for n, seed in enumerate(seeds):
            kind = args.kinds[n % len(args.kinds)] if args.cover else draw_kind(seed, args.kinds)
            sch = make_schedule(seed, args.p, args.root, kind)
            t = time.monotonic()
            try:
                out = drill.run(sch)
            except Exception as exc:  # noqa: BLE001 - a fault of the drill itself: counted, not hidden
                out = Outcome(DRILL_ERROR, f"{type(exc).__name__}: {exc}")
            rows.append((sch, out))
            print(f"seed {seed:>6} {sch.kind:<16} {out.cls:<27} {time.monotonic() - t:5.1f}s  {out.note}", flush=True)
            if out.cls in BAD:
                print(f"    replay: scripts/drill --replay {seed} --kinds {sch.kind}{_same_job(args)}"
                      f"; logs kept in {drill.keep(sch)}", flush=True)
            if args.replay is not None:
                print(f"schedule: {json.dumps(sch.__dict__)}")
    finally:
        drill.close()
    table = summarize(rows)
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"table": table, "schedules": [dict(seed=s.seed, kind=s.kind, cls=o.cls, note=o.note, missed=o.missed,
                                                           detail=s.detail) for s, o in rows]}, f, indent=1)
    return 1 if any(table["total"][c] for c in BAD) else 0


def _same_job(args: argparse.Namespace) -> str:
    """The options that shape the job, as a command line suffix (only those not default)."""
    out = ""
    for name in ("p", "root", "events", "keys", "duration", "max_restarts", "heartbeat"):
        value, default = getattr(args, name), parse_args([]).__dict__[name]
        if value != default:
            out += f" --{name.replace('_', '-')} {value}"
    return out


def summarize(rows: list) -> dict:
    table: dict = {"total": {c: 0 for c in CLASSES}}
    table["total"]["schedules"] = len(rows)
    table["total"]["missed"] = 0
    for sch, out in rows:
        per = table.setdefault(sch.kind, {**{c: 0 for c in CLASSES}, "schedules": 0, "missed": 0})
        per["schedules"] += 1
        per[out.cls] += 1
        table["total"][out.cls] += 1
        per["missed"] += out.missed
        table["total"]["missed"] += out.missed
    return table


def print_table(table: dict) -> None:
    cols = ("schedules",) + CLASSES + ("missed",)
    heads = ("schedules", "exact", "lost", "dup", "stuck", "fail+left", "drill-err", "fail-exh", "refused", "skipped", "missed")
    print()
    print(f"{'':<16}" + "".join(f"{h:>10}" for h in heads))
    for name in [k for k in KINDS if k in table] + ["total"]:
        print(f"{name:<16}" + "".join(f"{table[name][c]:>10}" for c in cols))
    print("fail+left: job failed with restarts left; fail-exh: failed, restarts exhausted (allowed); "
          "refused: a restore refused because the damage left no intact checkpoint (allowed); "
          "missed: the fault did not land (the job ended first), counted in its class too")


if __name__ == "__main__":
    sys.exit(main())
