"""The README's code runs as written, and every name it shows imports as written."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def _run(code: str, cwd: Path, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"README code failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_readme_has_its_example_blocks():
    assert len(BLOCKS) >= 3, "the headline example, the Spark run and the Spark data source"
    assert "if __name__ == \"__main__\":" in BLOCKS[0]


def test_the_headline_example_runs_and_shows_deltas_a_restore_and_exact_output(tmp_path):
    out = _run(BLOCKS[0], tmp_path)
    before, sep, after = out.partition("restored checkpoint ")
    assert sep, out
    sizes = lambda text: [(float(a), float(b)) for a, b in re.findall(r"wrote ([\d.]+) of ([\d.]+) MiB", text)]
    assert len(sizes(before)) >= 2, out  # several checkpoints before the restore
    restored_from = int(after.split()[0])
    assert restored_from == int(re.findall(r"checkpoint (\d+): wrote", before)[-1]), out
    after_restore = sizes(after)
    assert after_restore, out
    # after the restore a few keys change per checkpoint: each checkpoint writes those alone,
    # except one that folds a chain grown past its base into a new base (compaction)
    small = [w for w, full in after_restore if w < 0.25 * full]
    compactions = [w for w, full in after_restore if w >= 0.25 * full]
    assert small and len(compactions) <= 1, out
    assert "2,020,000 output rows, 500,000 keys; key 7 counted 5 times, key 20,000 4 times" in out


def test_the_spark_blocks_run_after_the_headline_definitions(tmp_path):
    pytest.importorskip("pyspark")
    spark_blocks = [b for b in BLOCKS[1:] if "spark" in b]
    assert len(spark_blocks) == 2
    # the headline block defines build(); the Spark blocks continue it in one interpreter
    code = "\n".join(["__name__ = 'readme'", BLOCKS[0], "__name__ = '__main__'", *spark_blocks,
                      "spark.stop()"])
    out = _run(code, tmp_path)
    assert re.search(r"^FINISHED \d+$", out, re.M), out
    assert re.search(r"sum\(value\)\s*\|\s*\n\+-+\+\s*\n\|\s*200000\s*\|", out), out  # 200,000 counted events


def _names_shown() -> set[str]:
    names = set(re.findall(r"\b((?:abscore|abs|storage|recovery)(?:\.[A-Za-z_]\w*)+)", TEXT))
    table = TEXT[TEXT.index("### Public API"):TEXT.index("## Architecture")]
    for row in table.splitlines():
        cells = row.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith("`"):
            continue
        for code in re.findall(r"`([^`]+)`", cells[1]):
            head = re.match(r"[A-Za-z_][\w.]*", code)
            if head and not head[0].startswith(("abs.", "storage.", "recovery.")):
                names.add("abs." + head[0])
    return names


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_name_the_readme_shows_imports_as_written():
    names = _names_shown()
    assert {"abs.FileSink", "abs.FileSource", "abs.run", "abs.Stream.map", "storage.spark.load"} <= names
    missing = []
    for name in sorted(names):
        if name.endswith((".py", ".md", ".json")):
            continue  # a file name such as abs/runtime/writer.py written with dots
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, "names in the README that do not import:\n" + "\n".join(missing)


def test_the_live_reconfiguration_example_moves_key_groups_and_stays_exact(tmp_path):
    (block,) = [b for b in BLOCKS if "job.move(" in b]
    out = _run(block, tmp_path)
    assert "before: w0: 0-7; w1: 8-15" in out, out
    assert re.search(r"moved key groups \(0, 1, 2, 3\) in \d+ ms, [\d,]+ bytes handed over", out), out
    assert "after:  w0: 0-1,4-7; w1: 2-3,8-15 (2 steps)" in out, out
    assert "grown:  w0: 0-1,4-7; w1: 2-3,8-10; w2: 11-15 (3 steps)" in out, out
    assert "shrunk: w0: 0-1,4-7,11-12; w1: 2-3,8-10,13-15" in out, out
    assert "FINISHED 800000 rows; key 7 counted 800" in out, out


def test_the_autoscaling_example_scales_out_by_itself(tmp_path):
    (block,) = [b for b in BLOCKS if "autoscale=abs.Autoscale(" in b]
    out = _run(block, tmp_path)
    assert re.search(r"scale_out to [23]: input [\d,]+/s, lag [\d,]+ records, busy .*needs \d+ workers at 70% busy"
                     r"( \(max_workers=3\))? \(COMPLETED\)", out), out
    assert re.search(r"^FINISHED at [23] workers; 20000 rows$", out, re.M), out


def test_the_loop_example_labels_the_connected_components(tmp_path):
    (block,) = [b for b in BLOCKS if ".iterate(" in b]
    out = _run(block, tmp_path)
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for i in range(2_000):
        a, b = find(i * 7 % 3_000), find(i * 13 % 3_000)
        if a != b:
            parent[max(a, b)] = min(a, b)
    want = len({find(x) for x in list(parent)})
    assert re.search(rf"^{want} components, \d+ checkpoints$", out, re.M), (want, out)
