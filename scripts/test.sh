#!/usr/bin/env bash
# The test command: sets up .venv, then runs the whole CPU test suite.
# Kernels run under the Triton interpreter (TRITON_INTERPRET=1) when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
python -m pytest -q -x --durations=15 "$@"
