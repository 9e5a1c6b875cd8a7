#!/usr/bin/env bash
# Train small addition (operands 0..4) with GRPO on 2 CPU ranks; builds the tiny text model and data if missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
[ -f artifacts/tiny-text/config.json ] || python -m data_tools.make_tiny_model --kind text --out artifacts/tiny-text
[ -f artifacts/addition/train.jsonl ] || python -m data_tools.synth_shapes --task addition --out artifacts/addition
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
torchrun --nproc_per_node "${NPROC:-2}" -m vlrft.cli train "$here/config.yaml" "$@"
echo "training wall time: $(( $(date +%s) - start )) s"
