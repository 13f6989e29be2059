"""The file push: each group of tensors is one safetensors file in shared memory, sent over ``/collective_rpc``.

The transport of ``ServerWeightPusher`` (``server_pusher``) kept beside the process-group one (``group_push``, the
default): the file lives in ``/dev/shm`` when the server is on this host, else its bytes travel base64 in the
request body. Each group is one ``gptoss_load_weights`` call of the worker extension, answered when every worker
has applied it.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from urllib.parse import urlparse

import torch
from safetensors.torch import save, save_file

from trl_gptoss.rollout.weights.server_calls import collective_rpc
from trl_gptoss.rollout.weights.server_pusher import ServerWeightPusher

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class HTTPWeightPusher(ServerWeightPusher):
    """The file push (see the module docstring and ``ServerWeightPusher``)."""

    transport = "file"

    def __init__(self, engine, info: dict):
        super().__init__(engine, info)
        local = urlparse(engine.base_url).hostname in _LOCAL_HOSTS
        self.shared_dir = ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) if local else None

    def _deliver(self, tensors: list[tuple[str, torch.Tensor]]):
        tensors = dict(tensors)
        if self.shared_dir is None:
            source = {"b64": base64.b64encode(save(tensors)).decode()}
            results = collective_rpc(self.engine, "gptoss_load_weights", json.dumps(source))
        else:
            fd, path = tempfile.mkstemp(prefix="gptoss-push-", suffix=".safetensors", dir=self.shared_dir)
            os.close(fd)
            try:
                save_file(tensors, path)
                results = collective_rpc(self.engine, "gptoss_load_weights", json.dumps({"path": path}))
            finally:
                os.unlink(path)
        return lambda: results
