"""The tests mirror the layers: each test file sits in ``tests/<layer>/``, named for the layer of the
package it tests (the layers of `test_imports.LAYERS`), or in ``tests/project/`` for the checks of the
whole project; the helpers they share sit in ``tests/support/`` (on ``sys.path`` through
pyproject.toml's ``pythonpath``), and only ``conftest.py`` stays at the top."""

from __future__ import annotations

from pathlib import Path

from test_imports import LAYERS

TESTS = Path(__file__).resolve().parents[1]

# The bottom layer is a few modules and packages (errors, checks, _native, state, ...), named the
# foundation in docs/internals/architecture.md; every layer above it is one subpackage.
LAYER_FOLDERS = ("foundation", *(members[0].removeprefix("mixer.") for members in LAYERS[1:]))
FOLDERS = (*LAYER_FOLDERS, "project")
SUPPORT = "support"


def misplaced(tests: Path) -> list[str]:
    """What breaks the layout under the folder ``tests``: a test file outside a layer folder (or
    deeper than one), a helper outside ``support/``, a test in ``support/``, two test files of one
    name (pytest imports them by bare name), and a folder that is neither a layer, project nor support."""
    found = []
    names: dict[str, str] = {}
    for path in sorted(tests.rglob("*.py")):
        where = path.relative_to(tests)
        test = path.name.startswith("test_")
        if where.parts == ("conftest.py",):
            continue
        if len(where.parts) != 2:
            found.append(f"{where}: a file belongs one level down, in a layer folder, project/ or support/")
        elif test and where.parts[0] == SUPPORT:
            found.append(f"{where}: a test belongs in the folder of the layer it tests, not in {SUPPORT}/")
        elif test and where.parts[0] not in FOLDERS:
            found.append(f"{where}: {where.parts[0]!r} is no layer of the package (one of {', '.join(FOLDERS)})")
        elif not test and where.parts[0] != SUPPORT:
            found.append(f"{where}: a helper belongs in {SUPPORT}/")
        if test and path.name in names:
            found.append(f"{where}: the same name as {names[path.name]}")
        names.setdefault(path.name, str(where))
    for folder in sorted(p for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if folder.name not in (*FOLDERS, SUPPORT):
            found.append(f"{folder.name}/: a folder that is neither a layer, project/ nor {SUPPORT}/")
    return found


def test_every_test_file_sits_in_the_folder_of_a_layer():
    assert misplaced(TESTS) == []


def test_the_layer_folders_are_the_layers_of_the_import_check():
    assert LAYER_FOLDERS == (
        "foundation",
        "storage",
        "spec",
        "read",
        "plan",
        "stream",
        "batching",
        "mixing",
        "observe",
        "runtime",
        "service",
        "config",
        "integrations",
        "cli",
    )


def test_the_layout_check_finds_each_kind_of_misplaced_file(tmp_path):
    for rel in (
        "conftest.py",
        "mixing/test_select.py",
        "support/shardutil.py",
        "project/golden/state.json",
        "test_top.py",
        "widgets/test_widget.py",
        "read/helper.py",
        "read/deep/test_deep.py",
        "storage/test_select.py",
        "support/test_oracle.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert misplaced(tmp_path) == [
        "read/deep/test_deep.py: a file belongs one level down, in a layer folder, project/ or support/",
        "read/helper.py: a helper belongs in support/",
        "storage/test_select.py: the same name as mixing/test_select.py",
        "support/test_oracle.py: a test belongs in the folder of the layer it tests, not in support/",
        "test_top.py: a file belongs one level down, in a layer folder, project/ or support/",
        "widgets/test_widget.py: 'widgets' is no layer of the package (one of " + ", ".join(FOLDERS) + ")",
        "widgets/: a folder that is neither a layer, project/ nor support/",
    ]
