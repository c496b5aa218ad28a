"""The README, the docs pages, the changelog and the example configs stand on their own: no
references to documents users do not have, and the defaults they state are the library's."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from mixer import IOOptions

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
USER_FACING = [
    REPO / "README.md",
    REPO / "CHANGELOG.md",
    *sorted(DOCS.rglob("*.md")),
    *sorted((REPO / "examples").iterdir()),
    *sorted((REPO / "mixer").rglob("*.py")),
]


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


def test_the_user_facing_pages_are_there():
    # The README's links into the docs, and the pages the docs must have, exist.
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    linked = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)\)", readme)
    assert linked and [p for p in linked if not (REPO / p).is_file()] == []
    for page in (
        "getting-started",
        "performance",
        "guides/remote",
        "reference/api",
        "reference/cli",
        "reference/config",
        "reference/state",
        "internals/architecture",
        "internals/contributing",
    ):
        assert (DOCS / f"{page}.md").is_file(), page


def test_remote_guide_states_the_io_options_defaults():
    d = IOOptions()
    guide = " ".join((DOCS / "guides" / "remote.md").read_text(encoding="utf-8").split())
    assert f"`timeout` {d.timeout:g} s" in guide
    assert f"`retries` {d.retries} " in guide
    assert f"`backoff` {d.backoff:g} s" in guide
    assert d.block_size == 1 << 20 and "`block_size` 1 MiB (`1 << 20`" in guide
    assert f"`read_ahead` {d.read_ahead} shards" in guide
    assert f"`max_connections` {d.max_connections} per process" in guide
    assert f"`max_open_shards` {d.max_open_shards} per reader" in guide
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


@pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None, reason="sphinx is not installed (pip install -e .[docs])"
)
def test_cli_reference_is_the_help_of_every_command(monkeypatch):
    # The CLI page is generated from the parser the `mixer` script runs: the command and every
    # subcommand, each with its full --help (an option added or renamed shows up by itself).
    monkeypatch.syspath_prepend(str(DOCS / "_ext"))
    sys.modules.pop("mixer_docs", None)
    import mixer_docs

    from mixer.cli import commands as cli

    helps = dict(mixer_docs.cli_helps())
    assert list(helps) == [
        "mixer",
        "mixer demo",
        "mixer run",
        "mixer plan",
        "mixer index",
        "mixer pretokenize",
        "mixer info",
    ]
    assert all(text.startswith(f"usage: {command} ") for command, text in helps.items())
    assert "--cache-dir DIR" in helps["mixer demo"] and "--tokens-per-step T" in helps["mixer plan"]
    assert mixer_docs.cli_parser().format_usage() == cli.build_parser().format_usage()
    assert "```{mixer-cli}" in (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")


def test_the_architecture_page_names_every_layer_and_module_and_only_those():
    """The architecture page is the map a new maintainer reads first: it must match the code."""
    page = (REPO / "docs" / "internals" / "architecture.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith(("| layer", "|---"))]
    named: set[str] = set()
    unlisted: set[str] = set()  # subpackages named without their modules: one module per plug-in
    for row in rows:
        layer, modules = row.split(" | ")[:2]
        base = "" if layer.strip("| ") == "foundation" else layer.strip("| `/")
        package = base
        for name in re.findall(r"`([\w/]+)`", modules):
            if name.endswith("/"):  # a subpackage of the layer, its modules (if listed) after it
                package = f"{base}.{name.rstrip('/')}" if base else name.rstrip("/")
                unlisted.add(package)
                continue
            unlisted.discard(package)
            named.add(f"{package}.{name}" if package else name)
    modules = {
        ".".join(p.relative_to(REPO / "mixer").with_suffix("").parts)
        for p in (REPO / "mixer").rglob("*.py")
        if p.name != "__init__.py"
    }
    named |= {m for m in modules if m.rpartition(".")[0] in unlisted}
    missing = sorted(p for p in unlisted if not (REPO / "mixer" / p.replace(".", "/") / "__init__.py").is_file())
    assert not missing, f"docs/internals/architecture.md names subpackages that do not exist: {missing}"
    assert modules <= named, f"modules missing from docs/internals/architecture.md: {sorted(modules - named)}"
    assert named <= modules, (
        f"docs/internals/architecture.md names modules that do not exist: {sorted(named - modules)}"
    )


@pytest.mark.slow
def test_the_site_builds_with_no_warning_and_every_reference_resolved(tmp_path):
    """`make docs` as `make test` runs it: warnings are errors and every reference must resolve
    (nitpicky). A test of the suite, so that the build (tens of CPU seconds: autodoc imports every
    module) runs beside the other tests instead of after them. Not skipped without Sphinx: `make test`
    installs the docs extra, and a build that cannot run is a build that failed."""
    import subprocess

    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-n", "-q"]
    cmd += ["-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the docs build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert (tmp_path / "html" / "index.html").is_file()
    assert (tmp_path / "html" / "reference" / "cli.html").is_file()
