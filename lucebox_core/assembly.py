"""The one place an engine is assembled: from options (model, backend, KV policy and types, drafter,
verifier, budget, ubatch, context) to a loaded model and an `Engine` over it.

`lucebox generate`, `lucebox bench` and `lucebox serve` all go through `build_engine`. Every choice is made
through a hook: the model's family by the GGUF's `general.architecture`, the backend by name or priority,
the KV policy by `--kv-policy NAME`, the drafter by the draft GGUF's architecture, the verifier by
`--spec-type NAME`. `check_options` validates what can be validated before anything is loaded, so a typo
in a flag fails in a second, not after a 27B upload.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from .errors import LuceboxError


@attrs.frozen(kw_only=True)
class EngineOptions:
    """What an engine is made of. The defaults are the CLI's."""

    model: str | None = None  # GGUF path; None: the default model a plugin provides
    backend: str | None = None  # kernel backend name; None: the available one with the highest priority
    device: str | None = None  # torch device for the backend
    target_device: str | None = None  # --target-device DEV (--device's other name)
    target_devices: str | None = None  # --target-devices DEV,DEV: the target's layers split across them
    target_layer_split: str | None = None  # --target-layer-split F,F: layers per device (default even)
    draft_device: str | None = None  # --draft-device DEV: the drafter's device
    ctx_size: int | None = None  # positions per sequence (-c); None: what fits (`context.fit_context`)
    prefill_chunk: int | None = None  # prompt tokens per prefill forward (-ub); None: the model's choice
    parallel: int = 1  # sequences generated at once (-np): finished ones kept for reuse, up to this many
    chat_template_file: str | None = None
    kv_policy: str = "full"  # --kv-policy NAME
    cache_type_k: str | None = None  # -ctk: as the KV policy stores it; None: the backend's dtype
    cache_type_v: str | None = None  # -ctv
    model_draft: str | None = None  # -md: a draft GGUF turns speculative decoding on
    spec_type: str = "ddtree"  # --spec-type NAME: the verifier
    tree_budget: int | str | None = None  # --tree-budget N|auto; None: the default model's, else DEFAULT_TREE_BUDGET
    draft_block_size: int | None = None  # --draft-block-size; None: the drafter's
    no_draft: bool = False  # --no-draft: the default model without the drafter it ships with
    prefix_cache_slots: int = 0  # --prefix-cache-slots (serve's default is 8): RAM snapshots; 0 and no dir: off
    prefix_cache_min_tokens: int | None = None  # --prefix-cache-min-tokens; None: prefix_cache.DEFAULT_MIN_TOKENS
    kv_cache_dir: str | None = None  # --kv-cache-dir: the prefix cache's disk tier
    kv_cache_budget: str | int = "4G"  # --kv-cache-budget
    prefix_cache_ram: str | int = "8G"  # --prefix-cache-ram
    spark: bool = False  # --spark: MoE experts behind a bounded pool of device slots (spark.py)
    spark_vram: str | int | None = None  # --spark-vram SIZE|P%: resident experts' bytes (default: half of them)
    spark_promote: str | int | None = None  # --spark-promote SIZE: promotions' bytes between steps (0: none)
    kvflash: str | int | None = None  # --kvflash N|auto: bounded KV residency (implies --kv-policy kvflash)
    kvflash_policy: str | None = None  # --kvflash-policy lru|qk|drafter (default lru)
    kvflash_tau: int | None = None  # --kvflash-tau N (default 64)
    kvflash_scorer: str | None = None  # --kvflash-scorer FILE: the drafter policy's scorer
    # --prefill-drafter FILE: PFlash's scorer GGUF (default: a qwen3 file beside -m), the drafter policy's too
    prefill_drafter: str | None = None

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> EngineOptions:
        """The options an argparse namespace holds (flags a subcommand lacks keep their defaults)."""
        names = {
            "model": "model", "backend": "backend", "device": "device", "ctx_size": "ctx_size",
            "target_device": "target_device", "target_devices": "target_devices",
            "target_layer_split": "target_layer_split", "draft_device": "draft_device",
            "prefill_chunk": "ubatch_size", "parallel": "parallel", "chat_template_file": "chat_template_file",
            "kv_policy": "kv_policy", "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v",
            "model_draft": "model_draft", "spec_type": "spec_type", "tree_budget": "tree_budget",
            "draft_block_size": "draft_block_size", "no_draft": "no_draft",
            "prefix_cache_slots": "prefix_cache_slots", "prefix_cache_min_tokens": "prefix_cache_min_tokens",
            "kv_cache_dir": "kv_cache_dir", "kv_cache_budget": "kv_cache_budget",
            "prefix_cache_ram": "prefix_cache_ram", "spark": "spark", "spark_vram": "spark_vram",
            "spark_promote": "spark_promote",
            "kvflash": "kvflash", "kvflash_policy": "kvflash_policy", "kvflash_tau": "kvflash_tau",
            "kvflash_scorer": "kvflash_scorer", "prefill_drafter": "prefill_drafter",
        }
        values = {field: getattr(args, flag) for field, flag in names.items()
                  if getattr(args, flag, None) is not None}
        return cls(**{**values, **overrides})


# When neither the user nor the default model says: the budget from the measured verify costs, and the
# governor that decodes plainly while drafting does not pay (H200, 27B: 98.8% of plain speed with a drafter
# that accepts nothing; forced 8.3: 320.8 tok/s against 280.6 with a fixed budget of 22).
DEFAULT_TREE_BUDGET = "auto"
SCORER_ALPHA = 0.85  # KVFlash's drafter scorer: block-sparse attention over long histories (PFlash's --prefill-alpha)


@attrs.frozen
class Choices:
    """The plugin specs the options name, found before anything is loaded."""

    kv_policy: Any  # KVPolicy
    cache_type_k: str | None
    cache_type_v: str | None
    verifier: Any  # Verifier spec, or None without a drafter
    drafter: Any  # Drafter spec (by the draft file's architecture), or None
    device_map: Any = None  # device_map.DeviceMap from the multi-device flags, or None


def check_options(options: EngineOptions) -> Choices:
    """Validate the options that need no weights (files exist, the model file is a GGUF some installed family
    loads, the chat template compiles, numbers in range, named plugins installed, cache types the KV policy
    stores); a LuceboxError names the flag or the file."""
    from .plugins import registry

    for flag, value in (("-c/--ctx-size", 1 if options.ctx_size is None else options.ctx_size),
                        ("-np/--parallel", options.parallel),
                        ("-ub/--ubatch-size", 1 if options.prefill_chunk is None else options.prefill_chunk),
                        ("--prefix-cache-slots", options.prefix_cache_slots + 1),
                        ("--prefix-cache-min-tokens", 1 if options.prefix_cache_min_tokens is None
                         else options.prefix_cache_min_tokens)):
        if value < 1:
            raise LuceboxError(f"{flag} must be at least 1, got {value}")
    for flag, path in (("-m/--model", options.model), ("-md/--model-draft", options.model_draft),
                       ("--chat-template-file", options.chat_template_file)):
        if path is not None and not os.path.isfile(path):
            raise LuceboxError(f"{path}: no such file ({flag})")
    from .prefix_cache import parse_size

    parse_size(options.prefix_cache_ram, "--prefix-cache-ram")
    from .spark import spark_budget, spark_promotion_bytes

    spark_budget(options.spark_vram)  # a bad size or share is refused before any weight is read
    spark_promotion_bytes(options.spark_promote)
    if options.kv_cache_dir is not None:
        parse_size(options.kv_cache_budget)
        if os.path.exists(options.kv_cache_dir) and not os.path.isdir(options.kv_cache_dir):
            raise LuceboxError(f"--kv-cache-dir {options.kv_cache_dir}: exists and is not a folder")
    if options.model is not None:
        _model_family(options.model)
    device_map = _device_map(options)
    if options.chat_template_file is not None:
        from .chat_template import ChatTemplate

        ChatTemplate.from_file(options.chat_template_file)  # a syntax error is reported now, not after loading
    named = "kvflash" if options.kvflash is not None else options.kv_policy  # --kvflash implies the policy
    policy = _configured_kv_policy(options, registry().kv_policy(named))
    if policy.name == "kvflash" and device_map is not None and device_map.is_split:
        # Each part would page its own layers and map positions to slots on its own, while the attention's
        # mask position and the static steps' window come from the one (split) cache: not built yet.
        raise LuceboxError("--kvflash cannot go with --target-devices yet (a split target keeps its whole KV "
                           "with the full policy); drop one of them")
    cache_type_k, cache_type_v = policy.check_types(options.cache_type_k, options.cache_type_v)
    verifier = drafter = None
    if options.model_draft is not None:
        verifier = registry().verifier(options.spec_type)
        budget = options.tree_budget
        if budget is not None and budget != "auto" and (not isinstance(budget, int) or budget < 1):
            raise LuceboxError(f"--tree-budget must be a positive integer or 'auto', got {options.tree_budget!r}")
        if options.draft_block_size is not None and not 2 <= options.draft_block_size <= 64:
            raise LuceboxError(f"--draft-block-size must be between 2 and 64, got {options.draft_block_size}")
        drafter = _drafter_spec(options.model_draft)
    if options.draft_device is not None and options.model_draft is None:
        raise LuceboxError("--draft-device needs a drafter (-md/--model-draft FILE)")
    return Choices(policy, cache_type_k, cache_type_v, verifier, drafter, device_map)


def _device_map(options: EngineOptions) -> Any:
    """The `DeviceMap` of --target-device / --target-devices / --target-layer-split / --draft-device, checked
    against the devices this machine has and the model's layer count (read from its header), or None."""
    from .device_map import build_device_map, model_layer_count
    from .ggufio import GGUFFile

    layers = model_layer_count(GGUFFile(options.model)) if options.model is not None else None
    return build_device_map(device=options.device, target_device=options.target_device,
                            target_devices=options.target_devices, layer_split=options.target_layer_split,
                            draft_device=options.draft_device, layers=layers)


def _configured_kv_policy(options: EngineOptions, policy: Any) -> Any:
    """The KV policy spec, with KVFlash's flags bound into its factory (`--kvflash` implies the policy)."""
    flags = (options.kvflash is not None or options.kvflash_policy is not None or options.kvflash_tau is not None
             or options.kvflash_scorer is not None)
    if options.kvflash is not None and options.kv_policy not in ("full", "kvflash"):
        raise LuceboxError(f"--kvflash is the kvflash KV policy; it cannot go with --kv-policy {options.kv_policy}")
    if policy.name != "kvflash":
        if flags:
            raise LuceboxError("--kvflash-policy, --kvflash-tau and --kvflash-scorer need --kvflash N|auto")
        return policy
    from .kvflash import KVFlashPolicy
    from .kvflash_policy import check_policy

    name = check_policy(options.kvflash_policy or "lru")
    if options.kvflash_scorer is not None and name != "drafter":
        raise LuceboxError(f"--kvflash-scorer scores chunks for --kvflash-policy drafter, not {name}")
    factory = KVFlashPolicy(options.kvflash if options.kvflash is not None else "auto", name,
                            64 if options.kvflash_tau is None else options.kvflash_tau,
                            _kvflash_scorer(options) if name == "drafter" else None)
    return attrs.evolve(policy, factory=factory)


def _kvflash_scorer(options: EngineOptions) -> Any:
    """The drafter policy's scorer (`kvflash_policy.DrafterScorer`, loaded on its first reselection): the file
    of --kvflash-scorer, else --prefill-drafter's, else the one qwen3 GGUF beside -m; a LuceboxError naming the
    flag when there is none or the file is no model an installed family loads."""
    from .kvflash_policy import DrafterScorer
    from .pflash import find_scorer_beside

    path = options.kvflash_scorer or options.prefill_drafter
    flag = "--kvflash-scorer" if options.kvflash_scorer else "--prefill-drafter"
    if path is None and options.model is not None:
        path, flag = find_scorer_beside(options.model), f"the qwen3 GGUF beside {options.model}"
    if path is None:
        raise LuceboxError("--kvflash-policy drafter needs a scorer model: pass --kvflash-scorer FILE (a qwen3 GGUF "
                           "such as Qwen3-0.6B; default --prefill-drafter's, or the one beside -m)")
    if not os.path.isfile(path):
        raise LuceboxError(f"{path}: no such file ({flag})")
    _model_family(path)  # a file no family loads fails now, not at the first reselection

    def load(scorer_path: str) -> Any:
        from .loading import load_model

        return load_model(scorer_path, backend=options.backend, device=options.device or options.target_device)

    from .block_sparse import BlockSparseConfig

    return DrafterScorer(path, load, sparse=BlockSparseConfig(alpha=SCORER_ALPHA))


def _model_family(path: str) -> Any:
    """The family that loads model file `path` (only its header is read: a file that is no GGUF, or one no
    installed plugin loads, fails in milliseconds)."""
    from .ggufio import GGUFFile
    from .plugins import registry

    return registry().family_for(GGUFFile(path).architecture, path)


def _drafter_spec(path: str) -> Any:
    """The drafter the draft file's architecture chooses (only its header is read)."""
    from .errors import PluginError
    from .ggufio import GGUFFile
    from .plugins import registry

    draft_file = GGUFFile(path)
    try:
        return registry().drafter_for(draft_file.architecture, path)
    except PluginError as exc:
        raise PluginError(f"-md/--model-draft {exc}") from None


@attrs.frozen
class AssembledEngine:
    loaded: Any  # lucebox_core.loading.LoadedModel
    engine: Any  # lucebox_core.engine.Engine
    options: EngineOptions
    context: Any = None  # lucebox_core.context.ContextChoice: the context and how it was chosen
    spark: Any = None  # lucebox_core.spark.Spark with --spark

    @property
    def speculative(self) -> Any:
        return self.engine.speculative


def load_drafter(path: str, target: Any, backend: Any = None) -> Any:
    """The drafter for draft GGUF `path`, chosen by the file's architecture through the drafting hook."""
    from .ggufio import GGUFFile

    return _drafter_spec(path).create(GGUFFile(path), target, backend=backend)


def with_default_model(options: EngineOptions) -> EngineOptions:
    """The options with the default model's file (and, unless -md names another or --no-draft, its drafter)
    filled in when no -m is given: written or reassembled once, announced on stderr."""
    if options.model is not None:
        return options
    from .loading import default_draft_path, default_model, default_model_path

    model = str(default_model_path())
    draft, budget = options.model_draft, options.tree_budget
    if draft is None and not options.no_draft:
        found = default_draft_path()
        draft = None if found is None else str(found)
        if found is not None and budget is None:
            budget = default_model().tree_budget  # the budget its drafter was measured best with
    return attrs.evolve(options, model=model, model_draft=draft, tree_budget=budget)


def build_speculative(options: EngineOptions, loaded: Any, choices: Choices | None = None) -> Any:
    """The `SpeculativeDecoder` the options ask for (drafter from `-md`, verifier from `--spec-type`), or None."""
    if options.model_draft is None:
        return None
    from .ggufio import GGUFFile
    from .speculative import SpeculativeDecoder, trees

    choices = choices if choices is not None else check_options(options)
    draft_backend = loaded.backend
    device_map = choices.device_map
    if device_map is not None and device_map.draft_device is not None \
            and device_map.draft_device != str(getattr(loaded.backend, "device", "")):
        from .plugins import registry

        # A drafter on the CPU next to a GPU target runs on the reference backend (GPU kernels need a GPU).
        on_cpu = device_map.draft_device == "cpu"
        draft_backend = registry().kernel_backend("torch" if on_cpu else options.backend).create(
            device=device_map.draft_device)
    drafter = choices.drafter.create(GGUFFile(options.model_draft), loaded.model, backend=draft_backend)
    budget = options.tree_budget if options.tree_budget is not None else DEFAULT_TREE_BUDGET
    verifier = choices.verifier.create(loaded.model, budget=budget, top_k=trees.DEFAULT_TOP_K,
                                      backend=loaded.backend)
    return SpeculativeDecoder(loaded.model, drafter, verifier, block_size=options.draft_block_size,
                              backend=loaded.backend)


def build_engine(options: EngineOptions) -> AssembledEngine:
    """Load the model and make the engine the options describe."""
    from .context import fit_context
    from .engine import Engine
    from .loading import load_model

    default_model = options.model is None
    options = with_default_model(options)
    choices = check_options(options)
    model_options: dict[str, Any] = {"kv_policy": choices.kv_policy}
    if choices.cache_type_k is not None:
        model_options["cache_type_k"] = choices.cache_type_k
    if choices.cache_type_v is not None:
        model_options["cache_type_v"] = choices.cache_type_v
    loaded = load_model(options.model, backend=options.backend, device=options.device,
                        chat_template_file=options.chat_template_file, device_map=choices.device_map, **model_options)
    _announce_device_map(loaded)
    spark = None
    if options.spark:
        from .spark import attach_spark, spark_budget, spark_promotion_bytes

        budget, share = spark_budget(options.spark_vram)
        spark = attach_spark(loaded.model, budget, model_path=loaded.path, share=share,
                             promotion_bytes=spark_promotion_bytes(options.spark_promote))
    speculative = build_speculative(options, loaded, choices)
    context = fit_context(loaded, parallel=options.parallel, requested=options.ctx_size,
                          default_model=default_model)
    prefill_chunk = options.prefill_chunk
    max_pass = getattr(choices.kv_policy.factory, "max_pass", None)
    if max_pass is not None:  # a bounded KV pool takes at most this much of a prompt a forward pass
        prefill_chunk = min(prefill_chunk or getattr(loaded.model, "prefill_chunk", 512), max_pass(context.size))
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=context.size, prefill_chunk=prefill_chunk,
                    speculative=speculative, idle_sequences=options.parallel,
                    backend=_engine_backend(loaded),
                    prefix_cache=build_prefix_cache(options, loaded))
    return AssembledEngine(loaded, engine, options, context, spark)


def _announce_device_map(loaded: Any) -> None:
    """Say on stderr where a split model's parts run and how its decode step runs (a graph per part, or
    eagerly)."""
    import sys

    from .split_step import step_mode

    device_map = getattr(loaded.model, "device_map", None)
    if device_map is None:
        return
    parts = ", ".join(f"layers {p['layers']} on {p['device']}" for p in device_map.describe()["parts"])
    print(f"note: the target's layers split into {device_map.parts} parts: {parts}; decode step: "
          f"{step_mode(loaded.model)}", file=sys.stderr)


def _engine_backend(loaded: Any) -> Any:
    """The backend the engine waits on: a split model's logits come from its last part, so that part's."""
    if getattr(loaded.model, "device_map", None) is None:
        return loaded.backend
    head = loaded.model.head_ops
    return getattr(head, "backend", head)  # the backend itself under a family's bound view


def build_prefix_cache(options: EngineOptions, loaded: Any) -> Any:
    """The prefix cache the options ask for (None when off). Its fingerprint names what makes a snapshot
    valid here: the weights (target and drafter files), how KV is stored, the backend and device, and this
    version of the code (kernels may round differently from one version to the next)."""
    from . import __version__
    from .prefix_cache import PrefixCache, PrefixCacheConfig, fingerprint, file_identity, parse_size
    from .prefix_cache import DEFAULT_MIN_TOKENS

    config = PrefixCacheConfig(
        slots=options.prefix_cache_slots, directory=options.kv_cache_dir,
        min_tokens=DEFAULT_MIN_TOKENS if options.prefix_cache_min_tokens is None else options.prefix_cache_min_tokens,
        disk_budget=parse_size(options.kv_cache_budget), ram_budget=parse_size(options.prefix_cache_ram, "--prefix-cache-ram"))
    if not config.enabled:
        return None
    model = loaded.model
    if getattr(getattr(model, "kv_policy", None), "name", "") == "kvflash":
        import logging

        logging.getLogger(__name__).warning("the prefix cache is off: the kvflash KV policy pages part of the "
                                            "context out and cannot snapshot its rows")
        return None
    parts = {
        "lucebox": __version__, "family": loaded.family.name, "model": file_identity(loaded.path),
        "draft": file_identity(options.model_draft) if options.model_draft else None,
        "backend": loaded.backend_name, "device": str(getattr(loaded.backend, "device", "cpu")),
        "dtype": str(getattr(loaded.backend, "dtype", "")), "kv_policy": options.kv_policy,
        "cache_type_k": getattr(model, "cache_type_k", None), "cache_type_v": getattr(model, "cache_type_v", None),
    }
    return PrefixCache(config, fingerprint(parts))
