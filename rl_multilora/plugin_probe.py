"""A submitted tenant's plugins (its reward by import path, its environment) loaded first in a throwaway interpreter.

A service's admission checks resolve a submitted adapter's reward and build one instance of its environment in the
service's own process (`validate.outside_facts`). Python code run at import can end that process for good
(`os._exit`, a crash in a C extension, a `SIGKILL` of its own): a reviewer's reward module that called `os._exit(3)`
at import took the service down with every other tenant's unsaved steps. `probe` runs the same loading in a fresh
interpreter (`python -m rl_multilora.plugin_probe`, the spec as JSON on stdin, the service's `sys.path` and working
folder), and says which field's loading ended it; only a submission whose plugins load there is loaded in the
service. What a plugin raises is left to the in-process checks, which say it in their own words.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

PROBE_TIMEOUT_S = 120.0  # an import that takes longer is refused (it would hold the submission as long in the service)
_MARK = "rl-multilora-probe:"  # a line the child writes before each field it loads, then once when done


def _specs(a) -> dict[str, dict[str, Any]]:
    """field -> what the child loads for it: user code only (a built-in reward name runs none)."""
    from pydantic import TypeAdapter

    from rollout.types import EnvironmentSpec, RewardSpec

    specs = {}
    if a.reward is not None and a.reward.path is not None:
        specs["reward"] = TypeAdapter(RewardSpec).dump_python(a.reward, mode="json")
    if a.environment is not None:
        specs["environment"] = TypeAdapter(EnvironmentSpec).dump_python(a.environment, mode="json")
    return specs


def probe(a, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """Problems (one per field, naming it and its value) when loading adapter config `a`'s plugins ended or hung a
    fresh interpreter; [] when they loaded or raised there (an exception is the in-process checks' to report)."""
    specs = _specs(a)
    if not specs:
        return []
    request = json.dumps({"sys_path": sys.path, "specs": specs})
    if "environment" in specs:  # its build is given turn_timeout_s there, after the imports
        timeout_s += float(specs["environment"].get("turn_timeout_s") or 0.0)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rl_multilora.plugin_probe"],
            input=request, capture_output=True, text=True, timeout=timeout_s, cwd=os.getcwd(),
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        field = _last_field(e.stdout)
        return [
            _problem(
                field, specs,
                f"loading it did not finish within {timeout_s:g} s (the limit of the fresh process a service loads a "
                "submitted plugin in first)",
            )
        ]  # fmt: skip
    if _last_field(done.stdout) == "done" and done.returncode == 0:
        return []
    field = _last_field(done.stdout)
    if done.returncode < 0:
        how = f"killed by {signal.Signals(-done.returncode).name}"
    else:
        how = f"exit code {done.returncode}"
    tail = " | ".join(done.stderr.strip().splitlines()[-3:])
    said = f"; it said: {tail}" if tail else ""
    return [
        _problem(
            field, specs,
            f"loading it ended the process ({how}){said}; a plugin must not exit or crash when it is imported or "
            "built (in a service it would end every tenant's training with it)",
        )
    ]  # fmt: skip


def _last_field(stdout: str | bytes | None) -> str | None:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    marks = [line[len(_MARK) :] for line in (stdout or "").splitlines() if line.startswith(_MARK)]
    return marks[-1] if marks else None


def _problem(field: str | None, specs: dict, what: str) -> str:
    field = field if field in specs else next(iter(specs))
    return f"{field}.path={specs[field]['path']!r} is not allowed: {what}"


def _build(load_environment, env) -> None:
    try:
        load_environment(env.path, env.kwargs).close()
    except BaseException:  # noqa: BLE001, S110 - what building or closing raises is the in-process checks' to say
        pass


def _load(specs: dict[str, dict[str, Any]], marks) -> None:
    """In the child: what `validate.outside_facts` does for these fields; progress on `marks`, a stream the
    plugins do not share."""
    from pydantic import TypeAdapter

    import rewards
    from rollout.environments import load_environment
    from rollout.types import EnvironmentSpec, RewardSpec

    for field, spec in specs.items():
        print(_MARK + field, file=marks, flush=True)
        try:
            if field == "reward":
                rewards.validate(TypeAdapter(RewardSpec).validate_python(spec))
            else:  # built as validation builds it: in a daemon thread, given turn_timeout_s (a later check says so)
                env = TypeAdapter(EnvironmentSpec).validate_python(spec)
                thread = threading.Thread(target=_build, args=(load_environment, env), daemon=True)
                thread.start()
                thread.join(env.turn_timeout_s)
        except BaseException:  # noqa: BLE001, S110 - a raise (SystemExit too) is the in-process checks' to say
            pass
    print(_MARK + "done", file=marks, flush=True)


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    sys.path[:] = request["sys_path"]
    # The marks go to the real stdout, kept on a descriptor of its own; what the plugins print (a partial line, a
    # replaced sys.stdout) goes to stderr and cannot hide them.
    marks = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _load(request["specs"], marks)
    os._exit(0)  # no interpreter shutdown: a plugin's atexit hooks or threads are not the probe's to wait for
