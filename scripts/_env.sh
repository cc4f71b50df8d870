# Shared set-up for scripts/demo and scripts/test: creates .venv if missing and
# installs the project with its dependencies. Sourced, not run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
# Re-install only when the dependency declarations or the C module's source changed (an
# editable install builds abscore/_native.c into abscore/; see setup.py).
STAMP=.venv/.abs-installed
WANT="$(cat setup.cfg pyproject.toml setup.py abscore/_native.c | "$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing the project and its dependencies into .venv"
  echo "[setup] (first time: 1-3 minutes, most of it downloading pyspark, ~320 MB; later runs skip this)"
  LOG=.venv/install.log
  SECONDS=0
  # the full output goes to the log; the packages pip fetches are named as it goes, each once
  set +o pipefail
  { "$VPY" -m pip install --upgrade pip && "$VPY" -m pip install -e ".[test,spark,s3,bench]"; } 2>&1 | tee "$LOG" | awk '
    function flush() { if (line != "") { print "[setup]   fetched " line; line = ""; k = 0 } fflush() }
    /^Collecting / { name = $2; sub(/[<>=!~;\[].*/, "", name)
                     if (!seen[tolower(name)]++) { line = line (k++ ? ", " : "") name; n++; if (k == 8) flush() } }
    /^Installing collected packages/ { flush(); print "[setup]   installing " n " packages"; n = 0; fflush() }
    END { flush() }'
  STATUS=${PIPESTATUS[0]}
  set -o pipefail
  if [ "$STATUS" -ne 0 ]; then
    tail -n 40 "$LOG" >&2
    echo "[setup] installation failed; the full log is in $LOG" >&2
    exit 1
  fi
  echo "[setup] installed in ${SECONDS} s"
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export PYSPARK_PYTHON="$VPY"
export SPARK_LOCAL_IP=127.0.0.1
