"""The warm-start renders its demonstrations through a memoising codec: same ids, far fewer backend calls."""

import random
import time

from trl_gptoss.data.arithmetic import make_problems
from trl_gptoss.data.formats import retool_row
from trl_gptoss.demo.demonstrations import MemoisedCodec, completion_messages, tokenize_demonstration
from trl_gptoss.harmony import harmony_tokenizer, render_conversation


class CountingCodec(MemoisedCodec):
    """Counts the texts that reach the backend (a miss of the memo)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.misses = 0

    def encode_text(self, text):
        self.misses += text not in self._encoded
        return super().encode_text(text)


def _demonstrations(tokenizer, count=24, seed=5):
    rng = random.Random(seed)
    out = []
    for i, problem in enumerate(make_problems(count, seed=seed)):
        prompt = retool_row(problem.question, str(problem.answer))["prompt"]
        kind = "tool" if i % 2 else "guess"
        out.append(tokenize_demonstration(prompt, completion_messages(problem, kind, rng), tokenizer, kind=kind))
    return out


def test_memoised_codec_renders_the_same_demonstrations_with_fewer_backend_calls():
    tokenizer = harmony_tokenizer()
    codec = CountingCodec(tokenizer)
    start = time.perf_counter()
    plain = _demonstrations(tokenizer)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    memoised = _demonstrations(codec)
    memo_s = time.perf_counter() - start
    assert memoised == plain  # input_ids, loss_mask and kind, token for token
    # 24 demonstrations render ~8 prefixes each (~1,500 encode calls); only distinct texts reach the backend
    assert codec.misses < 24 * 10
    assert memo_s < plain_s  # the backend calls were the cost
    conversation = [{"role": "user", "content": "What is 2 <|end|> 3?"}]  # special-token text stays text
    assert render_conversation(conversation, codec) == render_conversation(conversation, tokenizer)
