"""The long-context options under FSDP2 (2 gloo processes, layers and model sharded): the gradients equal FSDP2
without them -- bit for bit with the offload alone; with tiles of 7 tokens within 2e-6 relative (the
single-process bound of test_layer.py, 1e-6 or the plain fp32 path's own error from float64, measured up to
1.2e-6; here no float64 run)."""

from __future__ import annotations

import pytest

from tests.long_context._fsdp2_workers import compare_under_fsdp2
from tests.long_context.helpers import NUM_LAYERS
from trl_gptoss.testing.distributed import launch


@pytest.mark.distributed
def test_options_under_fsdp2_equal_fsdp2_without_them(tmp_path):
    results = launch(compare_under_fsdp2, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["offload"]["offloaded"] == result["tiles+offload"]["offloaded"] == NUM_LAYERS
        offload = {name: diff for name, diff in result["offload"]["diffs"].items() if diff != 0.0}
        assert not offload, f"rank {rank}: offload changed {offload}"
        tiled = {name: diff for name, diff in result["tiles+offload"]["diffs"].items() if diff > 2e-6}
        assert not tiled, f"rank {rank}: tiles+offload beyond 2e-6: {tiled}"
        print(f"rank {rank}: tiles+offload max {max(result['tiles+offload']['diffs'].values()):.2e} from plain")
    assert any(name.endswith("self_attn.sinks") for name in results[0]["offload"]["diffs"])
