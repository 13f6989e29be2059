"""The synthetic task, its demonstrations, and their agreement with what the rollout loop produces."""

import random

import pytest

from trl_gptoss.data.formats import retool_row
from trl_gptoss.demo.demonstrations import completion_messages, tokenize_demonstration, wrong_answer
from trl_gptoss.demo.task import arithmetic_dataset, make_problems
from trl_gptoss.harmony import harmony_tokenizer
from trl_gptoss.rewards import retool_reward


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


def test_problems_are_seeded_exact_and_need_big_numbers():
    first, again, other = make_problems(50, 3), make_problems(50, 3), make_problems(50, 4)
    assert first == again and first != other
    for p in first:
        assert p.expression in p.question
        operands = [int(t) for t in p.expression.split() if t.isdigit()][:3]
        assert len(operands) == 3 and all(100 <= n <= 999 for n in operands) and p.expression.endswith("% 1000")
        assert p.answer == eval(p.expression)  # noqa: S307  (our own digits-and-operators expression)
    assert all(0 <= p.answer < 1000 for p in first) and len({p.answer for p in first}) > 40  # one token, not guessable


def test_every_operand_is_one_token_at_the_same_distance_from_the_end_of_the_question(tokenizer):
    """The copy the demo model must learn: operand k sits at the same offset before the end of every prompt."""
    layouts = set()
    for p in make_problems(40, 5):
        ids = tokenizer.encode(p.question, add_special_tokens=False)
        pieces = [tokenizer.decode([i]) for i in ids]
        operand_offsets = tuple(len(ids) - k for k, piece in enumerate(pieces) if piece.isdigit())[:3]
        assert [pieces[len(ids) - o] for o in operand_offsets] == p.expression.split()[0:5:2]
        layouts.add(operand_offsets)
        assert len(tokenizer.encode(str(p.answer), add_special_tokens=False)) == 1  # the answer's copy: one token
    assert len(layouts) == 1, layouts


def test_dataset_rows_are_scored_by_the_retool_reward():
    rows = arithmetic_dataset(4, seed=0)
    assert rows[0]["prompt"][0]["role"] == "user" and "\\boxed{}" in rows[0]["prompt"][0]["content"]
    right = [[{"role": "assistant", "content": f"\\boxed{{{a}}}"}] for a in rows["answer"]]
    wrong = [[{"role": "assistant", "content": f"\\boxed{{{int(a) + 1}}}"}] for a in rows["answer"]]
    assert retool_reward(right, answer=rows["answer"]) == [1.0] * 4
    assert retool_reward(wrong, answer=rows["answer"]) == [-1.0] * 4


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
