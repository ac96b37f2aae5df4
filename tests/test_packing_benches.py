"""The benches behind docs/benchmarks.md's "Which groups pack" and the multi-turn baselines, small, as a user runs
them: `bench/bench_packing.py` prints the trainer's choice for a group, `bench/bench_episodes.py --baseline own`
gives every single-turn sample prompt tokens of its own."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize(("prompt", "completion", "packs"), [(8, 60, 0), (60, 4, 1)])
def test_bench_packing_prints_the_trainers_choice_and_both_layouts_agree(prompt, completion, packs):
    out = _run(
        "bench/bench_packing.py", "--tiny", "--groups", "1", "--group-size", "4", "--prompt", str(prompt),
        "--completion", str(completion), "--runs", "1",
    )  # fmt: skip
    assert f"it packs {packs} of 1 groups" in out, out
    first = out.splitlines()[0]
    lp = float(first.split("max |log-prob diff| ")[1].split(",")[0])
    assert lp < 1e-5, first  # the packed layout (every group packed here) gives the unpacked log-probs
    assert "packed / unpacked: CPU" in out


def test_bench_episodes_own_baseline_shares_nothing_past_the_first_prompt():
    """`--quick`: 2 tenants x 2 groups x 2 samples. The shared baseline prefills each group's prompt once, the own
    baseline each sample's; both single-turn paths have the episodes' tokens."""
    tables = {}
    for baseline in ("shared", "own"):
        out = _run("bench/bench_episodes.py", "--quick", "--baseline", baseline)
        assert f"single-turn baseline's environment tokens: {baseline}" in out
        rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| cache |")]
        tables[baseline] = {r[1].strip(): (int(r[3]), int(r[4])) for r in rows}  # path -> (all tokens, prefilled)
    shared, own = tables["shared"], tables["own"]
    assert shared["single"][0] == own["single"][0] == own["multi"][0]  # the same tokens in every path
    assert own["single"][1] == 2 * shared["single"][1]  # groups of 2: every sample prefills its own prompt
    assert own["multi"][0] == shared["multi"][0]  # the episodes' tokens do not depend on the baseline
    # What the episodes prefill does: which of a turn's tokens the prefix cache finds depends on the tokens sampled,
    # and those on the adapters the baseline's steps trained (CI's machine once printed 499 against 488). The cache
    # still finds every earlier turn: the episodes prefill fewer tokens than they hold.
    assert 0 < own["multi"][1] < own["multi"][0] and 0 < shared["multi"][1] < shared["multi"][0]
