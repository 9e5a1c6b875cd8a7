#!/usr/bin/env bash
# One node: CONFIG (1_5b_gsm8k.yaml, 7b_math.yaml) on NPROC GPUs (default 8); extra arguments
# are config overrides. Multi-node under Slurm: sbatch examples/qwen2_5_math/train.sbatch.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun --nproc_per_node "${NPROC:-8}" -m vlrft.cli train "$here/${CONFIG:-1_5b_gsm8k.yaml}" "$@"
