"""`rl-multilora engine-serve`: the embedded engine served over SGLang's HTTP API (`main(argv)`).

Design choices:
- Heavy imports (transformers, the model, the engine, the aiohttp server) happen inside the functions, so the
  CLI can import this module cheaply. It lives with the CLI, not in `rollout/`: it builds components from a config
  (`rl_multilora.components`), and `rollout` imports only `rl_multilora`'s leaves.
- Arguments are checked before the model loads, with one message per bad value in the project's grammar.
- Binds 127.0.0.1 unless told otherwise, and is never open by default: a key protects every endpoint but
  `/health*` (and SGLang's other exempt prefixes), as SGLang's `--api-key` does. The key is `--api-key` (or env
  RL_MULTILORA_API_KEY); without one, a random key (`secrets.token_urlsafe(32)`) is generated at every start and
  written to `--key-file` (default `$XDG_CACHE_HOME/rl-multilora/engine-serve-<port>.key`, i.e.
  `~/.cache/rl-multilora/...`), a file only its owner can read, replaced atomically so no reader sees a partial
  key. 127.0.0.1 alone is not enough: every local user and process can reach it. The host and port are checked first,
  so a second `engine-serve` started on a busy port fails at once instead of overwriting the running server's key file.
- The generated key is never printed, only the file's path: server output goes to terminals, nohup/systemd logs
  and CI logs that others read, and SGLang and vLLM users expect no printed key (neither generates one).
- `--no-api-key` is the explicit opt-out (serves every endpoint open, with a warning); it refuses to combine
  with a key, so a key is never dropped silently.
"""

from __future__ import annotations

import argparse
import errno
import os
import secrets
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_multilora.errors import bad_value

if TYPE_CHECKING:
    from rollout.engines.base import RolloutEngine


def build_embedded_engine(
    model_dir: str,
    max_loras: int = 8,
    max_rank: int = 64,
    target_modules: str = "all-linear",
    target_parameters: str | list[str] = "",
    expert_lora: str = "per_expert",
    device: str | None = None,
    max_batch_size: int = 256,
    dtype: str = "float32",
    prefix_cache_mb: int = 256,
    max_wave_tokens: int | None = None,
) -> tuple[RolloutEngine, Any]:
    """The embedded engine and tokenizer for an HF model folder (what `engine-serve` serves), from its flags: the
    model is built by `rl_multilora.components.build_embedded_engine`, as a run builds it."""
    from rl_multilora.components import build_embedded_engine as build
    from rl_multilora.config import ModelConfig

    targets: str | list[str] = target_modules
    if isinstance(targets, str) and targets != "all-linear":
        targets = [t.strip() for t in target_modules.split(",") if t.strip()]
    params = target_parameters
    if isinstance(params, str):
        params = [t.strip() for t in params.split(",") if t.strip()]
    m = ModelConfig(
        path=str(model_dir),
        max_loras=max_loras,
        max_rank=max_rank,
        target_modules=targets,
        target_parameters=params or None,
        expert_lora=expert_lora,
        dtype=dtype,
        device=device or "auto",
    )
    return build(m, max_batch_size=max_batch_size, prefix_cache_mb=prefix_cache_mb, max_wave_tokens=max_wave_tokens)


def main(argv: list[str] | None = None, process_entry: bool | None = None) -> int:
    """`rl-multilora engine-serve`: serve the embedded engine over SGLang's HTTP API."""
    from rl_multilora.host_memory import allocator_name, start_with_jemalloc

    process_entry = argv is None if process_entry is None else process_entry
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="rl-multilora engine-serve", description=main.__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (HF format) to serve")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (default 30000, as SGLang)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this host only)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every endpoint but /health* (env RL_MULTILORA_API_KEY); "
        "without one a random key is generated and written to --key-file",
    )
    parser.add_argument(
        "--key-file",
        default=None,
        help="where the generated key is written, readable by its owner only "
        "(default $XDG_CACHE_HOME or ~/.cache, then rl-multilora/engine-serve-<port>.key)",
    )
    parser.add_argument(
        "--no-api-key", action="store_true", help="serve every endpoint without authentication (prints a warning)"
    )
    parser.add_argument("--max-loras", type=int, default=8, help="adapter slots")
    parser.add_argument("--max-rank", type=int, default=64, help="largest LoRA rank a slot holds")
    parser.add_argument("--target-modules", default="all-linear", help="'all-linear' or comma-separated names")
    parser.add_argument(
        "--target-parameters",
        default="",
        help="MoE: comma-separated packed expert Parameters that take LoRA, e.g. "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj (default: none)",
    )
    parser.add_argument(
        "--expert-lora", choices=("per_expert", "shared_a"), default="per_expert", help="expert LoRA layout"
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=256,
        help="most rows one decode wave runs (SGLang: --max-running-requests)",
    )
    parser.add_argument(
        "--max-wave-tokens",
        type=int,
        default=None,
        help="bound on the KV positions a decode wave may hold: each row counts its prompt and max_new_tokens, a "
        "group's shared prompt once; a row alone over it still runs, alone (rollout.max_wave_tokens; SGLang's "
        "--max-total-tokens bounds its KV pool; default: no bound beyond --max-batch-size)",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="MiB of finished rows' KV kept, so a later request that starts with the same tokens under the same adapter "
        "weights prefills only its new tokens (rollout.prefix_cache_mb; 0: off)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=int,
        default=32,
        help="largest request body in MiB (default 32); a larger one gets a 413 and is not buffered",
    )
    parser.add_argument(
        "--max-adapter-body-mb",
        type=int,
        default=1024,
        help="largest /load_lora_adapter_from_tensors body in MiB (default 1024: a weight sync's base64 safetensors)",
    )
    parser.add_argument(
        "--adapter-root",
        default=None,
        help="/load_lora_adapter reads only PEFT folders inside this folder (links resolved first); default: any "
        "folder on the host a key holder names, as SGLang's route does",
    )
    parser.add_argument(
        "--host-allocator",
        choices=("glibc", "jemalloc"),
        default="glibc",
        help="the server's malloc: jemalloc (the jemalloc extra, Ray's wheel; Linux) reuses freed memory by size "
        "class; the command starts itself again with it preloaded, as `rl-multilora run` does (default glibc)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(bad_value("--port", args.port, "a port from 1 to 65535"))
    for key in ("max_loras", "max_rank", "max_body_mb", "max_adapter_body_mb", "max_batch_size"):
        if getattr(args, key) < 1:
            flag = f"--{key.replace('_', '-')}"
            parser.error(f"{flag}={getattr(args, key)!r} is not allowed; allowed: a positive integer")
    if args.max_wave_tokens is not None and args.max_wave_tokens < 1:
        parser.error(
            f"--max-wave-tokens={args.max_wave_tokens!r} is not allowed; allowed: a positive integer (or leave it out)"
        )
    if args.prefix_cache_mb < 0:
        parser.error(f"--prefix-cache-mb={args.prefix_cache_mb!r} is not allowed; allowed: an integer >= 0 (0: off)")
    if args.adapter_root is not None and not Path(args.adapter_root).expanduser().is_dir():
        parser.error(f"--adapter-root={args.adapter_root!r} is not allowed; allowed: an existing folder")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(bad_value("--model", args.model, "an existing model folder (HF format, with its config.json)"))
    if problem := bind_problem(args.host, args.port):
        parser.error(problem)
    try:  # before the key: a start again with jemalloc would write a second one
        if args.host_allocator == "jemalloc":  # `rl-multilora` (cli.main) restores the children's environment
            start_with_jemalloc(["engine-serve", *argv], process_entry, "--host-allocator")
    except ValueError as e:
        parser.error(str(e))
    print(f"engine-serve: host allocator {allocator_name()}", file=sys.stderr, flush=True)
    api_key = _resolve_api_key(parser, args)
    from rollout.server.http_server import serve

    try:
        engine, tokenizer = build_embedded_engine(
            args.model,
            args.max_loras,
            args.max_rank,
            args.target_modules,
            args.target_parameters,
            args.expert_lora,
            max_batch_size=args.max_batch_size,
            prefix_cache_mb=args.prefix_cache_mb,
            max_wave_tokens=args.max_wave_tokens,
        )
    except ValueError as e:  # only target selection's refusals (they need the model's modules); others are bugs
        flag = _target_flag(str(e))
        if flag is None:
            raise
        parser.error(flag + "=" + str(e).split("=", 1)[1])
    try:
        serve(
            engine,
            host=args.host,
            port=args.port,
            api_key=api_key,
            model_name=args.model,
            tokenizer=tokenizer,
            max_body_bytes=args.max_body_mb * 1024**2,
            max_adapter_body_bytes=args.max_adapter_body_mb * 1024**2,
            adapter_root=args.adapter_root,
        )
    finally:
        engine.close()
    return 0


# Target selection's refusals (rl_multilora.lora.model: select_targets, select_parameters) name the config field;
# the command names its flag instead.
_TARGET_FLAGS = {"target_modules=": "--target-modules", "target_parameters=": "--target-parameters"}


def _target_flag(message: str) -> str | None:
    """The flag behind a target selection's refusal `message`; None for any other error."""
    return next((flag for field, flag in _TARGET_FLAGS.items() if message.startswith(field)), None)


def bind_problem(host: str, port: int) -> str | None:
    """Why a server cannot listen on `host:port`, as a usage error naming --host or --port; None when it can (or
    when the reason is left to the server, which reports it itself). `engine-serve` and `tinker-serve` check it
    before a model loads, so a busy port or a host that does not resolve costs no load and shows no traceback."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
        return bad_value("--host", host, f"an address of this machine, or a name that resolves to one ({reason})")
    try:
        with socket.create_server((host, port), family=family):  # SO_REUSEADDR, as aiohttp binds
            return None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return bad_value("--port", port, f"a free port ({host}:{port} is in use)")
        if exc.errno == errno.EADDRNOTAVAIL:
            return bad_value("--host", host, "an address of this machine (no interface here has it)")
        return None


def default_key_file(port: int) -> Path:
    """Where `engine-serve --port PORT` writes its generated key unless `--key-file` says otherwise."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "rl-multilora" / f"engine-serve-{port}.key"


def write_key_file(path: Path, key: str) -> None:
    """Write `key` to `path`, readable and writable by its owner only (0600), replacing any older file atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key)  # no newline: the file's content is the header value as it is
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _resolve_api_key(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The key to serve with: given, generated (and written to the key file), or None after `--no-api-key`."""
    given = args.api_key if args.api_key is not None else os.environ.get("RL_MULTILORA_API_KEY")
    source = "--api-key" if args.api_key is not None else "RL_MULTILORA_API_KEY"
    if given is not None and not given:
        parser.error(f"{source}='' is not allowed; allowed: a non-empty key, or --no-api-key to serve without one")
    if args.no_api_key:
        if given is not None or args.key_file is not None:
            other = source if given is not None else "--key-file"
            parser.error(f"--no-api-key together with {other} is not allowed; allowed: one of them")
        print(
            f"WARNING: engine-serve --no-api-key: every endpoint (generate, load/unload adapters, pause) answers "
            f"anyone who can reach {args.host}:{args.port} without authentication; on 127.0.0.1 that is every "
            "local user and process.",
            file=sys.stderr,
            flush=True,
        )
        return None
    if given is not None:
        if args.key_file is not None:
            parser.error(
                f"--key-file={args.key_file!r} together with {source} is not allowed; allowed: --key-file only "
                "without a given key (it is where a generated key is written)"
            )
        return given
    key = secrets.token_urlsafe(32)
    path = Path(args.key_file).expanduser() if args.key_file is not None else default_key_file(args.port)
    write_key_file(path, key)
    print(
        f"engine-serve: API key written to {path} (readable by you only; a new key at every start). Clients send "
        f"'Authorization: Bearer <key>', e.g. --set rollout.api_key=\"$(cat {path})\". Opt out with --no-api-key.",
        file=sys.stderr,
        flush=True,
    )
    return key


if __name__ == "__main__":
    raise SystemExit(main())
