"""A run that cannot learn is said once, loudly: no final answers, or every group's rewards equal for a while.

The diagnosis is checked on log histories, and end to end on a real (tiny, untaught) model: it never writes a
Harmony final message, so every completion reaches the rewards as "" -- the trainer warns during the run and
the job's summary repeats it.
"""

import warnings

import pytest

from tests.trainer.helpers import grpo_args, prompt_dataset
from trl_gptoss.scripts.grpo_summary import format_summary, summarize
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer
from trl_gptoss.trainer.learning_signal import FLAT_LOGS, diagnose


def _rows(**columns):
    n = len(next(iter(columns.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def test_diagnose_names_each_cause_once_and_only_when_it_holds():
    assert diagnose(_rows(**{"rollout/final_answer_fraction": [0.5, 0.25], "frac_reward_zero_std": [1.0, 0.5]})) == []
    (message,) = diagnose(_rows(**{"rollout/final_answer_fraction": [0.5, 0.0, 0.0]}))
    assert "at step 2 no completion wrote a final answer" in message and "warm-start" in message
    flat = [1.0] * FLAT_LOGS
    (message,) = diagnose(_rows(frac_reward_zero_std=[1.0, 0.5, *flat]))
    assert f"equal for {FLAT_LOGS} logged steps in a row (up to step {FLAT_LOGS + 2}" in message
    assert diagnose(_rows(frac_reward_zero_std=[1.0] * (FLAT_LOGS - 1) + [0.75] + [1.0] * (FLAT_LOGS - 1))) == []
    both = diagnose(_rows(**{"rollout/final_answer_fraction": [0.0] * FLAT_LOGS, "frac_reward_zero_std": flat}))
    assert len(both) == 2


def constant_reward(completions, **kwargs):
    return [1.0 if c[0]["content"] == "" else 0.0 for c in completions]


def test_an_untaught_model_that_never_answers_is_said_during_the_run_and_in_the_summary(tokenizer, tmp_path):
    args = grpo_args(tmp_path, max_completion_length=16, max_steps=FLAT_LOGS)
    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0),
        constant_reward,
        args=args,
        train_dataset=prompt_dataset([0, 1]),
        processing_class=tokenizer,
        tools=[],
    )
    with pytest.warns(UserWarning, match="this run cannot learn") as caught:
        trainer.train()
    said = sorted({str(w.message).split(":")[1][:30] for w in caught if "cannot learn" in str(w.message)})
    assert said == [" at step 1 no completion wrote", " every group's rewards were eq"], said
    summary = summarize(trainer.state.log_history)
    text = format_summary(summary, {})
    assert text.count("WARNING: this run cannot learn") == 2, text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per cause: a later log row repeats nothing
        trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, trainer.state.log_history[-1])
