"""The ``Sampler`` on its own, without a Trainer: its two rules and its job bookkeeping, with a recording engine.

``VersionEngine`` is an engine kind registered the way a new one would be (one module, one ``ENGINE_KINDS`` row):
each conversation calls the ``add`` tool, then answers with the weight version the engine held when that turn was
sampled. So a rollout whose two turns name different versions is a batch that straddled a push, and every
request and push is timed (a push is slowed, so a sample taken while weights change is caught overlapping it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from accelerate import PartialState

from tests.rollout.loop_helpers import AddTool
from tests.trainer.helpers import SYSTEM, grpo_args, user
from trl_gptoss.rollout.types import Generation
from trl_gptoss.testing.engines import harmony_ids
from trl_gptoss.trainer.sampling import ENGINE_KINDS, EngineKind, Sampler
from trl_gptoss.trainer.sampling.engines import BuiltEngine
from trl_gptoss.trainer.sampling.read_ahead import NextBatchPeek

CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 2}<|call|>'


class VersionEngine:
    """Answers every conversation with one tool call, then ``v<version>``; records requests and pushes."""

    def __init__(self, tokenizer, delay_s=0.02, push_delay_s=0.1, fail=None):
        self.tokenizer, self.delay_s, self.push_delay_s, self.fail = tokenizer, delay_s, push_delay_s, fail
        self.max_model_len = 1024
        self.version = None
        self.requests, self.pushes, self.released = [], [], 0

    async def generate(self, request):
        start, version = time.time(), self.version
        try:
            if self.fail is not None:
                raise self.fail
            await asyncio.sleep(self.delay_s)
            turn = CALL if "functions.add to=assistant" not in self.tokenizer.decode(request.prompt_ids) else None
            text = turn or f"<|channel|>final<|message|>v{version}<|return|>"
            tokens = harmony_ids(self.tokenizer, text)
            return Generation(tokens, [-0.5] * len(tokens), "stop")
        finally:
            self.requests.append((start, time.time(), version))

    def push_weights(self, model):
        start = time.time()
        time.sleep(self.push_delay_s)
        self.version = getattr(model, "version", len(self.pushes))  # a real model: the count of pushes
        self.pushes.append((start, time.time(), self.version))


@pytest.fixture
def version_kind(tokenizer, monkeypatch):
    """Registers the kind ``"versions"``; yields the engines built from it."""
    built = []

    def build(args, model, tokenizer_):
        engine = VersionEngine(tokenizer)
        built.append(engine)
        return BuiltEngine(engine, release=lambda: setattr(engine, "released", engine.released + 1))

    monkeypatch.setitem(ENGINE_KINDS, "versions", EngineKind(build=build, needs_server=False, may_overlap=True))
    return built


def _sampler(tmp_path, tokenizer, policy, max_staleness=1):
    args = grpo_args(tmp_path, rollout_backend="versions", max_staleness=max_staleness)
    return Sampler(
        args, lambda: policy, tokenizer, tools=[AddTool()], system=SYSTEM, world=PartialState(), record=lambda *a: None
    )


def _prompts(*texts):
    return [user(t) for t in texts]


def _answers(batch) -> set:
    return {r.final_answer for r in batch.rollouts}


def _clashes(engine) -> list:
    return [(q, p) for q in engine.requests for p in engine.pushes if q[0] < p[1] and p[0] < q[1]]


def test_a_registered_kind_is_accepted_by_the_config_and_built_and_released_by_the_sampler(
    version_kind, tokenizer, tmp_path
):
    sampler = _sampler(tmp_path, tokenizer, SimpleNamespace(version=0))
    assert sampler.engine is version_kind[0]
    sampler.close()
    sampler.close()  # idempotent: released once
    assert version_kind[0].released == 1
    with pytest.raises(ValueError, match="rollout_backend"):
        grpo_args(tmp_path, rollout_backend="not-a-kind")


def test_a_trainer_trains_with_a_registered_kind_one_version_behind(version_kind, tokenizer, tmp_path):
    from tests.trainer.helpers import answer_reward, logged, prompt_dataset
    from trl_gptoss.testing import tiny_gpt_oss
    from trl_gptoss.trainer import GptOssGRPOTrainer

    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0),
        answer_reward,
        args=grpo_args(tmp_path, rollout_backend="versions", max_staleness=1),
        train_dataset=prompt_dataset([1, 2, 1, 2], answer="v0"),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )
    trainer.train()
    engine = version_kind[0]
    assert logged(trainer, "rollout/staleness") == [0.0, 1.0]  # step 1 trained on the batch prefetched at step 0
    assert logged(trainer, "reward") == [1.0, 1.0]  # every answer names version 0: the one push, before step 0
    assert [p[2] for p in engine.pushes] == [0] and _clashes(engine) == []
    trainer.close()
    assert engine.released == 1


def test_push_before_sample_and_only_when_the_engine_holds_older_weights(version_kind, tokenizer, tmp_path):
    policy = SimpleNamespace(version=0)
    sampler = _sampler(tmp_path, tokenizer, policy, max_staleness=0)
    first = sampler.sample(_prompts("a", "b"), step=0)
    again = sampler.sample(_prompts("c"), step=0)  # same step: the engine already holds its weights
    policy.version = 1
    later = sampler.sample(_prompts("d"), step=1)
    engine = version_kind[0]
    assert [p[2] for p in engine.pushes] == [0, 1]
    assert (first.version, again.version, later.version) == (0, 0, 1)
    assert _answers(first) == _answers(again) == {"v0"} and _answers(later) == {"v1"}
    assert first.background_s is None and sampler.last is later
    sampler.close()


def test_a_prefetched_batch_is_one_version_behind_and_no_push_lands_while_it_samples(version_kind, tokenizer, tmp_path):
    policy = SimpleNamespace(version=0)
    sampler = _sampler(tmp_path, tokenizer, policy)
    versions = []
    for step in range(4):  # the trainer's order: sample this step's batch, prefetch the next, train
        policy.version = step
        batch = sampler.sample(_prompts(f"batch {step}", "x"), step)
        versions.append((step, batch.version, _answers(batch)))
        sampler.prefetch(_prompts(f"batch {step + 1}", "x"), step)
    assert versions == [(0, 0, {"v0"}), (1, 0, {"v0"}), (2, 1, {"v1"}), (3, 2, {"v2"})]
    engine = version_kind[0]
    assert [p[2] for p in engine.pushes] == [0, 1, 2, 3]  # one push per step, before its prefetch
    assert _clashes(engine) == [], "a request was in flight while weights were pushed"
    sampler.close()


def test_a_push_waits_for_the_running_job(version_kind, tokenizer, tmp_path):
    policy = SimpleNamespace(version=0)
    sampler = _sampler(tmp_path, tokenizer, policy)
    engine = version_kind[0]
    engine.delay_s = 0.3
    sampler.prefetch(_prompts("slow"), step=0)
    policy.version = 1
    sampler.push(1)  # an evaluation's push, say: must wait until the job sampled
    assert engine.pushes[-1][2] == 1 and engine.pushes[-1][0] >= max(q[1] for q in engine.requests)
    batch = sampler.sample(_prompts("slow"), step=1)
    assert batch.version == 0 and _answers(batch) == {"v0"}  # the job's own version, not the one pushed since
    sampler.close()


@pytest.mark.parametrize(
    "asked",
    [
        pytest.param(dict(prompts=("other",), step=1), id="other-prompts"),
        pytest.param(dict(prompts=("next",), step=2), id="other-step"),
    ],
)
def test_a_job_for_another_batch_is_cancelled_and_the_batch_sampled_now(version_kind, tokenizer, tmp_path, asked):
    policy = SimpleNamespace(version=0)
    sampler = _sampler(tmp_path, tokenizer, policy)
    version_kind[0].delay_s = 30  # would never finish
    sampler.prefetch(_prompts("next"), step=0)
    version_kind[0].delay_s = 0.0
    policy.version = asked["step"]
    started = time.perf_counter()
    batch = sampler.sample(_prompts(*asked["prompts"]), asked["step"])
    assert time.perf_counter() - started < 10  # the stale job was cancelled, not waited for
    assert batch.version == asked["step"] and batch.background_s is None and _answers(batch) == {f"v{asked['step']}"}
    sampler.close()


def test_an_evaluation_batch_never_takes_the_training_job(version_kind, tokenizer, tmp_path):
    sampler = _sampler(tmp_path, tokenizer, SimpleNamespace(version=0))
    sampler.prefetch(_prompts("next"), step=0)
    evaluated = sampler.sample(_prompts("next"), step=1, train=False)
    assert evaluated.background_s is None
    trained = sampler.sample(_prompts("next"), step=1)
    assert trained.background_s is not None and trained.version == 0
    sampler.close()


def test_an_error_of_the_background_generation_surfaces_at_sample_naming_the_weights(version_kind, tokenizer, tmp_path):
    sampler = _sampler(tmp_path, tokenizer, SimpleNamespace(version=7))
    version_kind[0].fail = ConnectionError("http://127.0.0.1:9/v1/completions refused the connection")
    sampler.prefetch(_prompts("p"), step=7)
    with pytest.raises(RuntimeError, match=r"weights of step 7.*ConnectionError.*127\.0\.0\.1:9"):
        sampler.sample(_prompts("p"), step=8)
    sampler.close()


def test_end_run_cancels_the_job_stops_the_thread_and_forgets_the_pushed_version(version_kind, tokenizer, tmp_path):
    sampler = _sampler(tmp_path, tokenizer, SimpleNamespace(version=0))
    version_kind[0].delay_s = 30
    sampler.prefetch(_prompts("p"), step=0)
    started = time.perf_counter()
    sampler.end_run()
    assert time.perf_counter() - started < 10
    assert sampler.version is None  # a resumed run pushes before its first rollout
    assert not [t for t in threading.enumerate() if t.name == "trl-gptoss-rollouts"]
    version_kind[0].delay_s = 0.0
    assert sampler.sample(_prompts("p"), step=3).version == 3  # usable again: a new run
    sampler.close()


def test_read_ahead_reads_the_next_generation_batch_and_hands_it_back(version_kind, tokenizer, tmp_path):
    sampler = _sampler(tmp_path, tokenizer, SimpleNamespace(version=0))
    rows = iter([[{"prompt": user(f"p{i}")}] for i in range(3)])

    def fetch(iterator, num_batches, device):
        return [next(iterator) for _ in range(num_batches)], None

    state = SimpleNamespace(global_step=0, max_steps=3)
    batches, _ = sampler.read_batches(fetch, rows, 1, None, micro_step=0, state=state)
    assert batches == [[{"prompt": user("p0")}]]
    sampler.start_read_ahead(0)  # prefetches p1 for step 1
    state.global_step = 1
    batches, _ = sampler.read_batches(fetch, rows, 1, None, micro_step=1, state=state)
    assert batches == [[{"prompt": user("p1")}]]  # the peeked item, handed back
    assert sampler.sample(_prompts("p1"), step=1).background_s is not None
    sampler.close()


def test_the_peek_hands_the_item_back_to_the_same_iterator_only():
    peek, items = NextBatchPeek(), iter(range(5))
    assert next(peek.read(items)) == 0 and peek.peek(items) == 1
    reader = peek.read(items)
    assert [next(reader), next(reader)] == [1, 2]  # the peeked item first, then the iterator
    assert peek.peek(items) == 3
    assert list(peek.read(iter(["next epoch"]))) == ["next epoch"]  # a new epoch's iterator drops the item
    exhausted = iter(())
    assert peek.peek(exhausted) is None and list(peek.read(exhausted)) == []


def test_routes_from_an_engine_whose_routers_are_not_the_policys_are_refused(tokenizer, tmp_path, monkeypatch):
    from trl_gptoss.rollout.routes import RouteShape
    from trl_gptoss.testing import tiny_gpt_oss

    engine = VersionEngine(tokenizer)
    engine.enable_routes = lambda: RouteShape(layers=3, top_k=2, num_experts=4)  # the policy has 2 layers
    released = []
    kind = EngineKind(
        build=lambda *a: BuiltEngine(engine, release=lambda: released.append(1)),
        needs_server=False,
        may_overlap=False,
        returns_routes=True,
    )
    monkeypatch.setitem(ENGINE_KINDS, "routed", kind)
    args = grpo_args(tmp_path, rollout_backend="routed", routing_replay="rollout")
    policy = tiny_gpt_oss(seed=0)
    with pytest.raises(ValueError, match=r"routers are RouteShape\(layers=3.*the policy's RouteShape\(layers=2"):
        Sampler(args, lambda: policy, tokenizer, tools=[], system=SYSTEM, world=PartialState(), record=print)
    assert released == [1]  # the server it would have started is not left behind
