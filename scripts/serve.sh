#!/usr/bin/env bash
# Starts the server on the embedded default model (SmolLM2-135M-Instruct) at
# http://127.0.0.1:30000/v1. Extra arguments go to `python -m runtime serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m runtime serve "$@"
