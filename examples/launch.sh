#!/usr/bin/env bash
# Shared launcher of the examples: build the tiny model and data set if missing, then run
# `vlrft train` under torchrun on CPU (gloo). Usage:
#   examples/launch.sh MODEL_KIND(vl|text) TASK(colors|addition) CONFIG [overrides...]
# NPROC (default 2) sets the number of ranks.
set -euo pipefail
kind=$1 task=$2 config=$(cd "$(dirname "$3")" && pwd)/$(basename "$3")
shift 3
cd "$(dirname "$0")/.."
model=artifacts/tiny-$kind data=artifacts/$task
[ -f "$model/config.json" ] || python -m data_tools.make_tiny_model --kind "$kind" --out "$model"
[ -f "$data/train.jsonl" ] || python -m data_tools.synth_shapes --task "$task" --out "$data"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
# On SIGTERM torchrun forwards the signal, then SIGKILLs after --shutdown-timeout (default 30 s):
# give the ranks time to finish the step and write their checkpoint. Older torchrun (torch
# 2.11, for one) has no such flag and keeps its fixed grace period. The flag is looked up in
# torchrun's source: `torchrun --help` imports torch, 2 s of every launch.
grace=()
run_py=$(python -c "import importlib.metadata as m; print(m.distribution('torch').locate_file('torch/distributed/run.py'))")
grep -q -- "--shutdown-timeout" "$run_py" && grace=(--shutdown-timeout 600)
torchrun --nproc_per_node "${NPROC:-2}" ${grace[@]+"${grace[@]}"} -m vlrft.cli train "$config" "$@"
echo "training wall time: $(( $(date +%s) - start )) s"
