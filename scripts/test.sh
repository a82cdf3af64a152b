#!/usr/bin/env bash
# Quickstart 2: set up with the test extras, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# the 20 slowest tests printed at the end of every run (what keeps the suite quick)
exec .venv/bin/python -m pytest --durations=20 "$@"
