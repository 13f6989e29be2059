"""trl-gptoss: agentic RL training of GPT-OSS on the Hugging Face stack.

Importing the package registers ``attn_implementation="fa3_sink"`` (attention and mask interfaces) and
``experts_implementation="gptoss_sequential"`` with transformers.
"""

FA3_SINK = "fa3_sink"

__version__ = "0.1.0"

from trl_gptoss.attention import register_fa3_sink  # noqa: E402  (FA3_SINK must exist first)
from trl_gptoss.experts import SEQUENTIAL_EXPERTS  # noqa: E402  (importing registers it)

register_fa3_sink(FA3_SINK)

__all__ = ["FA3_SINK", "SEQUENTIAL_EXPERTS", "__version__"]
