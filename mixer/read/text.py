"""Raw text tokenized as it is read: :class:`TextDecode`, for a Hugging Face ``tokenizers`` tokenizer
(or the fast tokenizer of ``transformers``, whose ``backend_tokenizer`` it is), and the chunks long
documents are cut into.

A source with ``decode=TextDecode(tokenizer)`` is read by :class:`mixer.stream.text_stream.TextStream`:
its shuffle buffer holds documents as text, a run of them is tokenized in one ``encode_batch`` call as
they leave it, and each document becomes one sample per chunk of at most ``max_length`` tokens (the
batching's longest sample by default), so nothing is truncated. The up-front look
(:mod:`mixer.plan.profiling`) tokenizes only a small sample of text and estimates the rest of the
lengths from their size in characters.

Where a chunk lives: the *k*-th chunk of the document at byte ``offset`` of its shard is located at
``offset + (k + 1) * 2**40`` (:func:`chunk_offset`); a location below ``2**40`` is a document as
text. Both are read again by location on resume (:mod:`mixer.stream.reread`).

``tokenizers`` is an optional dependency: ``pip install 'wds-mixer[text]'``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mixer import _check, storage
from mixer.errors import ConfigError, SampleError
from mixer.read.decode import Sample

__all__ = ["Measure", "TextDecode", "chunk_lengths", "chunk_offset", "chunk_samples", "split_location"]

CHUNK_SHIFT = 40
"""A chunk's location is its document's byte offset plus ``(k + 1) << CHUNK_SHIFT`` (shards up to 1 TiB)."""
_OFFSETS = (1 << CHUNK_SHIFT) - 1

_tokenizers: Any = None
_quiet_pid = -1  # the process in which the tokenizer's own threads were turned off


def tokenizers_module() -> Any:
    """The ``tokenizers`` module, or a clear error saying how to install it."""
    global _tokenizers
    if _tokenizers is None:
        try:
            import tokenizers
        except ImportError as exc:
            raise ConfigError(
                f"mixer.TextDecode needs the 'tokenizers' package ({exc}); install it with pip install "
                "'wds-mixer[text]'"
            ) from exc
        _tokenizers = tokenizers
    return _tokenizers


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``: itself, a transformers fast tokenizer's
    ``backend_tokenizer``, or the one a ``tokenizer.json`` path names."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        try:
            return tokenizers_module().Tokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 (the Rust side raises plain Exceptions)
            raise ConfigError(f"TextDecode: cannot load a tokenizer from {path!r}: {exc}") from exc
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' PreTrainedTokenizerFast
    if backend is not None:
        tokenizer = backend
    if all(callable(getattr(tokenizer, m, None)) for m in ("encode", "encode_batch", "to_str", "token_to_id")):
        return tokenizer
    raise ConfigError(
        f"TextDecode: tokenizer must be a tokenizers.Tokenizer, a transformers fast tokenizer (use_fast=True) or the "
        f"path of a tokenizer.json file (got {type(tokenizer).__module__}.{type(tokenizer).__qualname__})"
    )


def _parse_field(field: Any) -> tuple[str, tuple[str, ...] | None]:
    """``"txt"`` → member ``txt`` as text; ``"json:text"`` (or ``"json:meta.body"``) → that key of
    the member parsed as JSON."""
    _check.string(field, "TextDecode.field")
    member, sep, path = field.partition(":")
    keys = tuple(path.split(".")) if sep else None
    if not member or (keys is not None and not all(keys)):
        _check.fail(
            "TextDecode.field",
            "must be a member name ('txt') or a member and a JSON key path ('json:text', 'json:meta.body'), got "
            f"{field!r}",
        )
    return member, keys


def _token_id(tokenizer: Any, value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        found = tokenizer.token_to_id(value)
        if found is None:
            raise ConfigError(f"TextDecode.{name}: the tokenizer has no token {value!r}")
        return int(found)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return int(_check.number(value, f"TextDecode.{name}", minimum=0, maximum=vocab - 1, integer=True))


class TextDecode:
    """``decode=`` for raw text: each document's tokens, ``bos`` + the tokenizer's ids + ``eos``, cut
    into chunks of at most ``max_length`` tokens that are delivered as separate samples.

    * ``tokenizer``: a ``tokenizers.Tokenizer``, a ``transformers`` fast tokenizer (its
      ``backend_tokenizer`` is used: the same ids as calling it), or the path of a ``tokenizer.json``.
    * ``field``: where the text is: a member (``"txt"``, read as UTF-8), or a member parsed as JSON
      and a key path in it (``"json:text"``, ``"json:meta.body"``). A missing member or key, invalid
      UTF-8 or JSON, or a value that is not a string is a :class:`~mixer.SampleError` naming the
      shard, the key and the field (the source's ``on_error`` applies).
    * ``eos`` / ``bos``: a token id or token string added at the end / start of every document (not
      of every chunk); None adds none. ``add_special_tokens``: also apply the tokenizer's own
      post-processor (its template's special tokens).
    * ``max_length``: the longest chunk, in tokens; None: the batching's longest sample
      (``TokenBudget.max_length``, else ``max_tokens``; a ``Packed`` row). A document of ``n`` tokens
      becomes ``ceil(n / max_length)`` chunks, all full but the last; the chunks of a document cut
      in several keep its key with ``#k`` appended (``doc-17#0``, ``doc-17#1``...) and are counted in
      the source's ``split`` counter. A document of no tokens is dropped (counted in ``dropped``).

    Picklable and fork-safe: pickling carries the tokenizer as its JSON text, rebuilt once in the
    process that unpickles it. In any process but the one that built the decode (DataLoader workers,
    :func:`mixer.plan.pretokenize.pretokenize`'s processes) the tokenizer's own thread pool is turned
    off (``TOKENIZERS_PARALLELISM=false`` there): those processes are the parallelism, and a pool
    forked from a parent that had used it would deadlock. Its ``repr`` names the tokenizer by a
    digest of its JSON, so the mixture's fingerprint changes with the tokenizer.
    """

    digest: str  # of the tokenizer's JSON (sha256, 16 hex digits)
    field: str
    eos: int | None  # as token ids
    bos: int | None
    max_length: int | None
    add_special_tokens: bool
    _tokenizer: Any
    _json: str | None
    _pid: int
    _member: str
    _keys: tuple[str, ...] | None
    _extra: int

    def __init__(
        self,
        tokenizer: Any,
        *,
        field: str = "txt",
        eos: int | str | None = None,
        bos: int | str | None = None,
        max_length: int | None = None,
        add_special_tokens: bool = False,
    ) -> None:
        backend = _backend(tokenizer)
        member, keys = _parse_field(field)
        eos_id, bos_id = _token_id(backend, eos, "eos"), _token_id(backend, bos, "bos")
        fields = {
            "_tokenizer": backend,
            "_json": None,  # the tokenizer's JSON, only while pickled
            "_pid": os.getpid(),
            "_member": member,
            "_keys": keys,
            "_extra": (bos_id is not None) + (eos_id is not None),
            "digest": hashlib.sha256(backend.to_str().encode()).hexdigest()[:16],
            "field": field,
            "eos": eos_id,
            "bos": bos_id,
            "max_length": _check.optional(max_length, _check.count, "TextDecode.max_length"),
            "add_special_tokens": _check.boolean(add_special_tokens, "TextDecode.add_special_tokens"),
        }
        self.__dict__.update(fields)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TextDecode is frozen: cannot set {name!r} (make another TextDecode)")

    # ---- configuration ----------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What decides the tokens (the tokenizer by the digest of its JSON)."""
        return {
            "type": "TextDecode",
            "tokenizer": f"sha256:{self.digest}",
            "field": self.field,
            "eos": self.eos,
            "bos": self.bos,
            "max_length": self.max_length,
            "add_special_tokens": self.add_special_tokens,
        }

    def __repr__(self) -> str:
        # Deterministic across processes: part of the mixture's fingerprint and of index files.
        d = self.describe()
        return "TextDecode(" + ", ".join(f"{k}={v!r}" for k, v in d.items() if k != "type") + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextDecode) and self.describe() == other.describe()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_json"] = self.tokenizer.to_str()
        state["_tokenizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (rebuilt from JSON once after unpickling)."""
        if self._pid != os.getpid():
            _quiet_threads()
        if self._tokenizer is None:
            self.__dict__.update(_tokenizer=tokenizers_module().Tokenizer.from_str(self._json), _json=None)
        return self._tokenizer

    def chunk_length(self, longest: int) -> int:
        """The longest chunk under a batching whose longest sample is ``longest``."""
        return longest if self.max_length is None else min(self.max_length, longest)

    # ---- decoding ---------------------------------------------------------------------------

    def text(self, sample: Mapping[str, Any]) -> str:
        """The document's text (see ``field``); a :class:`~mixer.SampleError` naming shard, key and field."""
        data = sample.get(self._member)
        if data is None:
            members = sorted(k for k in sample if not k.startswith("__"))
            raise SampleError(
                f"{_where(sample)}: no member {self._member!r} for field {self.field!r} (members: {members})"
            )
        if self._keys is None:
            return _utf8(data, sample, self._member)
        try:
            value: Any = json.loads(data)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise SampleError(f"{_where(sample)}: member {self._member!r} is not valid JSON: {exc}") from exc
        for depth, key in enumerate(self._keys):
            if not isinstance(value, dict) or key not in value:
                at = ".".join(self._keys[:depth]) or "the top level"
                has = sorted(value)[:10] if isinstance(value, dict) else f"a {type(value).__name__}"
                raise SampleError(
                    f"{_where(sample)}: member {self._member!r} has no key {'.'.join(self._keys[: depth + 1])!r} "
                    f"for field {self.field!r} ({at} holds {has})"
                )
            value = value[key]
        if not isinstance(value, str):
            raise SampleError(
                f"{_where(sample)}: field {self.field!r} holds a {type(value).__name__}, not a string of text"
            )
        return value

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The tokens of each text (``bos`` + ids + ``eos``, int32), all in one ``encode_batch`` call."""
        if not texts:
            return []
        tok = self.tokenizer
        batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # (fast: no character offsets)
        return [self._framed(e.ids) for e in batch(list(texts), add_special_tokens=self.add_special_tokens)]

    def count(self, texts: Sequence[str]) -> list[int]:
        """How many tokens each text makes, one ``encode`` at a time: never the tokenizer's thread
        pool, so the up-front look in the main process leaves none for DataLoader workers to inherit."""
        tok = self.tokenizer
        return [len(tok.encode(t, add_special_tokens=self.add_special_tokens).ids) + self._extra for t in texts]

    def __call__(self, sample: Mapping[str, Any]) -> np.ndarray:
        """The whole document's tokens (what a shard index counts; a stream delivers chunks)."""
        return self.encode([self.text(sample)])[0]

    def _framed(self, ids: list[int]) -> np.ndarray:
        if not self._extra:
            return np.array(ids, dtype=np.int32)
        out = np.empty(len(ids) + self._extra, dtype=np.int32)
        start = 0
        if self.bos is not None:
            out[0], start = self.bos, 1
        out[start : start + len(ids)] = ids
        if self.eos is not None:
            out[-1] = self.eos
        return out


def _quiet_threads() -> None:
    global _quiet_pid
    if _quiet_pid != os.getpid():
        _quiet_pid = os.getpid()
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the tokenizer on every batch call


def _utf8(data: Any, sample: Mapping[str, Any], member: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SampleError(f"{_where(sample)}: member {member!r} is not UTF-8 text: {exc}") from exc


def _where(sample: Mapping[str, Any]) -> str:
    return f"shard {storage.redact(str(sample.get('__url__', '?')))}, key {sample.get('__key__')!r}"


# ---- chunks -----------------------------------------------------------------------------------


def chunk_offset(offset: int, k: int) -> int:
    """The location of chunk ``k`` of the document at byte ``offset`` (see the module docstring)."""
    if offset > _OFFSETS:
        raise SampleError(f"byte offset {offset}: text documents are located in shards of at most 1 TiB")
    return offset + ((k + 1) << CHUNK_SHIFT)


def split_location(offset: int) -> tuple[int, int]:
    """``(document byte offset, chunk)`` of a location; chunk -1 for a document as text."""
    return offset & _OFFSETS, (offset >> CHUNK_SHIFT) - 1


def chunk_samples(doc: Sample, tokens: np.ndarray, length: int) -> list[Sample]:
    """The samples of document ``doc`` (a text record: its key, shard and byte offset), ``tokens``
    cut into chunks of at most ``length``; none for a document of no tokens."""
    n = len(tokens)
    if n <= length:
        return [Sample(doc.key, tokens, n, doc.shard, chunk_offset(doc.offset, 0))] if n else []
    return [
        Sample(
            f"{doc.key}#{k}",
            tokens[start : start + length],
            min(length, n - start),
            doc.shard,
            chunk_offset(doc.offset, k),
        )
        for k, start in enumerate(range(0, n, length))
    ]


def chunk_lengths(lengths: np.ndarray, length: int) -> np.ndarray:
    """The chunk lengths documents of ``lengths`` tokens are cut into (in document order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    full, rest = np.divmod(lengths, length)
    counts = full + (rest > 0)
    out = np.full(int(counts.sum()), length, dtype=np.int64)
    ends = np.cumsum(counts)
    has_rest = rest > 0
    out[ends[has_rest] - 1] = rest[has_rest]
    return out


MEASURE_CHARS = 1 << 16
"""Characters of text the up-front look tokenizes (spread over the shards it reads) to measure a
text source's tokens per character; every other document's length is estimated from its size."""


class Measure:
    """The up-front look at a text source (:mod:`mixer.plan.profiling`): :meth:`add` takes a tar
    sample and returns its text's size in characters, keeping the first characters of each shard
    read (at most :data:`MEASURE_CHARS` over ``shards`` shards) to measure on; :meth:`tokens` turns
    sizes into estimated token counts."""

    def __init__(self, decode: TextDecode, shards: int) -> None:
        self.decode = decode
        self.per_shard = max(1, MEASURE_CHARS // max(shards, 1))
        self.kept: dict[int, int] = {}
        self.texts: list[str] = []

    def add(self, sample: Mapping[str, Any], shard: int) -> int:
        text = self.decode.text(sample)
        kept = self.kept.get(shard, 0)
        if kept < self.per_shard:
            piece = text[: self.per_shard - kept]
            self.texts.append(piece)
            self.kept[shard] = kept + len(piece)
        return len(text)

    def tokens(self, chars: np.ndarray) -> np.ndarray:
        """Each document's tokens, estimated at the tokens per character measured on the texts kept."""
        decode = self.decode
        extra = decode.count([""])[0]  # what every document gets besides its text's tokens
        counts = decode.count(self.texts)
        measured = sum(len(t) for t in self.texts)
        rate = (sum(counts) - extra * len(counts)) / measured if measured else 0.0
        return np.rint(np.asarray(chars, dtype=np.float64) * rate).astype(np.int64) + extra
