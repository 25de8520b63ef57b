#!/usr/bin/env bash
# The test command: sets up .venv, then runs the whole CPU test suite and reports every failure
# (no -x) and how long the run took. Extra arguments go to pytest (e.g. -m "not slow", -k NAME).
# Kernels run under the Triton interpreter (TRITON_INTERPRET=1) when no GPU is present.
#
# Tests run in one pytest-xdist worker per core (-n $(nproc)), a test file per worker at a time
# (--dist loadfile: a file's module fixtures, such as a model compiled once, stay in one
# process), the heaviest files first (--no-loadscope-reorder keeps tests/conftest.py's order);
# each worker gets its share of the cores (tests/conftest.py). Arguments that need one
# process (-n, -p no:xdist, --pdb, --trace, -s) turn that off, and so does
# KVCOMPILE_TEST_WORKERS=0; KVCOMPILE_TEST_WORKERS=N sets the number of workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
# nproc, not -n auto: pytest-xdist's auto counts physical cores (psutil) and ignores the CPU
# affinity a container or taskset gives; one core runs in this process, without workers
workers=${KVCOMPILE_TEST_WORKERS:-$(nproc)}
if [ "$workers" = 1 ]; then workers=0; fi
for a in "$@"; do
  case "$a" in
    -n|-n?*|--numprocesses*|--dist*|no:xdist|-pno:xdist|--pdb|--trace|-s|--capture=no) workers=0 ;;
  esac
done
xdist=()
if [ "$workers" != 0 ]; then
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
start=$(date +%s)
status=0
if [ $# -eq 0 ]; then
  # 9-26 min of pytest in 2 workers on an idle 2-core machine, every build cache empty
  # (fresh clones, 2026-12-06/07, twenty-fifth to thirty-seventh sessions: 9 min 14 s to 25 min
  # 40 s; the machine's speed varies up to 1.8x from day to day); slower on a loaded machine
  # (README.md, "The two commands")
  where="one process"
  if [ "$workers" != 0 ]; then where="$workers xdist workers"; fi
  echo "running the whole test suite in $where: about 12-30 min in 2 workers on 2 idle CPU" \
       "cores, about twice that in one process (pytest -q: a dot per test)"
else
  echo "running pytest ${xdist[*]} $*"
fi
python -m pytest -q --durations=15 "${xdist[@]}" "$@" || status=$?
secs=$(( $(date +%s) - start ))
echo "test run: $((secs / 60)) min $((secs % 60)) s on $(nproc) CPU core(s), pytest exit status $status"
exit "$status"
