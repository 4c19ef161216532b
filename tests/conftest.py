"""Test-session setup shared by every test module."""

import os

# Triton decides when `triton.language` is first imported whether its kernels (and its standard library's
# helpers) are compiled or interpreted. Something may import it early (transformers does), so choose for the
# whole session here: without a GPU, the interpreter. (A GPU run can export TRITON_INTERPRET=0.)
os.environ.setdefault("TRITON_INTERPRET", "1")
