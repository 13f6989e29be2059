"""The demo's generated task: seeded, exact problems whose operands and answer are one token each."""

import pytest

from trl_gptoss.data.arithmetic import arithmetic_dataset, make_problems
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
