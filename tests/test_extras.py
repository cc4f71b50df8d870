"""pyspark and s3fs are extras ([spark], [s3]): the core works without them, and each piece
that needs one says which extra to install.

Each test runs a fresh interpreter; "without X" hides X with a ``sys.meta_path`` finder that
raises ModuleNotFoundError, as an installation without the extra would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

HIDE = """
import sys

class _Hide:
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hide(HIDDEN))
"""

LOCAL_JOB = """
import abs

def run_local_job(root):
    flow = abs.Dataflow("extras")
    counts = flow.source("src", abs.GeneratorSource(2000, num_keys=10, num_splits=2)).key_by("key")
    counts.reduce("sum", lambda a, b: {"key": a["key"], "value": a["value"] + b["value"]}).sink(
        "out", abs.FileSink(f"{root}/out"))
    result = abs.run(flow, parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.2),
                     storage=f"{root}/snapshots")
    return result.status, abs.read_output(f"{root}/out").num_rows
"""


def run_python(code: str, hidden: tuple[str, ...], cwd: Any) -> dict:
    """Run ``code`` (which prints one JSON line last) with the modules ``hidden``."""
    program = f"HIDDEN = {list(hidden)!r}\n" + textwrap.dedent(HIDE) + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", program], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.parametrize("hidden", [(), ("pyspark", "s3fs")], ids=["installed", "without-extras"])
def test_importing_the_packages_and_a_local_job_load_neither_pyspark_nor_s3fs(tmp_path, hidden):
    code = LOCAL_JOB + """
import json, sys
import storage, recovery, recovery.plan, storage.inspect
status, rows = run_local_job(".")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pyspark", "py4j", "s3fs", "aiobotocore"))
print(json.dumps({"status": str(status), "rows": rows, "loaded": loaded}))
"""
    got = run_python(code, hidden, tmp_path)
    assert got["loaded"] == []
    assert got["status"] == "FINISHED" and got["rows"] == 2000  # a running reduce emits every update


SPARK_PIECES = {
    "abs.SparkExecutor": "abs.SparkExecutor(object(), num_workers=2)",
    "abs.SparkStreamSource": "abs.SparkStreamSource(object())",
    "abs.SparkMicroBatchSource": "abs.SparkMicroBatchSource(object())",
    "storage.spark.register": "storage.spark.register(object())",
    "storage.spark.load": "storage.spark.load(object(), '.')",
}


def test_every_spark_piece_without_pyspark_says_to_install_the_spark_extra(tmp_path):
    code = """
import json
import abs, storage, storage.spark
from abs.errors import AbsError
from storage.errors import StorageError
out = {}
for name, call in PIECES.items():
    try:
        eval(call)
    except ImportError as exc:
        out[name] = {"type": type(exc).__module__ + "." + type(exc).__name__, "abs": isinstance(exc, AbsError),
                     "storage": isinstance(exc, StorageError), "message": str(exc)}
    else:
        out[name] = None
print(json.dumps(out))
"""
    got = run_python(f"PIECES = {SPARK_PIECES!r}\n" + code, ("pyspark",), tmp_path)
    for name in SPARK_PIECES:
        err = got[name]
        assert err is not None, f"{name} worked without pyspark"
        assert "install the project with its 'spark' extra: pip install '.[spark]' in a checkout" in err["message"] and "pyspark" in err["message"], (name, err)
        assert err["type"] == "storage.errors.MissingExtraError" and err["abs"] and err["storage"], (name, err)


def test_s3_urls_without_s3fs_say_to_install_the_s3_extra(tmp_path):
    code = """
import json
import abs
from abs.errors import AbsError
from storage import SnapshotStore
from storage.errors import StorageError
calls = {
    "SnapshotStore.open": lambda: SnapshotStore.open("s3://bucket/root"),
    "FileSink": lambda: abs.FileSink("s3://bucket/out").create_writer(0, 1),
    "FileSource": lambda: abs.FileSource("s3://bucket/in/*.txt").splits(),
    "abs.run": lambda: abs.run(_flow(), parallelism=1, storage="s3://bucket/root"),
}
def _flow():
    flow = abs.Dataflow("s3-extra")
    flow.source("src", abs.GeneratorSource(10)).sink("out", abs.CollectSink())
    return flow
out = {}
for name, call in calls.items():
    try:
        call()
    except Exception as exc:
        out[name] = {"type": type(exc).__module__ + "." + type(exc).__name__, "abs": isinstance(exc, AbsError),
                     "storage": isinstance(exc, StorageError), "import": isinstance(exc, ImportError),
                     "message": str(exc)}
    else:
        out[name] = None
print(json.dumps(out))
"""
    got = run_python(code, ("s3fs",), tmp_path)
    for name, err in got.items():
        assert err is not None, f"{name} worked without s3fs"
        assert "install the project with its 's3' extra: pip install '.[s3]' in a checkout" in err["message"] and "s3fs" in err["message"], (name, err)
        assert err["abs"] and err["import"], (name, err)
    for name in ("SnapshotStore.open", "FileSink", "FileSource"):
        assert got[name]["type"] == "storage.errors.MissingExtraError", (name, got[name])
    assert "s3://bucket/root" in got["SnapshotStore.open"]["message"]


def test_the_installed_package_requires_pyspark_and_s3fs_only_through_their_extras():
    from importlib.metadata import requires

    found: dict[str, str] = {}
    for requirement in requires("abs-snapshots") or []:
        name = requirement.split(";")[0].strip()
        for module in ("pyspark", "s3fs"):
            if name.lower().startswith(module):
                found[module] = requirement
    assert "extra" in found.get("pyspark", "") and '"spark"' in found["pyspark"], found
    assert "extra" in found.get("s3fs", "") and '"s3"' in found["s3fs"], found
