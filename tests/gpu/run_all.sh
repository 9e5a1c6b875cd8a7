#!/usr/bin/env bash
# The GPU checks in one place, for a CUDA machine with PyTorch: the GPU tests, the colour demo
# on one GPU under torchrun/NCCL, and the update benchmark. Each part's log goes to LOG_DIR
# (default runs/gpu) as well as to the terminal.
#
#   bash tests/gpu/run_all.sh tests                 # pytest -m gpu tests/gpu
#   bash tests/gpu/run_all.sh demo:float32:2 demo:bfloat16:2 demo:bfloat16:3   # dtype:ZeRO stage[:seed]
#   bash tests/gpu/run_all.sh bench:1.5B            # bench/gpu_step.py --shapes 1.5B
#   bash tests/gpu/run_all.sh bench                 # every shape, ZeRO stage and checkpointing
#   bash tests/gpu/run_all.sh shared:36             # bench/shared_prefix.py, bf16, 3B widths at LAYERS layers
#
# Without a package index: build the wheels on a machine with one
# (`bash tests/gpu/wheelhouse.sh .whl 3.12`), bring `.whl/` along; they are installed into
# /tmp/site first (WHEELS names another folder).
set -euo pipefail
cd "$(dirname "$0")/../.."
for part in "$@"; do  # a typo fails now, not after an hour of the parts before it
    [[ $part =~ ^(tests|demo(:(float32|bfloat16)(:[0-3](:[0-9]+)?)?)?|bench(:[^:]+)?|shared(:[0-9]+)?)$ ]] || {
        echo "run_all: unknown part '$part' (tests, demo[:DTYPE[:ZERO[:SEED]]], bench[:SHAPE], shared[:LAYERS])" >&2; exit 2; }
done
log_dir=${LOG_DIR:-runs/gpu}
mkdir -p "$log_dir"
# The checkout itself is imported from here (bench/ and the launcher run it without an install).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
wheels=${WHEELS:-.whl}
if [ -d "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! command -v python >/dev/null; then  # images that only name python3 (the launcher calls python)
    mkdir -p /tmp/python-shim && ln -sf "$(command -v python3)" /tmp/python-shim/python
    export PATH=/tmp/python-shim:$PATH
fi
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'deepspeed', deepspeed.__version__, 'GPU',
torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1 | tail -1

for part in "$@"; do
    IFS=: read -r what a b c <<< "$part"
    start=$(date +%s)
    case $what in
        tests)
            python3 -m pytest -m gpu tests/gpu -v -rs 2>&1 | tee "$log_dir/tests.log" ;;
        demo)  # the full 100-step colour demo, one rank
            dtype=${a:-bfloat16} zero=${b:-2} seed=${c:-0}
            name=$dtype-zero$zero-seed$seed
            NPROC=1 bash examples/color_shapes/run.sh "model.compute_dtype=$dtype" "train.zero_stage=$zero" \
                "train.seed=$seed" "output.dir=$PWD/runs/gpu-demo-$name" 2>&1 | tee "$log_dir/demo-$name.log"
            cp "runs/gpu-demo-$name/metrics.jsonl" "$log_dir/metrics-$name.jsonl" ;;
        bench)
            python3 bench/gpu_step.py ${a:+--shapes "$a"} 2>&1 | tee "$log_dir/bench${a:+-$a}.log" ;;
        shared)  # shared-prompt micro-batches against unshared, the demo's and a Geo3K-like shape
            python3 bench/shared_prefix.py --device cuda --compute-dtype bfloat16 --layers "${a:-36}" 2>&1 \
                | tee "$log_dir/shared-prefix.log" ;;
    esac
    echo "run_all: $part took $(( $(date +%s) - start )) s"
done
