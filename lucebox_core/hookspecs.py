"""The extension points of Lucebox.

A plugin is a module named by an entry point of group `lucebox`; it implements any of these hooks with
`@lucebox_core.hookimpl`. Each hook returns a list of *specs* (small `attrs` records from
`lucebox_core.specs`) that name what the plugin provides and import the heavy code only when used, so
that listing plugins never initialises a GPU.
"""

import pluggy

hookspec = pluggy.HookspecMarker("lucebox")


@hookspec
def lucebox_model_families():
    """Model families: which GGUF architectures each loads and how it builds a model from a GGUF."""


@hookspec
def lucebox_kernel_backends():
    """Kernel backends: a set of ops for a device, with availability and a priority."""


@hookspec
def lucebox_kv_policies():
    """KV policies (`--kv-policy`): how attention KV is stored, in what type, and what stays resident."""


@hookspec
def lucebox_drafters():
    """Drafters for speculative decoding, by draft-GGUF architecture: load a draft file, propose tokens."""


@hookspec
def lucebox_verifiers():
    """Verifiers for speculative decoding (`--spec-type`): build candidates, run one target pass, accept."""


@hookspec
def lucebox_synthesizers():
    """Writers of random-weight GGUF files with a family's exact layout, for tests and benchmarks."""


@hookspec
def lucebox_converters():
    """Converters from a Hugging Face checkpoint folder (by `model_type`) to a GGUF file."""


@hookspec
def lucebox_default_models():
    """Models that can stand in when the user names none (e.g. a small synthetic one)."""


@hookspec
def lucebox_response_parsers():
    """Parsers that split a family's raw output into reasoning, content and tool calls, while streaming."""


@hookspec
def lucebox_op_kernels():
    """Kernels a backend offers for named ops (generic or a family's), each with its check of what it takes."""


@hookspec
def lucebox_prefill_compressors():
    """Prefill compressors (`--prefill-compressor`): shorten a chat's aged messages before its prefill (PFlash)."""
