#!/usr/bin/env bash
# The calculator task, 2 CPU ranks: builds the tiny text model with the calculator turn format
# (data_tools/calculator_warmup.py) and the data set if missing, then trains (config.yaml).
# The no-tool baseline is the same run without the environment:
#   bash examples/calculator/run.sh "rollout.environment=''" output.dir=runs/calculator_no_tool
# Extra arguments are config overrides, e.g. train.total_steps=10.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
[ -f artifacts/tiny-text-calculator/config.json ] || OMP_NUM_THREADS=1 python -m data_tools.calculator_warmup --base artifacts/tiny-text --out artifacts/tiny-text-calculator
exec bash examples/launch.sh text product "$here/config.yaml" "$@"
