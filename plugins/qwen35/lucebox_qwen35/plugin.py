"""The hooks `lucebox-qwen` implements. Everything heavy is imported lazily, by reference."""

from lucebox_core import Converter, DefaultModel, Drafter, ModelFamily, ResponseParser, Synthesizer, hookimpl


@hookimpl
def lucebox_model_families():
    return [
        ModelFamily(
            name="qwen35",
            architectures=["qwen35"],
            loader="lucebox_qwen35.loader:load",
            ops="lucebox_qwen35.ops:QWEN35_OPS",
            description="Qwen3.5 / Qwen3.6 dense: Gated DeltaNet + gated attention hybrid",
        )
    ]


@hookimpl
def lucebox_drafters():
    # The family's own draft files (written by `lucebox synth --arch qwen35-dflash-draft`) are DFlash drafters:
    # the core's DFlash loader reads them.
    return [
        Drafter(
            name="dflash",
            factory="lucebox_core.speculative.dflash:load",
            architectures=["qwen35-dflash-draft"],
            description="DFlash drafter files written for qwen35 targets",
        )
    ]


@hookimpl
def lucebox_synthesizers():
    return [
        Synthesizer(
            name="qwen35",
            writer="lucebox_qwen35.synth:write",
            sizes=["tiny", "0.8b", "27b"],
            types=["f32", "f16", "q8_0", "q4_k_m"],
            description="random-weight qwen35 GGUF with llama.cpp's exact layout",
        ),
        Synthesizer(
            name="qwen35-dflash-draft",
            writer="lucebox_qwen35.draft_synth:write",
            sizes=["tiny", "full"],
            types=["f32", "f16", "q8_0", "q4_k_m"],
            description="random-weight DFlash drafter fitting a qwen35 target (needs --target FILE)",
        ),
    ]


@hookimpl
def lucebox_converters():
    return [
        Converter(
            name="qwen35",
            model_types=["qwen3_5", "qwen3_5_text"],
            writer="lucebox_qwen35.convert:convert",
            types=["f32", "f16", "bf16", "q8_0"],
            description="transformers Qwen3.5/3.6 checkpoint to GGUF (llama.cpp conventions)",
        )
    ]


@hookimpl
def lucebox_default_models():
    return [
        DefaultModel(
            name="qwen35-tiny-random",
            provider="lucebox_qwen35.default:provide",
            random_weights=True,
            description="tiny synthetic qwen35 model with random weights, written on first use",
        )
    ]


@hookimpl
def lucebox_response_parsers():
    return [
        ResponseParser(
            name="qwen35",
            factory="lucebox_qwen35.tool_calls:create_parser",
            architectures=["qwen35", "qwen35moe"],
            description="<think> reasoning and Qwen XML tool calls (<tool_call><function=...><parameter=...>)",
        )
    ]
