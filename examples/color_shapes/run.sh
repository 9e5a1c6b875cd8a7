#!/usr/bin/env bash
# GRPO on the colour task, 2 CPU ranks. Extra arguments are config overrides, e.g.
#   bash examples/color_shapes/run.sh train.total_steps=10
here=$(dirname "$0")
exec bash "$here/../launch.sh" vl colors "$here/config.yaml" "$@"
