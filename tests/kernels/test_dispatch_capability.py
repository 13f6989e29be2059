"""One capability rule (``validation.triton_unsupported``) for dispatch and the Triton entry: ``auto`` never
hands the kernel a case the entry would reject."""

import pytest
import torch

from gptoss_kernels.validation import triton_unsupported


@pytest.mark.parametrize("dtype,head_dim,reason", [
    (torch.float64, 64, "not torch.float64"),
    (torch.float32, 80, "not 80"),
    (torch.bfloat16, 256, "not 256"),
], ids=["float64", "head-dim-80", "head-dim-256"])
def test_triton_refuses_what_it_cannot_run(monkeypatch, dtype, head_dim, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time: lets the CPU stand in for CUDA here
    q = torch.empty(1, 4, 2, head_dim, dtype=dtype)
    why = triton_unsupported(q, q, None, interpreter_ok=True)
    assert why is not None and reason in why


def test_triton_accepts_gpt_oss_shape(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16)
    assert triton_unsupported(q, q, None, interpreter_ok=True) is None
