"""scripts/demo's own checks of --storage: it neither runs into nor deletes the snapshot root
of another job, and says so in one line (exit code 2), without a traceback."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from storage import SnapshotStore

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


def other_jobs_root(url: str) -> SnapshotStore:
    store = SnapshotStore.open(url)
    store.init_job({"job_name": "other-job", "max_parallelism": 128})
    return store


def test_a_local_root_of_another_job_is_refused_in_one_line_and_left_alone(tmp_path):
    root = tmp_path / "theirs"
    other_jobs_root(str(root))
    before = sorted(os.listdir(root))
    for keep in ([], ["--keep"]):
        done = subprocess.run([sys.executable, str(DEMO), "--storage", "theirs", "--events", "100", *keep],
                              cwd=tmp_path, env=dict(os.environ, ABS_DEMO_CALLER_DIR=str(tmp_path)),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stdout == "", (keep, done.stdout, done.stderr)
        assert done.stderr.splitlines() == [
            "scripts/demo: error: --storage theirs holds the snapshots of job 'other-job', not of this demo "
            "('demo-counts'); not touching them: give another directory with --storage, or delete theirs first if "
            "they are no longer needed (see scripts/demo --help)"], keep
        assert sorted(os.listdir(root)) == before  # not deleted, nothing written


def test_a_url_root_of_another_job_ends_in_one_line(memory_root, capsys):
    """A URL is not looked into beforehand: the job's own refusal is printed as one line."""
    other_jobs_root(memory_root)
    spec = importlib.util.spec_from_file_location("abs_demo_script", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.main(["--storage", memory_root, "--keep", "--events", "100", "--parallelism", "1"]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("scripts/demo: error: "))
    assert f"{memory_root}: this storage root belongs to job 'other-job'" in line and "use another storage root" in line
    assert "Traceback" not in err
