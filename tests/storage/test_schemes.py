"""The table of storage schemes (`mixer.storage.registry.SCHEMES`): a scheme's knowledge lives in its
own module of `mixer.storage.schemes` and nowhere else, and a scheme registered from code (here a
test-only ``vault://`` that maps to a local folder through fsspec) is listed, profiled and read by a
Mixture, in DataLoader workers too, like a built-in one.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shardutil import expected_tokens, key_lengths, write_token_shards

import mixer
from mixer.errors import ConfigError
from mixer.storage.backend import FsspecBackend
from mixer.storage.registry import SCHEMES

ROOT = Path(mixer.__file__).parent
SCHEME_FILES = ROOT / "storage" / "schemes"


# ------------------------------------------------------------------ scheme names live in one place


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (prose may name schemes)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def scheme_knowledge(source: str, names: set[str]) -> list[str]:
    """The places in ``source`` that know a scheme by name: a string (not a docstring) holding
    ``name://`` (a regex's ``names?://`` too) or starting with ``name:``; and a bare scheme name
    compared with, looked up in or listed beside anything (``scheme in ("http", "https")``,
    ``SCHEMES["s3"]``, ``{"s3", "s3a"}``), except a comparison that does not involve a scheme."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    alternatives = "|".join(sorted(map(re.escape, names)))
    url_form = re.compile(rf"(?i)(^({alternatives}):|\b({alternatives})s?\??://)")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if url_form.search(node.value):
                found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found += [f"line {e.lineno}: {e.value!r} in a collection" for e in node.elts if _is_name(e, names)]
        elif isinstance(node, ast.Dict):
            found += [
                f"line {k.lineno}: {k.value!r} as a key" for k in node.keys if k is not None and _is_name(k, names)
            ]
        elif isinstance(node, ast.Subscript) and _is_name(node.slice, names):
            found.append(f"line {node.lineno}: [{node.slice.value!r}]")  # type: ignore[attr-defined]
        elif isinstance(node, ast.Compare) and "scheme" in ast.unparse(node).lower():
            operands = [node.left, *node.comparators]
            found += [f"line {node.lineno}: {ast.unparse(node)}" for o in operands if _is_name(o, names)]
    return found


def _is_name(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names


def test_the_check_finds_the_if_chains_it_forbids() -> None:
    names = set(SCHEMES)
    # What the storage layer held before the table (one line each), and what it may hold.
    caught = [
        'if scheme == "pipe":\n    pass',
        'web = scheme in ("http", "https")',
        'PUMPED = {"http", "https", "s3", "s3a"}',
        'EXTRAS = {"s3": ("s3fs", "s3")}',
        '_WEB = re.compile(r"^https?://", re.IGNORECASE)',
        'prefix = "file://"',
        'ok = url.startswith("pipe:")',
        'b = SCHEMES["s3"]',
    ]
    for line in caught:
        assert scheme_knowledge(line, names), line
    allowed = [
        '"""Reads s3:// and http:// shards."""',
        'files = [e for e in entries if e.get("type", "file") == "file"]',
        'raise ConfigError(f"{scheme}:// shards need fsspec")',
        'where = "an s3 bucket"',
    ]
    for line in allowed:
        assert not scheme_knowledge(line, names), line


def test_scheme_names_appear_only_in_the_scheme_modules() -> None:
    names = set(SCHEMES)
    assert {"file", "http", "https", "pipe", "s3", "s3a"} <= names
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == SCHEME_FILES:
            continue
        found = scheme_knowledge(path.read_text(), names)
        if found:
            offenders[str(path.relative_to(ROOT.parent))] = found
    assert not offenders, f"scheme names outside mixer/storage/schemes/ (ask SCHEMES instead): {offenders}"


def test_every_scheme_module_declares_its_backend() -> None:
    modules = sorted(p.stem for p in SCHEME_FILES.glob("*.py") if p.stem != "__init__")
    backends = SCHEMES.backends()
    assert sorted(type(b).__module__.rpartition(".")[2] for b in backends) == modules
    assert [b for b in backends if b.paths] == [SCHEMES.for_scheme(None)] == [SCHEMES["file"]]
    assert [b for b in backends if b.fallback] == [SCHEMES.for_scheme("memory")]
    assert SCHEMES.scheme_of("pipe:cat a.tar") == "pipe" and SCHEMES.scheme_of("HTTPS://h/a.tar") == "https"
    assert SCHEMES.scheme_of("/data/a.tar") is None and SCHEMES.scheme_of("rel:ative/a.tar") is None


def test_a_scheme_name_is_served_once() -> None:
    class Other(FsspecBackend):
        schemes = ("s3",)

    with pytest.raises(ConfigError, match="'s3' is served already"):
        SCHEMES.register(Other())
    assert type(SCHEMES["s3"]).__name__ == "S3"


# -------------------------------------------------------------- a scheme registered from code


class Vault(FsspecBackend):
    """``vault://<path>``: the files of a local folder, through fsspec's DirFileSystem (a test-only
    scheme: no fsspec protocol of that name exists)."""

    schemes = ("vault",)

    def __init__(self, root: Path) -> None:
        self.root = root

    def new_filesystem(self, scheme: str, options: dict[str, Any]) -> Any:
        from fsspec.implementations.dirfs import DirFileSystem
        from fsspec.implementations.local import LocalFileSystem

        class VaultFileSystem(DirFileSystem):
            protocol = "vault"
            async_impl = False  # the local filesystem underneath is not async: call it directly

        return VaultFileSystem(path=str(self.root), fs=LocalFileSystem(), **options)


@pytest.fixture
def vault(tmp_path: Path) -> Any:
    backend = Vault(tmp_path)
    SCHEMES.register(backend)
    yield backend
    SCHEMES.unregister(backend)
    assert "vault" not in SCHEMES


def test_a_registered_scheme_is_listed_and_read_by_a_mixture(vault: Vault, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lengths = {name: [[int(n) for n in rng.integers(3, 60, size=9)] for _ in range(3)] for name in ("web", "code")}
    for name, shards in lengths.items():
        write_token_shards(tmp_path / name, name, shards)
    SCHEMES.unregister(vault)  # without its backend the scheme is unknown
    with pytest.raises(ConfigError, match="unsupported URL scheme 'vault'"):
        mixer.storage.check_url("vault://web/web-000000.tar")
    SCHEMES.register(vault)
    # One source as a brace pattern (nothing listed, sizes looked at up front), one as a prefix (listed).
    assert mixer.storage.expand_urls("vault://code/")[0] == (
        "vault://code/code-000000.tar",
        (tmp_path / "code" / "code-000000.tar").stat().st_size,
    )
    sources = [mixer.Source("web", "vault://web/web-{000000..000002}.tar"), mixer.Source("code", "vault://code/")]
    mix = mixer.Mixture(sources, batching=mixer.TokenBudget(256, max_length=64), stop="all_exhausted", seed=3)
    assert all(url.startswith("vault://") for listed in mix.listed for url in listed.shards)
    expected = {**key_lengths("web", lengths["web"]), **key_lengths("code", lengths["code"])}
    got: Counter[str] = Counter()
    for batch in mixer.make_loader(mix, num_workers=2):  # forked workers read through the table too
        for i, key in enumerate(batch.keys):
            n = int(batch.lengths[i])
            assert n == expected[key] and np.array_equal(batch.tokens[i, :n].numpy(), expected_tokens(key, n))
            got[key] += 1
    assert got == Counter(expected.keys()), "every sample of both sources exactly once"
