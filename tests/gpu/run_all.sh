#!/usr/bin/env bash
# The GPU checks in one place, for a CUDA machine with PyTorch: the GPU tests, the colour demo
# on one GPU under torchrun/NCCL, and the benchmarks. Each part's log goes to LOG_DIR (default
# runs/gpu), named after the part (demo-bfloat16-2.log).
#
#   bash tests/gpu/run_all.sh tests                 # pytest -m gpu tests/gpu
#   bash tests/gpu/run_all.sh demo:float32:2 demo:bfloat16:2 demo:bfloat16:3   # dtype:ZeRO stage[:seed]
#   bash tests/gpu/run_all.sh bench:1.5B            # bench/gpu_step.py --shapes 1.5B
#   bash tests/gpu/run_all.sh bench:1.5B:3          # ... --zero 3 only (each update setting: ~2 minutes)
#   bash tests/gpu/run_all.sh bench                 # every shape, ZeRO stage and checkpointing
#   BENCH_ARGS="--checkpointing on --budget 32768 --compile off on --fused-head chunked liger" \
#       bash tests/gpu/run_all.sh bench:1.5B:2      # more bench/gpu_step.py flags for the bench parts
#   bash tests/gpu/run_all.sh shared:36             # bench/shared_prefix.py, bf16, 3B widths at LAYERS layers
#
# Parts joined by '+' run at the same time, each into its own log only (a line each says how it
# ended): the tests and the demos, which neither fill the GPU nor are timed. Run benchmarks
# alone. Every part runs even after one failed; the exit status is 1 if any failed (2: a
# mistyped command, 3: an environment that cannot import what the parts need). Ctrl-C or a
# kill stops the running parts too. Each demo starts from scratch.
#   DEADLINE=SECONDS  every part is stopped that long after the start ("cut at the deadline";
#                     a demo writes its checkpoint first); parts not begun by then are skipped.
#   ARCHIVE=FILE      all logs packed into FILE (.tgz) at the end, however the run ended.
# A relative LOG_DIR or ARCHIVE is taken from the directory run_all is started in.
#
# The whole acceptance run is longer than one 10-minute call (docs/scaling.md, "Checking a GPU
# machine": on an H200 the tests and the four demos took 3.3 minutes, each update setting of
# the bench about 2). The first call's worth:
#   DEADLINE=540 LOG_DIR=/tmp/gpu ARCHIVE=$OUT/gpu-logs.tgz bash tests/gpu/run_all.sh \
#       tests+demo:bfloat16:2:0+demo:bfloat16:2:1+demo:float32:2+demo:bfloat16:3 bench:1.5B:2
#
# Without a package index: build the wheels on a machine with one
# (`bash tests/gpu/wheelhouse.sh .whl 3.12`), bring `.whl/` along; they are installed into
# /tmp/site first (WHEELS names another folder).
set -uo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # each part runs this script again, after the cd
started_in=$PWD  # a relative LOG_DIR or ARCHIVE is taken from here
cd "$(dirname "$self")/../.."

if [ "${1:-}" = --one ]; then  # one part's command (run_all runs each part this way, under `timeout`)
    IFS=: read -r what a b c <<< "$2"
    case $what in
        tests)
            exec python3 -m pytest -m gpu tests/gpu -v -rs ;;
        demo)  # the full 100-step colour demo from scratch, one rank, on a port of its own (demos may run at once)
            dtype=${a:-bfloat16} zero=${b:-2} seed=${c:-0}
            name=$dtype-zero$zero-seed$seed
            rm -rf "runs/gpu-demo-$name"  # (an earlier run's checkpoint would be resumed)
            PET_MASTER_PORT=$(python3 -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])") \
            NPROC=1 bash examples/color_shapes/run.sh "model.compute_dtype=$dtype" "train.zero_stage=$zero" \
                "train.seed=$seed" "output.dir=$PWD/runs/gpu-demo-$name" || exit
            cp "runs/gpu-demo-$name/metrics.jsonl" "$3/metrics-$name.jsonl" ;;
        bench)
            # shellcheck disable=SC2086  # BENCH_ARGS: more flags, split on spaces
            exec python3 bench/gpu_step.py ${a:+--shapes "$a"} ${b:+--zero "$b"} ${BENCH_ARGS:-} ;;
        shared)  # shared-prompt micro-batches against unshared, the demo's and a Geo3K-like shape
            exec python3 bench/shared_prefix.py --device cuda --compute-dtype bfloat16 --layers "${a:-36}" --threads "$(nproc)" ;;
    esac
    exit
fi

one_part='(tests|demo(:(float32|bfloat16)(:[0-3](:[0-9]+)?)?)?|bench(:[^:+]+(:[0-3])?)?|shared(:[0-9]+)?)'
seen=" "
for group in "$@"; do  # a typo fails now, not after an hour of the parts before it
    [[ $group =~ ^$one_part(\+$one_part)*$ ]] || {
        echo "run_all: unknown part '$group' (tests, demo[:DTYPE[:ZERO[:SEED]]], bench[:SHAPE[:ZERO]], shared[:LAYERS]; '+' joins parts run at once)" >&2
        exit 2; }
    IFS=+ read -ra parts <<< "$group"
    for part in "${parts[@]}"; do  # the same part twice would share its log (a demo: its run directory)
        IFS=: read -r what a b c <<< "$part"
        [ "$what" = demo ] && part=demo:${a:-bfloat16}:${b:-2}:${c:-0}
        [[ $seen != *" $part "* ]] || { echo "run_all: part '$part' is named twice" >&2; exit 2; }
        seen+="$part "
    done
done
[[ -z ${DEADLINE:-} || $DEADLINE =~ ^[0-9]+$ ]] || { echo "run_all: DEADLINE is whole seconds, not '$DEADLINE'" >&2; exit 2; }
started=$(date +%s)
log_dir=${LOG_DIR:-runs/gpu}
[[ $log_dir = /* ]] || [ -z "${LOG_DIR:-}" ] || log_dir=$started_in/$log_dir
mkdir -p "$log_dir"
log_dir=$(cd "$log_dir" && pwd)
if [ -n "${ARCHIVE:-}" ]; then
    [[ $ARCHIVE = /* ]] || ARCHIVE=$started_in/$ARCHIVE
    trap 'tar czf "$ARCHIVE" -C "$log_dir" . && echo "run_all: logs in $ARCHIVE"' EXIT
fi
# The checkout itself is imported from here (bench/ and the launcher run it without an install).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
wheels=${WHEELS:-.whl}
if [ -d "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    # The CUTLASS DSL (CUTEDSL wheels) puts its packages on the path by a .pth file, which a
    # --target folder's modules on PYTHONPATH never run.
    [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! command -v python >/dev/null; then  # images that only name python3 (the launcher calls python)
    mkdir -p /tmp/python-shim && ln -sf "$(command -v python3)" /tmp/python-shim/python
    export PATH=/tmp/python-shim:$PATH
fi
# Every import a part makes, first: an image that lacks a package (or holds one too old for
# transformers' import-time checks) fails here in one line, not in every part.
needs_pytest=$([[ " $* " =~ tests ]] && echo 1 || echo 0)
python3 - "$needs_pytest" > "$log_dir/versions.log" 2>&1 <<'PY'
import sys
try:
    import deepspeed, peft, torch, transformers
    from transformers import get_constant_schedule_with_warmup  # (imports accelerate through peft)
    import vlrft.cli, vlrft.trainer.spmd_trainer, vlrft.backends.deepspeed_backend
    from vlrft.models.attention import attention_missing
    if sys.argv[1] == "1":
        import pytest
except Exception as error:
    sys.exit(f"run_all: this environment cannot run the checks: {type(error).__name__}: {error}")
print("torch", torch.__version__, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__,
      "peft", peft.__version__, "GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print("torch_varlen:", attention_missing("torch_varlen") or "ready", "| flash_attention_2:",
      attention_missing("flash_attention_2") or "ready")
from vlrft.models.fused_head import liger_missing
print("fused head (liger, bf16):", liger_missing("bfloat16") or "ready")
PY
preflight=$?
cat "$log_dir/versions.log"
if [ $preflight != 0 ]; then
    echo "run_all: nothing was run (WHEELS=$wheels: carry what is missing, tests/gpu/wheelhouse.sh)"
    exit 3
fi
if [[ " $* " =~ demo ]]; then  # built once here: demos started together would race to build them
    [ -f artifacts/tiny-vl/config.json ] || python3 -m data_tools.make_tiny_model --kind vl --out artifacts/tiny-vl
    [ -f artifacts/colors/train.jsonl ] || python3 -m data_tools.synth_shapes --task colors --out artifacts/colors
fi

seconds_left() {  # until the deadline (0: none set, which `timeout` reads as no limit)
    if [ -z "${DEADLINE:-}" ]; then echo 0; else echo $(( started + DEADLINE - $(date +%s) )); fi
}

verdict() {  # verdict PART STATUS SECONDS LOG: one line on how the part ended, and what it found
    local how found
    if [ "$2" = 0 ]; then
        how=passed
    elif [[ $2 =~ ^(124|137)$ ]] && [ -n "${DEADLINE:-}" ] && [ "$(seconds_left)" -le 0 ]; then
        how="cut at the deadline"  # (timeout's status; 137: it needed SIGKILL)
    else
        how="FAILED (exit status $2)"
    fi
    # pytest's summary, or the demo's accuracy curve (its last evaluation if cut)
    found=$(grep -oE 'held-out accuracy by step: .*$|step +[0-9]+ +held-out accuracy [0-9.]+|=+ [0-9]+ (passed|failed|skipped|errors?).* =+$' "$4" | tail -1)
    echo "run_all: $1 $how after $3 s${found:+: $found}"
}

declare -A running=()  # pid of each running part's `timeout` -> the part
stop_parts() {  # Ctrl-C or a kill: the parts run in process groups of their own, so stop them too
    [ ${#running[@]} = 0 ] || kill -TERM "${!running[@]}" 2>/dev/null  # (timeout passes it to its part)
    wait
    exit "$1"
}
trap 'stop_parts 130' INT
trap 'stop_parts 143' TERM

status=0
for group in "$@"; do
    IFS=+ read -ra parts <<< "$group"
    left=$(seconds_left)
    if [ -n "${DEADLINE:-}" ] && [ "$left" -le 0 ]; then
        echo "run_all: $group skipped: the deadline (DEADLINE=$DEADLINE s) has passed"
        status=1
        continue
    fi
    begin=$(date +%s)
    for part in "${parts[@]}"; do
        # A demo stopped at the deadline saves a checkpoint first: a minute before SIGKILL.
        timeout --kill-after=60 "$left" bash "$self" --one "$part" "$log_dir" < /dev/null > "$log_dir/${part//:/-}.log" 2>&1 &
        running[$!]=$part
    done
    echo_pid=
    if [ ${#parts[@]} = 1 ]; then  # alone: its output on the terminal too
        tail -n +1 -f --pid="$!" "$log_dir/${part//:/-}.log" &
        echo_pid=$!
    fi
    while [ ${#running[@]} -gt 0 ]; do
        wait -n -p ended "${!running[@]}"
        code=$?
        [ -z "$echo_pid" ] || wait "$echo_pid"  # (its last lines before the verdict)
        verdict "${running[$ended]}" "$code" $(( $(date +%s) - begin )) "$log_dir/${running[$ended]//:/-}.log"
        [ "$code" = 0 ] || status=1
        unset "running[$ended]"
    done
done
echo "run_all: done in $(( $(date +%s) - started )) s"
exit $status
