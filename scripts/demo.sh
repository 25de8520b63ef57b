#!/usr/bin/env bash
# The main job: sets up .venv, then runs the SmolLM2-135M demo (CPU by default, GPU if present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# the demo prints one line per step (load, compile, generate) with its rough duration
python -m kvcompile demo "$@"
