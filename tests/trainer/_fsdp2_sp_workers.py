"""Code run inside spawned gloo processes by the SP-under-FSDP2 trainer test (importable by ``spawn``)."""

from __future__ import annotations


def sp_train_rank(rank: int, world: int, layout: str, state_path: str, output_dir: str, overrides: dict) -> dict:
    """``tests.trainer._fsdp2_workers.train_rank`` (same layouts, data and seeds), plus what the trainer logged
    as ``entropy`` and whether the SP runner computed the loss (``sp_runner``: its group size, or None)."""
    from tests.trainer._fsdp2_workers import train_rank
    from trl_gptoss.trainer import GptOssGRPOTrainer

    seen = {}
    train = GptOssGRPOTrainer.train

    def recording_train(self, *args, **kwargs):  # this spawned process only
        try:
            return train(self, *args, **kwargs)
        finally:
            seen["entropy"] = [h["entropy"] for h in self.state.log_history if "entropy" in h]
            runner = self.sp_loss.runner if self.sp_loss is not None else None
            seen["sp_runner"] = None if runner is None else runner.sp.size

    GptOssGRPOTrainer.train = recording_train
    try:
        return {**train_rank(rank, world, layout, state_path, output_dir, overrides), **seen}
    finally:
        GptOssGRPOTrainer.train = train
