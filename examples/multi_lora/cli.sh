# Sourced by the example scripts: `cli` is the command that runs `rl-multilora`, the same way provision.sh picks its
# Python: PYTHON (the tests set it to their interpreter) when set, else the console script, else `python`.
if [ -n "${PYTHON:-}" ]; then
  cli=("$PYTHON" -m rl_multilora.cli)
elif command -v rl-multilora >/dev/null 2>&1; then
  cli=(rl-multilora)
else
  cli=(python -m rl_multilora.cli)
fi
