"""Two agent tenants for the tiny-agents preset (`examples/multi_lora/configs/agents.yaml`): a tool user and a game.

- `Calculator` (a `ToolEnv`): "Compute 37 * 46 with the calculator. End with 'Answer: N'." The model may call
  `<tool_call>{"name": "mul", "arguments": {"a": 37, "b": 46}}</tool_call>` (tools `mul` and `add`, integers) and
  reads the result in a `tool` message; its turn without a call is the final answer: 1 when the last line is
  `Answer: <the result>`, else 0. Four-digit results are beyond the tiny base's head arithmetic, so the tool is
  the way to the reward.
- `GuessingGame`: "Guess my number between 40 and 48. Reply with one number." The dataset row's answer is the
  secret; a wrong guess gets the user turn "Higher." or "Lower." (or "Reply with one number."), at most `guesses`
  guesses; a right guess at guess k pays `discount ** (k - 1)`, so fewer guesses pay more.

The texts (questions, feedback, answer line, tool results) are `rl_multilora.presets.tiny_agents`'s rules, which
also wrote the transcripts the base was pretrained on; the environments here only apply them.
"""

from __future__ import annotations

from rl_multilora.presets.tiny_agents import (
    CALC_TOOLS,
    DISCOUNT,
    GUESSES,
    calc_tool,
    final_answer,
    guess_feedback,
    read_guess,
)
from rollout.environments import Environment, EnvStep, Task, ToolEnv


class Calculator(ToolEnv):
    """Tools `mul(a, b)` and `add(a, b)` on integers; the final answer `Answer: N` scores 1 when N is the label."""

    def tools(self):
        return {name: (lambda a, b, name=name: calc_tool(name, a, b)) for name in CALC_TOOLS}

    def answer(self, text: str) -> float:
        return float(final_answer(text) == str(self.task.label).strip())


class GuessingGame(Environment):
    """Higher / lower feedback until the right guess or `guesses` guesses; reward `discount ** (k - 1)` at guess k."""

    def __init__(self, guesses: int = GUESSES, discount: float = DISCOUNT):
        if guesses < 1 or not 0.0 < discount <= 1.0:
            raise ValueError(f"guesses={guesses!r} must be >= 1 and discount={discount!r} in (0, 1]")
        self.guesses, self.discount = guesses, discount

    def reset(self, task: Task) -> None:
        self.secret, self.made = int(task.label), 0

    def step(self, action: str) -> EnvStep:
        self.made += 1
        feedback = guess_feedback(read_guess(action), self.secret)
        if feedback is None:
            return EnvStep(reward=self.discount ** (self.made - 1), done=True, metadata={"guesses": self.made})
        if self.made >= self.guesses:
            return EnvStep(reward=0.0, done=True, metadata={"guesses": self.made})
        return EnvStep(observation=[{"role": "user", "content": feedback}])
