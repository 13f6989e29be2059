"""Train-inference parity against the real rollout engine (the retrospective's Figure 4, right).

vLLM honours the sinks when it samples; the trainer recomputes the same log-probs with ``fa3_sink``. They must
agree to float32 round-off, while attention that drops the sinks (what flash-attn 2/3 silently do) must not.
"""

import pytest
import torch

import trl_gptoss  # noqa: F401  (registers fa3_sink)
from trl_gptoss.harmony import render_conversation
from trl_gptoss.testing import harmony_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

QUESTION = (
    "A farmer has 17 sheep and buys 23 more, then sells a third of the flock. The rest are split evenly "
    "between two fields, and one field later gets 5 extra sheep from a neighbour. "
) * 3


def _completion_logprobs(model, prompt, completions):
    """Log-prob of every completion token under ``model`` given the prompt: one padded batch, right-padded."""
    rows = [prompt + c for c in completions]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    logps = torch.log_softmax(logits, dim=-1)
    out = []
    for i, completion in enumerate(completions):
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
        out.append(logps[i, positions, torch.tensor(completion)])
    return out


def _max_abs_diff(ours, engine):
    return max((a - torch.tensor(b, dtype=a.dtype)).abs().max().item() for a, b in zip(ours, engine))


def _load(checkpoint, attn):
    from transformers import GptOssForCausalLM

    return GptOssForCausalLM.from_pretrained(checkpoint, attn_implementation=attn, dtype=torch.float32).eval()


def test_fa3_sink_matches_vllm_and_sinkless_does_not(vllm_tiny_server, tiny_checkpoint):
    tokenizer = harmony_tokenizer(small=True)
    prompt = render_conversation([{"role": "user", "content": QUESTION}], tokenizer, add_generation_prompt=True)
    assert len(prompt) > 128, "prompt must exceed the sliding window by far"
    samples = vllm_tiny_server.complete(prompt, max_tokens=48, temperature=1.0, n=4, seed=11)
    completions = [s.token_ids for s in samples]
    engine = [s.logprobs for s in samples]

    model = _load(tiny_checkpoint, "fa3_sink")
    fa3_sink_diff = _max_abs_diff(_completion_logprobs(model, prompt, completions), engine)
    eager_diff = _max_abs_diff(_completion_logprobs(_load(tiny_checkpoint, "eager"), prompt, completions), engine)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # exp(-inf) = 0: the sink leaves the denominator
    sinkless_diff = _max_abs_diff(_completion_logprobs(model, prompt, completions), engine)

    print(
        f"\nmax|dlogp| vs vLLM over {sum(map(len, completions))} tokens: fa3_sink {fa3_sink_diff:.2e}, "
        f"eager {eager_diff:.2e}, sink-less {sinkless_diff:.3f}"
    )
    assert fa3_sink_diff <= 1e-4
    assert eager_diff <= 1e-4
    assert sinkless_diff >= 0.1
