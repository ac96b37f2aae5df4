#!/usr/bin/env bash
# Provision the tiny-agents preset: the tiny base (provisioned into artifacts/tiny first if missing) pretrained a
# little further on calculator tool calls and a higher/lower guessing game, plus five datasets (the tiny preset's
# three and calc / guess). About 3 minutes on a 2-core machine after the tiny preset; a second run on a
# provisioned DIR returns at once.
# Usage: examples/multi_lora/provision_agents.sh [DIR] [extra args, e.g. --force]   (DIR: artifacts/tiny-agents)
# Another seed needs a tiny base of that seed: `--seed 1 --tiny DIR` (DIR provisioned at seed 1 if missing);
# artifacts/tiny is only ever provisioned at seed 0, the main job's.
set -euo pipefail

# DIR and --tiny DIR are relative to where the script is called from, not the checkout it changes into below.
out=artifacts/tiny-agents
if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # a leading flag (--force, --seed 1) is for provisioning, not DIR
  out=$1
  shift
  [[ $out == /* ]] || out="$PWD/$out"
fi
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --tiny=*) tiny=${1#--tiny=}; [[ $tiny == /* ]] || tiny="$PWD/$tiny"; args+=("--tiny=$tiny") ;;
    --tiny)
      args+=("$1")
      if [ $# -gt 1 ]; then
        shift
        tiny=$1; [[ $tiny == /* ]] || tiny="$PWD/$tiny"; args+=("$tiny")
      fi
      ;;
    *) args+=("$1") ;;
  esac
  shift
done

cd "$(dirname "$0")/../.."  # the defaults (artifacts/...) are the checkout's, and the module runs from it
exec "${PYTHON:-python}" -m rl_multilora.presets.tiny_agents --out "$out" ${args[@]+"${args[@]}"}
