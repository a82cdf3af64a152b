#!/usr/bin/env bash
# Quickstart 2: set up with the test extras, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Two pytest-xdist workers: one process leaves a core idle while a test waits (process
# starts, sockets, signals, timeouts); two fill both (bench/README.md has the figures).
# --dist loadfile keeps a file's tests on one worker: its module fixtures and shared
# worlds are made once.
# DISTTRAIN_TEST_WORKERS=0: every test in this one process.
# The 20 slowest tests printed at the end of every run (what keeps the suite quick).
exec .venv/bin/python -m pytest -n "${DISTTRAIN_TEST_WORKERS:-2}" --dist loadfile \
    --durations=20 "$@"
