"""sp_size=2 (sink-aware Ulysses in the loss pass) trains exactly like sp_size=1 on the same two processes; what
SP refuses and accepts at construction. SP 2 under FSDP2 with temperature and entropy bonus: test_fsdp2_sp.py."""

import math

import pytest

from tests.trainer.helpers import grpo_args, prompt_dataset
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer


@pytest.mark.distributed
@pytest.mark.slow
def test_sp2_step_equals_sp1_step(tmp_path):
    from tests.trainer._workers import sp_rank
    from trl_gptoss.testing.distributed import launch

    sharded = launch(sp_rank, 2, tmp_path / "sp2", 2, str(tmp_path / "out2"), timeout=600)
    plain = launch(sp_rank, 2, tmp_path / "sp1", 1, str(tmp_path / "out1"), timeout=600)
    for rank in range(2):
        assert sharded[rank]["completions"] == plain[rank]["completions"], "the two runs sampled differently"
        assert sharded[rank]["loss"] == pytest.approx(plain[rank]["loss"], rel=1e-5, abs=1e-7)
        assert sharded[rank]["grads"].keys() == plain[rank]["grads"].keys()
        grads, reference = sharded[rank]["grads"], plain[rank]["grads"]
        assert grads.pop("sinks_full") == pytest.approx(reference.pop("sinks_full"), rel=1e-4, abs=1e-8)
        for name, (total, squares) in reference.items():
            assert grads[name][1] == pytest.approx(squares, rel=1e-4, abs=1e-14), name
            assert abs(grads[name][0] - total) <= 1e-4 * math.sqrt(squares) + 1e-9, name
    assert any(squares > 0 for _, squares in plain[0]["grads"].values()), "all gradients are zero"


@pytest.mark.distributed
@pytest.mark.slow
def test_sp2_computes_in_the_dtype_of_sp1_under_ddp_with_bf16_autocast(tmp_path):
    """fp32 weights + ``bf16: true`` (TRL's default config) under DDP: accelerate runs the model's forward under
    bf16 autocast; the SP loss pass swaps that forward out for its shard's, and must keep the autocast -- the same
    config may not train in two precisions. Layer 0's attention projection is watched during the loss pass."""
    from tests.trainer._workers import sp_rank
    from trl_gptoss.testing.distributed import launch

    sharded = launch(sp_rank, 2, tmp_path / "sp2", 2, str(tmp_path / "out2"), True, timeout=600)
    plain = launch(sp_rank, 2, tmp_path / "sp1", 1, str(tmp_path / "out1"), True, timeout=600)
    for rank in range(2):
        assert plain[rank]["loss_pass_dtypes"] == ["bfloat16"], plain[rank]["loss_pass_dtypes"]
        assert sharded[rank]["loss_pass_dtypes"] == ["bfloat16"], sharded[rank]["loss_pass_dtypes"]
        assert sharded[rank]["completions"] == plain[rank]["completions"], "the two runs sampled differently"
        assert sharded[rank]["loss"] == pytest.approx(plain[rank]["loss"], rel=2e-2, abs=1e-4)


def test_sp_refuses_what_it_cannot_compute(tokenizer, tmp_path):
    args = grpo_args(tmp_path, sp_size=1)
    args.sp_size = 3  # past __post_init__'s world check: the head check must still refuse it
    with pytest.raises(ValueError, match="num_attention_heads"):
        GptOssGRPOTrainer(
            tiny_gpt_oss(),
            lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=prompt_dataset([0]),
            processing_class=tokenizer,
            tools=[],
        )
    args.sp_size = 2
    args.top_entropy_quantile = 0.5
    with pytest.raises(ValueError, match="top_entropy_quantile < 1 .its quantile spans every rank's micro-batch"):
        GptOssGRPOTrainer(
            tiny_gpt_oss(),
            lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=prompt_dataset([0]),
            processing_class=tokenizer,
            tools=[],
        )


def test_sp_accepts_temperature_and_the_entropy_bonus(tmp_path):
    """Both are computed by the SP head now: only what it cannot compute is refused, naming the field."""
    from trl_gptoss.trainer.sequence_parallel import check_sequence_parallel, sequence_parallel_head

    args = grpo_args(tmp_path, temperature=0.7, entropy_coef=0.05, gradient_checkpointing=False)
    args.sp_size = 2
    check_sequence_parallel(args, tiny_gpt_oss().config)
    head = sequence_parallel_head(args)
    assert (head.temperature, head.entropy, head.entropy_grad) == (0.7, True, True)
    args.entropy_coef = 0.0
    assert not sequence_parallel_head(args).entropy_grad  # entropies for the metric only: no backward term
    args.use_adaptive_entropy = True
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
        check_sequence_parallel(args, tiny_gpt_oss().config)
