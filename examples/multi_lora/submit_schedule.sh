#!/usr/bin/env bash
# A tenant timeline against a running service (start it first: bash examples/multi_lora/start_service.sh):
#   t=0      submit gsm8k                      -> trains alone
#   t=GAP    submit arith                      -> both slots busy
#   t=2GAP   submit compare                    -> PENDING: no free slot
#   t=3GAP   remove gsm8k                      -> drains (final checkpoint), compare takes its slot
#   t=4GAP   final status
# Usage: [GAP=30] bash examples/multi_lora/submit_schedule.sh [--address HOST:PORT]
set -euo pipefail
source "$(dirname "$0")/cli.sh"
cd "$(dirname "$0")/../.."
gap="${GAP:-30}"
adapters=examples/multi_lora/configs/adapters
start=$SECONDS

say() { printf '\n[t=%4ss] %s\n' "$((SECONDS - start))" "$*"; }
status() { "${cli[@]}" status "$@"; }

say "submit gsm8k"
"${cli[@]}" submit "$adapters/gsm8k.yaml" "$@"
status "$@"
sleep "$gap"

say "submit arith"
"${cli[@]}" submit "$adapters/arith.yaml" "$@"
status "$@"
sleep "$gap"

say "submit compare (both slots are busy: it waits as PENDING)"
"${cli[@]}" submit "$adapters/compare.yaml" "$@"
status "$@"
sleep "$gap"

say "remove gsm8k (in-flight samples finish, final checkpoint, slot freed for compare)"
"${cli[@]}" remove gsm8k "$@"
status "$@"
sleep "$gap"

say "final status"
status "$@"
