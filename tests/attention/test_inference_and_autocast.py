"""``fa3_sink`` where transformers users run it: under ``torch.inference_mode`` (TRL's reward scoring, user
loops around ``generate`` and pipelines) and under ``torch.autocast`` on the CPU, and the per-tensor layout
cache staying correct there (inference tensors have no version counter).
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import pipeline
from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import trl_gptoss
from trl_gptoss.attention import fa3_sink_attention_forward, packed_layout, span_layout
from trl_gptoss.testing import harmony_tokenizer
from trl_gptoss.testing.models import tiny_gpt_oss

SEQ = 40  # > sliding_window (32)
TOL = 1e-5
F64 = torch.float64


@pytest.fixture(scope="module")
def models():
    return tiny_gpt_oss(seed=1, attn_implementation="eager"), tiny_gpt_oss(
        seed=1, attn_implementation=trl_gptoss.FA3_SINK
    )


def _batch(kind):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (2, SEQ), generator=gen)
    if kind == "packed-positions":
        return ids[:1], dict(position_ids=torch.cat([torch.arange(15), torch.arange(SEQ - 15)])[None])
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if kind == "left-padded":
        mask[1, :9] = 0
    elif kind == "right-padded":
        mask[0, SEQ - 11 :] = 0
    elif kind == "holes":
        mask[0, 5:8] = 0
    return ids, ({} if kind == "plain" else dict(attention_mask=mask))


KINDS = ["plain", "left-padded", "right-padded", "holes", "packed-positions"]


@pytest.mark.parametrize("kind", KINDS)
def test_forward_under_inference_mode_equals_no_grad_and_eager(models, kind):
    """Inside inference mode transformers builds position ids and masks as inference tensors."""
    eager, fa3 = models
    ids, kwargs = _batch(kind)
    with torch.no_grad():
        want = fa3(ids, use_cache=False, **kwargs).logits
        eager_logits = eager(ids, use_cache=False, **kwargs).logits if kind != "packed-positions" else want
    with torch.inference_mode():
        got = fa3(ids, use_cache=False, **kwargs).logits
        again = fa3(ids, use_cache=False, **kwargs).logits  # cache hits on the same inference tensors
    assert torch.equal(got, want) and torch.equal(again, want)
    assert (got - eager_logits).abs().max().item() <= TOL


def test_generate_under_inference_mode_matches_eager(models):
    eager, fa3 = models
    prompt = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    mask[0, :7] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        tokens_f = fa3.generate(prompt, **kwargs)
    tokens_e = eager.generate(prompt, **kwargs)
    assert tokens_f.shape[1] == 42 and torch.equal(tokens_f, tokens_e)


def test_text_generation_pipeline_under_inference_mode(models):
    """The model card's quick-start shape: a ``pipeline`` (its own context is ``no_grad`` in transformers
    5.23; callers such as TRL add ``inference_mode`` around it), batched so that it pads."""
    eager, fa3 = models
    tokenizer = harmony_tokenizer(small=True)
    prompts = ["The sum of two and two is", "Hi"]
    kwargs = dict(max_new_tokens=6, do_sample=False, batch_size=2, return_full_text=False)
    outputs = []
    for model in (fa3, eager):
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        with torch.inference_mode():
            outputs.append([r[0]["generated_text"] for r in pipe(prompts, **kwargs)])
    assert outputs[0] == outputs[1] and all(outputs[0])


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["left-padded", "right-padded", "holes"])
def test_padded_batch_under_cpu_autocast(models, kind, low):
    """Logits and the sinks' gradients under autocast, against the model in float64:
    ``|fa3 - ref64| <= 2 |eager_autocast - ref64| + atol`` (autocast runs the linears and attention in the
    low dtype for both; fa3 casts q, k, v once and accumulates in fp32)."""
    eager, fa3 = (m.train() for m in models)
    ids, kwargs = _batch(kind)
    ref_model = tiny_gpt_oss(seed=1, dtype=F64, attn_implementation="eager").train()
    ref_model.set_experts_implementation("eager")  # grouped_mm has no float64
    keep = kwargs["attention_mask"].bool() if "attention_mask" in kwargs else torch.ones_like(ids, dtype=torch.bool)
    results = []
    for model, autocast in ((ref_model, False), (eager, True), (fa3, True)):
        model.zero_grad()
        with torch.autocast("cpu", dtype=low, enabled=autocast):
            logits = model(ids, use_cache=False, **kwargs).logits
        logits.float()[keep].square().mean().backward()  # touches every valid position
        sinks = torch.stack([layer.self_attn.sinks.grad.double() for layer in model.model.layers])
        results.append((logits.detach().double()[keep], sinks))
    (ref_logits, ref_sinks), (eager_logits, eager_sinks), (got_logits, got_sinks) = results
    for name, got, lowp, ref in (
        ("logits", got_logits, eager_logits, ref_logits),
        ("dsinks", got_sinks, eager_sinks, ref_sinks),
    ):
        tol = 2 * (lowp - ref).abs().max().item() + 1e-3 * max(ref.abs().max().item(), 1.0)
        diff = (got - ref).abs().max().item()
        assert diff <= tol, f"{name}: max|diff| {diff:.3e} > tol {tol:.3e}"
    eager.eval(), fa3.eval()


def _direct_call(mask, window, requires_grad=False):
    """One fa3_sink layer call (float64, transformers' layout [B, H, T, D]) with a 2-D keep-mask."""
    gen = torch.Generator().manual_seed(5)
    batch, seqlen = mask.shape
    query = torch.randn(batch, 4, seqlen, 16, dtype=F64, generator=gen).requires_grad_(requires_grad)
    key, value = (torch.randn(batch, 2, seqlen, 16, dtype=F64, generator=gen) for _ in range(2))
    sinks = torch.rand(4, dtype=F64, generator=gen)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False, sinks=sinks)
    got, _ = fa3_sink_attention_forward(
        module, query, key, value, mask, scaling=0.25, sliding_window=window, s_aux=sinks
    )
    return got, (query, key, value, module)


def _eager_with_mask(inputs, mask, window):
    query, key, value, module = inputs
    additive = eager_mask(
        batch_size=query.shape[0],
        q_length=query.shape[2],
        kv_length=key.shape[2],
        mask_function=causal_mask_function if window is None else sliding_window_causal_mask_function(window),
        attention_mask=mask.clone(),
        dtype=F64,
    )
    return eager_attention_forward(module, query, key, value, additive, scaling=0.25)[0]


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_mask_written_in_place_or_replaced_is_not_served_a_stale_layout(inference):
    """The layout cache keys on the mask object and its values: an in-place write (no version counter on an
    inference tensor) and a new mask of the same shape each get their own layout."""
    with torch.inference_mode(inference):
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)
        first = span_layout(mask)
        assert span_layout(mask) is first  # the layers of one pass share it
        got, inputs = _direct_call(mask, 3)
        assert (got - _eager_with_mask(inputs, mask, 3)).abs().max().item() <= 1e-10
        mask[1, 5:] = False  # e.g. a preallocated mask updated in place
        assert span_layout(mask) is not first and span_layout(mask).ends == (8, 5)
        got, inputs = _direct_call(mask, 3)
        assert (got - _eager_with_mask(inputs, mask, 3)).abs().max().item() <= 1e-10
        other = torch.tensor([[1] * 8, [0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
        assert span_layout(other).starts == (0, 1)
        got, inputs = _direct_call(other, 3)
        assert (got - _eager_with_mask(inputs, other, 3)).abs().max().item() <= 1e-10


def test_position_ids_written_in_place_under_inference_mode_get_a_new_layout():
    with torch.inference_mode():
        positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
        assert packed_layout(1, 8, positions, "cpu").cu_seqlens.tolist() == [0, 3, 8]
        positions[0, 3:] += 3  # now one document
        assert packed_layout(1, 8, positions, "cpu") is None
        positions[0, 5:] -= 5
        assert packed_layout(1, 8, positions, "cpu").cu_seqlens.tolist() == [0, 5, 8]


def test_layout_built_under_inference_mode_serves_a_training_call():
    """A mask made outside inference mode keeps its version; a layout first built for it under inference mode
    (scoring) must serve a training call with the same mask (its index tensors are saved for backward)."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    with torch.inference_mode():
        _direct_call(mask, None)
    got, inputs = _direct_call(mask, None, requires_grad=True)
    want = _eager_with_mask(inputs, mask, None)
    grad_got, grad_want = (torch.autograd.grad(out, inputs[0], torch.ones_like(out)) for out in (got, want))
    assert (got - want).abs().max().item() <= 1e-10
    assert (grad_got[0] - grad_want[0]).abs().max().item() <= 1e-10
