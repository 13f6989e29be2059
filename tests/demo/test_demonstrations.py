"""The warm-start demonstrations of the arithmetic task, and their agreement with what the rollout loop produces."""

import random

import pytest

from trl_gptoss.data.arithmetic import make_problems
from trl_gptoss.data.formats import retool_row
from trl_gptoss.demo.demonstrations import completion_messages, tokenize_demonstration, wrong_answer
from trl_gptoss.harmony import harmony_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


@pytest.mark.parametrize("value", [1234567, -98765432, 10, 7])
def test_wrong_answers_are_wrong_and_plausible(value):
    rng = random.Random(0)
    for _ in range(50):
        guess = wrong_answer(value, rng)
        assert guess != value and len(str(abs(guess))) == len(str(abs(value))) and (guess < 0) == (value < 0)


def test_demonstration_mask_covers_exactly_what_the_model_writes(tokenizer):
    problem = make_problems(1, 0)[0]
    prompt = retool_row(problem.question, str(problem.answer))["prompt"]
    demo = tokenize_demonstration(
        prompt, completion_messages(problem, "tool", random.Random(0)), tokenizer, kind="tool"
    )
    written = tokenizer.decode([t for t, m in zip(demo.input_ids, demo.loss_mask) if m])
    unwritten_tail = tokenizer.decode([t for t, m in zip(demo.input_ids[-40:], demo.loss_mask[-40:]) if not m])
    assert f"print({problem.expression})" in written and f"\\boxed{{{problem.answer}}}" in written
    assert written.count("<|start|>") == 1  # only the header after the model's own <|end|> is sampled
    assert str(problem.answer) in unwritten_tail and "<|start|>python" in unwritten_tail  # the tool reply


@pytest.mark.slow
def test_demonstration_is_token_identical_to_a_rollout_of_the_same_turns(tokenizer):
    """Replay the demonstration's assistant turns through run_rollouts (real sandbox): same ids, same mask."""
    from trl_gptoss.harmony import render_conversation
    from trl_gptoss.rollout import RolloutConfig, run_rollouts
    from trl_gptoss.testing.engines import ScriptedEngine
    from trl_gptoss.tools import PythonTool

    problem = make_problems(1, 5)[0]
    prompt = retool_row(problem.question, str(problem.answer))["prompt"]
    demo = tokenize_demonstration(
        prompt, completion_messages(problem, "tool", random.Random(0)), tokenizer, kind="tool"
    )
    prompt_ids = render_conversation(prompt, tokenizer, python_tool=True, add_generation_prompt=True)
    completion, mask = demo.input_ids[len(prompt_ids) :], demo.loss_mask[len(prompt_ids) :]
    call_end = mask.index(0)  # the first sampled turn ends at <|call|>; the loop inserts the reply after it
    second_turn = [t for t, m in zip(completion[call_end:], mask[call_end:]) if m]
    engine = ScriptedEngine(tokenizer, {tuple(prompt_ids): [completion[:call_end], second_turn]})
    (rollout,) = run_rollouts(
        engine,
        [prompt],
        tokenizer=tokenizer,
        tools=[PythonTool()],
        config=RolloutConfig(max_turns=3),
    )
    assert rollout.stop_reason == "final" and rollout.num_tool_calls == 1 and rollout.num_tool_errors == 0
    assert rollout.prompt_ids == prompt_ids
    assert rollout.completion_ids == completion
    assert rollout.completion_mask == mask
