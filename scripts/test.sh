#!/usr/bin/env bash
# Runs the whole test suite: lint and format checks (ruff), then pytest. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --check --no-cache .
exec .venv/bin/python -m pytest "$@"
