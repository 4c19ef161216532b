"""From a GGUF path (or none: the default model) to a ready model, tokenizer and chat template."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .errors import GGUFError, LuceboxError, PluginError

if TYPE_CHECKING:  # torch is imported by what loads a model, not by what only finds one
    import torch

# What every family loader takes (see `ModelFamily`); a family adds its own (a kernel's chunk size, ...).
KV_OPTIONS = frozenset({"kv_policy", "kv_dtype", "cache_type_k", "cache_type_v"})
# What a family that can split its layers across devices takes too (`device_map.DeviceMap`, a backend per part).
SPLIT_OPTIONS = frozenset({"device_map", "part_backends"})


def lucebox_home() -> Path:
    """Where Lucebox keeps what it writes for the user: `$LUCEBOX_HOME`, else the user cache directory."""
    if os.environ.get("LUCEBOX_HOME"):
        return Path(os.environ["LUCEBOX_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "lucebox"


def default_model() -> Any:
    """The `DefaultModel` spec of the first installed plugin that offers one."""
    from .plugins import registry

    defaults = registry().default_models()
    if not defaults:
        raise PluginError(
            "no model given (-m FILE) and no installed plugin provides a default model; "
            "install lucebox-qwen (pip install lucebox-qwen) or pass -m"
        )
    return defaults[0]


def default_model_path(announce: bool = True) -> Path:
    """The embedded default model, written (or reassembled) on first use by the plugin that offers it."""
    default = default_model()
    path = default.path(lucebox_home())
    if announce:
        weights = "RANDOM WEIGHTS: its output is noise" if default.random_weights else default.description
        print(f"note: no -m given; using the default model {default.name} at {path} ({weights})", file=sys.stderr)
    return path


def default_draft_path(announce: bool = True) -> Path | None:
    """The default model's own drafter, when it ships one (None otherwise)."""
    default = default_model()
    path = default.draft_path(lucebox_home())
    if path is not None and announce:
        print(f"note: with its DFlash drafter at {path} (speculative decoding; --no-draft turns it off)",
              file=sys.stderr)
    return path


@attrs.define
class LoadedModel:
    path: Path
    gguf: Any  # GGUFFile
    family: Any  # ModelFamily spec
    backend: Any  # backend ops object
    backend_name: str
    model: Any
    tokenizer: Any
    chat_template: Any  # ChatTemplate | None


def load_model(
    path: str | Path | None,
    *,
    backend: str | None = None,
    device: str | None = None,
    chat_template_file: str | Path | None = None,
    device_map: Any = None,
    **options: Any,
) -> LoadedModel:
    """Open `path` (the default model when None), pick its family and a backend, build everything.

    `device_map` (a `device_map.DeviceMap`): the target's layers split into parts, one backend per distinct
    device (parts on the same device share it), handed to the family as `part_backends`, one per part."""
    from .chat_template import ChatTemplate, special_token_strings
    from .ggufio import GGUFFile
    from .plugins import registry
    from .tokenizer import Tokenizer

    path = Path(path) if path is not None else default_model_path()
    gguf_file = GGUFFile(path)
    family = registry().family_for(gguf_file.architecture, path)
    backend_spec = registry().kernel_backend(backend)
    if device_map is not None:
        device = device_map.embed_device
    ops = backend_spec.create(device=device) if device else backend_spec.create()
    if device_map is not None and device_map.is_split:
        by_device = {device_map.embed_device: ops}
        for part_device in device_map.devices:
            if part_device not in by_device:
                by_device[part_device] = backend_spec.create(device=part_device)
        options["device_map"] = device_map
        options["part_backends"] = [by_device[d] for d in device_map.devices]
    model = family.load(gguf_file, ops, **options)
    tokenizer = Tokenizer.from_metadata(gguf_file.metadata, source=str(path))
    if chat_template_file is not None:
        bos_token, eos_token = special_token_strings(gguf_file.metadata)
        template = ChatTemplate.from_file(chat_template_file, bos_token=bos_token, eos_token=eos_token)
    else:
        template = ChatTemplate.from_metadata(gguf_file.metadata)
    return LoadedModel(path, gguf_file, family, ops, backend_spec.name, model, tokenizer, template)


# -- what every family's loader does before it reads a weight -------------------------------------------


@attrs.frozen
class FamilyLoad:
    """A family loader's checked inputs: the open GGUF, the backend and the KV settings to hand the model."""

    gguf: Any  # GGUFFile
    backend: Any
    kv: dict[str, Any]  # kv_policy, kv_dtype, cache_type_k, cache_type_v: keyword arguments of the model


def start_family_load(gguf_file: Any, backend: Any, options: dict[str, Any], *, family: str, architecture: str,
                      known_options: frozenset[str] = KV_OPTIONS) -> FamilyLoad:
    """Check a family loader's `options` and open `gguf_file` (a `GGUFFile` or a path) for it, on `backend`
    (default: torch on the CPU). An unknown option or a cache type the KV policy (default the built-in `full`)
    does not store fails before the file is opened, a file of another architecture before any weight is read."""
    from .ggufio import GGUFFile
    from .kv import K_FLAG, V_FLAG, kv_cache_type
    from .plugins import registry
    from .torch_backend import TorchBackend

    if options.get("device_map") is not None and "device_map" not in known_options:
        from .device_map import TARGET_DEVICES_FLAG

        raise LuceboxError(f"{TARGET_DEVICES_FLAG}: the {family} family cannot split its layers across devices yet "
                           f"(qwen35 can); run it on one device (--target-device)")
    options = {key: value for key, value in options.items()
               if not (key in SPLIT_OPTIONS and value is None)}
    unknown = set(options) - known_options
    if unknown:
        raise LuceboxError(f"unknown {family} model option(s): {', '.join(sorted(unknown))} "
                           f"(known: {', '.join(sorted(known_options))})")
    kv_policy = options.get("kv_policy") or registry().kv_policy("full")
    for option, flag in (("cache_type_k", K_FLAG), ("cache_type_v", V_FLAG)):
        if options.get(option) is not None:
            kv_cache_type(options[option], flag)
    kv_policy.check_types(options.get("cache_type_k"), options.get("cache_type_v"))
    if isinstance(gguf_file, (str, os.PathLike)):
        gguf_file = GGUFFile(gguf_file)
    backend = backend if backend is not None else TorchBackend()
    if gguf_file.architecture != architecture:
        raise GGUFError(f"{gguf_file.path}: architecture is {gguf_file.architecture!r}, expected {architecture!r}")
    kv = {"kv_policy": kv_policy, **{key: options.get(key) for key in ("kv_dtype", "cache_type_k", "cache_type_v")}}
    return FamilyLoad(gguf_file, backend, kv)


class LayoutTensors:
    """Tensors of one GGUF by transformers name, each checked against the shape the family's layout expects
    (a missing or mis-shaped tensor raises a GGUFError naming the file and the tensor)."""

    def __init__(self, gguf_file: Any, shapes: dict[str, tuple[int, ...]], gguf_names: dict[str, str], ops: Any, *,
                 family: str):
        self.gguf = gguf_file
        self.shapes = shapes
        self.gguf_names = gguf_names  # transformers name -> GGUF name, `{i}` standing for the layer
        self.ops = ops
        self.family = family

    def _tensor(self, hf_name: str, layer: int | None) -> Any:
        name = self.gguf_names[hf_name].format(i=layer)
        if name not in self.shapes:
            raise GGUFError(f"{self.gguf.path}: the {self.family} layout has no tensor {name}")
        return self.gguf.tensor(name, self.shapes[name])

    def weight(self, hf_name: str, layer: int | None = None) -> Any:
        """A matrix (or an expert stack), kept in its GGUF type."""
        return self._tensor(hf_name, layer)

    def vector(self, hf_name: str, layer: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A small tensor (norm, scale, conv kernel, per-head scalars), dequantized once."""
        return self._tensor(hf_name, layer).dequantize(dtype or self.ops.dtype, self.ops.device)
