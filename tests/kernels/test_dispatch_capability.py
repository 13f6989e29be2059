"""One capability rule (``validation.triton_unsupported``) for dispatch and the Triton entry: ``auto`` never
hands the kernel a case the entry would reject."""

import pytest
import torch

from gptoss_kernels.validation import triton_unsupported


@pytest.mark.parametrize(
    "dtype,head_dim,reason",
    [
        (torch.float64, 64, "not torch.float64"),
        (torch.bfloat16, 256, "not 256"),
    ],
    ids=["float64", "head-dim-256"],
)
def test_triton_refuses_what_it_cannot_run(monkeypatch, dtype, head_dim, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time: lets the CPU stand in for CUDA here
    q = torch.empty(1, 4, 2, head_dim, dtype=dtype)
    why = triton_unsupported(q, q, None, interpreter_ok=True)
    assert why is not None and reason in why


@pytest.mark.parametrize("head_dim", [64, 80, 8], ids=["gpt-oss-64", "80-padded-to-128", "8-padded-to-16"])
def test_triton_accepts_gpt_oss_shape_any_head_dim_and_decoding(monkeypatch, head_dim):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.empty(1, 4, 2, head_dim, dtype=torch.bfloat16)
    k = torch.empty(1, 9, 2, head_dim, dtype=torch.bfloat16)
    assert triton_unsupported(q, q, None, interpreter_ok=True) is None
    assert triton_unsupported(q, k, None, interpreter_ok=True) is None, "Tq < Tk (decoding) runs on Triton"


def test_padding_holes_go_to_the_chunked_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.empty(1, 4, 2, 64)
    assert "chunked" in triton_unsupported(q, q, None, key_mask=torch.ones(1, 4, dtype=torch.bool), interpreter_ok=True)
