#!/usr/bin/env bash
# The main job: provision the offline tiny preset if needed, then train three adapters at once with GRPO.
#   bash examples/multi_lora/single_run.sh [CONFIG] [--set key=value ...]
# On a 2-core machine: provisioning about 2.5-3 min, once (5-8 min when other jobs load the cores; it logs each phase
# and shows a bar with an estimate), then training 2-4 min. Each phase says what it does before it starts.
set -euo pipefail
source "$(dirname "$0")/cli.sh"
default_config=examples/multi_lora/configs/tiny.yaml
config=$default_config
if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # a leading flag (--set ...) is for `run`, not the config
  config=$1
  shift
  if [[ $config != /* ]] && [ -e "$config" ]; then  # relative to where it was called from, not the checkout
    config="$PWD/$config"
  fi
fi
cd "$(dirname "$0")/../.."
if [[ $config == /* ]] && [[ $config != "$PWD"/* ]]; then  # a config of the caller's, outside the checkout
  echo "note: the run starts in $PWD: relative paths in $config (data_files, run_dir, model.path) resolve from" \
    "there; make them absolute, or run \`rl-multilora run $config\` from its own folder"
fi
preset=artifacts/tiny
# The tiny preset is what the default config (and any config on artifacts/tiny/) trains on; another config's model
# is its own to provision (e.g. `rl-multilora provision --preset tiny-moe --out artifacts/tiny-moe`).
if [ "$config" = "$default_config" ] || grep -Eq "^[[:space:]]*path:[[:space:]]*['\"]?(\./)?$preset/" "$config" 2>/dev/null; then
  if [ -f "$preset/PROVISIONED.json" ]; then
    echo "[1/2] $preset is already provisioned (its PROVISIONED.json): checking the recipe, no rebuild ..."
  else
    echo "[1/2] provisioning the tiny preset into $preset (about 2.5-3 min on 2 cores, once): datasets, tokenizer," \
      "pretraining a 0.85M-parameter base, base-model evaluation ..."
  fi
  bash examples/multi_lora/provision.sh "$preset"
else
  echo "[1/2] $config does not train on $preset: not provisioning it"
fi

if [ "$config" = "$default_config" ] && [ $# -eq 0 ]; then
  echo "[2/2] training 3 adapters (gsm8k, arith, compare) at once for 80 GRPO steps (about 2-4 min on 2 cores) ..."
else
  echo "[2/2] training the adapters of $config${*:+ with $*} ..."
fi
exec "${cli[@]}" run "$config" "$@"
