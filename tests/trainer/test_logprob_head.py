"""The loss pass's log-probs through ``selective_logprobs`` equal TRL's fused head: values and every gradient."""

import copy

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from tests.trainer.helpers import grpo_args, prompt_dataset
from trl_gptoss.parallel import ContextParallelPlugin, HeadConfig, prepare_context_parallel
from trl_gptoss.parallel.head import token_values_forward
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer
from trl_gptoss.trainer.logprob_head import add_selective_logprobs_head


def _batch(seed=0, rows=3, length=150):
    """Rows longer than the 128-token sliding window, ragged (left padding), completions of varied length."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (rows, length), generator=generator)
    attention = torch.ones_like(ids)
    attention[1, :7] = 0
    attention[-1, :40] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-60] = -100  # score the last 60 positions, as TRL's logits_to_keep does
    labels[0, -5:] = -100
    return ids, attention, labels


def _patched(model, which, temperature):
    model = copy.deepcopy(model)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))  # what TRL does
    if which == "selective_logprobs":
        add_selective_logprobs_head(model, temperature)
    return model


def _run(model, ids, attention, labels, weights):
    out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    objective = (out.log_probs * weights[0]).sum() + (out.entropy * weights[1]).sum()
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def _reference(model, ids, attention, labels, weights, temperature):
    """Plain float64 math on the model's full logits: log-softmax of logits / T at the label, and entropy."""
    model = copy.deepcopy(model)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1] / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    target = labels[:, 1:]
    mask = target != -100
    logp = logp_all.gather(-1, target.clamp(min=0)[..., None])[..., 0] * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_values_and_every_gradient_equal_the_plain_math(temperature):
    """TRL's own head computes in float32 whatever the input dtype, so the float64 check is against plain math on
    the model's logits (the float32 agreement with TRL's head is the trainer test below)."""
    model = tiny_gpt_oss(seed=0).double().train()
    model.set_attn_implementation("fa3_sink")
    model.set_experts_implementation("gptoss_sequential")  # float64-capable, as the trainer runs it
    ids, attention, labels = _batch()
    shifted = (ids.shape[0], ids.shape[1] - 1)  # position t scores label t + 1
    weights = torch.randn(2, *shifted, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _reference(model, ids, attention, labels, weights, temperature)
    ours = _run(_patched(model, "selective_logprobs", temperature), ids, attention, labels, weights)
    assert ours[0].dtype == torch.float64
    for name, a, b in (("logp", ref[0], ours[0]), ("entropy", ref[1], ours[1])):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), (name, (a - b).abs().max().item())
    assert ref[2].keys() == ours[2].keys() and "model.layers.0.self_attn.sinks" in ours[2]
    for name in ref[2]:
        diff = (ref[2][name] - ours[2][name]).abs().max().item()
        assert diff <= 1e-10 * max(1.0, ref[2][name].abs().max().item()), (name, diff)


def test_plain_forward_and_generation_are_untouched():
    model = tiny_gpt_oss(seed=0).eval()
    patched = _patched(model, "selective_logprobs", 1.0)
    ids = torch.randint(5, 500, (1, 20))
    assert torch.equal(model(input_ids=ids).logits, patched(input_ids=ids).logits)
    assert torch.equal(
        model.generate(ids, max_new_tokens=4, do_sample=False), patched.generate(ids, max_new_tokens=4, do_sample=False)
    )


def test_the_trainer_loss_and_gradients_equal_trls_path(tokenizer, tmp_path, monkeypatch):
    from trl_gptoss.parallel import head

    calls = []
    op = head.selective_logprobs
    monkeypatch.setattr(head, "selective_logprobs", lambda *a, **k: calls.append(1) or op(*a, **k))
    losses, grads = {}, {}
    ids, attention, _ = _batch(rows=2, length=140)
    completion = 40
    for which in ("trl", "selective_logprobs"):
        torch.manual_seed(0)
        trainer = GptOssGRPOTrainer(
            tiny_gpt_oss(seed=0),
            lambda completions, **kw: [0.0] * len(completions),
            args=grpo_args(tmp_path, logprobs_implementation=which, entropy_coef=0.05),
            train_dataset=prompt_dataset([0]),
            processing_class=tokenizer,
            tools=[],
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = {
            "prompt_ids": ids[:, :-completion],
            "prompt_mask": attention[:, :-completion],
            "completion_ids": ids[:, -completion:],
            "completion_mask": torch.ones(2, completion, dtype=torch.long),
            "advantages": torch.tensor([1.0, -0.5]),
            "num_items_in_batch": torch.tensor(2.0 * completion),
        }
        before = len(calls)
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        assert (len(calls) > before) == (which == "selective_logprobs"), which  # the configured path ran
        losses[which] = loss.item()
        grads[which] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert losses["selective_logprobs"] == pytest.approx(losses["trl"], rel=1e-5, abs=1e-7)
    for name, ref in grads["trl"].items():
        diff = (ref - grads["selective_logprobs"][name]).abs().max().item()
        assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), (name, diff)


def test_a_peft_adapter_on_lm_head_is_refused_not_silently_skipped():
    """TRL 1.16's trainer refuses lm_head adapters itself; the head refuses them too for direct callers."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_gpt_oss(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    with pytest.raises(
        ValueError, match=r"lm_head is a peft\.tuners\.lora\..*Linear; leave lm_head out of the adapter"
    ):
        add_selective_logprobs_head(peft_model.get_base_model())
    add_selective_logprobs_head(tiny_gpt_oss(seed=0))  # a plain head is accepted


def _sp_values(model, ids, labels, config):
    """The sequence-parallel head on one unsharded row: ``token_labels[t]`` is the label of position t + 1."""
    token_labels = torch.cat([labels[0, 1:], labels.new_full((1,), -100)])
    positions = torch.arange(ids.shape[1])[None]
    with token_values_forward(model):
        return model(input_ids=ids, position_ids=positions, token_labels=token_labels, head_config=config)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainer_head_and_the_sp_head_agree_in_float64(temperature):
    """Same hidden states -> the same log-probs, entropies and gradients from both callers of the one head."""
    model = tiny_gpt_oss(seed=0).double().train()
    model.set_attn_implementation("fa3_sink")
    model.set_experts_implementation("gptoss_sequential")
    ids, _, labels = (t[:1] for t in _batch())  # row 0: no padding (the SP head takes positions, no mask)
    weights = torch.randn(2, ids.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    trainer_model, sp_model = _patched(model, "selective_logprobs", temperature), copy.deepcopy(model)
    out = trainer_model(input_ids=ids, labels=labels, fused_lm_head=True)
    logp, entropy = _sp_values(sp_model, ids, labels, HeadConfig(temperature=temperature, entropy_grad=True))
    assert logp.dtype == out.log_probs.dtype == torch.float64
    assert logp[-1] == 0 and entropy[-1] == 0  # the last position has no next token
    for name, a, b in (("logp", out.log_probs[0], logp[:-1]), ("entropy", out.entropy[0], entropy[:-1])):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (name, (a - b).abs().max().item())
    ((out.log_probs[0] * weights[0, :-1]).sum() + (out.entropy[0] * weights[1, :-1]).sum()).backward()
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    trainer_grads = {n: p.grad for n, p in trainer_model.named_parameters() if p.grad is not None}
    sp_grads = {n: p.grad for n, p in sp_model.named_parameters() if p.grad is not None}
    assert trainer_grads.keys() == sp_grads.keys() and "lm_head.weight" in sp_grads
    for name, ref in trainer_grads.items():
        diff = (ref - sp_grads[name]).abs().max().item()
        assert diff <= 1e-10 * max(1.0, ref.abs().max().item()), (name, diff)


def test_both_heads_cast_to_fp32_when_asked(monkeypatch):
    """``cast_lm_head_to_fp32`` (trainer) and ``cast_to_fp32`` (SP) both hand the op fp32 hidden states and head."""
    from trl_gptoss.parallel import head

    seen, op = [], head.selective_logprobs
    monkeypatch.setattr(
        head, "selective_logprobs", lambda h, w, *a, **k: seen.append((h.dtype, w.dtype)) or op(h, w, *a, **k)
    )
    model = tiny_gpt_oss(seed=0).to(torch.bfloat16)
    ids = torch.randint(5, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    for cast in (False, True):
        seen.clear()
        patched = copy.deepcopy(model)
        add_selective_logprobs_head(patched, 1.0, cast_lm_head_to_fp32=cast)
        patched(input_ids=ids, labels=labels, fused_lm_head=True)
        _sp_values(copy.deepcopy(model), ids, labels, HeadConfig(cast_to_fp32=cast))
        dtype = torch.float32 if cast else torch.bfloat16
        assert seen == [(dtype, dtype)] * 2, (cast, seen)


def _raised(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


def test_the_trainer_head_and_the_sp_head_refuse_with_the_same_text():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_gpt_oss(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    trainer_error = _raised(lambda: add_selective_logprobs_head(peft_model.get_base_model()))
    sp_error = _raised(lambda: prepare_context_parallel(None, peft_model, ContextParallelPlugin(sp_size=1)))
    assert trainer_error == sp_error and "lm_head is a peft.tuners.lora" in sp_error
    trainer_error = _raised(lambda: add_selective_logprobs_head(tiny_gpt_oss(seed=0), temperature=0.0))
    assert (
        trainer_error
        == _raised(lambda: HeadConfig(temperature=0.0))
        == ("temperature must be a positive finite number, got 0.0")
    )
    trainer_error = _raised(lambda: add_selective_logprobs_head(tiny_gpt_oss(seed=0), cast_lm_head_to_fp32=None))
    assert trainer_error == _raised(lambda: HeadConfig(cast_to_fp32=None)) == "cast_to_fp32 must be a bool, got None"
