#!/usr/bin/env bash
# The colour task, 2 CPU ranks. CONFIG picks the recipe (default config.yaml = GRPO; also
# gspo.yaml, ppo_critic.yaml, dapo.yaml). Extra arguments are config overrides, e.g.
#   CONFIG=dapo.yaml bash examples/color_shapes/run.sh train.total_steps=10
here=$(dirname "$0")
exec bash "$here/../launch.sh" vl colors "$here/${CONFIG:-config.yaml}" "$@"
