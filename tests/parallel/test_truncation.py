"""``truncated_log_mass`` against its float64 definition, gradients included; the head scores the sampled support."""

import pytest
import torch

from trl_gptoss.parallel.batching import IGNORE_INDEX
from trl_gptoss.parallel.head import HeadConfig, token_values
from trl_gptoss.parallel.truncation import reference_truncated_log_mass, truncated_log_mass
from trl_gptoss.rollout.sampling import processed_logprobs

SETTINGS = [(-1, 0.8), (5, 1.0), (3, 0.5), (50, 0.999), (-1, 1.0)]


def _inputs(n=37, h=16, v=50, dtype=torch.float64, seed=0, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(v, generator=g).to(dtype).requires_grad_()
    return hidden, weight, bias


@pytest.mark.parametrize("top_k, top_p", SETTINGS)
@pytest.mark.parametrize("chunk", [1, 8, 1024])
def test_matches_the_definition_with_gradients_in_float64(top_k, top_p, chunk):
    hidden, weight, bias = _inputs()
    got = truncated_log_mass(hidden, weight, bias, temperature=0.7, top_k=top_k, top_p=top_p, chunk=chunk)
    want = reference_truncated_log_mass(hidden, weight, bias, 0.7, top_k, top_p)
    assert got.dtype == torch.float64 and (got <= 1e-12).all()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    if top_k < 0 and top_p == 1:
        assert (got.abs() < 1e-12).all()  # nothing truncated: the whole mass
    upstream = torch.randn_like(got)
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias))
    expected = torch.autograd.grad((want * upstream).sum(), (hidden, weight, bias))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_gradcheck():
    hidden, weight, bias = _inputs(n=5, h=4, v=9, seed=3)

    def fn(h, w, b):
        return truncated_log_mass(h, w, b, temperature=1.3, top_k=4, top_p=0.7, chunk=2)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias), eps=1e-6, atol=1e-7)


def test_hostile_shapes_and_dtypes():
    hidden, weight, bias = _inputs(n=0)
    empty = truncated_log_mass(hidden, weight, bias, top_p=0.5)
    assert empty.shape == (0,)
    empty.sum().backward()
    hidden, weight, _ = _inputs(n=7, v=3)
    # top_k beyond the vocabulary keeps everything; no bias
    assert truncated_log_mass(hidden, weight, None, top_k=10).abs().max() < 1e-12
    ties = torch.zeros(3, 4, dtype=torch.float64)
    weight = torch.ones(6, 4, dtype=torch.float64)  # every logit equal: top-k keeps the ties, all of them
    assert truncated_log_mass(ties, weight, None, top_k=2).abs().max() < 1e-12
    hidden, weight, bias = (t.detach().to(torch.bfloat16).requires_grad_() for t in _inputs(n=9))
    out = truncated_log_mass(hidden, weight, bias, top_p=0.6)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="chunk"):
        truncated_log_mass(hidden, weight, bias, top_p=0.6, chunk=0)


@pytest.mark.parametrize("top_k, top_p", SETTINGS[:3])
def test_the_head_gives_the_engines_processed_logprobs(top_k, top_p):
    """With ``top_k`` / ``top_p`` the head's log-prob of a token is the one vLLM reports (``processed_logprobs``)."""
    hidden, weight, bias = _inputs(n=12, h=16, v=50, dtype=torch.float32)
    temperature = 0.9
    logits = hidden.detach() @ weight.detach().T + bias.detach()
    support = processed_logprobs(logits, temperature, top_k, top_p)
    labels = support.argmax(-1)  # a token inside every row's support
    labels[3] = IGNORE_INDEX
    config = HeadConfig(temperature=temperature, entropy=True, top_k=top_k, top_p=top_p)
    logp, entropy = token_values(hidden, weight, bias, labels, config)
    keep = labels != IGNORE_INDEX
    want = support[keep].gather(-1, labels[keep, None])[:, 0]
    torch.testing.assert_close(logp[keep], want, atol=1e-5, rtol=0)
    assert logp[3] == 0 and entropy is not None
    logp.sum().backward()
    assert torch.isfinite(hidden.grad).all()


def test_head_config_refuses_bad_truncation():
    with pytest.raises(ValueError, match="top_p must be in"):
        HeadConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an int"):
        HeadConfig(top_k=-3)
    assert not HeadConfig().truncates and HeadConfig(top_k=5).truncates and HeadConfig(top_p=0.9).truncates
