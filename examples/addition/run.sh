#!/usr/bin/env bash
# GRPO on small addition (operands 0..4) with the tiny text model, 2 CPU ranks.
here=$(dirname "$0")
exec bash "$here/../launch.sh" text addition "$here/config.yaml" "$@"
