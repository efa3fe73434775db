#!/usr/bin/env bash
# Runs the test suite: lint and format checks (ruff), a type check (mypy), then pytest.
# `--fast` as the first argument runs the unit tier alone (tests/unit: no server, no engine
# processes, no model load); `--perf` the perf tier alone (tests/perf: the token path's cost
# against the released number's code, ~10 min, on a quiet machine); without either, every
# tier CI runs (tests/unit, tests/server, tests/gpu). Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- tests/unit "$@"
elif [ "${1:-}" = "--perf" ]; then
    shift
    set -- tests/perf "$@"
fi
scripts/setup.sh
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --check --no-cache .
.venv/bin/mypy  # the packages [tool.mypy] in pyproject.toml names
exec .venv/bin/python -m pytest "$@"
