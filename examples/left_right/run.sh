#!/usr/bin/env bash
# The two-shape relation task ("what colour is the shape on the left/right?"), 2 CPU ranks,
# with the colour demo's GRPO recipe unchanged (examples/color_shapes/config.yaml): only the
# data and the run directory differ. A policy that answers any colour in the image scores 0.5.
# Extra arguments are config overrides, e.g. train.total_steps=10.
here=$(dirname "$0")
exec bash "$here/../launch.sh" vl left_right "$here/../color_shapes/config.yaml" \
    data.train_path=artifacts/left_right/train.jsonl data.eval_path=artifacts/left_right/test.jsonl \
    output.dir=runs/left_right train.total_steps=150 "$@"
