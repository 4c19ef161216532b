"""Logits from llama.cpp on the CPU through llama-cpp-python (f32 KV, flash attention off), for a given token
sequence: teacher-forced, every position.

usage: python llama_cpp_python_logits.py MODEL.gguf '[ids...]' OUT.npy  -> writes [len(ids), vocab] float32
(llama-cpp-python builds from its sdist in ~15 min on 2 cores: see docs/results/ for the recipe.)
"""
import json
import sys

import numpy as np
from llama_cpp import Llama

path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_ctx=max(512, len(ids) + 8), n_gpu_layers=0, flash_attn=False, type_k=0, type_v=0,
            verbose=False, logits_all=True)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
