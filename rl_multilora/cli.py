"""`rl-multilora` command line: provision, run, export, engine-serve, tinker-serve, and the service verbs.

A user mistake (bad config, missing file, unknown adapter) prints one clear message and exits 2 without a
traceback; a bug still shows its traceback. Heavy imports (torch, transformers) happen inside the commands so
`--help` is instant.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys

# OS errors that are the environment's (space, quota, permissions, read-only file systems), reported without a trace.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1, else argparse's usage error naming the value (no traceback).

    >>> _positive_int("3")
    3
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: an int >= 1")
    return value


def _user_errors() -> tuple[type[BaseException], ...]:
    from rl_multilora.checkpoint import RunStateError
    from rl_multilora.config import ConfigError
    from rl_multilora.tenants import TenantError

    errors: list[type[BaseException]] = [ConfigError, TenantError, FileNotFoundError, RunStateError]
    for mod, name in [
        ("rewards", "RewardConfigError"),
        ("rollout.data_source", "DatasetError"),
        ("rollout.generate_state", "HooksError"),
        ("rl_multilora.service", "ServiceError"),
    ]:
        try:
            errors.append(getattr(__import__(mod, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def cmd_provision(args) -> int:
    from rl_multilora.provision import provision_command

    return provision_command(args)


def cmd_run(args) -> int:
    from rl_multilora.config import load_run_config
    from rl_multilora.loop import RunStopped, run, summarize

    cfg = load_run_config(args.config, args.set)
    if args.resume:
        cfg.checkpoint.resume = "always"
    if args.fresh:
        cfg.checkpoint.resume = "never"
    if args.dry_run:
        from rl_multilora.validate import check_run

        check_run(cfg, args.config)  # the same checks `run` makes before it starts
        print(f"{args.config}: valid ({len(cfg.adapters)} adapters)")
        return 0
    if cfg.model.host_allocator == "jemalloc":
        _start_with_jemalloc(args)
    try:
        rt = run(cfg, source=args.config)
    except RunStopped as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum  # the shell's code for a process ended by that signal
    summary = summarize(cfg.run_dir)
    print(f"run finished: {cfg.run_dir}")
    for name, s in sorted(summary.items()):
        state = rt.tenants.tenants[name].state.value if name in rt.tenants.tenants else "ABSENT"  # not in the config
        held = ""
        if s["eval_base"] is not None and s["eval_final"] is not None:
            held = (
                f" | held-out: base {s['eval_base']:.3f} -> {s['eval_final']:.3f} at step {s['eval_final_step']} "
                f"({s['eval_final'] - s['eval_base']:+.3f})"
            )
            if s["eval_final_errors"]:
                held += f", {s['eval_final_errors']} answers failed (counted 0)"
        print(
            f"  {name:<12} {state:<8} reward first{s['window']} {s['first']:.3f} -> last{s['window']} {s['last']:.3f} "
            f"(gain {s['gain']:+.3f}, {s['steps']} steps){held}"
        )
    for name, t in sorted(rt.tenants.tenants.items()):  # every tenant has a line: the one that needs a look too
        if name not in summary:
            print(
                f"  {name:<12} {t.state.value:<8} no reward in its metrics: no step scored a sample "
                f"({t.adapter_step} steps)"
            )
    # A FAILED adapter (its reward kept raising, its loss was not finite, ...) is the run's failure, not a success:
    # exit 1 for scripts and CI, after the summary; the others trained on and their checkpoints are kept.
    failed = {name: t.reason for name, t in rt.tenants.tenants.items() if t.state.value == "FAILED"}
    if failed:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in sorted(failed.items()))
        print(
            f"error: {len(failed)} of {len(rt.tenants.tenants)} adapter(s) FAILED ({reasons}); the checkpoints of "
            f"every adapter are in {cfg.run_dir}/adapters",
            file=sys.stderr,
        )
        return 1
    return 0


def _start_with_jemalloc(args) -> None:
    """model.host_allocator: jemalloc. A process's malloc is fixed when it starts, so the command starts itself again
    with jemalloc preloaded (rl_multilora/host_memory.py); called in-process (`cli.main([...])`), it says so and
    goes on with the malloc it has, as `loop.run` does."""
    from rl_multilora.config import ConfigError
    from rl_multilora.host_memory import start_with_jemalloc

    try:
        start_with_jemalloc(sys.argv[1:], args.process_entry)
    except ValueError as e:
        raise ConfigError([str(e)], args.config) from None


def cmd_export(args) -> int:
    from pathlib import Path

    from rl_multilora.checkpoint import CheckpointManager
    from rl_multilora.config import ConfigError
    from rl_multilora.errors import bad_value
    from rl_multilora.lora.peft_io import validate_adapter_name

    name, label = args.name, None
    try:
        if name.startswith("tinker://"):  # a Tinker client's save_weights path: its model's newest checkpoint so named
            from rl_multilora.tinker.ops import checkpoint_ref

            name, label = checkpoint_ref(name)
        validate_adapter_name(name)  # NAME becomes a path under RUN_DIR: no '..', no separators
    except ValueError as e:
        raise ConfigError([f"NAME: {e}"]) from None
    if not args.out.strip():  # Path('') is '.': an unset shell variable would write into the current folder
        raise ConfigError([bad_value("OUT", args.out, "a folder path (it is created if missing)")])
    if not Path(args.run_dir).is_dir():
        raise ConfigError([bad_value("RUN_DIR", args.run_dir, "an existing run dir (or a Tinker --state-dir)")])
    out = Path(args.out)
    ck = CheckpointManager(Path(args.run_dir)).export(name, out, args.step, label=label)
    print(f"exported {ck} -> {out}")
    return 0


def cmd_eval(args) -> int:
    import json
    from pathlib import Path

    from rl_multilora.config import ConfigError
    from rl_multilora.errors import bad_value
    from rl_multilora.evaluate import evaluate_checkpoints, format_table

    if args.n is not None and args.n < 1:
        raise ConfigError([bad_value("--n", args.n, "an integer >= 1")])
    if args.out and Path(args.out).is_dir():  # checked before the evaluation, not after it
        raise ConfigError([bad_value("--out", args.out, "a file to write (this is a folder)")])
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise ConfigError([bad_value("--out", args.out, "a file in an existing folder")])
    rows = evaluate_checkpoints(args.run_dir, args.adapter, args.step, args.split, args.n, args.peft)
    if not rows:
        raise ConfigError(
            [bad_value("run_dir", args.run_dir, "a run dir with adapter checkpoints; this one has none")]
        )
    out = Path(args.out) if args.out else Path(args.run_dir) / f"eval_{rows[0]['split'] if rows else 'none'}.json"
    out.write_text(json.dumps(rows, indent=1))
    print(format_table(rows))
    print(f"wrote {out}")
    return 0


def cmd_engine_serve(args) -> int:
    from rl_multilora.engine_serve import main as serve_main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return serve_main(rest, process_entry=args.process_entry) or 0


def cmd_tinker_serve(args) -> int:
    from rl_multilora.tinker.server import main as tinker_main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return tinker_main(rest, process_entry=args.process_entry) or 0


def cmd_service(args) -> int:
    from rl_multilora import service

    return service.cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rl-multilora", description="GRPO training of many LoRA adapters at once.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "provision", help="build an offline tiny preset (dense or MoE), or download a Hub model + datasets"
    )
    from rl_multilora.presets.arguments import add_provision_arguments

    add_provision_arguments(s)
    s.set_defaults(fn=cmd_provision)

    s = sub.add_parser(
        "run",
        help="train every adapter in CONFIG until all are done; exit 1 when one ended FAILED (after the summary)",
    )
    s.add_argument("config")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. grpo.kl_coef=0.01")
    resume = s.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="require a checkpoint to resume from")
    resume.add_argument(
        "--fresh",
        action="store_true",
        help="start anew: an earlier run's run state, checkpoints and metrics move to RUN_DIR/archive/<time>/",
    )
    s.add_argument("--dry-run", action="store_true", help="validate the config, datasets and rewards, then exit")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("export", help="copy an adapter's checkpointed PEFT folder out of a run dir")
    s.add_argument("run_dir", help="a run dir (or a Tinker server's --state-dir)")
    s.add_argument("name", help="adapter name, or a Tinker checkpoint path tinker://<model_id>/weights/<name>")
    s.add_argument("out")
    s.add_argument("--step", type=int, default=None, help="adapter step (default: latest)")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("eval", help="evaluate saved checkpoints (or a PEFT folder) on held-out data vs the base")
    s.add_argument("run_dir", help="a run directory (its config.yaml names the model, datasets and rewards)")
    s.add_argument("--adapter", action="append", default=None, metavar="NAME", help="adapter(s) (default: all)")
    s.add_argument("--step", type=int, default=None, help="adapter step of the checkpoint (default: latest)")
    s.add_argument("--split", default=None, help="split to evaluate on (default: the run's eval.split, 'test')")
    s.add_argument("--n", type=int, default=None, help="held-out prompts per adapter (default: eval.n_prompts)")
    s.add_argument("--peft", default=None, metavar="DIR", help="evaluate this PEFT folder as --adapter NAME")
    s.add_argument("--out", default=None, help="JSON output (default: RUN_DIR/eval_<split>.json)")
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("engine-serve", help="serve the embedded engine over SGLang's HTTP protocol", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_engine_serve)

    s = sub.add_parser(
        "tinker-serve", help="serve a Tinker-API-compatible training server (docs/guides/tinker.md)", add_help=False
    )
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_tinker_serve)

    s = sub.add_parser("serve", help="run the trainer as a long-running service on Ray")
    s.add_argument("config")
    s.add_argument("--address", default=None, help="join an existing Ray cluster")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--fresh", action="store_true", help="archive what an earlier run left in the run dir, start anew")
    s.add_argument(
        "--tinker-port", type=int, default=None, help="also serve the Tinker API on this port (off by default)"
    )
    s.add_argument("--host", default="127.0.0.1", help="address the Tinker API binds (with --tinker-port)")
    s.add_argument("--tinker-base-model", default=None, help="name clients pass as base_model (default: model.path)")
    s.add_argument(
        "--tinker-snapshot-every",
        type=int,
        default=50,
        help="a Tinker client's optimizer steps between journal snapshots (a restart replays at most this many)",
    )
    s.add_argument(
        "--tinker-max-tokens-cap",
        type=int,
        default=None,
        help="the most tokens one Tinker sample may generate (default: the model's context length)",
    )
    s.add_argument(
        "--tinker-session-timeout-s",
        type=float,
        default=120.0,
        help="a Tinker session without heartbeats for this long is ended and its models unloaded (default 120)",
    )
    s.add_argument(
        "--tinker-stability-max-tokens",
        type=_positive_int,
        default=None,
        help="tokens of Tinker stability records (record_stability_info samples, for stable_reinforce) kept at most; "
        "past it the least recently used are evicted (default: tinker-serve's --stability-max-tokens default)",
    )
    s.set_defaults(fn=cmd_service)
    for verb, helptext in [("submit", "submit ADAPTER.yaml to the service"), ("remove", "drain adapter NAME")]:
        s = sub.add_parser(verb, help=helptext)
        s.add_argument("target", help="ADAPTER.yaml" if verb == "submit" else "NAME")
        s.add_argument("--address", default=None)
        s.set_defaults(fn=cmd_service)
    s = sub.add_parser("status", help="show every adapter's state, slot, steps and last reward")
    s.add_argument("--json", action="store_true")
    s.add_argument("--address", default=None)
    s.set_defaults(fn=cmd_service)
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    from rl_multilora.host_memory import no_mkl_buffer_cache, restore_child_env

    restore_child_env()  # started again with jemalloc (model.host_allocator): the children get the user's environment
    no_mkl_buffer_cache()  # before anything imports torch: MKL's per-thread buffer cache is not kept (host_memory.py)
    process_entry = argv is None  # the process's own command line, which `run` may start again (host_allocator)
    # Plugins (`module:function` rewards, `module:Class` hooks) resolve from the current directory, as with
    # `python -m`; the console script alone would not put it on sys.path (spawned reward workers inherit it).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["engine-serve"], ["tinker-serve"]):  # their own parsers: flags pass through untouched
        argv = [argv[0], "--", *argv[1:]] if argv[1:2] != ["--"] else argv
    args = build_parser().parse_args(argv)
    args.process_entry = process_entry
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        return args.fn(args)
    except _user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        # A full disk, a read-only or forbidden run dir: the machine's problem, not a bug. Checkpoints are written to a
        # temp folder and renamed, so the last complete one is intact; temp leftovers are removed at the next start.
        where = f" {e.filename}" if e.filename else ""
        print(
            f"error: cannot write{where}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}). Free space or "
            "fix the permissions, then run the same command again: it resumes from the last complete checkpoint.",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
