"""Records that plugins return from their hooks.

Each names one thing a plugin provides. Heavy code is referenced as a `"module:attribute"` string and
imported only when used (`resolve`), so listing plugins stays cheap and never touches a GPU.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

import attrs

Target = str | Callable[..., Any]


def resolve(target: Target) -> Callable[..., Any]:
    """Turn a `"package.module:attribute"` reference into the object it names."""
    if callable(target):
        return target
    module_name, _, attribute = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split(".") if attribute else []:
        obj = getattr(obj, part)
    return obj


def _always_available() -> tuple[bool, str]:
    return True, ""


def target_available(target: Target) -> tuple[bool, str]:
    """Whether a lazy target's module can be found, without importing it."""
    import importlib.util

    if callable(target):
        return True, ""
    module_name = target.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError) as exc:
        return False, f"cannot locate {module_name}: {exc}"
    return (True, "") if found else (False, f"module {module_name} is not installed")


@attrs.frozen(kw_only=True)
class ModelFamily:
    """A model family: the GGUF architectures it loads and the function that builds a model.

    `loader(gguf_file, backend, **options)` returns a model object the engine drives; the options the
    engine passes are `kv_policy` (a `KVPolicy`) and, when given, `cache_type_k` / `cache_type_v`. `ops`:
    the family's own named ops (a `lucebox_core.ops.OpSet`), so tools can find the reference of any op a
    backend offers a kernel for.
    """

    name: str
    architectures: tuple[str, ...] = attrs.field(converter=tuple)
    loader: Target
    ops: Target | None = None
    description: str = ""
    kind = "model"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.loader)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.loader)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class KernelBackend:
    """A set of ops for a device. The available backend with the highest priority is chosen."""

    name: str
    factory: Target
    priority: int = 0
    availability: Callable[[], tuple[bool, str]] = _always_available
    description: str = ""
    kind = "backend"

    def is_available(self) -> tuple[bool, str]:
        found, reason = target_available(self.factory)
        if not found:
            return found, reason
        try:
            return self.availability()
        except Exception as exc:  # an availability probe must never take the process down
            return False, f"availability check failed: {exc}"

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.factory)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class KVPolicy:
    """A way of storing and keeping attention KV resident (`full`, paged, kvflash...).

    `factory(layers, max_context, *, dtype, device, k_type, v_type)` makes one sequence's cache (a
    `lucebox_core.kv.KVCache`); `cache_types` are the `-ctk` / `-ctv` types it stores. `bounded`: a row's
    slot is not its position (a resident set smaller than the context), so a family's attention must take
    its causal offset from the rows `append` returns and mask static windows at `kv.attention_position`; a
    model whose family does not (`DecoderModel.reads_bounded_kv`) refuses such a policy.
    """

    name: str
    factory: Target
    cache_types: tuple[str, ...] = attrs.field(default=("f32", "f16", "bf16"), converter=tuple)
    bounded: bool = False
    description: str = ""
    kind = "kv_policy"

    def check_types(self, k_type: Any, v_type: Any) -> tuple[str | None, str | None]:
        """The cache type names for the `-ctk` / `-ctv` values given (None: the default), or a LuceboxError
        naming the flag and what this policy stores."""
        from .kv import K_FLAG, V_FLAG, kv_cache_type

        checked = []
        for value, flag in ((k_type, K_FLAG), (v_type, V_FLAG)):
            if value is None:
                checked.append(None)
                continue
            name = kv_cache_type(value, flag)
            if name not in self.cache_types:
                from .errors import LuceboxError

                raise LuceboxError(f"{flag} {name}: the {self.name!r} KV policy stores {', '.join(self.cache_types)}")
            checked.append(name)
        if None not in checked:  # a pair the kernels cannot read is refused at load, not at the first request
            from .kv import KV_CACHE_TYPES
            from .kv_quant import check_kv_pair

            check_kv_pair(checked[0], checked[1], tuple(KV_CACHE_TYPES))
        return checked[0], checked[1]

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.factory)

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.factory)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class Drafter:
    """A drafter kind; `architectures` are the draft-GGUF architectures it loads (the draft file's
    `general.architecture` chooses the drafter, as a model's chooses its family).

    `factory(gguf_file, target, **options)` returns a drafter (see `lucebox_core.speculative.loop`).
    """

    name: str
    factory: Target
    architectures: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""
    kind = "drafter"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.factory)

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.factory)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class Verifier:
    """A verifier: turns proposals into a candidate set, runs one target pass, accepts a prefix.

    Chosen by name (`--spec-type NAME`); `factory(target, *, budget, top_k, backend, **options)` returns one
    (`budget`: `--tree-budget`; `backend`: the target's ops, for timings that wait on its device; a verifier
    ignores what it has no use for; see `lucebox_core.speculative.loop.TreeVerifier`).
    """

    name: str
    factory: Target
    description: str = ""
    kind = "verifier"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.factory)

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.factory)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class Synthesizer:
    """Writes random-weight GGUF files for one architecture.

    `writer(path, *, size, type, seed, vocab)` writes the file; `sizes` and `types` list the choices;
    `options` the writer's further keywords (`router_skew`: MoE routers biased toward a hot set of experts).
    """

    name: str  # the architecture written, as in `general.architecture`
    writer: Target
    sizes: tuple[str, ...] = attrs.field(converter=tuple)
    types: tuple[str, ...] = attrs.field(converter=tuple)
    description: str = ""
    options: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    kind = "synth"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.writer)

    def write(self, path: Path, **options: Any) -> Any:
        return resolve(self.writer)(path, **options)


@attrs.frozen(kw_only=True)
class Converter:
    """Converts a Hugging Face checkpoint folder whose config has one of `model_types` to GGUF.

    `writer(hf_dir, path, *, type, vocab)` writes the file; `types` lists the output types.
    """

    name: str
    model_types: tuple[str, ...] = attrs.field(converter=tuple)
    writer: Target
    types: tuple[str, ...] = attrs.field(converter=tuple)
    # When set, the config's `architectures` must name one of these too: z-lab's DFlash drafters say
    # `model_type: qwen3` like every Qwen3 checkpoint, and only `DFlashDraftModel` tells them apart.
    hf_architectures: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""
    kind = "converter"

    def accepts(self, config: dict) -> bool:
        """Whether a Hugging Face `config.json` (as a dict) is one this converter handles."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        model_type = config.get("model_type") or text.get("model_type")
        if model_type not in self.model_types:
            return False
        return not self.hf_architectures or bool(set(config.get("architectures") or ()) & set(self.hf_architectures))

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.writer)

    def convert(self, hf_dir: Path, path: Path, **options: Any) -> Any:
        return resolve(self.writer)(hf_dir, path, **options)


@attrs.frozen(kw_only=True)
class DefaultModel:
    """A model used when the user names none; `provider(home)` returns its path, creating it once, and
    `draft_provider(home)`, when the model ships with a drafter, the draft file's (speculative decoding on
    unless the user turns it off)."""

    name: str
    provider: Target
    draft_provider: Target | None = None
    tree_budget: int | str | None = None  # with its drafter, unless --tree-budget says: e.g. "auto"
    random_weights: bool = False
    description: str = ""
    kind = "default_model"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.provider)

    def path(self, home: Path) -> Path:
        return Path(resolve(self.provider)(home))

    def draft_path(self, home: Path) -> Path | None:
        return None if self.draft_provider is None else Path(resolve(self.draft_provider)(home))


@attrs.frozen(kw_only=True)
class ResponseParser:
    """Splits raw model output into reasoning, content and tool calls (incrementally, for streaming).

    `architectures` are the GGUF architectures whose output format it reads; `factory(**options)` builds
    a parser for one response.
    """

    name: str
    factory: Target
    architectures: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    description: str = ""
    # The markup that opens and closes the family's reasoning, as the model writes it: the server detects a
    # prompt left inside a thought, ends a thought at a token budget and keeps structured output after it.
    reasoning_tags: tuple[str, str] = attrs.field(default=("<think>", "</think>"), converter=tuple)
    kind = "response_parser"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.factory)

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.factory)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class PrefillCompressor:
    """A prefill compressor, chosen by name (`--prefill-compressor NAME`): `factory(config, loaded)` (the
    server's `ServeConfig` and the target's `LoadedModel`) returns an object with `compress(pieces) -> texts`
    (see `lucebox_core.chat_compression`), which the server runs on chats that `--prefill-compression`
    selects."""

    name: str
    factory: Target
    description: str = ""
    kind = "prefill_compressor"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.factory)

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.factory)(*args, **kwargs)


@attrs.frozen(kw_only=True)
class OpKernel:
    """A backend's kernel for one named op (generic, or a family's own): see `lucebox_core.ops`.

    `kernel(ops, *args, **kwargs)` computes the op; `accepts(ops, *args, **kwargs)` says whether it takes
    these arguments (None: any), else the next kernel or the op's reference runs. Highest `priority` first.
    """

    op: str
    backend: str  # the `KernelBackend` name whose instances use it
    kernel: Target
    accepts: Target | None = None
    priority: int = 0
    description: str = ""
    kind = "kernel"

    @property
    def name(self) -> str:
        return f"{self.backend}.{self.op}"

    def is_available(self) -> tuple[bool, str]:
        return target_available(self.kernel)


# -- specs every family plugin declares alike ---------------------------------------------------------

# The types a Hugging Face checkpoint converter writes (plain types; K-quant mixes come from a quantizer)
# and those a random-weight synthesizer writes (its quantized blocks are random, so K-quants cost nothing).
CONVERTED_TYPES = ("f32", "f16", "bf16", "q8_0")
SYNTHESIZED_TYPES = ("f32", "f16", "q8_0", "q4_k_m")
DFLASH_LOADER = "lucebox_core.speculative.dflash:load"
DRAFT_SIZES = ("tiny", "full")


def dflash_drafter(architecture: str, description: str) -> Drafter:
    """The `dflash` drafter for draft files of `architecture`: DFlash drafters share the core's layout, so the
    core's loader reads them whatever target they were written for."""
    return Drafter(name="dflash", factory=DFLASH_LOADER, architectures=[architecture], description=description)


def dflash_draft_synthesizer(target: str, writer: Target) -> Synthesizer:
    """The synthesizer of random-weight DFlash drafters fitted to a `target` file (`lucebox synth --arch
    {target}-dflash-draft --target FILE`)."""
    return Synthesizer(name=f"{target}-dflash-draft", writer=writer, sizes=DRAFT_SIZES, types=SYNTHESIZED_TYPES,
                       description=f"random-weight DFlash drafter fitting a {target} target (needs --target FILE)")


ALL_KINDS = {
    "lucebox_model_families": ModelFamily,
    "lucebox_kernel_backends": KernelBackend,
    "lucebox_kv_policies": KVPolicy,
    "lucebox_drafters": Drafter,
    "lucebox_verifiers": Verifier,
    "lucebox_synthesizers": Synthesizer,
    "lucebox_converters": Converter,
    "lucebox_default_models": DefaultModel,
    "lucebox_response_parsers": ResponseParser,
    "lucebox_op_kernels": OpKernel,
    "lucebox_prefill_compressors": PrefillCompressor,
}
