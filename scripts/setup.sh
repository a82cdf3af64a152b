#!/usr/bin/env bash
# Create .venv and install disttrain into it. The pinned CPU build of torch goes in
# first, so the package's own torch range is already satisfied and no CUDA wheels are
# ever pulled. Idempotent: a second run only re-installs when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="${DISTTRAIN_TORCH:-torch==2.13.0}"
EXTRAS="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
PY=.venv/bin/python
stamp=".venv/.disttrain-installed${EXTRAS:+-$EXTRAS}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_PIN"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$PY" -m pip install -q --disable-pip-version-check "$TORCH_PIN"
    "$PY" -m pip install -q --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
    echo "$want" > "$stamp"
fi
