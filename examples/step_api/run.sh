#!/usr/bin/env bash
# The step API example on 2 CPU ranks (builds the tiny text model and the addition data if missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f artifacts/tiny-text/config.json ] || python -m data_tools.make_tiny_model --kind text --out artifacts/tiny-text
[ -f artifacts/addition/train.jsonl ] || python -m data_tools.synth_shapes --task addition --out artifacts/addition
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec torchrun --nproc_per_node "${NPROC:-2}" examples/step_api/train.py "$@"
