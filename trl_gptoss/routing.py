"""Deprecated alias of ``trl_gptoss.experts.routing`` (removed in the next release)."""

import warnings

from trl_gptoss.experts.routing import (  # noqa: F401
    FORMAT_VERSION,
    RoutingRecord,
    compact_index_dtype,
    record_routing,
    replay_routing,
)

warnings.warn(
    "trl_gptoss.routing moved to trl_gptoss.experts.routing; the old import path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
