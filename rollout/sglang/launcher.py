"""`SGLangLauncher`: starts a local `python -m sglang.launch_server` with LoRA enabled, and stops it.

Design choices:
- `sglang` is an optional extra: nothing here imports it; the launcher only runs it as a subprocess, in its own
  session (process group), so `stop()` reaches the server's worker processes too.
- Ready means `/health_generate` answered 200 (the server generated a token), not just that the process is
  alive; a process that dies while starting fails `start()` at once with the tail of its log.
- The tensor-parallel size comes from the launch arguments (`tp_size_from_args`): the client must send one
  serialized tensor copy per TP rank.
- Expert LoRA (`expert_lora=True`): SGLang wraps its FusedMoE layers with LoRA only when both gate_up_proj and
  down_proj are LoRA target modules, so they are added; `--experts-shared-outer-loras` is refused, since the client
  pushes one A and one B per expert (tests/fixtures/sglang_moe_lora.json).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import requests

from rollout.sglang.protocol import SGLANG_EXPERT_MODULES

if TYPE_CHECKING:
    from rollout.sglang.client import SGLangEngine


def tp_size_from_args(args: list[str]) -> int:
    """The tensor-parallel size that `sglang.launch_server` arguments ask for (1 when they do not say).

    >>> tp_size_from_args(["--mem-fraction-static", "0.5", "--tp-size", "4"])
    4
    >>> tp_size_from_args(["--tensor-parallel-size=2"]), tp_size_from_args(["--tp", "8"]), tp_size_from_args([])
    (2, 8, 1)
    """
    flags = ("--tp-size", "--tensor-parallel-size", "--tp")
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not raw.isdigit() or int(raw) < 1:
                allowed = "a positive integer (in the SGLang arguments)"
                raise ValueError(f"{name}={raw!r} is not allowed; allowed: {allowed}")
            return int(raw)
    return 1


# ----------------------------------------------------------------------------------------------- launcher


@dataclass
class SGLangLauncher:
    """Starts `python -m sglang.launch_server` with LoRA enabled and waits until it can generate.

    Ready means `/health_generate` answered 200 (the server generated a token), not just that the process is
    alive. If the process dies while starting, `start()` fails at once with the tail of its log. `stop()` sends
    SIGTERM to the server's process group, then SIGKILL after `stop_grace_s`.
    """

    model_path: str
    port: int = 30000
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: list[str] | str = "all"
    lora_backend: str = "triton"
    extra_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    api_key: str | None = None
    python: str = sys.executable
    log_path: str | None = None
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 30.0
    expert_lora: bool = False  # the model has expert LoRA (target_parameters): serve SGLang's MoE LoRA too
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log_file: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path={self.model_path!r} is not allowed; allowed: a model folder or hub id")
        for key in ("port", "max_loras_per_batch", "max_lora_rank"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} is not allowed; allowed: a positive integer")
        if not isinstance(self.lora_backend, str) or not self.lora_backend:
            raise ValueError(
                f"lora_backend={self.lora_backend!r} is not allowed; allowed: a backend name, e.g. 'triton' or 'csgmv'"
            )
        if not isinstance(self.extra_args, (list, tuple)) or not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError(f"extra_args={self.extra_args!r} is not allowed; allowed: a list of command-line strings")
        if self.expert_lora and any(a.partition("=")[0] == "--experts-shared-outer-loras" for a in self.extra_args):
            raise ValueError(
                "extra_args has --experts-shared-outer-loras, which is not allowed with expert_lora; allowed: "
                "without it (SGLang then wants one gate_up A and one down B for all experts, and the client pushes "
                "one per expert)"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size asked for in `extra_args` (SGLang wants one serialized tensor copy per rank)."""
        return tp_size_from_args(list(self.extra_args))

    def target_modules(self) -> list[str]:
        """`--lora-target-modules` values; PEFT's "all-linear" is SGLang's "all" (which includes its MoE experts).

        With `expert_lora`, SGLang's expert modules are added: it wraps a FusedMoE layer only when both are there.
        """
        mods = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        out = ["all" if m == "all-linear" else m for m in mods]
        if not out or not all(isinstance(m, str) and m for m in out):
            raise ValueError(
                f"lora_target_modules={self.lora_target_modules!r} is not allowed; allowed: e.g. 'all' or ['q_proj']"
            )
        if self.expert_lora and "all" not in out:
            out += [m for m in SGLANG_EXPERT_MODULES.values() if m not in out]
        return out

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path]
        cmd += ["--host", self.host, "--port", str(self.port), "--enable-lora"]
        cmd += ["--max-loras-per-batch", str(self.max_loras_per_batch), "--max-lora-rank", str(self.max_lora_rank)]
        cmd += ["--lora-target-modules", *self.target_modules(), "--lora-backend", self.lora_backend]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)

    def start(self) -> str:
        """Launch the server, wait until it generates, and return its URL (`attach(url)` gives a client)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"SGLang server already running (pid {self._proc.pid})")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="sglang_", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # A new session makes the server the leader of its own process group, so stop() reaches its workers.
        self._proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll() if self._proc is not None else None
            if code is not None:
                raise RuntimeError(f"SGLang server exited with code {code} while starting:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"SGLang server not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @staticmethod
    def attach(url: str, api_key: str | None = None, **engine_kwargs: Any) -> SGLangEngine:
        """A client for an already running server; fails unless `/health` answers 200."""
        from rollout.sglang.client import SGLangEngine  # here: sglang.py re-exports this module's launcher

        engine = SGLangEngine(url, api_key=api_key, **engine_kwargs)
        if not engine.health():
            raise RuntimeError(f"no healthy SGLang server at {url} (GET /health did not answer 200)")
        return engine

    def __enter__(self) -> SGLangLauncher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
