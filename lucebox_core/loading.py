"""From a GGUF path (or none: the default model) to a ready model, tokenizer and chat template."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import attrs

from .errors import PluginError


def lucebox_home() -> Path:
    """Where Lucebox keeps what it writes for the user: `$LUCEBOX_HOME`, else the user cache directory."""
    if os.environ.get("LUCEBOX_HOME"):
        return Path(os.environ["LUCEBOX_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "lucebox"


def default_model_path(announce: bool = True) -> Path:
    """The embedded default model, written on first use by whichever family plugin offers one."""
    from .plugins import registry

    defaults = registry().default_models()
    if not defaults:
        raise PluginError(
            "no model given (-m FILE) and no installed plugin provides a default model; "
            "install lucebox-qwen (pip install lucebox-qwen) or pass -m"
        )
    default = defaults[0]
    path = default.path(lucebox_home())
    if announce:
        weights = "RANDOM WEIGHTS: its output is noise" if default.random_weights else default.description
        print(f"note: no -m given; using the default model {default.name} at {path} ({weights})", file=sys.stderr)
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
    **options: Any,
) -> LoadedModel:
    """Open `path` (the default model when None), pick its family and a backend, build everything."""
    from .chat_template import ChatTemplate, special_token_strings
    from .ggufio import GGUFFile
    from .plugins import registry
    from .tokenizer import Tokenizer

    path = Path(path) if path is not None else default_model_path()
    gguf_file = GGUFFile(path)
    family = registry().family_for(gguf_file.architecture, path)
    backend_spec = registry().kernel_backend(backend)
    ops = backend_spec.create(device=device) if device else backend_spec.create()
    model = family.load(gguf_file, ops, **options)
    tokenizer = Tokenizer.from_metadata(gguf_file.metadata, source=str(path))
    if chat_template_file is not None:
        bos_token, eos_token = special_token_strings(gguf_file.metadata)
        template = ChatTemplate.from_file(chat_template_file, bos_token=bos_token, eos_token=eos_token)
    else:
        template = ChatTemplate.from_metadata(gguf_file.metadata)
    return LoadedModel(path, gguf_file, family, ops, backend_spec.name, model, tokenizer, template)
