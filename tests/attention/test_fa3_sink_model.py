"""Whole tiny GPT-OSS with ``attn_implementation="fa3_sink"`` vs transformers eager (fp32).

Logits and EVERY parameter gradient (sinks included) must match eager on padded batches, and on packed
batches match each document run alone through eager (eager itself leaks across packed documents).
"""

import pytest
import torch
from transformers import GptOssForCausalLM

import trl_gptoss
from trl_gptoss.testing.models import tiny_gpt_oss

SEQ = 80  # > sliding_window (32): the sliding layer's window really cuts
TOL = 1e-5


def _pair():
    eager = tiny_gpt_oss(seed=1, attn_implementation="eager").train()
    fa3 = tiny_gpt_oss(seed=1, attn_implementation=trl_gptoss.FA3_SINK).train()
    return eager, fa3


def _weighted_loss(logits, weights, keep):
    """A loss touching every valid logit with distinct weights (so every gradient path is exercised)."""
    return (logits * weights)[keep].sum()


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close_grads(got, want, what):
    assert got.keys() == want.keys(), f"{what}: parameters with gradients differ"
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        scale = max(want[name].abs().max().item(), 1.0)
        assert diff <= TOL * scale, f"{what}: grad {name} max|diff|={diff:.3e} (max|ref|={scale:.3e})"
    assert any("sinks" in name for name in want), "sinks must receive a gradient"


def _padding_mask(side):
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if side == "right":
        mask[1, SEQ - 23 :] = 0
    elif side == "left":
        mask[1, :23] = 0
    else:  # holes: generate() extends a right-padded mask with ones; users build masks of their own
        mask[0, 10:14] = 0
        mask[1, 3::7] = 0
    return mask


@pytest.mark.parametrize("side", ["right", "left", "holes"])
def test_padded_batch_logits_and_all_grads_match_eager(side):
    """Every position, padding included (eager's padding queries attend to the valid keys they see; last-token
    pooling reads them), and every gradient through all of them."""
    eager, fa3 = _pair()
    ids = torch.randint(0, 512, (2, SEQ))
    mask = _padding_mask(side)
    weights = torch.randn(2, SEQ, 512)
    keep = torch.ones(2, SEQ, dtype=torch.bool)
    results = []
    for model in (eager, fa3):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        _weighted_loss(logits, weights, keep).backward()
        results.append((logits.detach(), _grads(model)))
    (logits_e, grads_e), (logits_f, grads_f) = results
    diff = (logits_f - logits_e)[keep].abs().max().item()
    assert diff <= TOL, f"logits max|diff|={diff:.3e}"
    _assert_close_grads(grads_f, grads_e, f"{side}-padded")


def _packed_docs():
    lengths = [37, 1, 50]
    ids = torch.randint(0, 512, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return ids, position_ids, list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("trl_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_batch_equals_documents_alone_through_eager(trl_kwargs):
    eager, fa3 = _pair()
    ids, position_ids, spans = _packed_docs()
    weights = torch.randn(1, ids.shape[1], 512)
    extra = {}
    if trl_kwargs:  # what TRL's padding-free collator hands the model
        cu = torch.tensor([0] + [end for _, end in spans], dtype=torch.int32)
        longest = max(end - start for start, end in spans)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    logits_f = fa3(input_ids=ids, position_ids=position_ids, use_cache=False, **extra).logits
    logits_f.mul(weights).sum().backward()
    for start, end in spans:
        piece = slice(start, end)
        logits_e = eager(input_ids=ids[:, piece], use_cache=False).logits
        logits_e.mul(weights[:, piece]).sum().backward()
        diff = (logits_f[:, piece].detach() - logits_e.detach()).abs().max().item()
        assert diff <= TOL, f"document {start}:{end} logits max|diff|={diff:.3e}"
    _assert_close_grads(_grads(fa3), _grads(eager), "packed")
    with torch.no_grad():  # the check is meaningful: upstream eager on the packed row leaks across documents
        leaky = eager(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert (leaky - logits_f.detach()).abs().max().item() > 1e-2


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_with_kv_cache_matches_eager(cache):
    eager, fa3 = (m.eval() for m in _pair())
    prompt = torch.randint(0, 512, (2, 30))
    mask = torch.ones_like(prompt)
    mask[0, :7] = 0  # left padding, as generate() expects
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation=cache)
    tokens_e = eager.generate(prompt, **kwargs)
    tokens_f = fa3.generate(prompt, **kwargs)
    assert tokens_f.shape[1] == 42 > eager.config.sliding_window
    assert torch.equal(tokens_f, tokens_e), f"eager {tokens_e[:, 30:].tolist()} vs fa3 {tokens_f[:, 30:].tolist()}"


def test_gradient_checkpointing_gives_the_same_gradients():
    _, plain = _pair()
    _, ckpt = _pair()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, SEQ))
    mask = _padding_mask("right")
    for model in (plain, ckpt):
        model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    _assert_close_grads(_grads(ckpt), _grads(plain), "gradient checkpointing")


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    tiny_gpt_oss(seed=2).save_pretrained(tmp_path)
    loaded = GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation="fa3_sink")
    assert loaded.config._attn_implementation == "fa3_sink"
    switched = GptOssForCausalLM.from_pretrained(tmp_path)
    switched.set_attn_implementation("fa3_sink")
    ids = torch.randint(0, 512, (1, 40))
    reference = GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    want = reference(input_ids=ids).logits
    for model in (loaded, switched):
        assert (model(input_ids=ids).logits - want).abs().max().item() <= TOL
