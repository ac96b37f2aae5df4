#!/usr/bin/env bash
# A venv with sglang 0.5.23 (no GPU needed) for the `sglang`-marked tests, which run SGLang's own HTTP app and LoRA
# loader against our client. Usage: bash tests/setup_sglang_oracle.sh [VENV_DIR]   (default .venv-sglang)
# Then: RL_MULTILORA_SGLANG_PYTHON=VENV_DIR/bin/python python -m pytest -m sglang
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-sglang}"
python -m venv "$venv"
"$venv/bin/pip" install -q -r tests/sglang_real_app_requirements.txt
# sglang's own dependency list pins CUDA kernels and a torch we do not want here; the file above has what it imports.
"$venv/bin/pip" install -q --no-deps sglang==0.5.23
"$venv/bin/python" -c "import sglang.srt.entrypoints.http_server" 2>/dev/null
echo "$venv/bin/python"
