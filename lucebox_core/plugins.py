"""Discovery and bookkeeping of plugins.

Built-in modules register first (they always load); then every entry point of group `lucebox`, or only
those named in `LUCEBOX_PLUGINS=a,b`. A plugin that fails to import is recorded with its error and
skipped: one broken package must not take the server down. `LUCEBOX_TRACE_HOOKS=1` prints every hook
call to stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from importlib import metadata
from typing import Any, Iterable, Iterator

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError
from .specs import ALL_KINDS, KernelBackend

ENTRY_POINT_GROUP = "lucebox"
BUILTIN_MODULES = ("lucebox_core.builtin",)

# Where to send a user whose file no installed plugin handles, by the start of a GGUF architecture, an HF
# `model_type` or a backend name. Only a hint: the core never imports these.
INSTALL_HINTS = {
    "qwen3": "lucebox-qwen",
    "gemma": "lucebox-gemma4",
    "laguna": "lucebox-laguna",
    "cuda": "lucebox-cuda",
    "hip": "lucebox-hip",
}


def install_hint(name: str, loaded: Iterable[str] = ()) -> str:
    """Where to look for what handles `name`. `loaded`: the distributions whose plugins are loaded (one of
    those not handling `name` is no reason to suggest it again)."""
    name = str(name).lower()
    package = next((p for prefix, p in INSTALL_HINTS.items() if name.startswith(prefix)), None)
    if package is not None and not _installed(package):
        return f"; install {package} (pip install {package})"
    if package is not None and package not in set(loaded):
        return f"; {package} is installed but not loaded (left out by LUCEBOX_PLUGINS?)"
    return "; is a plugin for it installed? (`lucebox plugins` lists what is)"


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


@attrs.define
class PluginInfo:
    name: str  # the entry-point name (what LUCEBOX_PLUGINS names), or "builtin"
    distribution: str
    version: str
    module: str
    builtin: bool = False
    error: str | None = None  # why it failed to load, if it did
    specs: list[Any] = attrs.Factory(list)


@attrs.define
class Registry:
    """Everything that is installed and loaded, and what each plugin provides."""

    manager: pluggy.PluginManager
    plugins: list[PluginInfo]

    @property
    def loaded_distributions(self) -> set[str]:
        """The distributions whose plugins loaded."""
        return {info.distribution for info in self.plugins if info.error is None}

    def provided(self, hook: str) -> Iterator[tuple[Any, PluginInfo]]:
        """Each spec returned by `hook`, with the plugin that returned it (built-ins first)."""
        for info in self.plugins:
            for spec in info.specs:
                if isinstance(spec, ALL_KINDS[hook]):
                    yield spec, info

    def _specs(self, hook: str) -> list[Any]:
        return [spec for spec, _ in self.provided(hook)]

    def model_families(self) -> list[Any]:
        return self._specs("lucebox_model_families")

    def kernel_backends(self) -> list[Any]:
        return self._specs("lucebox_kernel_backends")

    def kv_policies(self) -> list[Any]:
        return self._specs("lucebox_kv_policies")

    def drafters(self) -> list[Any]:
        return self._specs("lucebox_drafters")

    def verifiers(self) -> list[Any]:
        return self._specs("lucebox_verifiers")

    def synthesizers(self) -> list[Any]:
        return self._specs("lucebox_synthesizers")

    def converters(self) -> list[Any]:
        return self._specs("lucebox_converters")

    def default_models(self) -> list[Any]:
        return self._specs("lucebox_default_models")

    def response_parsers(self) -> list[Any]:
        return self._specs("lucebox_response_parsers")

    def op_kernels(self) -> list[Any]:
        return self._specs("lucebox_op_kernels")

    def family_for(self, architecture: str | None, path: Any = None) -> Any:
        """The model family that loads GGUF architecture `architecture`, or a PluginError saying what to install."""
        return self._by_architecture(self.model_families(), architecture, path, "plugin handles", "handled")

    def drafter_for(self, architecture: str | None, path: Any = None) -> Any:
        """The drafter that loads draft-GGUF architecture `architecture`, or a PluginError saying what is
        handled (the draft file chooses its drafter as a model file chooses its family)."""
        return self._by_architecture(self.drafters(), architecture, path, "drafter loads", "drafters load")

    def _by_architecture(self, specs: list[Any], architecture: str | None, path: Any, verb: str, known_as: str) -> Any:
        for spec in specs:
            if architecture in spec.architectures:
                return spec
        where = f"{path}: " if path is not None else ""
        known = ", ".join(sorted({a for spec in specs for a in spec.architectures})) or "none"
        raise PluginError(f"{where}no installed {verb} architecture {architecture!r} ({known_as}: {known})"
                          f"{install_hint(str(architecture), self.loaded_distributions)}")

    def verifier(self, name: str) -> Any:
        """The verifier `--spec-type NAME` names."""
        return self.named("lucebox_verifiers", name, "verifier (--spec-type)")

    def prefill_compressor(self, name: str) -> Any:
        """The prefill compressor `--prefill-compressor NAME` names."""
        return self.named("lucebox_prefill_compressors", name, "prefill compressor (--prefill-compressor)")

    def kv_policy(self, name: str) -> Any:
        """The KV policy `--kv-policy NAME` names."""
        return self.named("lucebox_kv_policies", name, "KV policy (--kv-policy)")

    def named(self, hook: str, name: str, what: str) -> Any:
        for spec in self._specs(hook):
            if spec.name == name:
                return spec
        names = ", ".join(sorted(spec.name for spec in self._specs(hook))) or "none"
        raise PluginError(f"no installed plugin provides the {what} {name!r} (available: {names})"
                          f"{install_hint(name, self.loaded_distributions)}")

    def kernel_backend(self, name: str | None = None) -> KernelBackend:
        """The named backend, or the available one with the highest priority."""
        if name is not None:
            backend = self.named("lucebox_kernel_backends", name, "kernel backend")
            ok, reason = backend.is_available()
            if not ok:
                raise PluginError(f"kernel backend {name!r} is not available here: {reason}")
            return backend
        candidates = [b for b in self.kernel_backends() if b.is_available()[0]]
        if not candidates:
            raise PluginError("no kernel backend is available")
        return max(candidates, key=lambda b: b.priority)


def _distribution_of(entry_point: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"], dist.version


def _collect_specs(manager: pluggy.PluginManager, plugin: Any, info: PluginInfo) -> None:
    for hook_name, kind in ALL_KINDS.items():
        function = getattr(plugin, hook_name, None)
        if function is None or manager.parse_hookimpl_opts(plugin, hook_name) is None:
            continue
        try:
            returned = function() or []
        except Exception as exc:
            info.error = f"{hook_name} raised {type(exc).__name__}: {exc}"
            continue
        for spec in returned:
            if not isinstance(spec, kind):
                info.error = f"{hook_name} returned {type(spec).__name__}, expected {kind.__name__}"
                continue
            info.specs.append(spec)


def discover(allowed: str | None = None) -> Registry:
    """Load built-ins and the `lucebox` entry points (limited to `allowed`, comma separated, if given)."""
    import importlib

    manager = pluggy.PluginManager("lucebox")
    manager.add_hookspecs(hookspecs)
    if os.environ.get("LUCEBOX_TRACE_HOOKS"):
        manager.trace.root.setwriter(lambda message: sys.stderr.write(message))
        manager.enable_tracing()

    from . import __version__

    plugins: list[PluginInfo] = []
    for module_name in BUILTIN_MODULES:
        module = importlib.import_module(module_name)
        info = PluginInfo("builtin", "lucebox-core", __version__, module_name, builtin=True)
        manager.register(module, name=module_name)
        _collect_specs(manager, module, info)
        plugins.append(info)

    if allowed is None:
        allowed = os.environ.get("LUCEBOX_PLUGINS")
    wanted = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}

    seen: set[str] = set()
    for entry_point in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        if entry_point.name in seen or (wanted is not None and entry_point.name not in wanted):
            continue
        seen.add(entry_point.name)
        distribution, version = _distribution_of(entry_point)
        info = PluginInfo(entry_point.name, distribution, version, entry_point.value)
        plugins.append(info)
        try:
            module = entry_point.load()
            if manager.is_registered(module):  # a module named by two entry points loads once
                continue
            manager.register(module, name=entry_point.name)
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
            where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
            info.error = f"failed to load: {type(exc).__name__}: {exc}{where}"
            continue
        _collect_specs(manager, module, info)
    return Registry(manager, plugins)


_registry: Registry | None = None
_lock = threading.Lock()


def registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = discover()
        return _registry


def reset_registry() -> None:
    """Forget the discovered plugins (tests, or after installing a plugin at run time)."""
    global _registry
    with _lock:
        _registry = None
