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
import contextlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

try:  # the server's interpreter: this directory is on its path, trl_gptoss is not installed there
    from gptoss_vllm_routes import RouteCapture
    from gptoss_vllm_transfer import TransferError, WeightGroup
except ImportError:  # imported as part of trl_gptoss (tests, the pushers' name rules)
    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_routes import RouteCapture
    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_transfer import TransferError, WeightGroup

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
        return {
            "layout": layout,
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "device": self.device.type,
            "gpu": str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else None,
            "rank": _worker_rank(self),
        }

    def gptoss_start_reload(self) -> None:
        """Open ONE layerwise reload session for a whole push: every layer's parameters go to meta until a
        ``gptoss_load_weights`` call brings that layer's (reload-route) tensors; ``gptoss_finish_reload`` puts
        back the kernel tensors of modules nothing was loaded into. Sinks and experts are not accepted while
        the session is open (they would land on meta): send them after it is finished."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._gptoss_settle()
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

        self._gptoss_settle()
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
        ``{"b64": base64 safetensors bytes}`` (the file push). Returns what ``_gptoss_apply`` does."""
        self._gptoss_settle()
        started = time.perf_counter()
        tensors = list(_read_source(source).items())
        return self._gptoss_apply(tensors, time.perf_counter() - started)

    # -- the process-group transfer (gptoss_vllm_transfer) ---------------------------------------------------
    def gptoss_join_weight_group(self, spec: str) -> dict:
        """Join the trainer's weight group: ``spec`` is JSON ``{backend, host, port, token, group_id,
        rank_offset, world_size, timeout_s}``; this worker takes rank ``rank_offset + its rank in the server``.
        Blocks until every rank has joined (or the timeout). A group this worker held before is left first."""
        spec = json.loads(spec)
        self.gptoss_leave_weight_group()
        self._gptoss_settle()
        rank = int(spec["rank_offset"]) + _worker_rank(self)
        self._gptoss_group = WeightGroup(
            backend=spec["backend"],
            host=spec["host"],
            port=int(spec["port"]),
            token=spec["token"],
            rank=rank,
            world_size=int(spec["world_size"]),
            timeout_s=float(spec["timeout_s"]),
            device=self.device if spec["backend"] == "nccl" else torch.device("cpu"),
        )
        self._gptoss_group_id = spec["group_id"]
        return {"group_id": self._gptoss_group_id, "rank": rank}

    def gptoss_weight_group(self) -> str | None:
        """The id of the weight group this worker holds (``None``: none, e.g. after a restart)."""
        return getattr(self, "_gptoss_group_id", None)

    def gptoss_leave_weight_group(self) -> None:
        group = getattr(self, "_gptoss_group", None)
        self._gptoss_group, self._gptoss_group_id = None, None
        if group is not None:
            group.close()

    def gptoss_receive_weights(self, header: str) -> dict:
        """Receive one group of tensors over the weight group (``header``: JSON of ``layer_header`` plus
        ``group_id``), then apply it (as ``gptoss_load_weights`` does) on the worker's apply thread while the next
        group arrives. Answers ``{"applied": the previous group's answer, or None}``: the trainer checks each group
        one call later, the last with ``gptoss_weights_applied``. A failed receive leaves the group (the trainer
        joins again on its next push); a failed apply is raised by the next call."""
        started = time.perf_counter()
        header = json.loads(header)
        group = getattr(self, "_gptoss_group", None)
        if group is None or header.get("group_id") != self._gptoss_group_id:
            raise RuntimeError(
                f"gptoss_receive_weights: this worker holds weight group {self.gptoss_weight_group()!r}, not "
                f"{header.get('group_id')!r}; the trainer must join again (gptoss_join_weight_group)"
            )
        try:
            named = group.receive(header)
        except TransferError:
            self.gptoss_leave_weight_group()
            raise
        received = time.perf_counter() - started
        previous = self.gptoss_weights_applied()
        if not hasattr(self, "_gptoss_apply_thread"):
            self._gptoss_apply_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptoss-apply")
        self._gptoss_applying = self._gptoss_apply_thread.submit(self._gptoss_apply_here, named, received)
        return {"applied": previous}

    def gptoss_weights_applied(self) -> dict | None:
        """Wait for the group being applied and answer what ``_gptoss_apply`` did (``None``: nothing was being
        applied); raises the apply's error."""
        future, self._gptoss_applying = getattr(self, "_gptoss_applying", None), None
        return None if future is None else future.result()

    def _gptoss_settle(self) -> None:
        """Before anything else touches the weights: let a group still being applied finish. Its error, if any,
        belongs to the push that sent it and was aborted (that push never asked for its answer)."""
        with contextlib.suppress(Exception):
            self.gptoss_weights_applied()

    def _gptoss_apply_here(self, tensors, read_s: float) -> dict:
        """``_gptoss_apply`` on the apply thread, on this worker's device (a new thread starts on device 0)."""
        if self.device.type != "cuda":
            return self._gptoss_apply(tensors, read_s)
        with torch.cuda.device(self.device):
            return self._gptoss_apply(tensors, read_s)

    def _gptoss_apply(self, tensors: list[tuple[str, torch.Tensor]], read_s: float) -> dict:
        """Apply one group of checkpoint-format tensors. Inside a ``gptoss_start_reload`` session the group's
        tensors are loaded into that session (sinks and experts refused); outside one, the group is reloaded on
        its own (one session for this group) and its sinks/experts are written directly. Returns the names
        applied by each route and the time split (``read_s``: how long reading or receiving the group took)."""
        self._gptoss_weights_changed()
        reload = [(n, t) for n, t in tensors if not loads_directly(n)]
        direct = [(n, t) for n, t in tensors if loads_directly(n)]
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
        seconds = {"read": read_s, "reload": reloaded - read, "direct": time.perf_counter() - reloaded}
        return {
            "reloaded": [n for n, _ in reload],
            "direct": [n for n, _ in direct],
            "repacked": repacked,
            "seconds": seconds,
        }

    def _gptoss_load_direct(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        model = self.model_runner.get_model()
        names = {n for n, _ in named}
        with torch.no_grad():
            model.load_weights(named)
            _refresh_sink_copies(model, names, self.vllm_config.model_config.dtype)
            return _repack_experts(model, names)


def _worker_rank(worker) -> int:
    """This worker's rank among the server's workers (tensor/pipeline parallel), 0 for a single worker."""
    return int(getattr(worker, "rank", 0) or 0)


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
