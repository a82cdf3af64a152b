#!/usr/bin/env bash
# Quickstart 1: set up, then run the default training job (2 local CPU workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/disttrain train "$@"
