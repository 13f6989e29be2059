"""vLLM worker extension that applies a GPT-OSS weight push to EVERY parameter (runs inside the vLLM worker).

Imported by vLLM (``--worker-extension-cls gptoss_vllm_worker.GptOssWeightSyncExtension``) in the server's own
interpreter, which has neither trl_gptoss nor our transformers: this file imports only torch, safetensors and
vLLM. Its methods are mixed into the worker class and called over ``/collective_rpc`` (dev mode), which
``gptoss_vllm_auth.SecretMiddleware`` opens only to holders of the run's secret.

Why not just ``model_runner.reload_weights``: vLLM's layerwise reload parks every layer's tensors on the meta
device and only re-materialises layers whose parameter ``weight_loader`` was called. GPT-OSS's ``load_weights``
writes the attention sinks and the expert tensors with a plain ``param.copy_`` (no ``weight_loader``), so during
a reload those writes land on meta tensors and are lost: the server keeps the OLD sinks and experts. And the
CPU MoE kernel re-packs w13/w2 into its grouped-GEMM layout only when the model is first loaded
(``_setup_kernel`` skips it on weight updates), so experts written in place must be re-packed here. So:
non-sink, non-expert tensors go through vLLM's layerwise reload (which re-runs each layer's weight processing,
e.g. the oneDNN packing of Linear weights) -- one session per push (``gptoss_start_reload``, a load per layer,
``gptoss_finish_reload``) -- then sinks and experts through ``load_weights`` into the live parameters, then
expert weights are re-packed with the kernel's own ISA. Measurements: docs/rollouts.md
("Weight sync").
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

try:  # the server's interpreter: this directory is on its path, trl_gptoss is not installed there
    from gptoss_vllm_routes import RouteCapture
except ImportError:  # imported as part of trl_gptoss (tests, the pushers' name rules)
    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_routes import RouteCapture

_LAYER_RE = re.compile(r"^(model\.layers\.\d+)\.")
PUSH_FILE_RE = re.compile(r"gptoss-push-[A-Za-z0-9_]+\.safetensors")  # tempfile.mkstemp(prefix=, suffix=) names


def loads_directly(name: str) -> bool:
    """Checkpoint tensors that ``reload_weights`` silently drops (see the module docstring)."""
    return name.endswith(".self_attn.sinks") or ".mlp.experts." in name


def _read_source(source: str) -> dict[str, torch.Tensor]:
    """The tensors of one push group: a pusher's shared-memory file (``{"path": ...}``, named
    ``PUSH_FILE_RE``: no other file on the host is read) or base64 safetensors bytes (``{"b64": ...}``)."""
    spec = json.loads(source)
    if "path" in spec:
        path = Path(spec["path"])
        if not PUSH_FILE_RE.fullmatch(path.name) or path.is_symlink():
            raise ValueError(f"gptoss_load_weights: {path.name!r} is not a push file (gptoss-push-*.safetensors)")
        return load_file(str(path))
    return load_safetensors_bytes(base64.b64decode(spec["b64"]))


def _checkpoint_dir(model: str) -> Path:
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


class GptOssWeightSyncExtension(RouteCapture):
    """Methods added to vLLM's worker; ``self`` is the worker (``self.model_runner``, ``self.vllm_config``).
    Route capture (R3) comes from ``gptoss_vllm_routes.RouteCapture``."""

    def gptoss_checkpoint_layout(self) -> dict:
        """``{checkpoint name: shape}`` of the served checkpoint (from the safetensors headers, no tensor read):
        what a push must contain, name for name and shape for shape."""
        layout = {}
        for file in sorted(_checkpoint_dir(self.vllm_config.model_config.model).glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    layout[name] = list(handle.get_slice(name).get_shape())
        transfer = getattr(self.vllm_config, "weight_transfer_config", None)
        return {
            "layout": layout,
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "weight_transfer_backend": getattr(transfer, "backend", None),
        }

    def gptoss_start_reload(self) -> None:
        """Open ONE layerwise reload session for a whole push: every layer's parameters go to meta until a
        ``gptoss_load_weights`` call brings that layer's (reload-route) tensors; ``gptoss_finish_reload`` puts
        back the kernel tensors of modules nothing was loaded into. Sinks and experts are not accepted while
        the session is open (they would land on meta): send them after it is finished."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_gptoss_reloading", False):
            raise RuntimeError(
                "gptoss_start_reload: a reload session is already open on this server: another push is in "
                "progress, or the same server is listed twice (under two URLs); list each server once"
            )
        self._gptoss_weights_changed()
        with _vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._gptoss_reloading = True

    def gptoss_finish_reload(self) -> dict:
        """Close the session ``gptoss_start_reload`` opened (runs each layer's weight processing that was
        deferred, e.g. attention's); drops the state derived from the old weights as ``reload_weights`` does."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not getattr(self, "_gptoss_reloading", False):
            raise RuntimeError("gptoss_finish_reload: no reload session is open (call gptoss_start_reload first)")
        started = time.perf_counter()
        try:
            with _vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        finally:
            self._gptoss_reloading = False
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(self.model_runner, reset, lambda: None)()
        return {"seconds": time.perf_counter() - started}

    def gptoss_load_weights(self, source: str) -> dict:
        """Apply one group of checkpoint-format tensors; ``source`` is JSON ``{"path": safetensors file}`` or
        ``{"b64": base64 safetensors bytes}``. Inside a ``gptoss_start_reload`` session the group's tensors are
        loaded into that session (sinks and experts refused); outside one, the group is reloaded on its own
        (one session for this group) and its sinks/experts are written directly. Returns the names applied by
        each route."""
        self._gptoss_weights_changed()
        started = time.perf_counter()
        tensors = _read_source(source)
        reload = [(n, t) for n, t in tensors.items() if not loads_directly(n)]
        direct = [(n, t) for n, t in tensors.items() if loads_directly(n)]
        session = getattr(self, "_gptoss_reloading", False)
        if session and direct:
            raise ValueError(
                f"gptoss_load_weights: {direct[0][0]!r} loads directly and a reload session is open (it would land "
                "on meta); send sinks and experts after gptoss_finish_reload"
            )
        read = time.perf_counter()
        if reload and session:
            with _vllm_config(self.vllm_config), torch.no_grad():
                self.model_runner.get_model().load_weights(iter(reload))
        elif reload:
            self.model_runner.reload_weights(weights_iterator=iter(reload), is_checkpoint_format=True)
        reloaded = time.perf_counter()
        repacked = self._gptoss_load_direct(direct) if direct else []
        seconds = {"read": read - started, "reload": reloaded - read, "direct": time.perf_counter() - reloaded}
        return {
            "reloaded": [n for n, _ in reload],
            "direct": [n for n, _ in direct],
            "repacked": repacked,
            "seconds": seconds,
        }

    def gptoss_receive_direct_nccl(self, update_info: str) -> dict:
        """GPU: receive sinks/expert tensors over the weight-transfer NCCL group (packed, as the trainer sends
        them) and load them into the live parameters. ``update_info``: JSON ``{names, dtype_names, shapes}``."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        self._gptoss_weights_changed()
        info = json.loads(update_info)
        engine = self.weight_transfer_engine
        received = []
        packed_nccl_broadcast_consumer(
            iterator=(
                (n, (s, getattr(torch, d))) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])
            ),
            group=engine.model_update_group,
            src=0,
            post_unpack_func=lambda items: received.extend((n, t.clone()) for n, t in items),  # buffers get reused
            buffer_size_bytes=engine.packed_buffer_size_bytes,
            num_buffers=engine.packed_num_buffers,
            device=self.device,
        )
        torch.accelerator.synchronize()
        repacked = self._gptoss_load_direct(received)
        return {"direct": [n for n, _ in received], "repacked": repacked}

    def _gptoss_load_direct(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        model = self.model_runner.get_model()
        names = {n for n, _ in named}
        with torch.no_grad():
            model.load_weights(named)
            _refresh_sink_copies(model, names, self.vllm_config.model_config.dtype)
            return _repack_experts(model, names)


def _vllm_config(config):
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


def _refresh_sink_copies(model: torch.nn.Module, names: set[str], dtype: torch.dtype) -> list[str]:
    """Attention backends that keep their own copy of the sinks (FlashInfer: a float32 one) refresh it in
    ``process_weights_after_loading``, which vLLM runs at load and at the end of a reload, i.e. BEFORE these
    direct sink writes: re-run it for the layers whose sinks were just written (a no-op on backends that
    read the parameter)."""
    refreshed = []
    for layer in sorted({m.group(1) for n in names if (m := _LAYER_RE.match(n)) and n.endswith(".self_attn.sinks")}):
        # vLLM names the attention block ``attn`` (checkpoint: ``self_attn``): find its backend by the ``impl``
        for module_name, module in model.get_submodule(layer).named_modules():
            impl = getattr(module, "impl", None)
            if impl is not None and hasattr(impl, "process_weights_after_loading"):
                impl.process_weights_after_loading(dtype)
                refreshed.append(f"{layer}.{module_name}")
    return refreshed


def _repack_experts(model: torch.nn.Module, names: set[str]) -> list[str]:
    """Re-pack freshly written expert weights into the CPU MoE kernel's layout (what vLLM does once at load:
    ``cpu_prepack_moe_weight(weight, isa)`` in ``CPUUnquantizedExperts.process_weights_after_loading``)."""
    repacked = []
    for layer in sorted({m.group(1) for n in names if (m := _LAYER_RE.match(n)) and ".mlp.experts." in n}):
        for module_name, module in model.get_submodule(f"{layer}.mlp").named_modules():
            if not hasattr(module, "w13_weight"):
                continue
            kernel = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
            isa = getattr(kernel, "isa", None)
            if isa is None or getattr(kernel, "_use_zentorch", False):
                continue  # not the CPU grouped-GEMM kernel: weights are used as loaded
            from vllm._custom_ops import cpu_prepack_moe_weight

            for suffix, attr in ((".gate_up_proj", "w13_weight"), (".down_proj", "w2_weight")):
                if f"{layer}.mlp.experts{suffix}" in names:
                    param = getattr(module, attr)
                    param.data.copy_(cpu_prepack_moe_weight(param.data, isa))
                    repacked.append(f"{layer}.mlp.{module_name}.{attr}")
    return repacked
