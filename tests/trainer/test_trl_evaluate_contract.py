"""TRL's evaluation contract against ``GptOssGRPOTrainer``: the scenarios of TRL 1.16's
``test_evaluate_with_eval_dataset`` (every kind of evaluation set passed to ``evaluate()``: a Dataset, an
IterableDataset, a DatasetDict, an IterableDatasetDict, a dict of either; one metric set per named set) and what
takes the place of ``eval_loss``: held-out accuracy, which ``metric_for_best_model`` may name, and a refusal before
the model loads of ``load_best_model_at_end`` with transformers' default metric ``loss`` (never logged: the GRPO loss
of sampled evaluation groups ranks checkpoints by noise, see ``held_out.best_model_metric_problem``)."""

import pytest
from datasets import Dataset, DatasetDict, IterableDatasetDict

from tests.trainer.helpers import SYSTEM, AddTool, answer_reward, grpo_args, load_taught, prompt_dataset

K = 2  # num_generations_eval


def _trainer(taught, tokenizer, output_dir, **overrides):
    from trl_gptoss.trainer import GptOssGRPOTrainer

    return GptOssGRPOTrainer(
        load_taught(taught[0]),
        answer_reward,
        args=grpo_args(output_dir, per_device_train_batch_size=2, num_generations_eval=K, **overrides),
        train_dataset=prompt_dataset([1, 2]),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )


def _eval_split(streaming: bool):
    split = prompt_dataset([0, 1, 2])
    return split.to_iterable_dataset() if streaming else split


def _eval_dataset(kind: str):
    """TRL's six kinds, built from one split as TRL's test builds them."""
    streaming = "iterable" in kind
    split = _eval_split(streaming)
    if kind in ("dataset", "iterable_dataset"):
        return split
    if kind in ("dataset_dict", "iterable_dataset_dict"):
        return (IterableDatasetDict if streaming else DatasetDict)({"data1": split, "data2": split})
    return {"data1": split, "data2": split}


@pytest.mark.parametrize(
    "kind",
    [
        "dataset",
        "iterable_dataset",
        "dataset_dict",
        "iterable_dataset_dict",
        "dict_of_dataset",
        "dict_of_iterable_dataset",
    ],
)
def test_evaluate_with_eval_dataset(taught, tokenizer, tmp_path, kind):
    trainer = _trainer(taught, tokenizer, tmp_path)
    metrics = trainer.evaluate(eval_dataset=_eval_dataset(kind))
    names = [""] if kind in ("dataset", "iterable_dataset") else ["data1_", "data2_"]
    for name in names:
        assert metrics[f"eval_{name}mean@{K}"] is not None and metrics[f"eval_{name}problems"] == 3.0
        assert 0.0 <= metrics[f"eval_{name}pass@1"] <= 1.0
    assert "eval_loss" not in metrics
    trainer.close()


def test_load_best_model_at_end_with_the_default_metric_is_refused_before_the_model_loads(taught, tokenizer, tmp_path):
    args = grpo_args(
        tmp_path,
        per_device_train_batch_size=2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
    )
    assert args.metric_for_best_model == "loss"  # transformers' default for load_best_model_at_end
    from trl_gptoss.trainer import GptOssGRPOTrainer

    with pytest.raises(ValueError, match=r"defaults it to 'loss'.*'eval_mean@2', 'eval_pass@1'"):
        GptOssGRPOTrainer("no/such-model", answer_reward, args=args, train_dataset=prompt_dataset([1, 2]))


def test_load_best_model_at_end_follows_a_held_out_metric(taught, tokenizer, tmp_path):
    """Stock TRL trains with load_best_model_at_end; so does the subclass, choosing by held-out accuracy."""
    from trl_gptoss.trainer import GptOssGRPOTrainer

    args = grpo_args(
        tmp_path,
        per_device_train_batch_size=2,
        num_generations_eval=K,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model=f"eval_mean@{K}",
    )
    trainer = GptOssGRPOTrainer(
        load_taught(taught[0]),
        answer_reward,
        args=args,
        train_dataset=prompt_dataset([1, 2]),
        eval_dataset=Dataset.from_list(list(prompt_dataset([0, 1, 2]))),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )
    trainer.train()
    assert trainer.state.best_metric is not None and trainer.state.best_model_checkpoint is not None
    assert trainer.state.best_metric == max(
        h[f"eval_mean@{K}"] for h in trainer.state.log_history if f"eval_mean@{K}" in h
    )
    trainer.close()
