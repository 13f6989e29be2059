"""Replays recorded HTTP requests through the installed vLLM's own routers (run by the vLLM interpreter).

stdin: a JSON list of ``{method, path, query, body}``. stdout (last line): a JSON list of ``{path, status, text,
parsed}``, ``parsed`` naming the typed info vLLM's worker would build from the body (its own dataclasses, as
``WeightTransferEngine.parse_init_info`` / ``parse_update_info`` do). Imports nothing from trl_gptoss.
"""

import json
import sys
import types

from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.entrypoints.rl.online.api_router import router as rl_router
from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router
from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc_router


class EngineClient:
    """What the routes call on ``app.state.engine_client``; builds the typed infos a worker would."""

    vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size_across_dp=1, world_size=1))

    def __init__(self):
        self.parsed = None

    async def pause_generation(self, mode, clear_cache):
        pass

    async def resume_generation(self):
        pass

    async def init_weight_transfer_engine(self, request):
        self.parsed = repr(NCCLWeightTransferInitInfo(**request.init_info))

    async def start_weight_update(self):
        pass

    async def update_weights(self, request):
        self.parsed = repr(NCCLWeightTransferUpdateInfo(**request.update_info))

    async def finish_weight_update(self, weight_version=None):
        self.parsed = f"finish(weight_version={weight_version!r})"

    async def shutdown_weight_transfer_engine(self):
        pass

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [{"method": method}]

    async def reset_prefix_cache(self, reset_running_requests=False, reset_external=False):
        return True


def main() -> None:
    app = FastAPI()
    for router in (rl_router, rpc_router, cache_router):
        app.include_router(router)
    app.state.engine_client = engine = EngineClient()
    answers = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for request in json.load(sys.stdin):
            if request["path"] == "/v1/models":
                continue  # the OpenAI app's route, not part of the weight-update API
            engine.parsed = None
            kwargs = {"params": request["query"]}
            if request["body"] is not None:
                kwargs["json"] = request["body"]
            response = client.request(request["method"], request["path"], **kwargs)
            answers.append(
                {
                    "path": request["path"],
                    "status": response.status_code,
                    "text": response.text[:500],
                    "parsed": engine.parsed,
                }
            )
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
