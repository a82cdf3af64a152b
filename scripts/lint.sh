#!/usr/bin/env bash
# Lint and type checks (CI runs them before the tests): ruff's E, F, I, B, UP rules over
# the code, mypy over src/disttrain (pyproject.toml holds both configurations).
# Needs the test extras: bash scripts/setup.sh test.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests bench scripts examples
.venv/bin/mypy
