"""Weights: the trainer's parameters into the rollout engines, and the proof that they landed.

``push_tensors(model)`` (``push``), on every rank, yields ``(checkpoint_name, full_tensor)`` one decoder layer at
a time on the pushing rank (FSDP2 gathered, PEFT merged into the copy), named and grouped by ``names``;
``push_model`` (``sync``) feeds the pushers of vLLM servers (``server_pusher``: the process-group transport
``group_push``, gloo on CPUs and NCCL between GPUs, or the shared-memory file push ``http_push``),
``copy_weights_into`` (``in_process``) the in-process engine; ``check_sync.check_sync`` proves every parameter
group landed.
"""

from trl_gptoss.rollout.weights.push import push_tensors
from trl_gptoss.rollout.weights.sync import push_model

__all__ = ["push_model", "push_tensors"]
