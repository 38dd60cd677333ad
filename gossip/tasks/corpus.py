"""The text ``charlm`` trains on, its fixed validation split, and its samples.

**The default corpus** needs no download: the ``.py`` sources of the running interpreter's standard
library, read in sorted path order, leaving out the test suites (``test``, ``tests``, ``idle_test``) and
``site-packages`` (about 730 files and 12 MB on CPython 3.11). Another Python gives another text; the
corpus's name, size and SHA-256 (over every file's relative path, length and bytes) are recorded in
summary.json, so two runs are known to have trained on the same text. ``--data PATH`` takes a text file, or
a folder whose files (every one, hidden ones and ``__pycache__`` left out) are read the same way.

**Characters are bytes**: the text is read as raw bytes and every byte is a token (a vocabulary of 256), so
any text, in any encoding, needs no vocabulary file and every run has the same model shape. On the default
corpus 99.97% of the bytes are ASCII, so bits per byte are bits per character.

**The validation split** depends on the text only, never on the seed: every file is cut into blocks of
``BLOCK`` bytes, and the twentieth of all blocks whose BLAKE2b hashes are smallest is held out (at least
one block). Identical blocks (licence headers) hash alike and so land on the same side. Held-out text is
never trained on, whatever the partition.

**Samples** are windows of ``context + 1`` bytes (the inputs and, shifted by one, the targets), cut from
each run of consecutive training blocks of a file at a stride of ``context``, so every training byte but
a run's last few is predicted exactly once per epoch. A window belongs to one file, which is what
``--partition by-file`` deals out. Evaluation uses ``EVAL_WINDOWS`` windows spread evenly over the
held-out text: the same windows in every run, so losses compare across modes and seeds.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gossip.errors import TaskError

BLOCK = 16384  # bytes per validation unit
HELD_OUT = 20  # one block in HELD_OUT is validation text
EVAL_WINDOWS = 256
SKIPPED_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class Corpus:
    name: str
    files: tuple[str, ...]  # paths relative to the root, in reading order
    text: np.ndarray  # uint8: every file's bytes, one after the other
    starts: np.ndarray  # int64: where each file begins in ``text``, and its end (len(files) + 1 entries)
    sha256: str


@dataclass(frozen=True)
class Windows:
    """Where the samples of a context length lie in a corpus's text."""

    train: np.ndarray  # int64: start of every training window
    train_file: np.ndarray  # int64: the file each training window comes from
    eval: np.ndarray  # int64: start of every evaluation window
    held_out_bytes: int


def default_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_name() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"


def list_files(root: Path, suffix: str = "") -> list[Path]:
    """Files under ``root`` in sorted path order (directories sorted at every level), hidden ones and
    ``SKIPPED_DIRS`` left out; with ``suffix``, only names ending in it."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
        found += [Path(folder) / n for n in sorted(names) if n.endswith(suffix) and not n.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def corpus_files(data: str) -> tuple[str, Path, list[Path]]:
    """(name, root, files) of ``--data`` (empty: the default corpus), or ``TaskError`` in one line."""
    if not data:
        root = default_root()
        return default_name(), root, list_files(root, ".py")
    path = Path(data).expanduser()
    if path.is_file():
        return path.name, path.parent, [path]
    if path.is_dir():
        files = [f for f in list_files(path) if f.is_file()]
        if not files:
            raise TaskError(f"--data {data}: the folder holds no files to train on")
        return str(path), path, files
    raise TaskError(f"--data {data}: no such file or folder")


def read_corpus(data: str = "") -> Corpus:
    name, root, paths = corpus_files(data)
    digest, chunks, relative = hashlib.sha256(), [], []
    for path in paths:
        try:
            content = path.read_bytes()
        except OSError as exc:
            raise TaskError(f"cannot read {path} of the charlm corpus: {exc.strerror}") from exc
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
        chunks.append(content)
        relative.append(rel)
    starts = np.concatenate([[0], np.cumsum([len(c) for c in chunks], dtype=np.int64)])
    text = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return Corpus(name, tuple(relative), text, starts, digest.hexdigest())


def held_out_blocks(corpus: Corpus) -> set[tuple[int, int]]:
    """(file, block) of every validation block: the twentieth with the smallest hashes."""
    keyed = []
    for index in range(len(corpus.files)):
        begin, end = int(corpus.starts[index]), int(corpus.starts[index + 1])
        for block, at in enumerate(range(begin, end, BLOCK)):
            digest = hashlib.blake2b(corpus.text[at:min(at + BLOCK, end)].tobytes(), digest_size=8).digest()
            keyed.append((digest, index, block))
    if len(keyed) < 2:
        raise TaskError(f"the charlm corpus {corpus.name} is too small ({len(corpus.text)} bytes): it needs at least "
                        f"{BLOCK + 1} bytes, so that one block of {BLOCK} can be held out for validation")
    keyed.sort()
    return {(index, block) for _, index, block in keyed[:max(1, len(keyed) // HELD_OUT)]}


def windows(corpus: Corpus, context: int) -> Windows:
    """The training and evaluation windows of ``context + 1`` bytes (module docstring)."""
    held = held_out_blocks(corpus)
    train, train_file, held_starts, held_bytes = [], [], [], 0
    for index in range(len(corpus.files)):
        begin, end = int(corpus.starts[index]), int(corpus.starts[index + 1])
        blocks = range(begin, end, BLOCK)
        for validation, first, last in _runs([(index, b) in held for b in range(len(blocks))]):
            run_begin, run_end = begin + first * BLOCK, min(begin + (last + 1) * BLOCK, end)
            cut = np.arange(run_begin, run_end - context, context, dtype=np.int64)
            if validation:
                held_starts.append(cut)
                held_bytes += run_end - run_begin
            else:
                train.append(cut)
                train_file.append(np.full(len(cut), index, dtype=np.int64))
    train_starts = np.concatenate(train) if train else np.zeros(0, np.int64)
    held_out = np.concatenate(held_starts) if held_starts else np.zeros(0, np.int64)
    if not len(train_starts) or not len(held_out):
        raise TaskError(f"the charlm corpus {corpus.name} ({len(corpus.text)} bytes) yields no "
                        f"{'training' if not len(train_starts) else 'validation'} window of {context + 1} bytes; "
                        "give more text (--data) or a shorter --context")
    picked = np.unique(np.linspace(0, len(held_out) - 1, min(EVAL_WINDOWS, len(held_out))).round().astype(np.int64))
    return Windows(train_starts, np.concatenate(train_file), held_out[picked], held_bytes)


def _runs(flags: list[bool]) -> list[tuple[bool, int, int]]:
    """(value, first, last) of every maximal run of equal values in ``flags``."""
    runs: list[tuple[bool, int, int]] = []
    for position, flag in enumerate(flags):
        if runs and runs[-1][0] == flag:
            runs[-1] = (flag, runs[-1][1], position)
        else:
            runs.append((flag, position, position))
    return runs
