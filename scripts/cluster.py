"""A Spark standalone cluster on this machine, for trying and testing jobs on ``spark://``
masters: a master, N workers (each a separate JVM with its own cores and memory) and an S3 API
server (moto) as the storage every host shares.

::

    scripts/cluster up [--hosts N] [--netns] [--dir D]   # prints the master URL and S3 endpoint
    scripts/cluster status [--dir D]
    scripts/cluster kill-host N [--dir D]                 # lose host N: SIGKILL all its processes
    scripts/cluster revive-host N [--dir D]               # start host N's worker again
    scripts/cluster down [--dir D]                        # stops exactly what `up` started

Everything runs from the installed pyspark (``SPARK_HOME`` is its package directory; the
daemons are started with its ``bin/spark-class``). ``up`` records what it started (pids with
their start times, namespaces, links) in ``D/cluster.json``; ``down`` stops those processes
(each daemon leads its own process group, which also holds the executor JVMs and Python
workers it starts) and removes those namespaces and links, nothing else.

``--netns`` (root, Linux, ``ip``): each worker runs in its own network namespace with its own
address on a private bridge the script creates (one veth pair per worker); the master and
the S3 server listen on the bridge's host address. Workers then reach each other, the master,
the S3 server and the driver only through the bridge: nothing is reachable by loopback across
"hosts". Without it, every daemon listens on 127.0.0.1.

A job's driver runs outside the workers' namespaces: with ``--netns`` it must listen on the
bridge's host address (``spark.driver.host`` = the ``driver_host`` printed by ``up``). The
workers see the ``PYTHONPATH`` the cluster was started with, and ``PYSPARK_PYTHON`` is this
interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

STATE_FILE = "cluster.json"
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "abs-cluster")
READY_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """The cluster could not be started, found or stopped; the message says why and what to do."""


# ----------------------------------------------------------------------------- helpers
def spark_home() -> Path:
    """The installed pyspark's package directory, which holds ``bin/spark-class`` and the jars."""
    try:
        import pyspark
    except ImportError as exc:
        raise ClusterError("pyspark is not installed in this interpreter; install the project with the 'spark' extra") from exc
    home = Path(pyspark.__file__).resolve().parent
    if not (home / "bin" / "spark-class").exists():
        raise ClusterError(f"pyspark at {home} has no bin/spark-class; reinstall pyspark from PyPI")
    return home


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state is [0], ppid [1], start time [19])."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process,
    not a later one that reused the pid."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def alive(proc: dict) -> bool:
    """Whether the process recorded as ``{"pid", "start"}`` still runs (not a zombie, not a reused pid)."""
    fields = _stat(proc["pid"])
    return fields is not None and fields[0] != "Z" and int(fields[19]) == proc["start"]


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise ClusterError(f"'ip {' '.join(args)}' failed: {res.stderr.strip() or res.stdout.strip()}")


def netns_available() -> str | None:
    """``None`` when network namespaces can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing"
    probe = f"absprobe{uuid.uuid4().hex[:6]}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"'ip netns add' failed here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _pick_subnet() -> str:
    """A free ``10.x.y`` /24 prefix (none of this machine's routes overlaps it)."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    for _ in range(100):
        prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f"{prefix}." not in routes:
            return prefix
    raise ClusterError("no free 10.200-250.x.0/24 subnet found for the cluster's bridge")


def _read_state(directory: str) -> dict:
    path = Path(directory) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterError(f"no cluster recorded in {directory} ({STATE_FILE} missing); start one with "
                           f"'scripts/cluster up --dir {directory}'") from None


def _write_state(state: dict) -> None:
    path = Path(state["dir"]) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def _spawn(state: dict, name: str, argv: list[str], env: dict, namespace: str | None = None) -> dict:
    """Start a daemon in its own session (its own process group), logging to ``logs/NAME.log``;
    recorded in the state file at once so that ``down`` finds it whatever happens next."""
    log_path = Path(state["dir"]) / "logs" / f"{name}.log"
    if namespace is not None:
        argv = ["ip", "netns", "exec", namespace, *argv]  # ip execs the command: same pid
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, close_fds=True)
    entry = {"pid": proc.pid, "start": _start_time(proc.pid), "log": str(log_path)}
    state["processes"][name] = entry
    _write_state(state)
    return entry


def _master_json(state: dict) -> dict:
    with urllib.request.urlopen(state["master_ui"] + "/json/", timeout=2) as resp:
        return json.loads(resp.read())


def _wait_until(what: str, check: Any, state: dict, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in state["processes"].items():
            if not alive(proc):
                raise ClusterError(f"{name} exited while waiting for {what}; see its log {proc['log']}")
        try:
            if check():
                return
        except (OSError, ValueError):
            # not up yet; ValueError: the master's UI answered /json/ with its HTML page (its
            # JSON endpoint was not mounted yet: seen once in a clean-clone run beside a CPU hog)
            pass
        time.sleep(0.3)
    raise ClusterError(f"{what} not within {timeout:.0f} s; see the logs in {state['dir']}/logs")


# ----------------------------------------------------------------------------- up / down
def up(hosts: int = 2, netns: bool = False, directory: str = DEFAULT_DIR, cores: int = 1,
       memory: str = "1g", env: dict | None = None) -> dict:
    """Start the cluster; returns its state (also in ``DIRECTORY/cluster.json``). On failure
    everything started so far is stopped again."""
    if hosts < 1:
        raise ClusterError(f"--hosts must be at least 1, got {hosts}")
    d = Path(directory).resolve()
    if (d / STATE_FILE).exists():
        old = _read_state(str(d))
        if any(alive(p) for p in old["processes"].values()) or old.get("namespaces"):
            raise ClusterError(f"a cluster recorded in {d} is still up; stop it with 'scripts/cluster down --dir {d}'")
    if netns:
        why = netns_available()
        if why is not None:
            raise ClusterError(f"--netns is not possible: {why}; run without --netns (every daemon on 127.0.0.1)")
    (d / "logs").mkdir(parents=True, exist_ok=True)
    home = spark_home()
    tag = uuid.uuid4().hex[:4]
    state: dict[str, Any] = {"dir": str(d), "netns": netns, "tag": tag, "spark_home": str(home),
                             "processes": {}, "namespaces": [], "links": [], "hosts": []}
    _write_state(state)
    try:
        _up(state, hosts, cores, memory, dict(os.environ if env is None else env))
    except BaseException:
        down(str(d))
        raise
    return state


def _up(state: dict, hosts: int, cores: int, memory: str, base_env: dict) -> None:
    tag = state["tag"]
    if state["netns"]:
        prefix = _pick_subnet()
        host_addr = f"{prefix}.1"
        bridge = f"absbr{tag}"
        _ip("link", "add", bridge, "type", "bridge")
        state["links"].append(bridge)
        _write_state(state)
        _ip("addr", "add", f"{host_addr}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(hosts):
            ns, veth, addr = f"abs{tag}-h{i}", f"absv{tag}h{i}", f"{prefix}.{10 + i}"
            _ip("netns", "add", ns)
            state["namespaces"].append(ns)
            _write_state(state)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", host_addr)
            state["hosts"].append({"name": f"host{i}", "address": addr, "namespace": ns})
        state["subnet"] = f"{prefix}.0/24"
    else:
        host_addr = "127.0.0.1"
        state["hosts"] = [{"name": f"host{i}", "address": "127.0.0.1", "namespace": None} for i in range(hosts)]
    state["host_address"] = host_addr
    state["driver_host"] = host_addr

    spark_class = str(Path(state["spark_home"]) / "bin" / "spark-class")
    env = _daemon_env(state, base_env)
    (Path(state["dir"]) / "conf").mkdir(exist_ok=True)

    # the S3 API server: the storage every host shares
    s3_port = _free_port(host_addr)
    _spawn(state, "s3", [sys.executable, "-m", "moto.server", "-H", host_addr, "-p", str(s3_port)],
           dict(env, SPARK_LOCAL_IP=host_addr))
    state["s3_endpoint"] = f"http://{host_addr}:{s3_port}"

    m_port, ui_port = _free_port(host_addr), _free_port(host_addr)
    state["master_url"] = f"spark://{host_addr}:{m_port}"
    state["master_ui"] = f"http://{host_addr}:{ui_port}"
    _spawn(state, "master", [spark_class, "org.apache.spark.deploy.master.Master", "--host", host_addr,
                             "--port", str(m_port), "--webui-port", str(ui_port)], dict(env, SPARK_LOCAL_IP=host_addr))
    _wait_until("the master's web UI", lambda: _master_json(state).get("status") == "ALIVE", state)

    for i, host in enumerate(state["hosts"]):
        host["cores"], host["memory"] = cores, memory
        _start_worker(state, i, f"worker{i}", env)
    state["cores"] = cores * len(state["hosts"])
    _write_state(state)
    _wait_until(f"{len(state['hosts'])} worker(s) registered with the master",
                lambda: _alive_workers(state) >= len(state["hosts"]), state)
    _wait_until("the S3 server", lambda: urllib.request.urlopen(state["s3_endpoint"], timeout=2).status < 500, state)
    _write_state(state)


def _daemon_env(state: dict, base_env: dict) -> dict:
    env = dict(base_env)
    env.update({"SPARK_HOME": state["spark_home"], "PYSPARK_PYTHON": sys.executable, "SPARK_DAEMON_MEMORY": "256m",
                "SPARK_LOG_DIR": str(Path(state["dir"]) / "logs"), "SPARK_CONF_DIR": str(Path(state["dir"]) / "conf")})
    return env


def _start_worker(state: dict, i: int, name: str, env: dict) -> None:
    """Start host ``i``'s Spark worker JVM (named ``name`` in the state file)."""
    host = state["hosts"][i]
    addr = host["address"]
    if host["namespace"]:
        port, wui = 7078, 8081  # a namespace of its own: these ports are free (its old worker is gone)
    else:
        port, wui = _free_port(addr), _free_port(addr)
    work = Path(state["dir"]) / f"work-{i}"
    work.mkdir(exist_ok=True)
    spark_class = str(Path(state["spark_home"]) / "bin" / "spark-class")
    _spawn(state, name, [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", addr,
                         "--port", str(port), "--webui-port", str(wui), "--cores", str(host["cores"]),
                         "--memory", host["memory"], "--work-dir", str(work), state["master_url"]],
           dict(env, SPARK_LOCAL_IP=addr), namespace=host["namespace"])
    host["worker"] = name
    _write_state(state)


def _alive_workers(state: dict) -> int:
    return sum(1 for w in _master_json(state).get("workers", []) if w.get("state") == "ALIVE")


def revive_host(state: dict, host: int, timeout: float = READY_TIMEOUT_S) -> None:
    """Bring a host lost with :func:`kill_host` back: a new worker JVM on its address (in its
    namespace), waited for until the master counts it ALIVE again."""
    if alive(state["processes"][state["hosts"][host]["worker"]]):
        raise ClusterError(f"host {host} is up (its worker runs); kill_host it first")
    before = _alive_workers(state)
    generation = sum(1 for name in state["processes"] if name.startswith(f"worker{host}"))
    _start_worker(state, host, f"worker{host}-{generation}", _daemon_env(state, dict(os.environ)))
    # the killed daemons stay recorded (down skips the dead ones); wait for the new one only
    new = state["processes"][state["hosts"][host]["worker"]]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(new):
            raise ClusterError(f"the revived worker of host {host} exited; see its log {new['log']}")
        try:
            if _alive_workers(state) > before:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise ClusterError(f"the revived worker of host {host} did not register within {timeout:.0f} s; see {new['log']}")


def _signal_group(proc: dict, sig: int) -> None:
    if alive(proc):
        try:
            os.killpg(proc["pid"], sig)  # the daemon leads its group (started in its own session)
        except ProcessLookupError:
            pass


def down(directory: str = DEFAULT_DIR, grace: float = 10.0) -> list[str]:
    """Stop what ``up`` recorded in ``DIRECTORY``: its processes (with their process groups:
    executor JVMs and Python workers), then its namespaces and links. Returns what it stopped."""
    state = _read_state(directory)
    stopped: list[str] = []
    procs = state.get("processes", {})
    # workers first (they stop their executors), then the master and the S3 server
    order = sorted(procs, key=lambda n: (not n.startswith("worker"), n))
    for name in order:
        if alive(procs[name]):
            _signal_group(procs[name], signal.SIGTERM)
            stopped.append(name)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(procs[n]) for n in order):
        time.sleep(0.1)
    for name in order:
        _signal_group(procs[name], signal.SIGKILL)
    # processes left in a namespace (e.g. an executor that outlived its worker's group)
    for ns in state.get("namespaces", []):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in state.get("namespaces", []):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        stopped.append(f"netns {ns}")
    for link in state.get("links", []):
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        stopped.append(f"link {link}")
    state["namespaces"], state["links"] = [], []
    _write_state(state)
    (Path(state["dir"]) / STATE_FILE).rename(Path(state["dir"]) / (STATE_FILE + ".down"))
    return stopped


def status(directory: str = DEFAULT_DIR) -> dict:
    """What runs of the recorded cluster: each process alive or not, workers the master knows."""
    state = _read_state(directory)
    report: dict[str, Any] = {"master_url": state.get("master_url"), "s3_endpoint": state.get("s3_endpoint"),
                              "driver_host": state.get("driver_host"), "netns": state["netns"],
                              "processes": {n: alive(p) for n, p in state["processes"].items()}}
    try:
        info = _master_json(state)
        report["workers_alive"] = sum(1 for w in info.get("workers", []) if w.get("state") == "ALIVE")
        report["cores"], report["cores_used"] = info.get("cores"), info.get("coresused")
        report["apps"] = [a.get("name") for a in info.get("activeapps", [])]
    except (OSError, KeyError, ValueError) as exc:
        report["master"] = f"unreachable: {exc}"
    return report


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def host_processes(state: dict, host: int, marker: bytes) -> list[int]:
    """Pids of the processes below worker ``host``'s JVM (its executors, their Python workers
    and what those start) whose command line contains ``marker``."""
    kids = _children()
    todo, found = list(kids.get(state["processes"][state["hosts"][host]["worker"]]["pid"], [])), []
    while todo:
        pid = todo.pop()
        if marker in _cmdline(pid):
            found.append(pid)
        todo.extend(kids.get(pid, []))
    return found


def executor_pids(state: dict, host: int) -> list[int]:
    """Pids of the Spark executor JVMs (``CoarseGrainedExecutorBackend``) worker ``host`` runs."""
    return host_processes(state, host, b"CoarseGrainedExecutorBackend")


def abs_worker_hosts(state: dict) -> list[int]:
    """The hosts running an abs worker process (a job's barrier task) now."""
    return [i for i in range(len(state["hosts"])) if host_processes(state, i, b"abs.runtime.worker_main")]


def kill_host(state: dict, host: int) -> list[int]:
    """Lose "host" ``host`` at once: SIGKILL its worker JVM's process group (the worker, its
    executors, their Python workers and what those started) and, with namespaces, every
    process left in its namespace. Returns the pids killed."""
    proc = state["processes"][state["hosts"][host]["worker"]]
    # the group outlives its leader, and its id is not reused while a member lives
    pids = [p for ps in _children().values() for p in ps if _pgid(p) == proc["pid"]]
    ns = state["hosts"][host]["namespace"]
    if ns:
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in listed]
    pids = sorted(set(pids))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _pgid(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[2])


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start a master, N workers and an S3 server")
    p_up.add_argument("--hosts", type=int, default=2, help="number of workers (default 2)")
    p_up.add_argument("--netns", action="store_true", help="each worker in its own network namespace (root)")
    p_up.add_argument("--cores", type=int, default=1, help="cores per worker (default 1)")
    p_up.add_argument("--memory", default="1g", help="memory per worker for its executors (default 1g)")
    p_kill = sub.add_parser("kill-host", help="lose a host at once: SIGKILL every process of it")
    p_revive = sub.add_parser("revive-host", help="start a lost host's worker again")
    for p in (p_kill, p_revive):
        p.add_argument("host", type=int, help="the host's number (0-based, as 'up' lists them)")
    for p in (p_up, sub.add_parser("down", help="stop what 'up' started"),
              sub.add_parser("status", help="show what runs"), p_kill, p_revive):
        p.add_argument("--dir", default=DEFAULT_DIR, help=f"state and logs directory (default {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    try:
        if args.command in ("kill-host", "revive-host"):
            state = _read_state(args.dir)
            if not 0 <= args.host < len(state["hosts"]):
                raise ClusterError(f"no host {args.host}: the cluster has hosts 0..{len(state['hosts']) - 1}")
            if args.command == "kill-host":
                print(f"killed {len(kill_host(state, args.host))} process(es) of host {args.host}")
            else:
                revive_host(state, args.host)
                print(f"host {args.host} is back: its worker registered with the master")
            return 0
        if args.command == "up":
            state = up(args.hosts, args.netns, args.dir, args.cores, args.memory)
            print(f"master      {state['master_url']}  (web UI {state['master_ui']})")
            print(f"s3          {state['s3_endpoint']}  (any key and secret, e.g. testing/testing)")
            print(f"driver_host {state['driver_host']}  (spark.driver.host for a driver on this machine)")
            for h in state["hosts"]:
                where = f"netns {h['namespace']}" if h["namespace"] else "loopback"
                print(f"{h['name']:<11} {h['address']}  ({where}, {h['cores']} core(s))")
            print(f"state       {Path(state['dir']) / STATE_FILE}")
        elif args.command == "down":
            stopped = down(args.dir)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            print(json.dumps(status(args.dir), indent=2))
    except ClusterError as exc:
        print(f"scripts/cluster {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
