#!/usr/bin/env bash
# Runs the test suite: lint and format checks (ruff), then pytest. `--fast` as the first argument
# runs the unit tier alone (tests/unit: no server, no engine processes, no model load); without
# it, every tier (tests/unit, tests/server, tests/gpu), as CI does. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- tests/unit "$@"
fi
scripts/setup.sh
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --check --no-cache .
exec .venv/bin/python -m pytest "$@"
