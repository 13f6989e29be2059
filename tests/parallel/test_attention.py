"""The Ulysses wrapper in one process: its mask semantics vs the float64 reference, the unsharded bypass,
and the whole owner loop at sp = 1 (packing, global labels, unpacking) vs per-document runs."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from gptoss_kernels import sink_attention_ref
from tests.parallel._workers import build_model, grpo_loss_fn, make_batch, reference_step
from trl_gptoss.parallel import (
    ContextParallelPlugin,
    HeadConfig,
    prepare_context_parallel,
    sharded_forward,
    ulysses_attention_forward,
)
from trl_gptoss.parallel.groups import SequenceParallelGroup
from trl_gptoss.parallel.masks import additive_mask, cu_seqlens
from trl_gptoss.testing import tiny_gpt_oss


class _Heads(torch.nn.Module):
    def __init__(self, sinks, groups):
        super().__init__()
        self.sinks, self.num_key_value_groups = sinks, groups


@pytest.mark.parametrize("window", [None, 5, 64], ids=["full", "window5", "window-gt-T"])
def test_packed_mask_in_eager_equals_float64_varlen_reference(window):
    """Documents [7, 1, 12] (one a lone token whose only other entry is its sink), GQA 4/2, float64."""
    positions = torch.cat([torch.arange(7), torch.arange(1), torch.arange(12)])[None]
    total, hq, hkv, dim = positions.shape[1], 4, 2, 16
    q, k, v = (torch.randn(total, h, dim, dtype=torch.float64) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, dtype=torch.float64)
    mask = additive_mask(positions, window, torch.float64)
    out, _ = eager_attention_forward(
        _Heads(sinks, hq // hkv), *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scaling=dim**-0.5
    )
    expected = sink_attention_ref(q, k, v, sinks, cu_seqlens=cu_seqlens(positions), window=window)
    torch.testing.assert_close(out[0], expected, atol=1e-13, rtol=0)


def test_unsharded_calls_bypass_the_wrapper():
    """Generation and plain forwards (padded batch, KV cache) are exactly the inner implementation's."""
    plain = tiny_gpt_oss(seed=5)
    wrapped = tiny_gpt_oss(seed=5)
    prepare_context_parallel(None, wrapped, ContextParallelPlugin(sp_size=1))
    assert wrapped.config._attn_implementation == "ulysses_eager"
    ids = torch.randint(0, 512, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    torch.testing.assert_close(
        wrapped(input_ids=ids, attention_mask=mask).logits,
        plain(input_ids=ids, attention_mask=mask).logits,
        atol=0,
        rtol=0,
    )
    generated = [m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False) for m in (plain, wrapped)]
    assert torch.equal(*generated)


def test_sharded_forward_refuses_padding_masks_missing_positions_and_caches():
    model = tiny_gpt_oss()
    prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=1))
    ids = torch.randint(0, 512, (1, 8))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    single = SequenceParallelGroup.single()
    with sharded_forward(single), pytest.raises(ValueError, match="pack the batch first"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(8)[None])
    with sharded_forward(single), pytest.raises(ValueError, match="needs position_ids"):
        model.model.layers[0].self_attn(model.model.embed_tokens(ids), (torch.ones(1, 8, 32),) * 2, None)
    query, cached_keys = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 12, 64)
    with sharded_forward(single), pytest.raises(ValueError, match="use_cache=False"):
        ulysses_attention_forward(
            model.model.layers[0].self_attn, query, cached_keys, cached_keys, None, position_ids=torch.arange(8)[None]
        )


@pytest.mark.parametrize("tempered", [False, True], ids=["plain", "T0.7-entropy-bonus"])
@pytest.mark.parametrize("inner", ["eager", "fa3_sink"])
def test_owner_loop_at_sp1_matches_per_document_float64(inner, tempered):
    """sp = 1 runs the same wrapper without collectives: packed rows must equal each document run alone
    (tempered: log-probs and entropies of softmax(logits / 0.7), entropy bonus, 5-row tiles)."""
    batch = make_batch(seed=7)
    head, coef = (HeadConfig(temperature=0.7, entropy_grad=True, chunk_size=5), 0.05) if tempered else (HeadConfig(), 0)
    ref_losses, _, ref_grads, ref_logps, ref_entropies = reference_step(torch.float64, [batch], 1, head, coef)
    model = build_model(torch.float64)
    plugin = ContextParallelPlugin(sp_size=1, inner_attention=inner)
    runner = prepare_context_parallel(None, model, plugin, head)
    result = runner.forward_backward(batch[0], batch[1], grpo_loss_fn(batch[2], batch[3], coef))
    torch.testing.assert_close(result.loss, ref_losses[0], atol=1e-12, rtol=0)
    scored = runner.score(batch[0], batch[1])
    torch.testing.assert_close(scored[0] if tempered else scored, ref_logps[0], atol=1e-12, rtol=0)
    if tempered:
        torch.testing.assert_close(result.token_entropies, ref_entropies[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(scored[1], ref_entropies[0], atol=1e-12, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


class _Layer(torch.nn.Module):
    """What the Ulysses wrapper reads from a GPT-OSS attention layer: config (inner name), sinks, GQA."""

    def __init__(self, inner, sinks, groups):
        super().__init__()
        self.config = type("Config", (), {"_attn_implementation": f"ulysses_{inner}"})()
        self.sinks, self.num_key_value_groups, self.is_causal = sinks, groups, True


@pytest.mark.parametrize("window", [None, 2], ids=["full", "window2"])
def test_eager_and_fa3_sink_sp_paths_agree_on_where_documents_start(window):
    """position_ids ``[0, 1, 2, 5, 6, 0, 1]``: the gap opens a document (transformers' rule) in the SP eager
    mask, the SP fa3_sink layout and the plain fa3_sink call alike; all equal per-document float64 runs."""
    from trl_gptoss.attention import fa3_sink_attention_forward

    positions = torch.tensor([[0, 1, 2, 5, 6, 0, 1]])
    assert cu_seqlens(positions).tolist() == [0, 3, 5, 7]
    hq, hkv, dim = 4, 2, 16
    query, key, value = (torch.randn(1, h, 7, dim, dtype=torch.float64) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, dtype=torch.float64)
    outputs = {}
    for inner in ("eager", "fa3_sink"):
        with sharded_forward(SequenceParallelGroup.single()):
            outputs[inner], _ = ulysses_attention_forward(
                _Layer(inner, sinks, hq // hkv),
                query,
                key,
                value,
                None,
                scaling=dim**-0.5,
                sliding_window=window,
                s_aux=sinks,
                position_ids=positions,
            )
    outputs["plain"], _ = fa3_sink_attention_forward(
        _Layer("fa3_sink", sinks, hq // hkv),
        query,
        key,
        value,
        None,
        scaling=dim**-0.5,
        sliding_window=window,
        s_aux=sinks,
        position_ids=positions,
    )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    expected = sink_attention_ref(
        q, k, v, sinks, cu_seqlens=torch.tensor([0, 3, 5, 7], dtype=torch.int32), window=window
    )
    for name, out in outputs.items():
        torch.testing.assert_close(out[0], expected, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
