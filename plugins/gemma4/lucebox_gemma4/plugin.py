"""The hooks `lucebox-gemma4` implements. Everything heavy is imported lazily, by reference."""

from lucebox_core import Converter, ModelFamily, ResponseParser, Synthesizer, provides
from lucebox_core.specs import CONVERTED_TYPES, SYNTHESIZED_TYPES, dflash_draft_synthesizer, dflash_drafter

lucebox_model_families = provides(
    ModelFamily(name="gemma4", architectures=["gemma4"], loader="lucebox_gemma4.loader:load",
                ops="lucebox_gemma4.ops:GEMMA4_OPS",
                description="Gemma-4 31B (dense) and 26B-A4B (MoE): sliding-window + full attention, GeGLU")
)

# Lucebox's Gemma-4 draft files (and `lucebox synth --arch gemma4-dflash-draft`) are DFlash drafters in the
# core's layout: the core's DFlash loader reads them; the target supplies embeddings, soft-capped head, mask.
lucebox_drafters = provides(dflash_drafter("gemma4-dflash-draft", "DFlash drafter files for gemma4 targets"))

lucebox_synthesizers = provides(
    Synthesizer(name="gemma4", writer="lucebox_gemma4.synth:write", sizes=["tiny", "tiny-moe", "26b-a4b", "31b"],
                types=SYNTHESIZED_TYPES,
                description="random-weight gemma4 GGUF with llama.cpp's exact layout (dense 31B, MoE 26B-A4B)"),
    dflash_draft_synthesizer("gemma4", writer="lucebox_gemma4.synth:write_draft"),
)

lucebox_converters = provides(
    Converter(name="gemma4", model_types=["gemma4", "gemma4_text"], writer="lucebox_gemma4.convert:convert",
              types=CONVERTED_TYPES, description="transformers Gemma-4 checkpoint to GGUF (llama.cpp conventions)")
)

lucebox_response_parsers = provides(
    ResponseParser(name="gemma4", factory="lucebox_gemma4.tool_calls:create_parser", architectures=["gemma4"],
                   reasoning_tags=("<|channel>", "<channel|>"),
                   description="Gemma-4 thought channel and tool calls (<|tool_call>call:NAME{...}<tool_call|>)")
)
