"""The GPU check and its wheelhouse script run in the default suite at tiny sizes on CPU, so they cannot rot
between the rare sessions that are lent a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import gemm_rows_independent

ROOT = Path(__file__).resolve().parents[1]


BENCH_SECTIONS = ["peft_parity_bf16", "grouped_vs_loop", "engine_greedy_vs_peft", "lora_overhead", "decode_64_vs_1",
                  "lora_overhead_profile"]  # fmt: skip
RUN_SECTIONS = ["gpu_tests", "grpo_tiny", "grpo_smollm2_shape", "cpu_oracle_tests"]  # pytest and GRPO runs: slow


def _gpu_check(tmp_path: Path, sections: list[str]) -> dict:
    """`gpu_check.py --device cpu --small` of `sections`, each in its own process as on the GPU; the report."""
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--small", "--only", *sections, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"running {sections[0]}" in proc.stdout  # said before each section, so a hang is read as one
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["sections"]) == sections
    for name, entry in report["sections"].items():
        assert (tmp_path / "logs" / f"{name}.log").is_file()
        if name == "grpo_tiny" and not (ROOT / "artifacts/tiny/model").exists():
            assert entry["status"] == "skipped" and not entry["ok"], entry  # not a pass: nothing was checked
            continue
        assert entry["ok"] and entry["status"] == "ok" and entry["result"] and entry["seconds"] >= 0, (name, entry)
    return report


def test_every_section_is_a_default_or_an_extra_and_each_is_tested():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import EXTRAS, SECTIONS

    assert sorted([*SECTIONS, *EXTRAS]) == sorted(BENCH_SECTIONS + RUN_SECTIONS)


def test_gpu_check_small_on_cpu_oracles_and_benches(tmp_path):
    report = _gpu_check(tmp_path, BENCH_SECTIONS)
    assert "| grouped_vs_loop | ok |" in (tmp_path / "gpu_check.md").read_text()
    greedy = report["sections"]["engine_greedy_vs_peft"]["result"]
    assert greedy["rows"] > 1 and greedy["mismatched_rows"] == []
    assert all(m["max_abs_diff"] <= 1e-4 for m in report["sections"]["grouped_vs_loop"]["result"]["mixes"].values())
    for prof in report["sections"]["lora_overhead_profile"]["result"]["shapes"].values():
        steps = prof["per_step"]
        assert set(steps) == {"base", "one", "one_autocast"}
        assert all(s["kernels"] > 0 and s["busy_ms"] > 0 and s["wall_ms"] > 0 for s in steps.values())
        assert steps["one"]["kernels"] > steps["base"]["kernels"]  # the adapter's ops were counted
        for top in (prof["top_one"], prof["top_one_autocast"]):
            assert top and top[0]["ms"] >= top[-1]["ms"]
    for over in report["sections"]["lora_overhead"]["result"]["shapes"].values():
        want = {"base", "one", "mixed64", "one_autocast", "peft_one", "peft_one_autocast"}
        assert set(over["fwd_bwd_ms"]) == want and all(v > 0 for v in over["fwd_bwd_ms"].values())


@pytest.mark.slow
def test_gpu_check_small_on_cpu_gpu_tests_and_grpo_runs(tmp_path):
    """The sections that start pytest or a GRPO run (about 45 s at tiny sizes on 2 cores): on CPU the GPU tests skip
    and say so; the tiny preset's run is skipped, not passed, when artifacts/tiny is absent."""
    report = _gpu_check(tmp_path, RUN_SECTIONS)
    assert "skipped" in report["sections"]["gpu_tests"]["result"]["summary"]  # no GPU here


def test_gpu_check_kills_a_section_at_the_budget_and_goes_on(tmp_path):
    """A section that outlives what is left of --budget-s is killed (its log kept) and the report still written: a
    running section used to be waited for, so a 10-minute call could be killed with no report at all. Here the
    budget (3 s) is less than a section's start (Python, torch, transformers)."""
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--small", "--budget-s", "3", "--min-section-s", "1",
         "--only", "peft_parity_bf16", "grouped_vs_loop", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    first, second = sections["peft_parity_bf16"], sections["grouped_vs_loop"]
    assert first["status"] == "timed out" and first["error"] == "killed at 3 s" and first["seconds"] < 10, first
    assert second["status"] == "skipped" and "left" in second["error"]
    assert (tmp_path / "logs" / "peft_parity_bf16.log").is_file()
    assert "| peft_parity_bf16 | **timed out** |" in (tmp_path / "gpu_check.md").read_text()


def wheelhouse_list(*flags: str) -> list[str]:
    return subprocess.run(
        [sys.executable, "bench/build_wheelhouse.py", "--list", "--dir", "wh", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()


def test_wheelhouse_list_names_the_project_and_what_the_gpu_machine_lacks_without_downloading():
    core, full = wheelhouse_list(), wheelhouse_list("--with-data")
    assert core[0].startswith("rl-multilora") and full[0] == core[0]
    names = {line.split("==")[0] for line in full[1:-1]}
    assert {"pydantic", "pytest"} <= {line.split("==")[0] for line in core[1:-1]}
    assert {"datasets", "dill", "multiprocess", "pydantic"} <= names
    # what the GPU image holds (pyarrow alone is 55 MB, over what the device tool carries) is not in the wheelhouse
    assert not names & {
        "ray",
        "sglang",
        "torch",
        "transformers",
        "peft",
        "safetensors",
        "aiohttp",
        "pyyaml",
        "pyarrow",
        "pandas",
    }
    assert core[-1].startswith("pip install --no-index --find-links wh --no-deps rl-multilora pydantic")
    assert "datasets" not in core[-1] and "datasets" in full[-1]
    assert not (ROOT / "wh").exists()


def test_isolation_probe_on_cpu_finds_every_check_bit_exact():
    """`bench/isolation_probe.py`, the script behind the GPU runs' isolation table, on CPU at the tiny shape: a
    tenant alone gives the bits of the same rows in a mixed batch, and every step repeats (the CPU property that the
    paging and isolation tests rely on). Run as a user runs it; its table is parsed."""
    proc = subprocess.run(
        [sys.executable, "bench/isolation_probe.py", "--device", "cpu", "--models", "tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 9  # 3 dtype settings x 3 batch sizes
    exact = gemm_rows_independent()  # a CPU whose matrix products round a row by how many share it: to rounding
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "True" and cells[6:] == ["True", "True"], row  # every step repeats, to the bit
        for cell in cells[4:6]:
            if exact:
                assert cell == "True (0.00e+00)", row
            else:
                assert float(cell.split("(")[1].rstrip(")")) < 1e-6, row
