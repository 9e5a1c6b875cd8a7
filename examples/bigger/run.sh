#!/usr/bin/env bash
# The two-shape size relation ("what colour is the bigger shape?"), 2 CPU ranks, with the colour
# demo's GRPO recipe unchanged (examples/color_shapes/config.yaml): only the data, the run
# directory and the step budget differ. A policy that answers any colour in the image scores 0.5.
# Extra arguments are config overrides, e.g. train.total_steps=10.
here=$(dirname "$0")
exec bash "$here/../launch.sh" vl bigger "$here/../color_shapes/config.yaml" \
    data.train_path=artifacts/bigger/train.jsonl data.eval_path=artifacts/bigger/test.jsonl \
    output.dir=runs/bigger train.total_steps=150 "$@"
