#!/usr/bin/env bash
# The main job: provision the offline tiny preset if needed, then train three adapters at once with GRPO.
#   bash examples/multi_lora/single_run.sh [CONFIG] [--set key=value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
config="${1:-examples/multi_lora/configs/tiny.yaml}"
[ $# -gt 0 ] && shift
bash examples/multi_lora/provision.sh artifacts/tiny
exec rl-multilora run "$config" "$@"
