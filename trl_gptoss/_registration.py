"""Register ``fa3_sink`` and ``gptoss_sequential`` with transformers without importing torch or transformers.

``import trl_gptoss`` must stay light (reward workers, the sandbox launcher and data tools never load torch),
yet a user who imports ``trl_gptoss`` and then transformers must find both names registered. So each
registration waits for the transformers module it plugs into:

- attention (``AttentionInterface``, ``AttentionMaskInterface``): ``transformers.modeling_utils``;
- experts (``ExpertsInterface``; subclasses ``GptOssExperts``): transformers' GPT-OSS modeling module.

If that module is already imported, the registration runs inside ``import trl_gptoss``. Otherwise a
``sys.meta_path`` finder wraps the loader of every ``transformers.*`` and ``trl_gptoss.*`` module imported
later and runs the registration once the outermost of them has finished executing: registering imports
``trl_gptoss.attention`` / ``trl_gptoss.experts``, which import transformers modules of their own, and none
of those may be half-imported at that moment.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings

# Plain classes below, no dataclasses/importlib.abc: those two imports alone would double this module's cost.
_WATCHED_ROOTS = ("transformers", "trl_gptoss")


class _Task:
    """Once ``trigger`` (a transformers module) is imported, ``register(import_module(package))``."""

    __slots__ = ("trigger", "package", "register")

    def __init__(self, trigger: str, package: str, register):
        self.trigger, self.package, self.register = trigger, package, register


_pending: list[_Task] = []
_executing = threading.local()  # .depth: watched modules this thread is executing right now


def _depth() -> int:
    return getattr(_executing, "depth", 0)


def _run_ready_tasks() -> None:
    """Register every pending task whose trigger is imported, unless a watched import is still under way."""
    if _depth():
        return
    for task in list(_pending):
        if task not in _pending or task.trigger not in sys.modules:
            continue
        _pending.remove(task)
        try:
            task.register(importlib.import_module(task.package))
        except Exception as error:  # never break the user's transformers import; say what is missing instead
            warnings.warn(
                f"trl_gptoss could not register {task.package} with transformers: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )
    if not _pending and _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)


class _NotifyingLoader:
    """Runs the real loader (counting nested watched imports), puts it back on the module, then registers."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: whatever the real loader offers
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        _executing.depth = _depth() + 1
        try:
            self._loader.exec_module(module)
        finally:
            _executing.depth -= 1
        module.__loader__ = module.__spec__.loader = self._loader
        _run_ready_tasks()


class _Watcher:
    """Finds nothing itself: asks the finders after it and wraps the loader of a watched module."""

    def find_spec(self, fullname, path, target=None):
        if not _pending or fullname.partition(".")[0] not in _WATCHED_ROOTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader)
                return spec
        return None


_WATCHER = _Watcher()


def _register_attention(package) -> None:
    from trl_gptoss import FA3_SINK

    package.register_fa3_sink(FA3_SINK)


def _register_experts(package) -> None:
    from trl_gptoss import SEQUENTIAL_EXPERTS

    package.register_sequential_experts(SEQUENTIAL_EXPERTS)


def register_when_transformers_loads() -> None:
    """Register now what can be registered, watch imports for the rest. Called once, by ``import trl_gptoss``."""
    _pending[:] = [
        _Task("transformers.modeling_utils", "trl_gptoss.attention", _register_attention),
        _Task("transformers.models.gpt_oss.modeling_gpt_oss", "trl_gptoss.experts", _register_experts),
    ]
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)
    _run_ready_tasks()
