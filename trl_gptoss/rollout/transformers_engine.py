"""In-process rollout engine: concurrent ``generate`` calls become one left-padded, KV-cached batched decode.

Each request keeps its own sampling parameters and its own random stream (a per-row ``torch.Generator``
seeded from ``request.seed``), so a seeded request samples the same tokens alone or in any batch. Tokens are
drawn from ``processed_logprobs`` (temperature, top-k, top-p) and the log-prob of each drawn token under
that same distribution is returned: what the trainer recomputes.

A model whose parameters are FSDP2 shards (``DTensor``) is never decoded directly: every forward of a sharded
model all-gathers each layer, and ranks decode different numbers of steps (each conversation stops when it
stops, tool turns differ), so their collectives would pair up out of order -- a hang on NCCL, a size-mismatch
abort on gloo. The engine instead samples from an unsharded replica that ``push_weights`` fills (a collective
every rank joins at the same point), and decoding does no collectives at all.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from dataclasses import dataclass, field

import torch

from trl_gptoss.rollout.sampling import processed_logprobs, sample_from_logprobs
from trl_gptoss.rollout.types import Generation, GenerationRequest
from trl_gptoss.rollout.weights.in_process import copy_weights_into
from trl_gptoss.rollout.weights.names import unwrap


@dataclass
class _Row:
    """Decode state of one request inside a batch."""

    request: GenerationRequest
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def append(self, token: int, logprob: float) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.request.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.max_new_tokens:
            self.finish_reason = "length"


class TransformersEngine:
    """Sample from a transformers causal LM in this process.

    ``max_batch_size``: at most this many pending requests share one batched decode; requests that arrive
    while a batch runs wait for the next one. ``max_model_len``: prompt + completion limit (default the
    model's ``max_position_embeddings``). ``tokenizer`` supplies the pad id (padded positions are masked).
    """

    def __init__(self, model, tokenizer=None, max_batch_size: int = 8, max_model_len: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self._stream = torch.Generator().manual_seed(int(torch.randint(2**62, ())))  # for seed=None requests
        self._model_lock = threading.Lock()  # one decode or weight copy at a time
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    # -- public interface -------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Generation:
        self._check(request)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((request, future))
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._worker = loop.create_task(self._drain())
        return await future

    def push_weights(self, model) -> None:
        """Make this engine sample from ``model``: nothing to do when it is the engine's own unsharded model.
        When ``model`` is FSDP2-sharded the engine decodes a replica built on the first push; the copy gathers
        the shards, so under FSDP2 every rank calls this at the same point of its program."""
        if unwrap(model) is unwrap(self.model):  # also through DDP/accelerate wrappers
            if not is_sharded(model):
                return
            with self._model_lock:
                self.model = unsharded_replica(model)
        with self._model_lock:
            copy_weights_into(self.model, model)

    # -- batching ---------------------------------------------------------------------------------------
    def _check(self, request: GenerationRequest) -> None:
        request.check_fits(self.max_model_len)
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {self.vocab_size})")

    async def _drain(self) -> None:
        """Run pending requests batch by batch until none is left; the model runs in a worker thread."""
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
            batch = [(req, fut) for req, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self.generate_batch, [req for req, _ in batch])
            except Exception as exc:  # every waiter of the failed batch gets the error, none hangs
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    def _row(self, request: GenerationRequest) -> _Row:
        seed = request.seed if request.seed is not None else int(torch.randint(2**62, (), generator=self._stream))
        return _Row(request, torch.Generator().manual_seed(seed))

    def generate_batch(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Synchronous batched decode of ``requests`` (what concurrent ``generate`` calls end up in)."""
        for request in requests:
            self._check(request)
        rows = [self._row(r) for r in requests]
        with self._model_lock, torch.no_grad(), _eval_mode(self.model):
            self._decode(rows)
        return [Generation(row.token_ids, row.logprobs, row.finish_reason) for row in rows]

    def _decode(self, rows: list[_Row]) -> None:
        device = self.model.device
        input_ids, attention_mask = _left_pad([r.request.prompt_ids for r in rows], self.pad_token_id, device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        temperature = torch.tensor([r.request.temperature for r in rows], device=device)
        top_k = torch.tensor([r.request.top_k for r in rows], device=device)
        top_p = torch.tensor([r.request.top_p for r in rows], device=device)
        cache = None
        while any(r.finish_reason is None for r in rows):
            # `past_key_values`, not 5.24's `cache`: 5.23 silently drops `cache=`; 5.24 maps the old name (and
            # `out.past_key_values`) to `cache` with a FutureWarning until 5.40
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logprobs = processed_logprobs(out.logits[:, -1, :], temperature, top_k, top_p)
            # one uniform per row per step, from the row's own stream, drawn even for finished rows' slots
            uniforms = torch.stack([1.0 - torch.rand((), generator=r.generator, dtype=torch.float64) for r in rows])
            tokens = sample_from_logprobs(logprobs, uniforms.to(device))
            chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
            for row, token, logprob in zip(rows, tokens.tolist(), chosen.tolist()):
                if row.finish_reason is None:
                    row.append(token, logprob)
            input_ids = tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1


def is_sharded(model) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2 shard): its forward is collective."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in unwrap(model).parameters())


def unsharded_replica(model) -> torch.nn.Module:
    """A plain model of ``model``'s architecture (its PEFT base model's, adapters are merged by the push) on
    the device and dtype of its local shards, in eval mode; the weights are filled by ``copy_weights_into``."""
    from transformers import AutoModelForCausalLM

    base = unwrap(model, peft=True)
    local = next(getattr(p, "to_local", lambda p=p: p)() for p in base.parameters())
    config = copy.deepcopy(base.config)
    kwargs = {"attn_implementation": config._attn_implementation}
    experts = getattr(config, "_experts_implementation", None)
    if experts is not None:
        kwargs["experts_implementation"] = experts
    with torch.device(local.device):
        replica = AutoModelForCausalLM.from_config(config, dtype=local.dtype, **kwargs)
    return replica.eval().requires_grad_(False)


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T_max]`` ids with each prompt right-aligned, and the matching 0/1 attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


class _eval_mode:
    """Decode in eval mode (no dropout, KV cache allowed under gradient checkpointing); restore afterwards."""

    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)
