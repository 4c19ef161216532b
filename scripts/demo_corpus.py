"""The demo models' corpus: the Python standard library's own source (PSF licence), on every machine.

- `stdlib_files`: every `.py` under `sysconfig.get_paths()["stdlib"]`, without installed packages and
  (unless asked) without the test suites, which would otherwise be more than half of it; without the codec
  tables of `encodings/` and the generated `pydoc_data/topics.py` (data, not code).
- `split_heldout`: a fixed set of held-out files, chosen by a hash of the relative path alone, so the same
  files are held out on every machine and Python version that has them.
- `function_prompts`: held-out functions as prompts (the signature and the docstring, what a user would
  type before asking for the body), found with `ast`; the acceptance benchmark and the recorded greedy
  texts use them, and `chat_documents` turns training functions into chat turns (the user gives the
  signature and the docstring, the assistant answers with the function) so a chat request to the default
  model gets code back rather than noise.
- `Corpus.build`: the token streams (files joined by `<|endoftext|>`), tokenized once with the real
  Qwen3.5 tokenizer and cached as `.npy` files.
"""

from __future__ import annotations

import ast
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import platform
import re
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import numpy as np

SKIPPED_PARTS = {"site-packages", "dist-packages", "__pycache__"}
TEST_PARTS = {"test", "tests", "idle_test"}
DATA_PARTS = {"encodings", "pydoc_data"}  # codec tables and generated documentation: data, not code
END_OF_TEXT = "<|endoftext|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_hash(relative: str) -> int:
    """A stable number for a relative path (`/` separators), the same on every machine."""
    return int(hashlib.sha256(relative.encode("utf-8")).hexdigest()[:12], 16)


def stdlib_files(root: Path | None = None, *, include_tests: bool = False) -> list[str]:
    """Relative paths (`/` separators, sorted) of the corpus's `.py` files under `root`."""
    root = root or stdlib_root()
    skipped = SKIPPED_PARTS | DATA_PARTS | (set() if include_tests else TEST_PARTS)
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if skipped & set(parts[:-1]) or (not include_tests and parts[-1].startswith("test_")):
            continue
        files.append("/".join(parts))
    return sorted(files)


def split_heldout(files: Iterable[str], permille: int) -> tuple[list[str], list[str]]:
    """(train, held out): a file is held out when its path hash falls in the first `permille` of 1000; at
    least one file is held out (the lowest hash) so a small corpus still has a test set."""
    files = sorted(files)
    heldout = [f for f in files if path_hash(f) % 1000 < permille]
    if not heldout and len(files) > 1:
        heldout = [min(files, key=path_hash)]
    return [f for f in files if f not in set(heldout)], heldout


def read_source(root: Path, relative: str) -> str:
    return (root / relative).read_text(encoding="utf-8", errors="replace")


# -- functions as prompts ---------------------------------------------------------------------------


@attrs.frozen
class FunctionPrompt:
    """A function of a source file: `prompt` is its header and docstring (dedented), `body` the rest."""

    file: str
    name: str
    line: int
    header: str  # the `def ...:` line(s)
    docstring: str
    prompt: str  # header + docstring, as written in the file, ending with a newline
    body: str


def functions(source: str, file: str, *, max_body_lines: int = 80) -> list[FunctionPrompt]:
    """Every function (methods included) of `source` that has a docstring and a body after it."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        if not doc or len(node.body) < 2 or not isinstance(first, ast.Expr):
            continue
        start, doc_end, end = node.lineno - 1, first.end_lineno, node.end_lineno
        if doc_end is None or end is None or end - doc_end > max_body_lines:
            continue
        text = textwrap.dedent("\n".join(lines[start:end]) + "\n")
        text_lines = text.splitlines(keepends=True)
        split = doc_end - start
        prompt, body = "".join(text_lines[:split]), "".join(text_lines[split:])
        header = "".join(text_lines[: first.lineno - 1 - start]).rstrip()
        if not body.strip() or not header.startswith(("def ", "async def ")):
            continue
        found.append(FunctionPrompt(file, node.name, node.lineno, header, doc, prompt, body))
    return sorted(found, key=lambda f: f.line)


def function_prompts(root: Path, files: Iterable[str], count: int, *, min_prompt_chars: int = 60,
                     max_prompt_chars: int = 1200) -> list[FunctionPrompt]:
    """Up to `count` functions of `files` (in a fixed order: by the hash of file and name), with prompts of a
    reasonable length; files missing on this machine are skipped."""
    candidates = []
    for file in files:
        path = root / file
        if not path.is_file():
            continue
        for f in functions(read_source(root, file), file):
            if min_prompt_chars <= len(f.prompt) <= max_prompt_chars and len(f.body.splitlines()) >= 3:
                candidates.append(f)
    candidates.sort(key=lambda f: path_hash(f"{f.file}:{f.name}:{f.line}"))
    return candidates[:count]


def chat_documents(root: Path, files: Iterable[str], render: Callable[[str], str], count: int) -> list[str]:
    """Chat turns made of up to `count` documented functions of `files` (a fixed choice, by hash): the user
    gives the signature and the docstring, the assistant answers with the function in a code block.
    `render(user_text)` is the chat template's prompt up to the assistant's turn."""
    chosen = []
    for file in files:
        module = file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for f in functions(read_source(root, file), file, max_body_lines=60):
            chosen.append((path_hash(f"{f.file}:{f.name}:{f.line}"), module, f))
    chosen = sorted(chosen, key=lambda c: c[0])[:count]
    # The template's text around a user message, rendered once (Jinja is slow): checked on the first one.
    sentinel = "\ue000"
    before, _, after = render(sentinel).partition(sentinel)
    documents = []
    for _, module, f in chosen:
        # Stripped as the template strips a message's content.
        user = f"Write the Python function `{f.header.removesuffix(':')}` ({module}).\n\n{f.docstring}".strip()
        prompt = before + user + after
        if not documents and prompt != render(user):
            before, after = "", None  # the template does more than wrap the text: render each one
        documents.append((prompt if after is not None else render(user)) + f"```python\n{f.prompt}{f.body}```<|im_end|>\n")
    return documents


CHAT_CONTROLS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
_CONTROL_SPLIT = re.compile("(" + "|".join(re.escape(c) for c in CHAT_CONTROLS) + ")")


def encode_chat(tokenizer, text: str, cache: dict[str, list[int]] | None = None) -> list[int]:
    """`text` with the chat template's control tokens as their ids, the rest as plain text: what
    `encode(text, parse_special=True)` gives for a rendered chat (the tokenizer cuts the text at special
    tokens too), without scanning the text for each of the padded vocabulary's hundred thousand control
    tokens. `cache` keeps the ids of the short pieces every turn repeats ("assistant\n", "\n\n")."""
    cache = {} if cache is None else cache
    ids: list[int] = []
    for piece in _CONTROL_SPLIT.split(text):
        if not piece:
            continue
        if piece not in cache:
            token = tokenizer.token_to_id(piece) if piece in CHAT_CONTROLS else None
            if piece in CHAT_CONTROLS and token is None:
                raise ValueError(f"the tokenizer has no {piece} token")
            encoded = [token] if token is not None else tokenizer.encode(piece, add_bos=False)
            if len(piece) > 32:
                ids.extend(encoded)
                continue
            cache[piece] = encoded
        ids.extend(cache[piece])
    return ids


# -- token streams ----------------------------------------------------------------------------------


def docstring_ends(tokenizer, stream: np.ndarray, sources: list[str], starts: list[int]) -> np.ndarray:
    """Positions `p` of `stream` (files `sources` tokenized from `starts`) where `stream[:p]` ends exactly at
    the end of a function's docstring line, newline included. Found by bytes: each token's byte length, summed
    along a file, meets the docstring line's byte offset (a token that straddles it gives no position)."""
    lengths = np.zeros(int(stream.max()) + 1 if stream.size else 1, dtype=np.int64)
    for token in np.unique(stream):
        lengths[token] = len(tokenizer.token_bytes(int(token)))
    found = []
    for source, start, end in zip(sources, starts, [*starts[1:], None]):
        tokens = stream[start:(end - 1 if end is not None else None)]  # the file's own, not its <|endoftext|>
        if end is None:
            tokens = tokens[: _file_length(tokens, tokenizer)]
        reached = np.cumsum(lengths[tokens])
        line_ends = np.cumsum([len(line.encode("utf-8")) for line in source.splitlines(keepends=True)])
        for f in functions(source, ""):
            doc_end = f.line - 1 + f.prompt.count("\n")  # lines of the file up to the docstring's last
            if not 0 < doc_end <= len(line_ends):
                continue
            index = int(np.searchsorted(reached, line_ends[doc_end - 1]))
            if index < len(reached) and reached[index] == line_ends[doc_end - 1]:
                found.append(start + index + 1)
    return np.unique(np.asarray(found, dtype=np.int64))


def _file_length(tokens: np.ndarray, tokenizer) -> int:
    """The last file's tokens end at its <|endoftext|> (the chat documents may follow)."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    where = np.nonzero(tokens == eot)[0]
    return int(where[0]) if where.size else len(tokens)


_WORKER_TOKENIZER = None  # the tokenizer a forked worker inherits (set just before the pool forks)
PARALLEL_FROM = 64  # texts: fewer are tokenized in this process


def _encode_one(job: tuple[str, bool]) -> list[int]:
    text, special = job
    if special:
        return encode_chat(_WORKER_TOKENIZER, text)
    return _WORKER_TOKENIZER.encode(text, add_bos=False)


def _encode_all(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    """Each text's ids, in order; a large corpus across the machine's cores (forked workers share the
    tokenizer: the byte-pair encoder is pure Python, and the whole stdlib takes a minute on one core)."""
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    workers = min(len(os.sched_getaffinity(0)), 32) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = [(text, special) for text in texts]
    if len(texts) < PARALLEL_FROM or workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_encode_one(job) for job in jobs]
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(_encode_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))))



@attrs.frozen
class Corpus:
    """Token streams of the training and held-out files (each file followed by `<|endoftext|>`)."""

    train: np.ndarray  # uint32
    heldout: np.ndarray  # uint32
    train_files: list[str]
    heldout_files: list[str]
    chat_documents: int
    info: dict  # python version, stdlib path, counts: what the metadata records
    # Positions of the training stream just after a function's docstring line: a prompt ending there is what the
    # acceptance benchmark asks (a signature and docstring, the body to come), on training files.
    docstring_ends: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def build(cls, tokenizer, cache_dir: Path, *, include_tests: bool = False, heldout_permille: int = 50,
              max_files: int = 0, chat: Callable[[str], str] | None = None, chat_count: int = 2000,
              log: Callable[[str], None] = print, tokenizer_id: str = "") -> Corpus:
        """Tokenize the stdlib (or load the cached arrays). `max_files` > 0 keeps that many files (the lowest
        path hashes: a fixed sample, for smoke tests); `chat`: the chat template's prompt for a user text,
        to add `chat_count` chat documents to the training stream."""
        root = stdlib_root()
        files = stdlib_files(root, include_tests=include_tests)
        if max_files:
            files = sorted(sorted(files, key=path_hash)[:max_files])
        train_files, heldout_files = split_heldout(files, heldout_permille)
        key_text = json.dumps(["v2", sys.version, str(root), files, include_tests, heldout_permille,
                               chat_count if chat is not None else 0, tokenizer_id])
        key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
        cache = cache_dir / f"corpus-{key}"
        info_path = cache / "info.json"
        if info_path.is_file():
            info = json.loads(info_path.read_text())
            log(f"corpus: cached token arrays {cache}")
            return cls(np.load(cache / "train.npy"), np.load(cache / "heldout.npy"), info["train_files"],
                       info["heldout_files"], info["chat_documents"], info, np.load(cache / "docstring_ends.npy"))
        start = time.perf_counter()
        eot = tokenizer.token_to_id(END_OF_TEXT)
        if eot is None:
            raise ValueError(f"the tokenizer has no {END_OF_TEXT} token")

        def stream(texts: list[str], special: bool, starts: list[int] | None = None) -> np.ndarray:
            ids: list[int] = []
            for encoded in _encode_all(tokenizer, texts, special):
                if starts is not None:
                    starts.append(len(ids))
                ids.extend(encoded)
                ids.append(eot)
            return np.asarray(ids, dtype=np.uint32)

        train_sources = [read_source(root, f) for f in train_files]
        file_starts: list[int] = []
        train = stream(train_sources, False, file_starts)
        ends = docstring_ends(tokenizer, train, train_sources, file_starts)
        heldout = stream([read_source(root, f) for f in heldout_files], False)
        documents = chat_documents(root, train_files, chat, chat_count) if chat is not None and chat_count else []
        if documents:
            train = np.concatenate([train, stream(documents, True)])
        info = {
            "python": platform.python_version(), "stdlib": str(root), "include_tests": include_tests,
            "files": len(files), "train_files": train_files, "heldout_files": heldout_files,
            "heldout_permille": heldout_permille, "chat_documents": len(documents),
            "train_tokens": int(train.size), "heldout_tokens": int(heldout.size), "docstring_ends": int(ends.size),
            "source_bytes": sum((root / f).stat().st_size for f in files),
        }
        cache.mkdir(parents=True, exist_ok=True)
        np.save(cache / "train.npy", train)
        np.save(cache / "heldout.npy", heldout)
        np.save(cache / "docstring_ends.npy", ends)
        info_path.write_text(json.dumps(info, indent=1))
        log(f"corpus: {len(files)} files ({len(heldout_files)} held out), {len(documents)} chat documents, "
            f"{train.size:,} training and {heldout.size:,} held-out tokens, tokenized in "
            f"{time.perf_counter() - start:.1f} s")
        return cls(train, heldout, train_files, heldout_files, len(documents), info, ends)
