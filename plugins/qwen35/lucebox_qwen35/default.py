"""The default model: the trained demo pair (issue #22), a small qwen35 code model trained on the Python standard
library's source and its DFlash drafter, reassembled under the Lucebox home from the package's parts; and the
tiny synthetic qwen35 with random weights (`provide`), which tests and examples still write.

The trained pair (`scripts/train_demo.py` on the H200: 12 layers, hidden 96, the real 248,320-token vocabulary
tied, Q8_0, 38.6 MB; the drafter 3 layers, 1.4 MB) ships gzip-compressed (9.9 MB for the target: most of its
embedding rows are zero) as parts under 16 MiB each in `data/demo/`. Beside them: `manifest.json`, with the
sha256 of every part and of every whole file (`scripts/demo_export.split_into_parts` writes both), and
`expected_greedy.json`, the greedy tokens the files gave for held-out prompts when they were trained (the
test suite's regression check). `reassemble` joins them under the Lucebox home once, checking every checksum;
`provide_trained` / `provide_trained_draft` are the providers the plugin's `DefaultModel` names.

The synthetic model is Q8_0 because it is the smallest type that keeps every matrix in one simple block format
(its 248,320 x 256 tied embedding dominates the file: 67 MB instead of 254 MB in F32); it is deterministic
(seed 0), so every machine gets the same weights and the same outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import zlib
from importlib import resources
from pathlib import Path
from typing import Any

from lucebox_core.errors import LuceboxError

from . import synth

DEFAULT_SIZE = "tiny"
DEFAULT_TYPE = "q8_0"
DEFAULT_SEED = 0

DEMO_FOLDER = "demo"  # under the package's data folder: the trained pair's parts and manifest
DEMO_TARGET = "lucebox-demo-qwen35-stdlib-q8_0.gguf"
DEMO_DRAFT = "lucebox-demo-qwen35-stdlib-dflash-draft-q8_0.gguf"


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


# -- the trained demo pair, from parts ----------------------------------------------------------------------


def demo_parts_folder() -> Path:
    return Path(str(resources.files("lucebox_qwen35") / "data" / DEMO_FOLDER))


def sha256_of(path: Path) -> str:
    """A file's sha256, read in 1 MiB pieces (the demo parts' manifest names each part and whole file by it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_entry(folder: Path, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LuceboxError(f"{manifest_path}: cannot read the demo model's manifest ({exc.strerror or exc}); "
                           "reinstall lucebox-qwen or pass -m") from None
    except ValueError as exc:
        raise LuceboxError(f"{manifest_path}: not valid JSON ({exc}); reinstall lucebox-qwen") from None
    for entry in manifest.get("files", []):
        if entry.get("name") == name:
            return manifest, entry
    raise LuceboxError(f"{manifest_path}: lists no file {name!r}")


def reassemble(name: str, dest_folder: Path, parts_folder: Path | None = None) -> Path:
    """The file `name` of the parts manifest, joined under `dest_folder` (once: a file already there with the
    manifest's size and sha256 is reused). Every part is checked against its own size and sha256 before it is
    used; the parts are one gzip stream (manifest format 2) or the file itself (format 1); the whole file is
    checked against its own size and sha256 before it takes its name. The write is atomic, so concurrent
    callers are safe. A missing or damaged part is a LuceboxError naming it."""
    folder = parts_folder if parts_folder is not None else demo_parts_folder()
    manifest, entry = _manifest_entry(folder, name)
    dest = Path(dest_folder) / name
    if dest.is_file() and dest.stat().st_size == entry["bytes"] and sha256_of(dest) == entry["sha256"]:
        return dest
    encoding = manifest.get("encoding", "identity")
    if encoding not in ("gzip", "identity"):
        raise LuceboxError(f"{folder / 'manifest.json'}: unknown encoding {encoding!r}; a newer lucebox-qwen wrote it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    whole = hashlib.sha256()
    written = 0
    inflate = zlib.decompressobj(wbits=31) if encoding == "gzip" else None  # 31: a gzip header and trailer
    try:
        with open(tmp, "wb") as out:
            for part in entry["parts"]:
                data = _checked_part(folder / part["name"], part, name)
                try:
                    data = inflate.decompress(data) if inflate is not None else data
                except zlib.error as exc:
                    raise LuceboxError(f"{folder / part['name']}: part of {name} does not inflate ({exc})") from None
                whole.update(data)
                written += len(data)
                out.write(data)
            if inflate is not None and not inflate.eof:
                raise LuceboxError(f"{folder / 'manifest.json'}: the parts of {name} end before their gzip stream does")
            out.flush()
            os.fsync(out.fileno())
        if written != entry["bytes"] or whole.hexdigest() != entry["sha256"]:
            raise LuceboxError(f"{folder / 'manifest.json'}: the parts of {name} give {written} bytes of sha256 "
                               f"{whole.hexdigest()[:16]}..., not the manifest's {entry['bytes']} bytes of "
                               f"{entry['sha256'][:16]}...")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _checked_part(path: Path, part: dict[str, Any], name: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LuceboxError(f"{path}: part of {name} cannot be read ({exc.strerror or exc}); "
                           "reinstall lucebox-qwen") from None
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != part["bytes"] or digest != part["sha256"]:
        raise LuceboxError(f"{path}: part of {name} is damaged ({len(data)} bytes, sha256 {digest[:16]}..., expected "
                           f"{part['bytes']} bytes, {part['sha256'][:16]}...); reinstall lucebox-qwen")
    return data


def provide_trained(home: Path) -> Path:
    """The trained demo target, reassembled under `home`: the default model."""
    return reassemble(DEMO_TARGET, Path(home) / "models")


def provide_trained_draft(home: Path) -> Path:
    """The trained demo target's DFlash drafter, reassembled under `home`."""
    return reassemble(DEMO_DRAFT, Path(home) / "models")
