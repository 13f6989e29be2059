"""Pushers that drop part of the model on purpose: what a stale-weights bug looks like to ``check_sync``."""


class SkipSinks:
    """A pusher that never sends the attention sinks: the stale-sinks bug of stock vLLM layerwise reloads."""

    def __init__(self, inner):
        self.inner = inner

    def send(self, pass_name, group):
        self.inner.send(pass_name, [(n, t) for n, t in group if not n.endswith("self_attn.sinks")])

    def __getattr__(self, name):
        return getattr(self.inner, name)
