"""Lucebox core: hook specs, plugin registry, GGUF I/O, tokenizer, chat templates, engine, server.

Plugins import what they need from here:

    from lucebox_core import hookimpl, ModelFamily

    @hookimpl
    def lucebox_model_families():
        return [ModelFamily(name="mine", architectures=["mine"], loader="my_pkg.model:load")]

A hook that only lists specs can be written `lucebox_model_families = provides(ModelFamily(...))`.
"""

from typing import Any, Callable

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("lucebox")


def provides(*specs: Any) -> Callable[[], list[Any]]:
    """A hook implementation that returns `specs`: most hooks only list what a plugin provides, and this
    spares each of them the decorator, the function and the list around its specs."""

    def hook() -> list[Any]:
        return list(specs)

    return hookimpl(hook)


from .errors import GGUFError, LuceboxError, PluginError, TemplateError  # noqa: E402
from .specs import (  # noqa: E402
    Converter,
    DefaultModel,
    Drafter,
    KernelBackend,
    KVPolicy,
    ModelFamily,
    OpKernel,
    PrefillCompressor,
    ResponseParser,
    Synthesizer,
    Verifier,
)

__all__ = [
    "__version__",
    "hookimpl",
    "provides",
    "LuceboxError",
    "GGUFError",
    "PluginError",
    "TemplateError",
    "ModelFamily",
    "OpKernel",
    "PrefillCompressor",
    "ResponseParser",
    "KernelBackend",
    "KVPolicy",
    "Drafter",
    "Verifier",
    "Synthesizer",
    "Converter",
    "DefaultModel",
]
