#!/usr/bin/env bash
# Run the trainer as a service: provision the offline tiny preset if needed, start a local Ray cluster (token auth
# on) and the `controller` actor, then wait. Submit tenants from another terminal (submit_schedule.sh does a demo).
# Ctrl-C (or SIGTERM) checkpoints every live adapter, stops the actor and Ray, and exits 0.
#   bash examples/multi_lora/start_service.sh [CONFIG] [--address HOST:PORT] [--set key=value ...]
set -euo pipefail
source "$(dirname "$0")/cli.sh"
config=examples/multi_lora/configs/service.yaml
if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # a leading flag (--address, --set ...) is for `serve`, not the config
  config=$1
  shift
  if [[ $config != /* ]] && [ -e "$config" ]; then  # relative to where it was called from
    config="$PWD/$config"
  fi
fi
cd "$(dirname "$0")/../.."
bash examples/multi_lora/provision.sh artifacts/tiny
# exec: the signals reach `rl-multilora serve` itself, which handles them.
exec "${cli[@]}" serve "$config" "$@"
