#!/usr/bin/env bash
# The test command: sets up .venv, then runs the whole CPU test suite and reports every failure
# (no -x) and how long the run took. Extra arguments go to pytest (e.g. -m "not slow", -k NAME).
# Kernels run under the Triton interpreter (TRITON_INTERPRET=1) when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
start=$(date +%s)
status=0
if [ $# -eq 0 ]; then
  echo "running the whole test suite: about 30-36 min on 2 CPU cores (pytest -q: a dot per test)"
else
  echo "running pytest $*"
fi
python -m pytest -q --durations=15 "$@" || status=$?
secs=$(( $(date +%s) - start ))
echo "test run: $((secs / 60)) min $((secs % 60)) s on $(nproc) CPU core(s), pytest exit status $status"
exit "$status"
