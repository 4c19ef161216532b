"""The default model: the tiny synthetic qwen35, written once under the Lucebox home.

Q8_0 because it is the smallest type that keeps every matrix in one simple block format (the tiny
model's 248,320 x 256 tied embedding dominates the file: 67 MB instead of 254 MB in F32), and a
Q8_0 matrix dequantizes or runs natively everywhere. The file is deterministic (seed 0), so every
machine gets the same weights and the same outputs.
"""

from __future__ import annotations

from pathlib import Path

from . import synth

DEFAULT_SIZE = "tiny"
DEFAULT_TYPE = "q8_0"
DEFAULT_SEED = 0


def default_path(home: Path) -> Path:
    return Path(home) / "models" / f"qwen35-{DEFAULT_SIZE}-random-{DEFAULT_TYPE}.gguf"


def provide(home: Path) -> Path:
    """Path of the default model under `home`, writing it first if it is not there.

    The write is atomic (temporary file, fsync, rename), so concurrent callers each end up with a
    complete file: the last rename wins and both writers produce identical bytes.
    """
    path = default_path(home)
    if not path.is_file():
        synth.write(path, size=DEFAULT_SIZE, type=DEFAULT_TYPE, seed=DEFAULT_SEED)
    return path
