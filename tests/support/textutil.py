"""Raw text shards and a byte-level BPE trained on them locally with `tokenizers` (no download), for
the tests of `mixer.TextDecode` and `mixer pretokenize`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from shardutil import write_samples

EOS = "<eos>"


def words(seed: int = 0, n: int = 400) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmwfgypbvk"))
    return sorted({"".join(rng.choice(letters, size=int(rng.integers(1, 9)))) for _ in range(n)})


def documents(n: int, *, median_words: float, sigma: float, seed: int, long_every: int = 0) -> list[str]:
    """``n`` documents of sentences over a fixed vocabulary; with ``long_every``, every such
    document is 40x longer (several chunks at the tests' lengths)."""
    vocab = words()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        count = max(1, round(median_words * float(np.exp(sigma * rng.standard_normal()))))
        if long_every and i % long_every == long_every - 1:
            count *= 40
        picked = rng.choice(len(vocab), size=count)
        text = " ".join(vocab[j] for j in picked)
        out.append(text.capitalize().replace(" e ", ". E ") + ".\n")
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int = 600) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return tok


def write_text_shards(
    folder: str | os.PathLike[str],
    name: str,
    docs_per_shard: Sequence[Sequence[str]],
    *,
    member: str = "txt",
    extra: Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, str]]:
    """One sample per document, key ``f"{name}-{shard:04d}-{i:05d}"``, as a ``txt`` member, or, with
    ``member="json"``, as ``{"text": ..., **extra}`` in a ``json`` member. Returns the brace pattern
    and ``{key: text}``."""
    texts: dict[str, str] = {}
    shards = []
    for s, docs in enumerate(docs_per_shard):
        samples = []
        for i, doc in enumerate(docs):
            key = f"{name}-{s:04d}-{i:05d}"
            texts[key] = doc
            if member == "json":
                samples.append({"__key__": key, "json": json.dumps({"text": doc, **(extra or {})}).encode()})
            else:
                samples.append({"__key__": key, member: doc})
        shards.append(samples)
    return write_samples(folder, name, shards), texts


def expected(tok: Any, text: str, eos: int | None) -> np.ndarray:
    """A document's tokens as TextDecode(tok, eos=eos) makes them: the tokenizer's own ids, then eos."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return np.asarray(ids + ([eos] if eos is not None else []), dtype=np.int64)


def reassemble(chunks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{key or key#k: tokens}`` of delivered samples back into whole documents (chunks in order;
    every chunk index present exactly once)."""
    parts: dict[str, dict[int, np.ndarray]] = {}
    for key, tokens in chunks.items():
        base, sep, k = key.rpartition("#")
        doc, index = (base, int(k)) if sep else (key, -1)
        assert index not in parts.setdefault(doc, {}), key
        parts[doc][index] = tokens
    out = {}
    for doc, pieces in parts.items():
        if -1 in pieces:
            assert list(pieces) == [-1], f"{doc}: delivered whole and in chunks"
            out[doc] = pieces[-1]
        else:
            assert sorted(pieces) == list(range(len(pieces))), f"{doc}: chunks {sorted(pieces)}"
            out[doc] = np.concatenate([pieces[k] for k in range(len(pieces))])
    return out
