"""Validate once, sync never on the hot path: once a step's layout is built (first layer), every further
``fa3_sink`` layer call — forward and backward — reads nothing back from the device.

On CPU a counting hook stands in for the GPU: it counts every op that would copy device data to the host
(``aten._local_scalar_dense`` behind ``.item()``/``int()``/``bool()``, ``nonzero``/``masked_select``/
``unique`` whose output size depends on data, ``repeat_interleave`` without ``output_size``) and every
``Tensor.tolist()``. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` turns any sync into an error.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trl_gptoss.attention import fa3_sink_attention_forward

_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if (
            name == "_local_scalar_dense"
            or name in _DATA_DEPENDENT
            or (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3)
        ):
            self.syncs.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def count_syncs(monkeypatch):
    """Context-manager factory; ``.syncs`` lists every host read inside it (tolist included)."""
    original = torch.Tensor.tolist

    def make():
        mode = _CountSyncs()

        def counting_tolist(self):
            mode.syncs.append("Tensor.tolist")
            return original(self)

        monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
        return mode

    return make


def _layer_inputs(batch, seqlen, device="cpu", hq=4, hkv=2, dim=16, q_len=None):
    module = SimpleNamespace(is_causal=True, num_key_value_groups=hq // hkv, training=True)
    q_len = seqlen if q_len is None else q_len
    shapes = ((batch, hq, q_len, dim), (batch, hkv, seqlen, dim), (batch, hkv, seqlen, dim), (hq,))
    return module, [torch.randn(s, device=device).requires_grad_() for s in shapes]


def _call(module, leaves, mask, kwargs, window):
    out, _ = fa3_sink_attention_forward(
        module, *leaves[:3], mask, scaling=0.25, sliding_window=window, s_aux=leaves[3], **kwargs
    )
    out.sum().backward()


CALLS = {
    "packed-position_ids": (
        1,
        None,
        lambda d: dict(position_ids=torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2, 3, 0]], device=d)),
    ),
    "trl-cu_seq_lens": (
        1,
        None,
        lambda d: dict(cu_seq_lens_q=torch.tensor([0, 4, 10], dtype=torch.int32, device=d), max_length_q=6),
    ),
    "right-and-left-padding": (2, [[1, 1, 1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], lambda d: {}),
    "holes": (2, [[1, 1, 0, 0, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1, 1, 1, 1, 0]], lambda d: {}),
    "decoding-3-of-10-with-padding": (2, [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10], lambda d: {}),
}
Q_LEN = {"decoding-3-of-10-with-padding": 3}


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("call_id", CALLS)
def test_second_layer_call_reads_nothing_back(call_id, window, count_syncs):
    batch, mask, make_kwargs = CALLS[call_id]
    mask = None if mask is None else torch.tensor(mask, dtype=torch.bool)
    kwargs = make_kwargs("cpu")
    module, leaves = _layer_inputs(batch, 10, q_len=Q_LEN.get(call_id))
    _call(module, leaves, mask, kwargs, window)  # layer 0: builds and validates the layout (host reads allowed)
    mode = count_syncs()
    with mode:
        _call(module, leaves, mask, kwargs, window)  # layer 1: same position_ids / mask / cu_seq_lens objects
    assert mode.syncs == [], f"{call_id}: host reads on the hot path: {mode.syncs}"


def test_the_counting_hook_sees_the_first_call(count_syncs):
    """The hook is not blind: building the layout on the first call does read the positions back."""
    module, leaves = _layer_inputs(1, 10)
    mode = count_syncs()
    with mode:
        _call(module, leaves, None, dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])), None)
    assert mode.syncs, "building a layout from fresh position_ids must read them back at least once"


@pytest.mark.gpu
@pytest.mark.parametrize("call_id", CALLS)
def test_no_cuda_sync_after_the_first_layer(call_id):
    batch, mask, make_kwargs = CALLS[call_id]
    mask = None if mask is None else torch.tensor(mask, dtype=torch.bool, device="cuda")
    kwargs = make_kwargs("cuda")
    module, leaves = _layer_inputs(batch, 10, device="cuda", q_len=Q_LEN.get(call_id))
    _call(module, leaves, mask, kwargs, 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call(module, leaves, mask, kwargs, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
