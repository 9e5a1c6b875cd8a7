#!/usr/bin/env bash
# The zoom task, 2 CPU ranks: builds the tiny VL model with the zoom turn format
# (data_tools/zoom_warmup.py) and the data set if missing, then trains (config.yaml).
# The no-tool baseline is the same run without the environment:
#   bash examples/zoom/run.sh "rollout.environment=''" output.dir=runs/zoom_no_tool
# Extra arguments are config overrides, e.g. train.total_steps=10.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
[ -f artifacts/tiny-vl-zoom/config.json ] || OMP_NUM_THREADS=1 python -m data_tools.zoom_warmup --base artifacts/tiny-vl --out artifacts/tiny-vl-zoom
exec bash examples/launch.sh vl zoom "$here/config.yaml" "$@"
