"""What a rehearsal launches in place of ``examples/retool_grpo.py``: ``accelerate launch [the recipe's launch
flags] tests/recipes/_rehearse.py --config RECIPE.yaml [overrides]`` runs ``examples/retool_grpo.main`` with the
same arguments, inside two test-only layers that change nothing the job computes:

- ``trl_gptoss.testing.fsdp_cpu.fsdp2_on_cpu``: on a host without an accelerator, accelerate 1.15 turns the
  launch's FSDP into ``MULTI_CPU`` and drops its FSDP plugin (mixed precision with it); the shim keeps both, so
  the model is prepared by accelerate's own FSDP2 code. It must be entered inside every launched process
  before the trainer creates its ``Accelerator``, and the job under test must not import test code: hence this
  script instead of a flag of the example. Without an FSDP plugin (the CPU demo) it does nothing.
- a probe, when ``$REHEARSAL_PROBE`` names a directory (``probe.json`` and ``*.safetensors`` there, written by
  rank 0): the accelerator's view (distributed type, mixed precision, FSDP2 policy); the dtypes of the trainable
  and frozen parameters and of what the optimizer holds; the dtypes the first decoder layer computes in during
  training (a forward hook); the full trainable parameters at train begin and end, and the full gradients and
  learning rate of every optimizer step (a step pre-hook), so the test can replay the update in fp32; every
  weight push of the trainer (server dtype, dtypes sent, the push's own numbers) and its order among the batches
  of rollouts it samples (``timeline``); with
  ``$REHEARSAL_CHECK_SYNC`` = N, ``check_sync`` of the pushed model right after the trainer's N-th push (every
  parameter group perturbed, pushed and seen to land; collective, as the push is).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _local_dtype(tensor: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    return str((tensor.to_local() if isinstance(tensor, DTensor) else tensor).dtype).removeprefix("torch.")


class Probe:
    """The callback and hooks described in the module docstring; every rank joins the gathers."""

    def __init__(self, out: Path):
        from transformers import TrainerCallback

        self.out, self.record = out, {"steps": [], "pushes": [], "timeline": [], "forward": None}
        self.lead = int(os.environ.get("RANK", "0")) == 0
        probe = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                probe.begin(probe.trainer)

            def on_train_end(self, args, state, control, **kwargs):
                probe.end(probe.trainer)

        self.callback = Callback()
        self.trainer = None

    def trainable(self, model) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def save(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.lead:
            from safetensors.torch import save_file

            save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(self.out / f"{name}.safetensors"))

    def begin(self, trainer) -> None:
        from trl_gptoss.rollout.weights.push import pushed_layout

        accelerator, model = trainer.accelerator, trainer.model
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        policy = getattr(plugin, "mixed_precision_policy", None)
        inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        trainable = self.trainable(model)
        self.record.update(
            distributed_type=str(accelerator.distributed_type),
            num_processes=accelerator.num_processes,
            mixed_precision=accelerator.mixed_precision,
            native_amp=bool(accelerator.native_amp),
            mp_policy=None
            if policy is None
            else {k: str(getattr(policy, k, None)).removeprefix("torch.") for k in ("param_dtype", "reduce_dtype")},
            trainable_dtypes=sorted({_local_dtype(p) for _, p in trainable}),
            frozen_dtypes=sorted({_local_dtype(p) for p in model.parameters() if not p.requires_grad}),
            optimizer=type(inner).__name__,
            optimizer_dtypes=sorted({_local_dtype(p) for g in inner.param_groups for p in g["params"]}),
            hyper={k: v for k, v in group.items() if isinstance(v, (int, float, bool, str, tuple, type(None)))},
            trainable_names=[n for n, _ in trainable],
            pushed_numel=sum(math.prod(shape) for shape in pushed_layout(model).values()),
        )
        self.save("initial", {n: _full(p) for n, p in trainable})
        inner.register_step_pre_hook(lambda optimizer, args, kwargs: self.before_step(trainer, optimizer))
        layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
        self._hook = layer.register_forward_hook(self.on_forward)

    def on_forward(self, module, inputs, output) -> None:
        if not module.training:  # check_sync's forwards (eval mode), not the loss pass
            return
        weight = getattr(module, "base_layer", module).weight
        self.record["forward"] = {
            "input": str(inputs[0].dtype).removeprefix("torch."),
            "weight": _local_dtype(weight),
            "output": str(output.dtype).removeprefix("torch."),
            "autocast": torch.is_autocast_enabled("cpu"),
            "autocast_dtype": str(torch.get_autocast_dtype("cpu")).removeprefix("torch."),
        }
        self._hook.remove()

    def before_step(self, trainer, optimizer) -> None:
        step = len(self.record["steps"]) + 1
        grads = {n: _full(p.grad) for n, p in self.trainable(trainer.model) if p.grad is not None}
        self.record["steps"].append({"lr": optimizer.param_groups[0]["lr"], "grads": sorted(grads)})
        self.save(f"grads-{step}", grads)

    def end(self, trainer) -> None:
        self.record["sp_runner"] = getattr(trainer.sp_loss, "runner", None) is not None
        self.save("final", {n: _full(p) for n, p in self.trainable(trainer.model)})
        if self.lead:
            (self.out / "probe.json").write_text(json.dumps(self.record, indent=1, default=str))

    def watch_pushes(self, check_sync_after: int | None) -> None:
        """Record every push the trainer makes (its engine's ``push_weights``, every rank; rank 0 sends, over the
        transport the job chose):
        the server's dtype, the dtypes sent and the push's own numbers; after its ``check_sync_after``-th push,
        run ``check_sync`` of the pushed model (collective, as the push is). The engine is observed the way a new
        engine kind is added: a row of ``ENGINE_KINDS`` whose build wraps the shipped one."""
        import dataclasses

        from trl_gptoss.rollout.weights import server_pusher
        from trl_gptoss.trainer.sampling import ENGINE_KINDS

        pusher, record, kind = server_pusher.ServerWeightPusher, self.record, ENGINE_KINDS["vllm_server"]
        send, finish = pusher.send, pusher.finish
        http: list[dict] = []  # every finished push to a server (check_sync's included)
        count = [0]  # the trainer's pushes, on every rank
        sent: set[str] = set()  # dtypes of the tensors the push in progress sent

        def recording_send(self, pass_name, group):
            sent.update(str(t.dtype).removeprefix("torch.") for _, t in group)
            return send(self, pass_name, group)

        def recording_finish(self):
            finish(self)
            dtypes = sorted(sent)
            sent.clear()
            http.append({"server_dtype": str(self.dtype).removeprefix("torch."), "sent": dtypes, **self.last_push})

        def observed_build(args, model, tokenizer):
            built = kind.build(args, model, tokenizer)
            engine, push = built.engine, built.engine.push_weights

            def recording_push(model) -> None:
                before = len(http)
                push(model)
                count[0] += 1
                if self.lead:
                    assert len(http) == before + 1, "a trainer push that did not end in one HTTP push"
                    record["pushes"].append(http[-1])
                    record["timeline"].append(f"push@{self.trainer.state.global_step}")
                if count[0] == check_sync_after:
                    record["sync"] = self.check_sync(engine, model)

            engine.push_weights = recording_push
            return built

        pusher.send, pusher.finish = recording_send, recording_finish
        ENGINE_KINDS["vllm_server"] = dataclasses.replace(kind, build=observed_build)

    def watch_generations(self) -> None:
        """Record, beside the pushes, every batch of rollouts the trainer samples (the ``Sampler``'s
        ``arun_rollouts``, called once the batch's weights are pushed)."""
        from trl_gptoss.trainer.sampling import sampler

        arun_rollouts, record = sampler.arun_rollouts, self.record

        def recording_arun_rollouts(*args, **kwargs):
            if self.lead:
                record["timeline"].append(f"sample@{self.trainer.state.global_step}")
            return arun_rollouts(*args, **kwargs)

        sampler.arun_rollouts = recording_arun_rollouts

    def check_sync(self, engine, model) -> dict:
        """``check_sync`` of the model just pushed against the trainer's servers. For a trainer that computes in
        bf16 against an fp32 server the absolute log-probs differ by ~0.1, so a group passes when the server
        reproduces the perturbation's effect (``moved`` within 1 +- 0.2; a stale group reads ~0). The trainer's
        bf16 noise shrinks ``moved`` of a group whose effect is small (sinks: 0.78 at scale 0.2), so the
        perturbation is 0.5 x RMS."""
        from trl_gptoss.rollout.weights.check_sync import check_sync, random_prompts

        engines = getattr(engine, "engines", [engine])
        vocab = model.config.vocab_size  # o200k's special tokens (Harmony's controls) are its ids >= 199998
        prompts = random_prompts(vocab, 3, 24, seed=1, exclude=range(199998, vocab))
        training = model.training
        model.eval()
        try:
            report = check_sync(engines, model, prompts, scale=0.5, tolerance=1e-2, moved_tolerance=0.2)
        finally:
            model.train(training)
        return report.to_dict()


def main(argv: list[str]) -> None:
    from trl_gptoss.testing.fsdp_cpu import fsdp2_on_cpu
    from trl_gptoss.trainer import GptOssGRPOTrainer

    spec = importlib.util.spec_from_file_location("retool_grpo", ROOT / "examples" / "retool_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    if os.environ.get("REHEARSAL_PROBE"):
        probe = Probe(Path(os.environ["REHEARSAL_PROBE"]))
        check = os.environ.get("REHEARSAL_CHECK_SYNC")
        probe.watch_pushes(check_sync_after=int(check) if check else None)
        probe.watch_generations()
        train = GptOssGRPOTrainer.train

        def probed_train(trainer, *args, **kwargs):
            probe.trainer = trainer
            trainer.add_callback(probe.callback)
            return train(trainer, *args, **kwargs)

        GptOssGRPOTrainer.train = probed_train
    with fsdp2_on_cpu():
        example.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
    from trl_gptoss.scripts.grpo import exit_launched_job

    exit_launched_job()  # as examples/retool_grpo.py's __main__ does
