"""The reference benchmark (scripts/bench_reference.py) runs: its --quick smoke test prints
every row of the headline workload and of the checkpoint cost, and verifies the final per-key
sums of every job."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_reference.py"


def test_quick_run_prints_every_row_with_its_sums_verified(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--root", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for key_type in ("string", "int"):
        assert f"10,000 {key_type} keys" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("process ", "aggregate "))]
    assert len(rows) == 4, out  # process and aggregate, string and int keys
    assert all("sums verified: yes" in row for row in rows), out
    assert out.count("plain Python dict loop") == 2 and out.count("pyarrow group_by") == 2
    assert "sums verified: NO" not in out
    assert "target >= 20.0 %" in out and "target >= 30.0 %" in out
    # a smoke test's sizes say nothing about the targets: no verdict either way
    assert "not judged (--quick)" in out and " met" not in out.replace("not judged", ""), out
    memory = [line for line in out.splitlines() if "peak PSS" in line]
    assert len(memory) == 1, out  # process, p=1, string keys
    assert "target <= 140 MB" in memory[0] and "sums verified: yes (1/1)" in memory[0] or "not measured" in memory[0], out
    if "not measured" not in memory[0]:
        distinct = [line for line in out.splitlines() if "peak distinct pages" in line]
        assert len(distinct) == 1 and ("target <= 140 MB" in distinct[0] or "not measured" in distinct[0]), out
    checkpoints = [line for line in out.splitlines() if line.lstrip().startswith("checkpoint ")]
    assert len(checkpoints) == 2 and all("aggregate" in c and "process" in c and "sums verified: yes" in c
                                         for c in checkpoints), out


def test_quick_deltas_run_prints_both_layouts_with_the_state_verified(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), "--deltas", "--quick", "--root", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "a stream per key group (format 5)" in out and "shared ranges (format 6+)" in out
    assert out.count("state verified: yes") == 2 and "delta / full" in out
    assert out.count("with the manifests:") == 2 and out.count("delta manifest: commit") == 2  # target 5 counts both
