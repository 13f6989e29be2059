"""The model card TRL writes, made true for a GPT-OSS run: its name, its base checkpoint, a quick start that
works (a Harmony chat through ``fa3_sink``), and the training curves."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

CITATION = textwrap.dedent("""\
    @article{shao2024deepseekmath,
        title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
        author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and others},
        year    = 2024,
        eprint  = {arXiv:2402.03300},
    }
    @article{feng2025retool,
        title   = {{ReTool: Reinforcement Learning for Strategic Tool Use in LLMs}},
        author  = {Jiazhan Feng and Shijue Huang and Xingwei Qu and Ge Zhang and Yujia Qin and others},
        year    = 2025,
        eprint  = {arXiv:2504.11536},
    }
    @article{xiao2024attentionsinks,
        title   = {{Efficient Streaming Language Models with Attention Sinks}},
        author  = {Guangxuan Xiao and Yuandong Tian and Beidi Chen and Song Han and Mike Lewis},
        year    = 2024,
        eprint  = {arXiv:2309.17453},
    }""")

# TRL's model card cites the trainer's ``_paper``: GRPO's, with ReTool and attention sinks beside it.
PAPER = {
    "title": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    "id": "2402.03300",
    "citation": CITATION,
}

QUICK_START = """```python
import trl_gptoss  # registers the fa3_sink attention (exact attention sinks)
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = "{model_id}"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation="fa3_sink")
messages = [{{"role": "user", "content": "What is 17 * 23?"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=128)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :]))
```"""


def card_model_name(args) -> str:
    """``hub_model_id`` when set, else the output directory's name."""
    return args.hub_model_id or Path(args.output_dir).resolve().name


def base_model_phrase(base: str | None) -> str:
    """The start of the card's first sentence (TRL's continues with the dataset, if any)."""
    if not base:
        return "This model was trained from a checkpoint without a recorded name"
    if Path(base).is_dir():
        return f"This model is a fine-tuned version of the local checkpoint `{base}`"
    return f"This model is a fine-tuned version of [{base}](https://huggingface.co/{base})"


def rewrite_card(readme: Path, *, model_id: str, base: str | None, plots: list[Path]) -> None:
    """Replace TRL's base-model line and quick start; append the training curves."""
    text = readme.read_text()
    text = re.sub(
        r"^This model is a fine-tuned version of \[[^\]]*\]\([^)]*\)",
        lambda _: base_model_phrase(base),
        text,
        count=1,
        flags=re.M,
    )
    text = re.sub(
        r"(## Quick start\n\n)```python\n.*?```",
        lambda m: m.group(1) + QUICK_START.format(model_id=model_id),
        text,
        count=1,
        flags=re.S,
    )
    if plots:
        text += "\n".join(["", "## Training curves", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots]) + "\n"
    readme.write_text(text)
