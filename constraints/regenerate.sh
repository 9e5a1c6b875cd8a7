#!/usr/bin/env bash
# Write constraints/tested.txt: the exact versions of a `.[dev]` environment whose whole suite
# just passed. Usage: bash constraints/regenerate.sh [VENV]
#   VENV given: freeze that environment after running the suite in it (.ci/run leaves
#   .ci-envs/readme behind); none: build a fresh one first (today's resolution), as .ci/run does.
# Install exactly these with: pip install torch==2.13.0 -e ".[dev]" -c constraints/tested.txt
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-}
if [ -z "$VENV" ]; then
    VENV=.ci-envs/constraints
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[dev]"
fi
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -q -n 2  # only a green suite's versions are written
{
    echo "# Versions of a .[dev] environment whose whole suite passed ($(date -u +%F), commit $(git rev-parse --short HEAD),"
    echo "# Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')). Written by constraints/regenerate.sh."
    echo "# torch is left out (the install command names it: CPU and CUDA builds differ)."
    "$VENV/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check \
        | grep -viE '^(torch|nvidia-.*|triton|pip)==' | grep -v '^#' | sort -f
} > constraints/tested.txt
echo "wrote constraints/tested.txt ($(grep -vc '^#' constraints/tested.txt) packages)"
