"""rl_multilora.host_memory: the glibc knobs a run uses to keep its resident size near its live bytes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rl_multilora.host_memory import (
    MKL_BUFFER_CACHE_ENV,
    heap_in_use,
    no_mkl_buffer_cache,
    release_freed_memory,
    set_mmap_threshold,
)

glibc = pytest.mark.skipif(heap_in_use() is None, reason="needs glibc >= 2.33 (mallinfo2)")


@glibc
def test_heap_in_use_counts_a_live_tensor_and_forgets_a_freed_one():
    before = heap_in_use()
    t = torch.ones(16 * 2**20 // 4)  # 16 MiB, float32
    held = heap_in_use() - before
    del t
    freed = heap_in_use() - before
    assert 15 * 2**20 < held < 17 * 2**20
    assert abs(freed) < 2**20


@glibc
def test_a_fixed_mmap_threshold_returns_a_freed_tensor_to_the_os():
    # in a child process: the threshold is process-wide and would stay set for the rest of the test session
    code = """
import psutil, torch
from rl_multilora.host_memory import set_mmap_threshold
assert set_mmap_threshold(128 * 1024)
proc = psutil.Process()
torch.ones(4 * 2**20).sum()  # 16 MiB freed: glibc alone would now raise its threshold above it
rss = proc.memory_info().rss
t = torch.ones(2 * 2**20)  # 8 MiB
assert proc.memory_info().rss - rss > 7 * 2**20
del t
assert proc.memory_info().rss - rss < 2**20, (proc.memory_info().rss - rss) / 2**20
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_trimming_runs_anywhere():
    assert release_freed_memory() in (True, False)


def test_a_bad_threshold_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="an int >= 0"):
        set_mmap_threshold(-1)


def _env_without_mkl_switch() -> dict[str, str]:
    """This environment as a fresh shell has it: without the switch an in-process `cli.main` may have set."""
    return {k: v for k, v in os.environ.items() if k != MKL_BUFFER_CACHE_ENV}


_MKL_PRODUCTS = """
import sys
from rl_multilora.host_memory import heap_in_use, no_mkl_buffer_cache
took = no_mkl_buffer_cache() if sys.argv[1] == "off" else False
import torch
torch.set_num_threads(2)
x, w = torch.randn(412, 576), torch.randn(8192, 576)
before = heap_in_use()
for _ in range(3):
    y = x @ w.t()
    del y
print(took, (heap_in_use() - before) / 2**20)
"""


@glibc
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch does not use Intel MKL")
def test_without_mkl_buffer_cache_a_product_keeps_no_buffer_after_it():
    env = _env_without_mkl_switch()
    root = Path(__file__).resolve().parents[1]
    kept = {}
    for mode in ("cache", "off"):
        out = subprocess.run([sys.executable, "-c", _MKL_PRODUCTS, mode], check=True, cwd=root, env=env,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
        assert out[0] == str(mode == "off")  # the switch took effect only where asked, before torch was imported
        kept[mode] = float(out[1])  # MiB still held after the products' outputs were freed
    assert kept["cache"] > 4, kept  # MKL's own cache holds its buffers...
    assert abs(kept["off"]) < 1, kept  # ...and without it nothing stays


def test_the_mkl_switch_changes_nothing_once_torch_is_imported(monkeypatch):
    monkeypatch.delenv(MKL_BUFFER_CACHE_ENV, raising=False)
    assert not no_mkl_buffer_cache()  # torch is imported here: too late for MKL to read it
    assert MKL_BUFFER_CACHE_ENV not in os.environ


def test_the_cli_turns_the_mkl_cache_off_before_torch_loads():
    code = """
import os, sys
from rl_multilora import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
print(os.environ.get("MKL_DISABLE_FAST_MM"), "torch" in sys.modules)
"""
    env = _env_without_mkl_switch()
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()  # fmt: skip
    assert out[-2:] == ["1", "False"], out


# --- jemalloc (model.host_allocator) ------------------------------------------------------------------------------

needs_jemalloc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or importlib.util.find_spec("ray") is None,
    reason="jemalloc comes from Ray's wheel (the README's test command installs the ray extra); Linux only",
)

_UNDER_JEMALLOC = """
import os, ctypes, psutil, torch
from rl_multilora.host_memory import heap_in_use, jemalloc_loaded, release_freed_memory, restore_child_env
restore_child_env()
assert jemalloc_loaded()
assert os.environ.get("LD_PRELOAD") == os.environ.get("EXPECT_PRELOAD"), os.environ.get("LD_PRELOAD")
assert "MALLOC_CONF" not in os.environ, os.environ["MALLOC_CONF"]
decay, size = ctypes.c_ssize_t(0), ctypes.c_size_t(8)
ctypes.CDLL(None).mallctl(b"opt.dirty_decay_ms", ctypes.byref(decay), ctypes.byref(size), None, 0)
assert decay.value == 1000, decay.value  # the options exec_with_jemalloc sets (JEMALLOC_CONF)
before = heap_in_use()
t = torch.ones(16 * 2**20 // 4)  # 16 MiB
assert 15 * 2**20 < heap_in_use() - before < 17 * 2**20
proc = psutil.Process()
held = proc.memory_info().rss
del t
assert abs(heap_in_use() - before) < 2**20
assert release_freed_memory()
assert held - proc.memory_info().rss > 15 * 2**20, (held - proc.memory_info().rss) / 2**20  # purged, not kept
print("ok")
"""


@needs_jemalloc
def test_a_process_started_with_jemalloc_uses_it_purges_and_hands_children_the_old_environment(tmp_path):
    from rl_multilora.host_memory import find_jemalloc

    assert find_jemalloc().name == "libjemalloc.so"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    starter = "import sys; from rl_multilora.host_memory import exec_with_jemalloc; exec_with_jemalloc(sys.argv[1:])"
    for preload in (None, "libm.so.6"):  # a user's own preload is kept, and comes back for the children
        if preload:
            env["LD_PRELOAD"] = env["EXPECT_PRELOAD"] = preload
        out = subprocess.run([sys.executable, "-c", starter, "-c", _UNDER_JEMALLOC], env=env, capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@needs_jemalloc
def test_a_process_another_starter_starts_with_jemalloc_env_has_it_or_refuses(tmp_path):
    # What `rl-multilora serve` hands Ray for its actor (runtime_env env_vars): a process started with these variables
    # runs under jemalloc and gives its children the environment back; where the loader could not preload the file
    # (it only warns), check_jemalloc_started refuses by name.
    from rl_multilora.host_memory import JEMALLOC_ENV, jemalloc_env

    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", JEMALLOC_ENV)}
    check = "from rl_multilora.host_memory import check_jemalloc_started; check_jemalloc_started('x.allocator')\n"
    out = subprocess.run([sys.executable, "-c", check + _UNDER_JEMALLOC], env={**clean, **jemalloc_env()},
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

    out = subprocess.run([sys.executable, "-c", check], env=clean, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode != 0 and "x.allocator='jemalloc' is not allowed here: this process started without it" in (
        out.stderr
    ), out.stderr[-2000:]

    broken = tmp_path / "libjemalloc.so"
    broken.write_text("not a shared object")
    env = {**clean, JEMALLOC_ENV: str(broken)}
    starter = "import os; from rl_multilora.host_memory import jemalloc_env; os.environ.update(jemalloc_env())\n"
    starter += f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {check!r}]).returncode)"
    out = subprocess.run([sys.executable, "-c", starter], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode != 0 and f"{broken} could not be preloaded" in out.stderr, out.stderr[-2000:]


def test_a_jemalloc_library_that_is_not_there_is_refused_by_name(monkeypatch, tmp_path):
    from rl_multilora.host_memory import JEMALLOC_ENV, find_jemalloc

    monkeypatch.setenv(JEMALLOC_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(ValueError, match=f"{JEMALLOC_ENV}=.*nope.so.* allowed: the path of a libjemalloc.so file"):
        find_jemalloc()


def test_jemalloc_and_glibcs_threshold_are_not_set_together():
    from rl_multilora.config import ModelConfig

    with pytest.raises(ValueError, match="malloc_mmap_threshold_kb=512 is not allowed; allowed: null with"):
        ModelConfig(path="m", host_allocator="jemalloc", malloc_mmap_threshold_kb=512)
    with pytest.raises(ValueError, match="host_allocator"):
        ModelConfig(path="m", host_allocator="tcmalloc")


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # all but the timings


@needs_jemalloc
def test_run_under_jemalloc_with_junk_filled_memory_learns_the_same_bits(tmp_path):
    # `rl-multilora run` with model.host_allocator: jemalloc starts itself again under jemalloc. Its junk option fills
    # every new and freed block with 0xa5 / 0x5a bytes, so a read of memory nothing wrote (torch.empty used before it
    # is filled) would change the numbers: the run must write the same metrics and adapters as glibc's.
    from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    for name, offset in (("a", 1), ("b", 3)):
        write_sum_task(tmp_path / "data" / f"{name}.jsonl", 20, offset)
    runs = {}
    for allocator in ("glibc", "jemalloc"):
        cfg = {
            "run_dir": str(tmp_path / allocator),
            "model": {"path": str(tmp_path / "model"), "max_loras": 2, "max_rank": 8, "device": "cpu",
                      "host_allocator": allocator},
            "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
            "logging": {"plot": False, "progress": False},
            "rewards": {"num_workers": 1},
            "adapters": [sum_task_adapter(tmp_path / "data", n, i, max_steps=2, rank=4 * (i + 1))
                         for i, n in enumerate(("a", "b"))],
        }  # fmt: skip
        (tmp_path / f"{allocator}.yaml").write_text(yaml.safe_dump(cfg))
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
        env["MALLOC_CONF"] = "junk:true"  # glibc ignores it; jemalloc's own options then stay at theirs + junk
        out = subprocess.run([sys.executable, "-m", "rl_multilora.cli", "run", str(tmp_path / f"{allocator}.yaml")],
                             env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        assert ("host allocator: jemalloc" in out.stderr) == (allocator == "jemalloc"), out.stderr[-3000:]
        runs[allocator] = _metrics(tmp_path / allocator)
    assert len(runs["glibc"]) == 4 and all(r["stepped"] for r in runs["glibc"])
    assert runs["jemalloc"] == runs["glibc"]
    for name in ("a", "b"):
        files = sorted(
            p.relative_to(tmp_path / "glibc") for p in (tmp_path / "glibc" / "adapters" / name).rglob("*.safetensors")
        )
        assert files
        for f in files:
            assert (tmp_path / "jemalloc" / f).read_bytes() == (tmp_path / "glibc" / f).read_bytes(), f


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD: Linux")
def test_a_library_the_loader_cannot_preload_is_an_error_not_a_loop(tmp_path):
    # The loader skips a preload it cannot load (and says so); the started-again process must then stop with a clear
    # error instead of starting itself again.
    broken = tmp_path / "libjemalloc.so"
    broken.write_bytes(b"not a shared object")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model"), "host_allocator": "jemalloc"},
        "adapters": [{"name": "a", "dataset": {"path": "json", "data_files": "x.jsonl"}, "reward": {"name": "format"},
                      "max_steps": 1}],
    }))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    env["RL_MULTILORA_JEMALLOC"] = str(broken)
    out = subprocess.run([sys.executable, "-m", "rl_multilora.cli", "run", str(cfg)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "could not be preloaded" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


# --- jemalloc for the serving commands (--host-allocator) -----------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_line(cmd: list[str], needle: str, env: dict[str, str], stream: str) -> str:
    """Start `cmd`, return its first output line (stdout or stderr) containing `needle`, then stop it."""
    proc = subprocess.Popen(cmd, env=env, text=True, cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
                            stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL)  # fmt: skip
    try:
        for line in getattr(proc, stream):
            if needle in line:
                return line
        raise AssertionError(f"{cmd[3]} exited ({proc.wait()}) before printing {needle!r}")
    finally:
        proc.kill()
        proc.wait()


@needs_jemalloc
@pytest.mark.parametrize("command", ["tinker-serve", "engine-serve"])
def test_a_serving_command_starts_itself_again_with_jemalloc(tmp_path, command):
    """`--host-allocator jemalloc`: the server process that comes up has jemalloc serving its malloc (its start line
    says which; `allocator_name` reads jemalloc's mallctl, which only a preloaded jemalloc has)."""
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    env["RL_MULTILORA_TINKER_TOKEN"] = "tml-t0ken"
    cli = [sys.executable, "-m", "rl_multilora.cli", command, "--model", str(model), "--port", str(_free_port())]
    if command == "tinker-serve":
        args, needle, stream = ["--state-dir", str(tmp_path / "state")], "tinker API on", "stdout"
    else:
        args, needle, stream = ["--key-file", str(tmp_path / "key")], "host allocator", "stderr"
    for allocator in ("jemalloc", "glibc"):
        line = _start_line([*cli, *args, "--host-allocator", allocator], needle, env, stream)
        assert f"host allocator {allocator}" in line, line


def test_a_serving_command_without_a_jemalloc_library_exits_2_naming_the_flag(tmp_path):
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    env = {**os.environ, "RL_MULTILORA_JEMALLOC": str(tmp_path / "nope.so"), "RL_MULTILORA_TINKER_TOKEN": "tml-t0ken"}
    for command, args in (("tinker-serve", ["--state-dir", str(tmp_path / "s")]), ("engine-serve", ["--no-api-key"])):
        out = subprocess.run(
            [sys.executable, "-m", "rl_multilora.cli", command, "--model", str(model), "--port", str(_free_port()),
             *args, "--host-allocator", "jemalloc"],
            env=env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        assert out.returncode == 2, (command, out.stderr[-2000:])
        assert "RL_MULTILORA_JEMALLOC=" in out.stderr and "nope.so" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
