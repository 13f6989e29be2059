"""trl-gptoss: agentic RL training of GPT-OSS on the Hugging Face stack.

Importing the package makes ``attn_implementation="fa3_sink"`` (attention and mask interfaces) and
``experts_implementation="gptoss_sequential"`` available to transformers without importing torch itself:
each is registered as soon as transformers' modules it plugs into are imported (at once if they already
are; see ``trl_gptoss/_registration.py``). So ``trl_gptoss.rewards``, ``.harmony``, ``.tools`` and ``.data``
stay torch-free.
"""

FA3_SINK = "fa3_sink"
SEQUENTIAL_EXPERTS = "gptoss_sequential"

__version__ = "0.1.0"

from trl_gptoss._registration import register_when_transformers_loads  # noqa: E402  (needs the names above)

register_when_transformers_loads()

__all__ = ["FA3_SINK", "SEQUENTIAL_EXPERTS", "__version__"]
