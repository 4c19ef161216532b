"""The hooks `lucebox-laguna` implements. Everything heavy is imported lazily, by reference."""

from lucebox_core import Converter, ModelFamily, ResponseParser, Synthesizer, provides
from lucebox_core.specs import CONVERTED_TYPES, SYNTHESIZED_TYPES

lucebox_model_families = provides(
    ModelFamily(name="laguna", architectures=["laguna"], loader="lucebox_laguna.loader:load",
                ops="lucebox_laguna.ops:LAGUNA_OPS",
                description="Poolside Laguna-XS.2: sliding-window + YaRN full attention, softplus head gate, "
                            "sigmoid-routed MoE with a shared expert")
)

lucebox_synthesizers = provides(
    Synthesizer(name="laguna", writer="lucebox_laguna.synth:write", sizes=["tiny", "xs2"], types=SYNTHESIZED_TYPES,
                options=["router_skew"],
                description="random-weight laguna GGUF with llama.cpp's exact layout (Laguna-XS.2)"),
)

lucebox_converters = provides(
    Converter(name="laguna", model_types=["laguna"], writer="lucebox_laguna.convert:convert", types=CONVERTED_TYPES,
              description="transformers Laguna checkpoint to GGUF (llama.cpp conventions)")
)

lucebox_response_parsers = provides(
    ResponseParser(name="laguna", factory="lucebox_laguna.tool_calls:create_parser", architectures=["laguna"],
                   reasoning_tags=("<think>", "</think>"),
                   description="Laguna reasoning (<think>) and tool calls (<tool_call>NAME<arg_key>..</arg_key>"
                               "<arg_value>..</arg_value></tool_call>)")
)
