"""Greedy tokens from llama.cpp on the CPU through llama-cpp-python (f32 KV, flash attention off).

usage: python llama_cpp_python_greedy.py MODEL.gguf '[[ids...], ...]'  -> prints a JSON list of 24-token lists
(llama-cpp-python builds from its sdist in ~15 min on 2 cores: see docs/results/ for the recipe.)
"""
import sys, json
from llama_cpp import Llama
path = sys.argv[1]
prompts = json.loads(sys.argv[2])
llm = Llama(model_path=path, n_ctx=512, n_gpu_layers=0, flash_attn=False, type_k=0, type_v=0, verbose=False, logits_all=True)
out = []
for p in prompts:
    llm.reset()
    toks = []
    cur = list(p)
    llm.eval(cur)
    import numpy as np
    for _ in range(24):
        logits = np.array(llm.scores[llm.n_tokens - 1])
        t = int(np.argmax(logits))
        toks.append(t)
        llm.eval([t])
    out.append(toks)
print(json.dumps(out))
