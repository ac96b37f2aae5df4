"""Tests for rewards/: built-ins on real-format data, config validation, the custom-reward contract, the executor.

Executor tests share one module-scoped executor where they can (worker start-up imports sympy) and use distinct
adapter names so their failure streaks do not interact.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

import rewards
from rewards import RewardConfigError, RewardExecutor, score, validate
from rewards._worker import run_task
from rollout.types import AdapterRef, RewardSpec, Sample, SampleStatus

try:  # importable as tests.reward_plugins from the repo root, or as reward_plugins when pytest puts tests/ first
    from tests import reward_plugins
except ImportError:
    import reward_plugins

PLUGINS = reward_plugins.__name__
ROOT = Path(__file__).resolve().parent.parent


def plugin(name: str, **kwargs) -> RewardSpec:
    return RewardSpec(path=f"{PLUGINS}:{name}", **kwargs)


# -- gsm8k on the dataset's own format ---------------------------------------------------------------------------

NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
WENG = (
    "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
    "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"
)
JOSH = (
    "The cost of the house and repairs came out to 80,000+50,000=$<<80000+50000=130000>>130,000\n"
    "He increased the value of the house by 80,000*1.5=<<80000*1.5=120000>>120,000\n"
    "So the new value of the house is 120,000+80,000=$<<120000+80000=200000>>200,000\n"
    "So he made a profit of 200,000-130,000=$<<200000-130000=70000>>70,000\n#### 70000"
)
TEMPERATURE = "The temperature fell from 3 to 3 - 8 = <<3-8=-5>>-5 degrees.\n#### -5"
PIZZA = "Each friend gets 9 / 4 = <<9/4=2.25>>2.25 slices.\n#### 2.25"

GSM8K_CASES = [
    # (label, response, strict, flexible)
    (NATALIA, "She sold 24 in May, so 48 + 24 = 72.\n#### 72", 1.0, 1.0),
    (NATALIA, "#### 72 clips", 1.0, 1.0),
    (NATALIA, "48 + 24 = 72 clips in total.", 0.0, 1.0),  # no '####': strict fails, flexible reads 72
    (NATALIA, "48 + 24 = 71\n#### 71", 0.0, 0.0),
    (WENG, "0.2 * 50 = 10\n#### $10", 1.0, 1.0),
    (WENG, "#### $ 10.00", 1.0, 1.0),
    (WENG, "#### 10.5", 0.0, 0.0),
    (JOSH, "Profit: 200,000 - 130,000\n#### $70,000", 1.0, 1.0),
    (JOSH, "####70000", 1.0, 1.0),
    (JOSH, "#### 7,000", 0.0, 0.0),
    (JOSH, "#### 70,000 dollars, roughly 3 houses", 1.0, 0.0),  # flexible takes the last number, 3
    (TEMPERATURE, "3 - 8 = -5\n#### -5", 1.0, 1.0),
    (TEMPERATURE, "#### 5", 0.0, 0.0),  # the sign matters
    (TEMPERATURE, "#### \N{MINUS SIGN}5", 1.0, 1.0),
    (TEMPERATURE, "It drops 8 degrees: 3-8", 0.0, 0.0),  # "3-8" is 3 and 8, not -8
    (PIZZA, "#### 2.25", 1.0, 1.0),
    (PIZZA, "#### 9/4", 0.0, 0.0),  # strict reads the first number after '####': 9
    ("1234", "The answer is 1,234.", 0.0, 1.0),
    (1234, "#### 1,234", 1.0, 1.0),
    (0.5, "#### .5", 1.0, 1.0),
    # a reviewer's: the last line a markdown bullet; a subtraction's "- 5" is not the number -5
    (NATALIA, "She sold 48 + 24 clips.\n- 72", 0.0, 1.0),
    (TEMPERATURE, "It was 3 and dropped by 8: 3 - 8", 0.0, 0.0),
]


@pytest.mark.parametrize(("label", "response", "strict", "flexible"), GSM8K_CASES)
def test_gsm8k_real_format(label, response, strict, flexible):
    assert score(RewardSpec(name="gsm8k"), "q", response, label) == strict
    assert score(RewardSpec(name="gsm8k", kwargs={"mode": "flexible"}), "q", response, label) == flexible


@pytest.mark.parametrize("text", [" " * 20_000 + "x", "Step 1: add." + "\n" * 20_000, "#### " + " " * 20_000 + "done"])
def test_gsm8k_takes_linear_time_on_runs_of_whitespace(text):
    """The number pattern had two optional whitespace runs side by side: N spaces with no number after them took
    cubic time (1,000: 16 s, so a degenerate sample killed its worker at the timeout). 20,000 now take milliseconds;
    the bound leaves room for a loaded machine."""
    for mode in ("strict", "flexible"):
        start = time.perf_counter()
        assert score(RewardSpec(name="gsm8k", kwargs={"mode": mode}), "q", text, NATALIA) == 0.0
        assert time.perf_counter() - start < 2.0, mode


def test_gsm8k_label_without_number_raises():
    with pytest.raises(ValueError, match="no number"):
        score(RewardSpec(name="gsm8k"), "q", "#### 3", "#### (see above)")


@pytest.mark.parametrize("label", ["1/2", "#### 3 / 4", " 10/3 "])
def test_gsm8k_refuses_a_fraction_label(label):
    """A label "1/2" was read as 1 (the first number), so a response "#### 1" scored 1.0; GSM8K's answers are numbers
    and a response's "#### 9/4" reads as 9 (lm-eval's strict match), so a fraction label is refused by name."""
    with pytest.raises(ValueError, match=r"is a fraction; allowed: one number .*'math'"):
        score(RewardSpec(name="gsm8k"), "q", "#### 1", label)


# -- math on boxed LaTeX -----------------------------------------------------------------------------------------

MATH_CASES = [
    ("The answer is $\\boxed{\\dfrac{3}{4}}$.", "\\frac{3}{4}", 1.0),
    ("So $p = \\boxed{0.75}$", "\\frac34", 1.0),
    (
        "In polar coordinates: $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        1.0,
    ),
    ("$x \\in \\boxed{[-2, 7)}$", "[-2,7)", 1.0),
    ("$x \\in \\boxed{(-2, 7)}$", "[-2,7)", 0.0),  # open vs half-open interval
    ("\\boxed{(-\\infty, 3] \\cup [5, \\infty)}", "(-\\infty,3]\\cup[5,\\infty)", 1.0),
    ("The share is \\boxed{25\\%}.", "25", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{10\\sqrt{2}}", "\\sqrt{200}", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\$18.90}", "\\boxed{18.90}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{3}", 0.0),
    ("first \\boxed{\\frac34}, on reflection \\boxed{\\frac12}", "\\frac{3}{4}", 0.0),  # the last box counts
    ("The answer is 3/4.", "\\frac{3}{4}", 0.0),  # no box
    ("\\boxed{\\frac{1}{2}", "\\frac12", 0.0),  # cut off inside the box
    ("\\boxed{2}", "\\boxed{3}", 0.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), MATH_CASES)
def test_math_equivalence(response, label, expected):
    assert score(RewardSpec(name="math"), "q", response, label) == expected


def test_math_is_not_a_string_compare():
    # same string inside the box, different value; different strings, same value
    assert score(RewardSpec(name="math"), "q", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert score(RewardSpec(name="math"), "q", "\\boxed{12}", "1.2") == 0.0


# -- dapo, exact_match, f1, format -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("Sum the roots: 12 + 22 = 34.\nAnswer: 34", "34", 1.0),
        ("Answer: 1,000", "1000", 1.0),
        ("Answer: $\\frac{3}{4}$", "0.75", 1.0),
        ("Answer: 34 degrees.", "34", 1.0),
        ("Answer: 35", "34", -1.0),
        ("Answer: 34\nAnswer: 35", "34", -1.0),  # the last Answer line counts
        ("The answer is 34.", "34", -1.0),  # no Answer line: DAPO scores it as wrong
        # a reviewer's, where DAPO's own normalization says +1: an escaped dollar, \\frac12, {,}, \\sqrt2
        ("Answer: \\$18.90", "18.90", 1.0),
        ("Answer: $18.90", "\\$18.90", 1.0),
        ("Answer: \\frac12", "0.5", 1.0),
        ("Answer: \\frac{1}{2}", "\\frac12", 1.0),
        ("Answer: 1{,}234", "1234", 1.0),
        ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),
        ("**Answer:** 34", "34", 1.0),  # markdown bold around the answer
        ("Answer: .5", "0.5", 1.0),
        ("Answer: \N{MINUS SIGN}5", "-5", 1.0),
    ],
)
def test_dapo(response, label, expected):
    assert score(RewardSpec(name="dapo"), "q", response, label) == expected


def test_exact_match_and_f1():
    assert score(RewardSpec(name="exact_match"), "q", "  The  Beatles.", "beatles") == 1.0
    assert score(RewardSpec(name="exact_match"), "q", "Beatles, The Rolling Stones", "beatles") == 0.0
    assert score(RewardSpec(name="f1"), "q", "John Lennon", "John Winston Lennon") == pytest.approx(0.8)
    assert score(RewardSpec(name="f1"), "q", "Paul", ["John Lennon", "Paul McCartney"]) == pytest.approx(2 / 3)


def test_format_bonus_added_only_in_format():
    gsm = RewardSpec(name="gsm8k", format_bonus=0.2)
    assert score(gsm, "q", "#### 72", NATALIA) == pytest.approx(1.2)
    assert score(gsm, "q", "#### 71", NATALIA) == pytest.approx(0.2)  # wrong but well formed
    assert score(gsm, "q", "The answer is 72", NATALIA) == 0.0
    assert score(RewardSpec(name="math", format_bonus=0.1), "q", "\\boxed{5}", "4") == pytest.approx(0.1)
    assert score(RewardSpec(name="math", format_bonus=0.1), "q", "5", "4") == 0.0
    dapo = RewardSpec(name="dapo", format_bonus=0.5)
    assert score(dapo, "q", "So:\nAnswer: 3", "4") == pytest.approx(-0.5)
    assert score(dapo, "q", "Answer: 3\nbye", "4") == -1.0  # Answer not on the last line: no bonus


def test_format_builtin():
    spec = RewardSpec(name="format", kwargs={"pattern": r"\A<think>.+</think>\s*<answer>.+</answer>\Z"})
    assert score(spec, "q", "<think>2+2</think>\n<answer>4</answer>", None) == 1.0
    assert score(spec, "q", "<answer>4</answer>", None) == 0.0


# -- validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (RewardSpec(name="gsm9k"), ["reward.name", "'gsm9k'", "dapo, exact_match, f1, format, gsm8k, math"]),
        (RewardSpec(), ["name=None", "path=None", "exactly one"]),
        (RewardSpec(name="math", path="x:y"), ["exactly one"]),
        (RewardSpec(path="no_colon_here"), ["reward.path", "'no_colon_here'", "module:function"]),
        (RewardSpec(path="no_such_module_xyz:fn"), ["reward.path", "module 'no_such_module_xyz' not found"]),
        (plugin("nope"), ["reward.path", "no attribute 'nope'", "sync_reward"]),
        (plugin("NOT_CALLABLE"), ["reward.path", "names a int, not a function"]),
        (plugin("yielding_reward"), ["reward.path", "yielding_reward'", "is a generator function", "not `yield"]),
        (plugin("yielding_scorer"), ["reward.path", "yielding_scorer'", "is a generator function"]),
        # it said "reward.kwargs lacks 'prompts', 'completions'", and passing them there passed --dry-run
        (
            plugin("trl_style"),
            ["reward.path", "takes TRL's batched data arguments ('prompts', 'completions')", "@rewards.batched"],
        ),
        (plugin("trl_style", kwargs={"prompts": 1}), ["TRL's batched data arguments ('completions')"]),
        (plugin("two_arg_reward"), ["reward.path", "wrong signature", "fn(prompt, response, label, metadata"]),
        (plugin("sync_reward", kwargs={"sclae": 2}), ["reward.kwargs", "'sclae'", "allowed keys: scale"]),
        (plugin("kwargs_reward"), ["reward.kwargs", "{}", "lacks 'weight'"]),
        (plugin("keyword_only_reward", kwargs={"x": 1}), ["reward.kwargs", "{'x': 1}", "allowed keys: (none)"]),
        (RewardSpec(name="gsm8k", kwargs={"mode": "lenient"}), ["reward.kwargs", "mode", "'lenient'", "'flexible'"]),
        (RewardSpec(name="format"), ["pattern", "None", "regular expression"]),
        (RewardSpec(name="format", kwargs={"pattern": "(unclosed"}), ["pattern", "'(unclosed'", "not a valid"]),
        (RewardSpec(name="gsm8k", timeout_s=0), ["reward.timeout_s", "0", "(0, 600]"]),
        # a tenant's hanging reward stalls every tenant's step for as long as its timeout: bounded
        (RewardSpec(name="gsm8k", timeout_s=86400), ["reward.timeout_s", "86400", "(0, 600]", "every tenant"]),
        (RewardSpec(name="gsm8k", failure_value=float("nan")), ["reward.failure_value", "nan"]),
        (RewardSpec(name="exact_match", format_bonus=0.1), ["reward.format_bonus", "exact_match", "declares none"]),
        (plugin("sync_reward", format_bonus=0.1), ["reward.format_bonus", "with_format_check"]),
    ],
)
def test_validate_reports_field_value_and_allowed(spec, fragments):
    with pytest.raises(RewardConfigError) as info:
        validate(spec)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"
    assert isinstance(info.value, ValueError)


def test_validate_accepts_every_builtin_and_plugin_shape():
    for name in rewards.BUILTINS:
        validate(RewardSpec(name=name, kwargs={"pattern": "x"} if name == "format" else {}))
    for name in ("sync_reward", "async_reward", "batched_reward", "batch_size_reward", "keyword_only_reward"):
        validate(plugin(name))
    validate(plugin("kwargs_reward", kwargs={"weight": 2.0}))
    validate(plugin("tagged_reward", format_bonus=0.5))
    assert rewards.resolve(RewardSpec(name="math")) is rewards.BUILTINS["math"]


def test_register_rejects_duplicate_names():
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("gsm8k")(lambda prompt, response, label, metadata: 0.0)


# -- the custom reward contract (in process) ---------------------------------------------------------------------


def test_custom_reward_contract_in_process():
    assert score(plugin("sync_reward"), "p", "4", 4) == 1.0
    assert score(plugin("sync_reward", kwargs={"scale": 3.0}), "p", "4", "4") == 3.0
    assert score(plugin("async_reward"), "p", "4", "4") == 1.0
    assert score(plugin("batched_reward", kwargs={"offset": 0.5}), "p", "4", "4") == 1.5
    assert score(plugin("kwargs_reward", kwargs={"weight": 2.0}), "p", "4", "4", {"difficulty": 3}) == 6.0
    assert score(plugin("keyword_only_reward"), "pp", "abc", None) == 5.0
    assert score(plugin("tagged_reward", format_bonus=0.25), "p", "x <answer>4</answer>", 4) == 1.25
    assert score(plugin("tagged_reward", format_bonus=0.25), "p", "<answer>5</answer>", 4) == 0.25
    with pytest.raises(TypeError, match="returned '1.0'"):
        score(plugin("string_reward"), "p", "r", None)
    with pytest.raises(ValueError, match="must be finite"):
        score(plugin("nan_reward"), "p", "r", None)


def test_example_compare_reward():
    path = ROOT / "examples" / "multi_lora" / "rewards.py"
    spec = importlib.util.spec_from_file_location("multi_lora_example_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted >= 3 and result.failed == 0
    assert module.compare_reward("p", "17 < 42\nAnswer: 42.", "42", {}) == 1.0
    with pytest.raises(ValueError, match="not a number"):
        module.compare_reward("p", "Answer: 42", None, {})


# -- the executor ------------------------------------------------------------------------------------------------


def make_samples(adapter: str | None, spec: RewardSpec, responses: list[str], label="4") -> list[Sample]:
    ref = AdapterRef(adapter, 0) if adapter is not None else None
    return [
        Sample(prompt="p", response=r, label=label, adapter=ref, reward_spec=spec, metadata={"i": i})
        for i, r in enumerate(responses)
    ]


@pytest.fixture(scope="module")
def executor():
    with RewardExecutor(num_workers=2) as ex:
        yield ex


def test_executor_matches_in_process_scores(executor):
    gsm = RewardSpec(name="gsm8k")
    math_spec = RewardSpec(name="math", format_bonus=0.5)
    samples = make_samples("g", gsm, ["#### 72", "#### 71", "72"], label=NATALIA)
    samples += make_samples("m", math_spec, ["\\boxed{\\dfrac{1}{2}}", "\\boxed{3}", "0.5"], label="0.5")
    samples += make_samples(None, plugin("sync_reward"), ["4", "5"])
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [score(s.reward_spec, s.prompt, s.response, s.label) for s in samples]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.5, 0.5, 0.0, 1.0, 0.0]
    assert report.errors == {} and report.timeouts == {} and report.all_failed == {}
    assert report.samples == {"g": 3, "m": 3, "": 2}


def test_executor_custom_contract_by_path(executor):
    samples = make_samples("sync", plugin("sync_reward", kwargs={"scale": 2.0}), ["4", "5", "ERR"])
    samples += make_samples("async", plugin("async_reward"), ["4", "5", "4"])
    samples += make_samples("batched", plugin("batched_reward", kwargs={"offset": 0.5}), ["4", "5"])
    samples += make_samples("batch_size", plugin("batch_size_reward"), ["a", "b", "c"])
    samples += make_samples("kw", plugin("kwargs_reward", kwargs={"weight": 3.0}), ["4"])
    samples += make_samples("kwonly", plugin("keyword_only_reward"), ["abc"])
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [2.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.5, 0.5, 3.0, 3.0, 3.0, 3.0, 4.0]
    assert report.errors == {"sync": 1}  # only the "ERR" sample; its neighbours still scored
    assert "ValueError" in report.last_error["sync"]


def test_a_batched_reward_may_return_a_numpy_array(executor):
    """Vectorized reward code returns arrays; a 1-D array of one value per sample was refused as 'ndarray'."""
    samples = make_samples("np", plugin("numpy_batched_reward"), ["4", "5", "4"])
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0] and report.errors == {}
    assert all(type(s.reward) is float for s in samples)


def test_executor_bad_return_values_and_config_fail_only_their_samples(executor):
    samples = make_samples("str", plugin("string_reward", failure_value=-1.0), ["x"])
    samples += make_samples("nan", plugin("nan_reward"), ["x"])
    samples += make_samples("badpath", RewardSpec(path="no_such_module_xyz:fn", failure_value=-2.0), ["x", "y"])
    samples += make_samples("ok", RewardSpec(name="exact_match"), ["4"])
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [-1.0, 0.0, -2.0, -2.0, 1.0]
    assert report.errors == {"str": 1, "nan": 1, "badpath": 2}
    assert "not found" in report.last_error["badpath"]


def test_executor_batched_bad_values_fail_only_their_own_samples(executor):
    spec = plugin("partly_bad_batched_reward", failure_value=-1.0)
    samples = make_samples("badbatch", spec, ["4", "NAN", "5", "NONE", "4"])
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [1.0, -1.0, 0.0, -1.0, 1.0]  # the good values of the batch count
    assert report.errors == {"badbatch": 2} and report.all_failed == {}
    assert "returned None (NoneType) at index 3 of its batch" in report.last_error["badbatch"]
    outcomes = run_task(spec, [(s.prompt, s.response, s.label, s.metadata) for s in samples], {})
    assert outcomes[1] == (
        "error",
        f"ValueError: reward '{PLUGINS}:partly_bad_batched_reward' returned nan at index 1 of its batch; "
        "a reward must be finite",
    )


def test_executor_overhead_for_100_samples(executor):
    samples = make_samples("g100", RewardSpec(name="gsm8k"), [f"#### {i}" for i in range(50)], label="7")
    samples += make_samples(
        "m100", RewardSpec(name="math"), [f"\\boxed{{\\frac{{{i}}}{{2}}}}" for i in range(50)], "3"
    )
    executor.score_samples(samples)  # warm the workers' caches
    report = executor.score_samples(samples)
    assert sum(s.reward for s in samples) == 2.0  # "#### 7" and "\frac{6}{2}"
    assert report.seconds < 1.0, report.seconds


def test_executor_contains_raising_and_hanging_rewards(executor):
    timeout = 1.0
    executor.wait_ready()  # time the call, not the workers' start-up
    pids = set(executor.worker_pids)
    hang = make_samples("hang", plugin("hanging_reward", timeout_s=timeout, failure_value=-1.0), ["a"] * 4)
    boom = make_samples("boom", plugin("raising_reward", failure_value=-0.5), ["a"] * 3)
    good = make_samples("good", RewardSpec(name="gsm8k"), ["#### 72", "#### 1"] * 3, label=NATALIA)
    samples = hang + boom + good
    start = time.monotonic()
    report = executor.score_samples(samples)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 0.75, elapsed
    # Its first task hung; the second worker may have taken its second once the others' queues ran dry. The rest
    # were not started after the first timeout: never scored, so no reward.
    timed_out = report.timeouts["hang"]
    assert [s.reward for s in hang] == [-1.0] * timed_out + [None] * (4 - timed_out) and timed_out in (1, 2)
    assert [s.reward for s in boom] == [-0.5] * 3
    assert [s.reward for s in good] == [1.0, 0.0] * 3  # untouched by the neighbours
    assert report.skipped == {"hang": 4 - timed_out} and report.errors == {"boom": 3}
    assert "timeout_s=1.0" in report.last_error["hang"] and "ZeroDivisionError" in report.last_error["boom"]
    assert pids - set(executor.worker_pids), "a hung worker is replaced"
    for pid in pids - set(executor.worker_pids):
        assert not Path(f"/proc/{pid}").exists(), "killed workers are reaped"

    # the replacement workers serve the next call normally
    again = make_samples("good", RewardSpec(name="gsm8k"), ["#### 72"], label=NATALIA)
    assert executor.score_samples(again).errors == {} and again[0].reward == 1.0


def test_executor_partial_hang_costs_only_that_sample(executor):
    executor.wait_ready()  # the other samples run on the second worker while the first hangs
    spec = plugin("hang_on_marker_reward", timeout_s=1.0)
    samples = make_samples("partial", spec, ["HANG", "ok", "ok", "ok"])
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [0.0, 1.0, 1.0, 1.0]
    assert report.timeouts == {"partial": 1}


def test_executor_samples_not_started_after_a_timeout_get_no_reward():
    # One worker, so the hang stops the tenant's queued samples: never checked, they must not train as failure_value
    # (6 correct answers trained as wrong ones). They get no reward and are FAILED, which the trainer leaves out.
    from rl_multilora.batch import build_batch

    with RewardExecutor(num_workers=1) as ex:
        spec = plugin("hang_on_marker_reward", timeout_s=0.5, failure_value=-1.0)
        samples = make_samples("skip", spec, ["ok", "HANG"] + ["ok"] * 6)
        report = ex.score_samples(samples)
        assert [s.reward for s in samples] == [1.0, -1.0] + [None] * 6  # the hung one keeps failure_value
        assert [s.status for s in samples] == [SampleStatus.PENDING] * 2 + [SampleStatus.FAILED] * 6
        assert all(
            s.metadata["error"].startswith("not started") and "timeout_s=0.5" in s.metadata["error"]
            for s in samples[2:]
        )
        assert report.timeouts == {"skip": 1} and report.skipped == {"skip": 6} and report.errors == {}
        assert report.all_failed == {}  # one sample scored

        # A reward that hangs on every sample still fails the call (the tenant's fault streak counts it).
        report = ex.score_samples(make_samples("skipall", plugin("hanging_reward", timeout_s=0.5), ["a"] * 3))
        assert report.timeouts == {"skipall": 1} and report.skipped == {"skipall": 2}
        assert "1/3 failed this step, 0 to a crash, 2 not started" in report.all_failed["skipall"]

    for s in samples:  # as the rollout leaves them: one group of one adapter
        s.prompt_ids, s.response_ids = [1, 2], [3]
    stats = build_batch(samples, drop_uniform_groups=False).stats["skip"]
    assert stats.error is None and stats.excluded == 6 and stats.n_rows == 2


def test_executor_async_timeouts_per_sample_and_blocked_loop(executor):
    executor.wait_ready()  # time the call, not the workers' start-up
    cooperative = make_samples("coop", plugin("async_reward", timeout_s=0.5), ["4", "SLOW", "4"])
    blocking = make_samples("block", plugin("blocking_async_reward", timeout_s=0.5, failure_value=-1.0), ["x"] * 4)
    start = time.monotonic()
    report = executor.score_samples(cooperative + blocking)
    assert time.monotonic() - start < 0.5 + 1.0  # a loop blocked for good costs one timeout_s, not one per sample
    assert [s.reward for s in cooperative] == [1.0, 0.0, 1.0]  # the worker cancels only the slow one
    assert [s.reward for s in blocking] == [-1.0] * 4
    assert report.timeouts == {"coop": 1, "block": 4}


def test_executor_async_sync_work_gets_timeout_s_per_sample(executor):
    # 6 samples of 0.2 s sync work each run one after another in one event loop (1.2 s): each is within its
    # timeout_s=0.5, so none times out (the whole chunk used to get one timeout_s and all 6 timed out).
    executor.wait_ready()
    samples = make_samples("syncwork", plugin("sync_work_async_reward", timeout_s=0.5), ["x"] * 6)
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [1.0] * 6
    assert report.timeouts == {} and report.errors == {} and report.seconds < 0.5 * 6


def test_executor_worker_death_is_an_error_and_worker_is_replaced(executor):
    samples = make_samples("exit", plugin("exiting_reward", failure_value=-3.0), ["x"])
    samples += make_samples("alive", RewardSpec(name="exact_match"), ["4"] * 3)
    report = executor.score_samples(samples)
    assert samples[0].reward == -3.0 and [s.reward for s in samples[1:]] == [1.0] * 3
    assert report.errors == {"exit": 1} and "exit code 3" in report.last_error["exit"]


def test_executor_worker_crash_fails_rest_of_tenant_within_one_timeout():
    # A fresh executor, to measure what one worker start costs on this machine (2 cores: sympy import, ~1 s).
    with RewardExecutor(num_workers=2) as ex:
        start = time.monotonic()
        ex.wait_ready()
        startup = time.monotonic() - start
        spec = plugin("crash_on_marker_reward", timeout_s=1.0, failure_value=-1.0)
        crashy = make_samples("crashy", spec, ["CRASH", "4", "CRASH", "CRASH"] * 4)
        good = make_samples("steady", RewardSpec(name="gsm8k"), ["#### 72", "#### 1"] * 8, label=NATALIA)
        start = time.monotonic()
        report = ex.score_samples(crashy + good)
        elapsed = time.monotonic() - start
        # One crash costs at most one respawn, never one per crashing sample (12 here: about 6 startups before).
        assert elapsed < spec.timeout_s + startup + 0.5, (elapsed, startup)
        assert [s.reward for s in good] == [1.0, 0.0] * 8
        # The first sample killed its worker; the tenant's queued samples were not started (no reward: never
        # scored). The other worker may have taken crashy[1] (a "4") and then crashy[2] (a crash) before the first
        # crash was seen, if the healthy tenant's queue ran dry first; nothing after that.
        rewards_ = [s.reward for s in crashy]
        assert rewards_ in ([-1.0] + [None] * 15, [-1.0, 1.0] + [None] * 14, [-1.0, 1.0, -1.0] + [None] * 13)
        failed = rewards_.count(-1.0)
        assert report.errors == {"crashy": failed} and report.crashes == {"crashy": failed}
        assert report.skipped == {"crashy": rewards_.count(None)}
        assert report.timeouts == {} and set(report.all_failed) == {"crashy"}  # one failing call: the tenant counts it
        assert "exit code -9" in report.last_error["crashy"] and "not started" in report.last_error["crashy"]

        # A step that kills exactly one worker (one task), then the next step at once, that worker still starting:
        # the crashed tenant goes after the healthy one, so its next crash cannot take the last live worker while
        # the healthy tenant has work (which would then wait for a worker start).
        ex.wait_ready()
        assert ex.score_samples(make_samples("crashy", spec, ["CRASH"])).crashes == {"crashy": 1}
        crashy = make_samples("crashy", spec, ["CRASH", "4"])
        good = make_samples("steady", RewardSpec(name="gsm8k"), ["#### 72", "#### 1"] * 8, label=NATALIA)
        start = time.monotonic()
        report = ex.score_samples(crashy + good)
        elapsed = time.monotonic() - start
        assert elapsed < startup / 2, (elapsed, startup)
        assert [s.reward for s in good] == [1.0, 0.0] * 8 and [s.reward for s in crashy] == [-1.0, None]
        assert report.crashes == {"crashy": 1} and report.errors == {"crashy": 1} and report.skipped == {"crashy": 1}

        # The next call is served as usual, the crashed tenant included.
        ex.wait_ready()
        again = make_samples("crashy", spec, ["4", "5"]) + make_samples("steady", RewardSpec(name="f1"), ["4"])
        report = ex.score_samples(again)
        assert [s.reward for s in again] == [1.0, 0.0, 1.0] and report.errors == {} and report.crashes == {}


def test_executor_partial_crashes_count_toward_fail_steps(executor):
    spec = plugin("crash_on_marker_reward", timeout_s=1.0)

    def step(crash: bool):
        executor.wait_ready()  # every step starts with both workers up, as a training step would
        samples = make_samples("partcrash", spec, ["4", "4", "4", "CRASH" if crash else "4"])
        report = executor.score_samples(samples)
        assert samples[0].reward == 1.0  # scored before the crash: only some samples fail
        assert report.errors.get("partcrash", 0) < len(samples)
        return report

    # Each call says whether the tenant's rewards all failed or crashed a worker; the tenant counts the streak.
    crashed = step(True)
    assert set(crashed.all_failed) == {"partcrash"} and "to a crash" in crashed.all_failed["partcrash"]
    assert step(False).all_failed == {}  # a step without a crash (and not all failing) is not a failing step
    assert set(step(True).all_failed) == {"partcrash"}


def test_executor_healthy_tenant_unaffected_by_crashing_neighbour(executor):
    crash = plugin("crash_on_marker_reward", timeout_s=1.0, failure_value=-2.0)
    for _ in range(3):
        executor.wait_ready()
        crashy = make_samples("allcrash", crash, ["CRASH"] * 16)
        healthy = make_samples("healthy", RewardSpec(name="gsm8k"), ["#### 72", "#### 71", "72"] * 5, label=NATALIA)
        healthy += make_samples("healthy", plugin("sync_reward", kwargs={"scale": 2.0}), ["4", "5"])
        start = time.monotonic()
        report = executor.score_samples(crashy + healthy)
        elapsed = time.monotonic() - start
        assert elapsed < crash.timeout_s + 1.0, elapsed  # was one respawn per crashing sample: 16 of them
        assert [s.reward for s in healthy] == [1.0, 0.0, 0.0] * 5 + [2.0, 0.0]
        crashed = report.crashes["allcrash"]  # the rest were not started: no reward
        assert [s.reward for s in crashy] == [-2.0] * crashed + [None] * (16 - crashed)
        assert "healthy" not in report.errors and "healthy" not in report.timeouts
        assert "healthy" not in report.crashes and "healthy" not in report.all_failed
        assert report.skipped == {"allcrash": 16 - crashed}
        assert "allcrash" in report.all_failed


def test_executor_survives_idle_worker_death_and_unpicklable_labels(executor):
    executor.wait_ready()
    victim = executor.worker_pids[0]
    os.kill(victim, signal.SIGKILL)  # e.g. the OOM killer, between two steps
    time.sleep(0.2)
    samples = make_samples("idle", RewardSpec(name="exact_match"), ["4"] * 4)
    samples += make_samples("pickle", RewardSpec(name="exact_match"), ["4"], label=lambda: "4")
    report = executor.score_samples(samples)
    assert [s.reward for s in samples] == [1.0] * 4 + [0.0]  # the dead worker's task went to a live one
    assert report.errors == {"pickle": 1} and "could not send" in report.last_error["pickle"]
    assert victim not in executor.worker_pids


def test_executor_reports_each_calls_all_failing_adapters(executor):
    def step(ok_response: str):
        samples = make_samples("boom2", plugin("raising_reward"), ["a", "b"])
        samples += make_samples("mixed", plugin("sync_reward"), [ok_response, "ERR"])
        return executor.score_samples(samples)

    first = step("4")
    assert set(first.all_failed) == {"boom2"}  # "mixed" scored one of its two samples
    assert "2/2 failed" in first.all_failed["boom2"] and "ZeroDivisionError" in first.all_failed["boom2"]
    assert set(step("ERR").all_failed) == {"boom2", "mixed"}
    assert "boom2" not in executor.score_samples(make_samples("boom2", plugin("sync_reward"), ["4"])).all_failed


def test_executor_rejects_samples_without_spec_and_bad_args(executor):
    with pytest.raises(ValueError, match=r"samples\[1\].reward_spec"):
        executor.score_samples([*make_samples("a", RewardSpec(name="f1"), ["x"]), Sample(prompt="p")])
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardExecutor(num_workers=0)


def test_executor_close_leaves_no_processes():
    ex = RewardExecutor(num_workers=2)
    os.kill(ex.worker_pids[0], signal.SIGKILL)  # killed while still importing: replaced, not fatal
    samples = make_samples("c", RewardSpec(name="exact_match"), ["4"] * 3)
    assert ex.score_samples(samples).errors == {} and [s.reward for s in samples] == [1.0] * 3
    ex.wait_ready()
    pids = ex.worker_pids
    ex.close()
    ex.close()  # idempotent
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # already reaped: not our child any more, no zombie left
        assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(RuntimeError, match="closed"):
        ex.score_samples(make_samples("c", RewardSpec(name="exact_match"), ["4"]))


def test_a_reward_that_moves_the_worker_does_not_move_the_next_tenants(tmp_path, monkeypatch):
    """Workers are shared by tenants: one reward's chdir and environment variables used to stay for the next task, so
    another tenant's reward that reads a file relative to the run's directory failed (FileNotFoundError)."""
    (tmp_path / "label_file.txt").write_text("4")
    monkeypatch.chdir(tmp_path)  # the workers start here, as they start in the run's directory
    with RewardExecutor(num_workers=1) as ex:  # one worker: every task runs after the one before
        for _ in range(2):
            wanderer = make_samples("wanderer", plugin("wandering_reward"), ["x", "y"])
            reader = make_samples("reader", plugin("relative_file_reward"), ["x", "y", "z"])
            report = ex.score_samples(wanderer + reader)
            assert [s.reward for s in wanderer + reader] == [1.0] * 5, report.last_error


def test_score_takes_the_reward_section_as_the_config_writes_it():
    """`rewards.score({'path': ..., 'kwargs': ...}, ...)` said the dict is not a RewardSpec (a reviewer's find: the
    rewards guide shows the config's mapping)."""
    from rewards import score

    assert score({"path": "tests.reward_plugins:sync_reward", "kwargs": {"scale": 2.0}}, "p", "r", "l", {}) == score(
        RewardSpec(path="tests.reward_plugins:sync_reward", kwargs={"scale": 2.0}), "p", "r", "l", {}
    )
    with pytest.raises(RewardConfigError, match=r"reward: \{'nmae': 'gsm8k'\}: nmae: Unexpected keyword argument"):
        score({"nmae": "gsm8k"}, "p", "r", "l")
