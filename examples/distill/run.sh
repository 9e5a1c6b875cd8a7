#!/usr/bin/env bash
# On-policy distillation beside GRPO, 2 CPU ranks each: the colour task (default) or its text
# twin, small addition (TASK=addition). Builds the teacher once, by supervised learning on the
# task's training rows (data_tools.supervised_probe --save, into artifacts/teacher-TASK), distils
# it into the demo's warmed-up student, trains the demo's GRPO recipe on the same task and seed,
# and prints both held-out curves. SEED sets both runs' train.seed (default 0); MODE the
# distillation's algo.distill.mode (default advantage; jsd: the top-k divergence); extra
# arguments are config overrides of the distillation run, e.g.
#   SEED=1 bash examples/distill/run.sh algo.distill.coef=0.5
#   MODE=jsd bash examples/distill/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
task=${TASK:-colors} seed=${SEED:-0} mode=${MODE:-advantage}
case $task in
  # The teacher's recipe: the probe's held-out accuracy reaches 0.97 (colours) and 1.00
  # (addition) there, with the answer's probability still well below 1 (a soft teacher, whose
  # per-token signal is less noisy than a near one-hot one's: docs/examples.md).
  colors) kind=vl config=config.yaml grpo=examples/color_shapes/config.yaml teach=(--steps 60 --eval-every 20) ;;
  addition) kind=text config=addition.yaml grpo=examples/addition/config.yaml teach=(--steps 100 --eval-every 50) ;;
  *) echo "examples/distill/run.sh: TASK must be colors or addition, not '$task'" >&2; exit 2 ;;
esac
model=artifacts/tiny-$kind data=artifacts/$task teacher=artifacts/teacher-$task
[ -f "$model/config.json" ] || python -m data_tools.make_tiny_model --kind "$kind" --out "$model"
[ -f "$data/train.jsonl" ] || python -m data_tools.synth_shapes --task "$task" --out "$data"
[ -f "$teacher/config.json" ] ||
  python -m data_tools.supervised_probe --model "$model" --data "$data" "${teach[@]}" --save "$teacher"
runs=runs/distill/$task-seed$seed
out=$runs/distill  # (the default mode's; another mode's run goes beside it, named by the mode)
[ "$mode" = advantage ] || out=$runs/$mode
bash examples/launch.sh "$kind" "$task" "examples/distill/$config" train.seed="$seed" algo.distill.mode="$mode" \
  output.dir="$out" "$@"
bash examples/launch.sh "$kind" "$task" "$grpo" train.seed="$seed" output.dir="$runs/grpo" eval.every_steps=5
python -m data_tools.compare_curves "$out/metrics.jsonl" "$runs/grpo/metrics.jsonl"
