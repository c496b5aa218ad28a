"""Built-in demo data: three WebDataset sources cut from real text that every Python install ships.

`ensure_demo_shards()` generates the shards once into a cache folder and reuses them afterwards.
The sources have clearly different length distributions, which is what the mixer is about:

* ``prose``: English paragraphs (the stdlib's docstrings, pydoc's topic pages, license texts): short, many;
* ``code``: top-level functions and classes of stdlib modules: medium, long-tailed;
* ``books``: whole documents (modules, pydoc topics, licenses) packed into 4k-32k token chunks: few, long.

Tokens are byte-level: the UTF-8 bytes of the ``txt`` member as an int32 ``tokens.npy`` member.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import webdataset as wds

__all__ = ["ensure_demo_shards"]

logger = logging.getLogger(__name__)

# Bump when the shard contents or layout change: a new version lands in a new subfolder.
FORMAT_VERSION = 1
# An integer: with the float `time.time()` webdataset uses by default, tarfile writes a PAX header
# in front of every member (about 1.7x larger shards, about 2x slower to read).
MTIME = 1_700_000_000

SHARDS = {"prose": 16, "code": 8, "books": 4}
SAMPLES = {"prose": 4096, "code": 1536, "books": 64}
PROSE_MIN, PROSE_MAX = 64, 4096  # bytes; shorter is a heading, longer is rarely a paragraph
CODE_MIN, CODE_MAX = 64, 32768
BOOK_MIN, BOOK_MAX = 4096, 32768
STALE_TMP_S = 3600.0  # a temp folder untouched this long belongs to a run that died

_MANIFEST = "manifest.json"
_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages", "dist-packages"}
_LICENSE_DIR = Path("/usr/share/common-licenses")


def ensure_demo_shards(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Return ``{source: brace pattern}`` for the demo sources, generating them on first use.

    The shards live in ``<cache_dir>/v<FORMAT_VERSION>/`` (default cache dir:
    ``$XDG_CACHE_HOME/mixer/demo`` or ``~/.cache/mixer/demo``). They are written into a temporary
    folder and renamed into place, so an interrupted or concurrent first run never leaves half a
    dataset behind; whichever concurrent run renames first wins and the others reuse its result.
    Generation is deterministic: the same input files give byte-identical shards.
    """
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    final = root / f"v{FORMAT_VERSION}"
    manifest = _load_manifest(final)
    if manifest is None:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root)
        _generate(root, final)
        manifest = _load_manifest(final)
        if manifest is None:
            raise RuntimeError(f"demo shards in {final} are incomplete right after generation")
    return {name: str(final / manifest["sources"][name]["pattern"]) for name in SHARDS}


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixer" / "demo"


# --- cache folder handling -------------------------------------------------------------------


def _load_manifest(final: Path) -> dict | None:
    """The manifest of a complete cache folder, or None if it is missing, stale or damaged."""
    try:
        manifest = json.loads((final / _MANIFEST).read_text())
        complete = manifest["version"] == FORMAT_VERSION and all(
            (final / path).is_file() for entry in manifest["sources"].values() for path in entry["files"]
        )
    except (OSError, ValueError, LookupError, TypeError, AttributeError):  # missing or mangled
        return None
    return manifest if complete else None


def _generate(root: Path, final: Path) -> None:
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
        manifest = _write_sources(tmp, _harvest())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _publish(tmp, final):
        elapsed = time.perf_counter() - start
        logger.info("wrote demo shards to %s in %.1f s", final, elapsed)
        for name, entry in manifest["sources"].items():
            logger.info(
                "  %-6s %2d shards %5d samples %9d tokens, median length %d",
                name,
                len(entry["files"]),
                entry["samples"],
                entry["tokens"],
                entry["median_length"],
            )


def _publish(tmp: Path, final: Path) -> bool:
    """Rename `tmp` to `final`; False (and `tmp` removed) if another run got there first.

    rename(2) refuses to replace a non-empty folder, so a finished cache is never clobbered; one
    without a valid manifest (damaged, or not ours) is moved aside once and the rename retried.
    """
    for attempt in range(2):
        try:
            os.rename(tmp, final)
            return True
        except OSError:
            if _load_manifest(final) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                logger.info("another process generated %s first; reusing it", final)
                return False
            if attempt:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            logger.warning("demo cache %s is incomplete; replacing it", final)
            _discard(final)
    raise AssertionError("unreachable")


def _discard(folder: Path) -> None:
    # Move aside first: the rename is atomic, the removal that follows is not.
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        os.rename(folder, trash / folder.name)
    except FileNotFoundError:  # a concurrent run moved it first
        pass
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_temps(root: Path) -> None:
    """Remove temp folders of runs that died; recent ones may belong to a run still going."""
    now = time.time()
    for path in root.glob(".*.tmp-*"):
        try:
            if now - path.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:  # removed by someone else meanwhile
            pass


# --- writing ---------------------------------------------------------------------------------


def _write_sources(folder: Path, texts: dict[str, list[str]]) -> dict:
    sources = {name: _write_source(folder, name, texts[name], SHARDS[name]) for name in SHARDS}
    manifest = {"version": FORMAT_VERSION, "sources": sources}
    (folder / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _write_source(folder: Path, name: str, texts: list[str], shards: int) -> dict:
    if len(texts) < shards:
        raise RuntimeError(f"demo source {name!r}: found {len(texts)} texts, need at least {shards}")
    (folder / name).mkdir()
    lengths = []
    writer = wds.ShardWriter(str(folder / name / f"{name}-%04d.tar"), maxcount=len(texts) + 1, verbose=0, mtime=MTIME)
    with writer:
        # Explicit shard boundaries (next_stream) rather than maxcount: sizes differ by at most one.
        for shard, part in enumerate(np.array_split(np.arange(len(texts)), shards)):
            if shard:
                writer.next_stream()
            for index, i in enumerate(part):
                data = texts[i].encode("utf-8")
                key = f"{name}-{shard:04d}-{index:06d}"
                tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
                writer.write({"__key__": key, "txt": data, "tokens.npy": tokens})
                lengths.append(len(data))
    return {
        "pattern": f"{name}/{name}-{{0000..{shards - 1:04d}}}.tar",
        "files": [f"{name}/{name}-{shard:04d}.tar" for shard in range(shards)],
        "samples": len(lengths),
        "tokens": int(sum(lengths)),
        "median_length": int(np.median(lengths)),
    }


# --- harvesting real text --------------------------------------------------------------------


def _harvest() -> dict[str, list[str]]:
    """Texts per source, chosen and ordered deterministically (by content hash, no RNG)."""
    modules = _stdlib_modules()
    # Split the modules between `code` and `books` so the two sources do not repeat each other.
    code_modules = [(rel, src) for rel, src in modules if _digest(rel)[0] % 2 == 0]
    book_modules = [(rel, src) for rel, src in modules if _digest(rel)[0] % 2 == 1]
    licenses = _licenses()
    topics = _pydoc_topics()

    prose: list[str] = []
    code: list[str] = []
    for _, src in code_modules:
        tree = _parse(src)
        if tree is None:
            continue
        code.extend(_code_blocks(src, tree))
        for doc in _docstrings(tree):
            prose.extend(_paragraphs(doc))
    for _, text in licenses + topics:
        prose.extend(_paragraphs(text))

    # Long prose first so that most books read like books; modules fill up the rest.
    documents = sorted(
        [(f"license:{n}", t) for n, t in licenses] + [(f"pydoc:{n}", t) for n, t in topics],
        key=lambda doc: _digest(doc[0]),
    )
    documents += sorted(book_modules, key=lambda doc: _digest(doc[0]))
    return {
        "prose": _pick(prose, SAMPLES["prose"]),
        "code": _pick(code, SAMPLES["code"]),
        # _pick only shuffles here: consecutive books would otherwise share a shard and a topic.
        "books": _pick(_books((text for _, text in documents), SAMPLES["books"]), SAMPLES["books"]),
    }


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def _pick(texts: list[str], n: int) -> list[str]:
    """Up to `n` distinct texts, in hash order: a deterministic, well-spread sample and shuffle."""
    return sorted(set(texts), key=lambda text: (_digest(text), text))[:n]


def _read_text(path: Path) -> str:
    # Replacement characters keep every sample valid UTF-8 whatever the file's encoding.
    return path.read_bytes().decode("utf-8", "replace")


def _stdlib_modules() -> list[tuple[str, str]]:
    """(relative path, source) of the stdlib's .py files, without tests and tools, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "__"))]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return [(path.relative_to(stdlib).as_posix(), _read_text(path)) for path in sorted(found)]


def _licenses() -> list[tuple[str, str]]:
    """License texts of this machine (Debian's common-licenses) and of Python itself, if present."""
    paths = sorted(_LICENSE_DIR.glob("*")) if _LICENSE_DIR.is_dir() else []
    paths.append(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    seen: set[Path] = set()
    texts = []
    for path in paths:
        real = path.resolve()
        if real.is_file() and real not in seen:  # GPL -> GPL-3 and friends are symlinks
            seen.add(real)
            texts.append((path.name, _read_text(real)))
    return texts


def _pydoc_topics() -> list[tuple[str, str]]:
    # The text of the language reference that `help()` shows; part of the stdlib, but some
    # distributions strip it, so it is optional.
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return sorted(topics.items())


def _parse(src: str) -> ast.Module | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences etc. are not our business
        try:
            return ast.parse(src)
        except (SyntaxError, ValueError):
            return None


def _docstrings(tree: ast.Module) -> Iterator[str]:
    nodes: list[ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef] = [tree]
    while nodes:
        node = nodes.pop()
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
        nodes.extend(
            child
            for child in reversed(node.body)
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        )


def _code_blocks(src: str, tree: ast.Module) -> Iterator[str]:
    """Top-level functions and classes with their decorators, cut to CODE_MAX at a line end."""
    lines = src.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            block = "".join(lines[first - 1 : node.end_lineno]).rstrip() + "\n"
            block = _cut(block, CODE_MAX)
            if len(block.encode("utf-8")) >= CODE_MIN:
                yield block


def _cut(text: str, limit: int) -> str:
    """`text` shortened to at most `limit` UTF-8 bytes, at a line end where there is one."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    head = data[:limit].decode("utf-8", "ignore")
    end = head.rfind("\n")
    return head[: end + 1] if end > 0 else head


_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _paragraphs(text: str) -> Iterator[str]:
    for block in _PARAGRAPH_BREAK.split(text):
        paragraph = inspect.cleandoc(block)
        if PROSE_MIN <= len(paragraph.encode("utf-8")) <= PROSE_MAX and _looks_like_prose(paragraph):
            yield paragraph


_WORDISH = re.compile(r"[^\W\d_]| ")  # a letter (any script) or a space


def _looks_like_prose(text: str) -> bool:
    # Rejects code examples, grammar rules and tables that share the docs with the prose.
    return len(_WORDISH.findall(text)) >= 0.85 * len(text) and text.count(" ") >= 8


def _books(documents: Iterable[str], n: int) -> list[str]:
    """Pack whole documents, line by line, into `n` chunks of BOOK_MIN..BOOK_MAX bytes.

    Chunk targets are log-uniform in that range (derived from a hash, so deterministic), which gives
    the few-and-long distribution a "books" source has.
    """
    books: list[str] = []
    lines: list[str] = []
    size = 0
    target = _book_target(0)
    for document in documents:
        for line in (document.rstrip() + "\n\n").splitlines(keepends=True):
            nbytes = len(line.encode("utf-8"))
            if size + nbytes > BOOK_MAX and size >= BOOK_MIN:  # does not fit: close the book early
                books.append("".join(lines))
                lines, size, target = [], 0, _book_target(len(books))
            if size + nbytes > BOOK_MAX:  # a giant line (data tables): keep what fits
                line = _cut(line, BOOK_MAX - size)
                nbytes = len(line.encode("utf-8"))
            lines.append(line)
            size += nbytes
            if size >= target:
                books.append("".join(lines))
                lines, size, target = [], 0, _book_target(len(books))
            if len(books) == n:
                return books
    if size >= BOOK_MIN:
        books.append("".join(lines))
    return books


def _book_target(index: int) -> int:
    fraction = int.from_bytes(_digest(f"book-{index}"), "big") / 2**64
    return int(BOOK_MIN * (BOOK_MAX / BOOK_MIN) ** fraction)
