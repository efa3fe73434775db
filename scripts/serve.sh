#!/usr/bin/env bash
# Starts the server on the embedded default model (SmolLM2-135M-Instruct) at
# http://127.0.0.1:30000/v1, on a CPU from the GGUF's own blocks with int8 activations
# (--quantization auto: gguf-q8; `--quantization none` for the exact fp32 computation).
# Extra arguments go to `python -m runtime serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m runtime serve "$@"
