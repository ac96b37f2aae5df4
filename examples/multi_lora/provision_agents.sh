#!/usr/bin/env bash
# Provision the tiny-agents preset: the tiny base (provisioned into artifacts/tiny first if missing) pretrained a
# little further on calculator tool calls and a higher/lower guessing game, plus five datasets (the tiny preset's
# three and calc / guess). About 3 minutes on a 2-core machine after the tiny preset; a second run on a
# provisioned DIR returns at once.
# Usage: examples/multi_lora/provision_agents.sh [DIR] [extra args, e.g. --seed 1 --force]   (DIR: artifacts/tiny-agents)
set -euo pipefail
cd "$(dirname "$0")/../.."

out="${1:-artifacts/tiny-agents}"
shift || true
exec "${PYTHON:-python}" -m rl_multilora.presets.tiny_agents --out "$out" "$@"
