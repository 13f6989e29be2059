"""The trainer's side of the rollout layer: build the engine, run one batch, hand TRL its tensors.

TRL's ``rollout_func`` contract is what ``GptOssGRPOTrainer`` fills: ``prompt_ids``, ``completion_ids``,
``logprobs`` (the engine's, 0.0 on inserted tool tokens), ``env_mask`` (becomes TRL's ``tool_mask``: 1 on
sampled tokens, 0 on inserted ones, so tool output is attended but never trained on) and extra columns that
TRL merges into the rows the reward functions receive.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import tempfile
from pathlib import Path

from trl_gptoss.rollout.config import RolloutConfig, derive_seed
from trl_gptoss.rollout.types import Rollout

logger = logging.getLogger(__name__)

# Extra columns every reward function receives (aligned with ``completions``).
ROLLOUT_COLUMNS = ("final_answer", "messages", "num_turns", "num_tool_calls", "num_tool_errors", "stop_reason")


def build_tools(names: list[str]) -> list:
    """Instantiate the tools named in ``GptOssGRPOConfig.tool_names`` from the registry ``trl_gptoss.tools.TOOLS``."""
    from trl_gptoss.tools import build_tools as build_registered_tools

    return build_registered_tools(names)


def rollout_config(args, step: int, process_index: int, system=None) -> RolloutConfig:
    """Sampling settings of one generation round. The seed differs per optimizer step and per process (so
    processes never sample the same continuations) and is reproducible from ``args.seed``."""
    return RolloutConfig(
        max_turns=args.max_turns_per_conversation,
        max_completion_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k and args.top_k > 0 else -1,
        seed=derive_seed(args.seed, step, process_index),
        system=system,
    )


def check_server(base_url, timeout: float = 10.0) -> None:
    """Raise at construction when a rollout server does not answer ``GET /health`` with 200. ``base_url``: one
    URL, a comma-separated string or a list; the error names the entry that failed."""
    from trl_gptoss.rollout.multi_server import server_urls
    from trl_gptoss.rollout.server import health_status

    for url in server_urls(base_url):
        status = health_status(url, timeout)
        if status == 200:
            continue
        raise ValueError(
            f"rollout_server_url entry {url!r} does not answer GET /health ({status}); start the server "
            "(`trl-gptoss vllm-serve ...`), drop it from the list, or set rollout_server_url=None to start one"
        )


def refuse_zero3(args, model) -> None:
    """The weight push gathers FSDP2 shards, not DeepSpeed ZeRO-3 partitions: refuse ZeRO-3 at construction
    (a push would send empty shards) and say what to use instead."""
    from trl_gptoss.rollout.push import ZERO3_MESSAGE, pushed_layout

    ds_config = getattr(args, "hf_deepspeed_config", None)
    zero3 = bool(ds_config is not None and getattr(ds_config, "is_zero3", lambda: False)())
    zero3 = zero3 or os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    if zero3:
        raise ValueError(f"rollout_backend={args.rollout_backend!r} with DeepSpeed ZeRO-3: {ZERO3_MESSAGE}")
    pushed_layout(model)  # raises, naming the parameter, when parameters are already ZeRO-3 partitions


class RolloutBackend:
    """The engine a trainer samples from, plus the server it started (if any), stopped by ``close``.

    ``push(model)`` gives the engine the model's current weights; it is collective (every rank calls it with
    its own, possibly sharded, model; rank 0 sends to every server).
    """

    def __init__(self, args, model, tokenizer):
        self.server = None
        self._tmp = None
        if args.rollout_backend == "transformers":
            from trl_gptoss.rollout.transformers_engine import TransformersEngine

            self.engine = TransformersEngine(model, tokenizer)
        else:
            refuse_zero3(args, model)
            self.engine = self._server_engine(args, model, tokenizer)

    def push(self, model) -> None:
        """Collective weight push: call on EVERY rank (FSDP2 shards are gathered with collectives)."""
        self.engine.push_weights(model)

    def _server_engine(self, args, model, tokenizer):
        from trl_gptoss.rollout.multi_server import MultiServerEngine, server_urls
        from trl_gptoss.rollout.vllm_engine import VLLMServerEngine

        url = args.rollout_server_url
        if url is None:
            url = self._start_server(args, model, tokenizer)
        check_server(url)
        urls = server_urls(url)
        return VLLMServerEngine(urls[0]) if len(urls) == 1 else MultiServerEngine(urls)

    def _start_server(self, args, model, tokenizer) -> str:
        """Save a merged COPY of the model (``push_tensors``: adapters merged into gathered copies, the trained
        model untouched, one layer in memory at a time) and serve it with ``vllm serve``; its weights are
        replaced by a push before every rollout anyway. Collective under ``torch.distributed``: every rank
        calls it, rank 0 writes the checkpoint and starts the one server, every rank gets its URL."""
        import torch.distributed as dist

        from trl_gptoss.rollout.server import VLLMServer

        distributed = dist.is_available() and dist.is_initialized()
        main = not distributed or dist.get_rank() == 0
        self._tmp = tempfile.TemporaryDirectory(prefix="trl-gptoss-rollout-") if main else None
        path = Path(self._tmp.name) if main else None
        save_merged_checkpoint(model, path)
        url = None
        if main:
            tokenizer.save_pretrained(path)
            self.server = VLLMServer(
                path,
                max_model_len=args.rollout_max_model_len,
                startup_timeout=args.rollout_server_timeout,
                remove_on_exit=[path],  # the model copy goes with the server, even if this process is killed
            )
            try:
                self.server.start()
                url = self.server.base_url
            finally:
                atexit.register(self.close)  # a server this process started never outlives it
                if distributed:  # the other ranks wait for the URL (None: the start failed)
                    dist.broadcast_object_list([url], src=0)
            logger.info("started a vLLM rollout server at %s", url)
            return url
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise RuntimeError("rank 0 could not start the vLLM rollout server; its log has the error")
        return box[0]

    def close(self) -> None:
        close_engine = getattr(self.engine, "close", None)
        if callable(close_engine):
            close_engine()
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None


def save_merged_checkpoint(model, path: Path | None) -> None:
    """Write ``model`` as a transformers checkpoint at ``path``: its config and one safetensors file per
    ``push_layers`` group (adapters merged into copies, one layer in memory) plus the index. Collective under
    ``torch.distributed`` (every rank calls it; rank 0, whose ``path`` is set, writes)."""
    import copy
    import json

    from safetensors.torch import save_file

    from trl_gptoss.rollout.push import push_layers
    from trl_gptoss.rollout.weight_sync import unwrap

    weight_map = {}
    for number, layer in enumerate(push_layers(model, to_rank=0), start=1):
        name = f"model-{number:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in layer}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((n for n, _ in layer), name))
        del layer
    if path is None:
        return
    base = unwrap(model, peft=True)
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]  # what vLLM picks the model class (and its tasks) by
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def rollouts_to_trl(rollouts: list[Rollout]) -> dict:
    """TRL ``rollout_func`` output for one batch (lists aligned with the prompts)."""
    output = {
        "prompt_ids": [r.prompt_ids for r in rollouts],
        "completion_ids": [r.completion_ids for r in rollouts],
        "logprobs": [r.logprobs for r in rollouts],
        "env_mask": [r.completion_mask for r in rollouts],
    }
    for column in ROLLOUT_COLUMNS:
        output[column] = [_column_value(r, column) for r in rollouts]
    return output


def _column_value(rollout: Rollout, column: str):
    value = getattr(rollout, column)
    if column == "messages":
        return [_message_dict(m) for m in value]
    return value


def _message_dict(message) -> dict:
    if isinstance(message, dict):
        return message
    to_dict = getattr(message, "to_dict", None)
    return (
        to_dict()
        if callable(to_dict)
        else {"role": getattr(message, "role", None), "content": getattr(message, "content", None)}
    )


def final_answer_completions(answers: list[str | None], conversational: bool = True) -> list:
    """What TRL passes as ``completions`` to rewards: the final answer ("" when the conversation ended without
    one), so answer-matching rewards never see tool output or analysis. Conversational prompts get one
    assistant message per completion, plain-text prompts the text itself (TRL's two formats)."""
    texts = [answer or "" for answer in answers]
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
