"""The hooks `lucebox-gemma4` implements. Everything heavy is imported lazily, by reference."""

from lucebox_core import Converter, Drafter, ModelFamily, ResponseParser, Synthesizer, hookimpl


@hookimpl
def lucebox_model_families():
    return [
        ModelFamily(
            name="gemma4",
            architectures=["gemma4"],
            loader="lucebox_gemma4.loader:load",
            ops="lucebox_gemma4.ops:GEMMA4_OPS",
            description="Gemma-4 31B (dense) and 26B-A4B (MoE): sliding-window + full attention, GeGLU",
        )
    ]


@hookimpl
def lucebox_drafters():
    # Lucebox's Gemma-4 draft files (and `lucebox synth --arch gemma4-dflash-draft`) are DFlash drafters in the
    # core's layout: the core's DFlash loader reads them; the target supplies embeddings, soft-capped head, mask.
    return [
        Drafter(
            name="dflash",
            factory="lucebox_core.speculative.dflash:load",
            architectures=["gemma4-dflash-draft"],
            description="DFlash drafter files for gemma4 targets",
        )
    ]


@hookimpl
def lucebox_synthesizers():
    return [
        Synthesizer(
            name="gemma4",
            writer="lucebox_gemma4.synth:write",
            sizes=["tiny", "tiny-moe", "26b-a4b", "31b"],
            types=["f32", "f16", "q8_0", "q4_k_m"],
            description="random-weight gemma4 GGUF with llama.cpp's exact layout (dense 31B, MoE 26B-A4B)",
        ),
        Synthesizer(
            name="gemma4-dflash-draft",
            writer="lucebox_gemma4.synth:write_draft",
            sizes=["tiny", "full"],
            types=["f32", "f16", "q8_0", "q4_k_m"],
            description="random-weight DFlash drafter fitting a gemma4 target (needs --target FILE)",
        ),
    ]


@hookimpl
def lucebox_converters():
    return [
        Converter(
            name="gemma4",
            model_types=["gemma4", "gemma4_text"],
            writer="lucebox_gemma4.convert:convert",
            types=["f32", "f16", "bf16", "q8_0"],
            description="transformers Gemma-4 checkpoint to GGUF (llama.cpp conventions)",
        )
    ]


@hookimpl
def lucebox_response_parsers():
    return [
        ResponseParser(
            name="gemma4",
            factory="lucebox_gemma4.tool_calls:create_parser",
            architectures=["gemma4"],
            reasoning_tags=("<|channel>", "<channel|>"),
            description="Gemma-4 thought channel and tool calls (<|tool_call>call:NAME{...}<tool_call|>)",
        )
    ]
