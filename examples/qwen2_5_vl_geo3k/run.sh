#!/usr/bin/env bash
# One node: CONFIG (3b.yaml, 7b.yaml, 7b_lora.yaml) on NPROC GPUs (default 8); extra arguments
# are config overrides. Multi-node under Slurm: sbatch examples/qwen2_5_vl_geo3k/train.sbatch.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec torchrun --nproc_per_node "${NPROC:-8}" -m vlrft.cli train "$here/${CONFIG:-7b.yaml}" "$@"
