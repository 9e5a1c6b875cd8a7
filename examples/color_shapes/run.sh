#!/usr/bin/env bash
# Train the colour task with GRPO on 2 CPU ranks (torchrun + DeepSpeed, gloo).
# Builds the tiny model and the data set first if they are missing. Extra arguments are
# config overrides, e.g.:  bash examples/color_shapes/run.sh train.total_steps=10
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
[ -f artifacts/tiny-vl/config.json ] || python -m data_tools.make_tiny_model --kind vl --out artifacts/tiny-vl
[ -f artifacts/color_shapes/train.jsonl ] || python -m data_tools.synth_shapes --task colors --out artifacts/color_shapes
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
torchrun --nproc_per_node "${NPROC:-2}" -m vlrft.cli train "$here/config.yaml" "$@"
echo "training wall time: $(( $(date +%s) - start )) s"
