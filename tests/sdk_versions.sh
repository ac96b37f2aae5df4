#!/usr/bin/env bash
# Drive the Tinker server with each supported `tinker` SDK release, each in a venv of its own.
#
#   tests/sdk_versions.sh [VERSION ...]     (default: every supported release below)
#
# For each release: a plain venv (`python -m venv`, no system site-packages) holding only `tinker==VERSION` and the
# dependencies it declares, installed from the package registry with pip; then a server started from this
# repository's venv on a tiny model built offline, and tests/sdk/session.py run by the release's own interpreter
# (create, forward, forward_backward + optim_step x3, save_state, sampler weights, sample). Prints one line per
# release, "ok VERSION {...}" or "FAIL VERSION", and exits non-zero when any failed.
#
# Environment: PYTHON (this repository's interpreter, default .venv/bin/python), BASE_PYTHON (the interpreter the
# SDK venvs are made from, default the one PYTHON's venv was made from), SDK_VENVS (where the venvs are kept and
# reused, default ~/.cache/rl-multilora/sdk-venvs), MODEL (a model folder to serve, default a tiny random one).
#
# Exit status 3: a release is not installable from the registry (pip's error is printed), so callers can skip.
set -euo pipefail

SUPPORTED=(0.16.1 0.24.1 0.25.0 0.26.2 0.38.0)  # docs/guides/tinker.md#sdk-versions
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
BASE_PYTHON="${BASE_PYTHON:-$("$PYTHON" -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')}"
SDK_VENVS="${SDK_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-multilora/sdk-venvs}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("${SUPPORTED[@]}")

WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

if [ -z "${MODEL:-}" ] && [ -z "${SDK_VENVS_ONLY:-}" ]; then
    MODEL="$WORK/model"
    (cd "$ROOT" && "$PYTHON" -c "from tests.tiny_models import save_tiny_model; save_tiny_model('$MODEL')")
fi

venv_for() {  # the venv of release $1, made (or re-made) when it does not hold exactly that release
    local version="$1" dir="$SDK_VENVS/tinker-$1"
    if [ -x "$dir/bin/python" ] && [ "$("$dir/bin/python" -c 'import tinker; print(tinker.__version__)' 2>/dev/null)" = "$version" ]; then
        echo "$dir"; return 0
    fi
    rm -rf "$dir"
    mkdir -p "$SDK_VENVS"
    "$BASE_PYTHON" -m venv "$dir" >&2
    if ! "$dir/bin/python" -m pip install -q "tinker==$version" >&2; then
        rm -rf "$dir"
        return 3
    fi
    echo "$dir"
}

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

failed=0
for version in "${VERSIONS[@]}"; do
    status=0
    venv="$(venv_for "$version")" || status=$?
    if [ "$status" -ne 0 ]; then
        echo "FAIL $version: tinker==$version is not installable from the package registry"
        exit 3
    fi
    if [ -n "${SDK_VENVS_ONLY:-}" ]; then
        echo "venv $version: $venv"
        continue
    fi
    port="$(free_port)"
    export RL_MULTILORA_TINKER_TOKEN="tml-sdk-versions" TINKER_API_KEY="tml-sdk-versions"
    (cd "$ROOT" && exec "$PYTHON" -m rl_multilora.tinker.server --model "$MODEL" --state-dir "$WORK/state-$version" \
        --base-model-name tiny --port "$port" --max-loras 2 --max-rank 8) >"$WORK/server-$version.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 240); do
        if "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/api/v1/healthz', timeout=1)" 2>/dev/null; then
            break
        fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.5
    done
    if out="$(cd "$WORK" && timeout 300 "$venv/bin/python" "$ROOT/tests/sdk/session.py" --base-url "http://127.0.0.1:$port" --base-model tiny 2>"$WORK/client-$version.log")"; then
        echo "ok $version $out"
    else
        echo "FAIL $version"
        tail -n 30 "$WORK/client-$version.log" | sed 's/^/  client: /'
        tail -n 15 "$WORK/server-$version.log" | sed 's/^/  server: /'
        failed=1
    fi
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
done
exit "$failed"
