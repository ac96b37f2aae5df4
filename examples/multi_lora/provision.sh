#!/usr/bin/env bash
# Provision the offline tiny preset: a small pretrained Llama base + the gsm8k / arith / compare datasets.
# Usage: examples/multi_lora/provision.sh [DIR] [extra args, e.g. --seed 1 --force]   (DIR defaults to artifacts/tiny)
# Takes about 2.5 minutes on an idle 2-core machine (longer when other jobs share it): it logs each phase, and
# pretraining shows a bar with the loss and an ETA (on a terminal; log lines every 10 % otherwise). A second run on a
# provisioned DIR returns at once.
set -euo pipefail

out=artifacts/tiny
if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # a leading flag (--force, --seed 1) is for provisioning, not DIR
  out=$1
  shift
fi

# PYTHON (the tests set it to their interpreter) names the Python to run; else the console script, else `python`.
if [ -n "${PYTHON:-}" ]; then
  exec "$PYTHON" -m rl_multilora.provision --preset tiny --out "$out" "$@"
fi
if command -v rl-multilora >/dev/null 2>&1; then
  exec rl-multilora provision --preset tiny --out "$out" "$@"
fi
# The console script is not installed (e.g. a plain checkout): run the module directly.
exec "${PYTHON:-python}" -m rl_multilora.provision --preset tiny --out "$out" "$@"
