"""The hooks `lucebox-qwen` implements. Everything heavy is imported lazily, by reference."""

from lucebox_core import Converter, DefaultModel, ModelFamily, ResponseParser, Synthesizer, provides
from lucebox_core.specs import CONVERTED_TYPES, SYNTHESIZED_TYPES, dflash_draft_synthesizer, dflash_drafter

lucebox_model_families = provides(
    ModelFamily(name="qwen35", architectures=["qwen35"], loader="lucebox_qwen35.loader:load",
                ops="lucebox_qwen35.ops:QWEN35_OPS",
                description="Qwen3.5 / Qwen3.6 dense: Gated DeltaNet + gated attention hybrid"),
    ModelFamily(name="qwen35moe", architectures=["qwen35moe"], loader="lucebox_qwen35.loader:load_moe",
                ops="lucebox_qwen35.ops:QWEN35_OPS",
                description="Qwen3.5 / Qwen3.6 MoE (35B-A3B): the hybrid with softmax top-k experts and a gated "
                            "shared expert"),
    ModelFamily(name="qwen3", architectures=["qwen3"], loader="lucebox_qwen35.qwen3:load",
                ops="lucebox_qwen35.ops:QWEN35_OPS",
                description="Qwen3 dense (e.g. Qwen3-0.6B): GQA with q/k RMSNorm, NeoX RoPE, SwiGLU"),
)

# The family's own draft files (written by `lucebox synth --arch qwen35-dflash-draft`) are DFlash drafters:
# the core's DFlash loader reads them.
lucebox_drafters = provides(dflash_drafter("qwen35-dflash-draft", "DFlash drafter files written for qwen35 targets"))

lucebox_synthesizers = provides(
    Synthesizer(name="qwen35", writer="lucebox_qwen35.synth:write", sizes=["tiny", "0.8b", "27b"],
                types=SYNTHESIZED_TYPES, description="random-weight qwen35 GGUF with llama.cpp's exact layout"),
    Synthesizer(name="qwen35moe", writer="lucebox_qwen35.synth:write_moe", sizes=["tiny", "35b-a3b"],
                types=SYNTHESIZED_TYPES, options=["router_skew"], description="random-weight qwen35moe GGUF with llama.cpp's exact layout"),
    Synthesizer(name="qwen3", writer="lucebox_qwen35.synth:write_qwen3", sizes=["tiny", "0.6b"],
                types=SYNTHESIZED_TYPES, description="random-weight qwen3 GGUF with llama.cpp's exact layout "
                                                     "(Qwen3-0.6B) and Qwen3's tokenizer"),
    dflash_draft_synthesizer("qwen35", writer="lucebox_qwen35.draft_synth:write"),
)

lucebox_converters = provides(
    Converter(name="qwen35", model_types=["qwen3_5", "qwen3_5_text"], writer="lucebox_qwen35.convert:convert",
              types=CONVERTED_TYPES, description="transformers Qwen3.5/3.6 checkpoint to GGUF (llama.cpp conventions)"),
    Converter(name="qwen35moe", model_types=["qwen3_5_moe", "qwen3_5_moe_text"],
              writer="lucebox_qwen35.convert:convert_moe", types=CONVERTED_TYPES,
              description="transformers Qwen3.5/3.6 MoE checkpoint to a qwen35moe GGUF (llama.cpp conventions)"),
    Converter(name="qwen3", model_types=["qwen3"], writer="lucebox_qwen35.convert_qwen3:convert",
              types=CONVERTED_TYPES, description="transformers Qwen3 checkpoint (Qwen3ForCausalLM) to a qwen3 GGUF "
                                                 "(llama.cpp conventions)"),
)

lucebox_default_models = provides(
    DefaultModel(name="lucebox-demo-qwen35-stdlib", provider="lucebox_qwen35.default:provide_trained",
                 draft_provider="lucebox_qwen35.default:provide_trained_draft", tree_budget="auto",
                 description="a small code model trained on the Python standard library, with its DFlash drafter: "
                             "Lucebox's demo, it continues Python code; pass -m for a real model")
)

lucebox_response_parsers = provides(
    ResponseParser(name="qwen35", factory="lucebox_qwen35.tool_calls:create_parser",
                   architectures=["qwen35", "qwen35moe"],
                   description="<think> reasoning and Qwen XML tool calls (<tool_call><function=...><parameter=...>)"),
    ResponseParser(name="qwen3", factory="lucebox_qwen35.qwen3_tool_calls:create_parser", architectures=["qwen3"],
                   description="<think> reasoning and Qwen3's JSON tool calls (<tool_call>{\"name\": ..., "
                               "\"arguments\": {...}}</tool_call>)"),
)
