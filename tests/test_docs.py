"""The README and the example configs stand on their own: no references to documents users do not
have, and the defaults they state are the library's."""

from __future__ import annotations

import re
from pathlib import Path

from mixer import IOOptions

REPO = Path(__file__).resolve().parents[1]
USER_FACING = [REPO / "README.md", *sorted((REPO / "examples").iterdir()), *sorted((REPO / "mixer").rglob("*.py"))]


def test_no_references_to_documents_outside_the_repository():
    private = re.compile(r"seed 00\d|gotcha|\.\./shared|DESIGN\.md|seeds/")
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in USER_FACING
        if path.is_file()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


def test_readme_states_the_io_options_defaults():
    d = IOOptions()
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert f"`timeout` {d.timeout:g} s" in readme
    assert f"`retries` {d.retries} " in readme
    assert f"`backoff` {d.backoff:g} s" in readme
    assert d.block_size == 1 << 20 and "`block_size` 1 MiB (`1 << 20`" in readme
    assert f"`read_ahead` {d.read_ahead} shards" in readme
    assert f"`max_connections` {d.max_connections} per process" in readme
    assert f"`max_open_shards` {d.max_open_shards} per reader" in readme
    doc = " ".join((IOOptions.__doc__ or "").split())
    for name, shown in (
        ("timeout", f"{d.timeout:g}"),
        ("retries", d.retries),
        ("backoff", d.backoff),
        ("block_size", "1 MiB"),
        ("read_ahead", d.read_ahead),
        ("max_connections", d.max_connections),
        ("max_open_shards", d.max_open_shards),
    ):
        assert f"``{name}`` (default {shown})" in doc


def test_the_architecture_page_names_every_layer_and_module_and_only_those():
    """The architecture page is the map a new maintainer reads first: it must match the code."""
    page = (REPO / "docs" / "internals" / "architecture.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith(("| layer", "|---"))]
    named: set[str] = set()
    for row in rows:
        layer, modules = row.split(" | ")[:2]
        package = "" if layer.strip("| ") == "foundation" else layer.strip("| `/")
        for name in re.findall(r"`([\w/]+)`", modules):
            if name.endswith("/"):  # a subpackage of the foundation, its modules listed after it
                package = name.rstrip("/")
                continue
            named.add(f"{package}.{name}" if package else name)
    modules = {
        ".".join(p.relative_to(REPO / "mixer").with_suffix("").parts)
        for p in (REPO / "mixer").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert modules <= named, f"modules missing from docs/internals/architecture.md: {sorted(modules - named)}"
    assert named <= modules, (
        f"docs/internals/architecture.md names modules that do not exist: {sorted(named - modules)}"
    )
