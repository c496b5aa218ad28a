"""Pages generated from the code at build time, so that they cannot drift from it.

* ``mixer-cli``: the ``mixer`` command's ``--help``, top level and every subcommand, from its
  argparse parser (found through ``[project.scripts]`` in pyproject.toml).
* ``mixer-config-keys``: the config file's keys, from the configuration dataclasses' fields.
* ``mixer-public-api``: a summary table and the autodoc entries of everything in ``mixer.__all__``.
* ``mixer-module-doc``: the docstring of the module that defines a given name (so a page can show,
  say, the state format without naming the module it lives in).
* At ``builder-inited``: one automodule stub per module of the package under
  ``docs/internals/api/`` (found with :func:`pkgutil.walk_packages`), so that every cross-reference
  in the docstrings has a target, wherever the modules move.
* ``missing-reference`` / ``warn-missing-reference``: references resolved by the names the code
  itself uses (module-relative, imported, re-exported), third-party ones named in full for the
  ignore rules of conf.py, and the ones to fix in the docstrings listed at the end of the build.

Nothing here names a module of the package other than ``mixer`` itself and its public names.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NewType, TypeVar

import tomllib
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.domains.python import PythonDomain
from sphinx.util.docutils import SphinxDirective

PACKAGE = "mixer"
REPO = Path(__file__).resolve().parents[2]
API_DIR = "internals/api"  # relative to the source directory; generated, not committed
HELP_COLUMNS = "100"


# ----------------------------------------------------------------------------------- the package


def package_modules() -> list[str]:
    """Every module of the package, the package first, sorted by name (C extensions included)."""
    pkg = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(pkg.__path__, prefix=PACKAGE + "."):
        if info.name.rpartition(".")[2] == "__main__":
            continue  # ``python -m`` entry points run the command when imported
        names.append(info.name)
    return sorted(set(names))


def defining_module(name: str) -> ModuleType:
    """The one module of the package whose own source assigns ``name`` at top level (a module that
    imports it does not count)."""
    pattern = re.compile(rf"^{re.escape(name)}\s*(:[^=]*)?=", re.MULTILINE)
    found = []
    for modname in package_modules():
        mod = importlib.import_module(modname)
        try:
            source = inspect.getsource(mod)
        except (OSError, TypeError):
            continue  # a C extension
        if pattern.search(source):
            found.append(mod)
    if len(found) != 1:
        raise ValueError(f"{name!r} is defined in {len(found)} modules of {PACKAGE}: {[m.__name__ for m in found]}")
    return found[0]


class _Generated(SphinxDirective):
    """A directive, used in a Markdown page, whose content is reStructuredText made from the code."""

    def rst(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        # The pages are Markdown (myst), whose nested parse reads Markdown: the reST goes in an
        # eval-rst block.
        text = StringList()
        fence = "`" * 6
        for line in [fence + "{eval-rst}", *self.rst(), fence]:
            text.append(line, f"<{self.name}>")
        node = nodes.container()
        self.state.nested_parse(text, self.content_offset, node)
        return list(node.children)


# --------------------------------------------------------------------------------------- the CLI


def console_script(name: str = PACKAGE) -> tuple[str, str]:
    """``(module, function)`` of a console script, as pyproject.toml declares it."""
    with open(REPO / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"][name]
    module, _, func = target.partition(":")
    return module, func


def cli_parser() -> argparse.ArgumentParser:
    """The parser of the ``mixer`` command: ``build_parser()`` of the console script's module."""
    module, _ = console_script()
    return importlib.import_module(module).build_parser()


@contextmanager
def _columns(columns: str) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = columns
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def cli_helps() -> list[tuple[str, str]]:
    """``(command, --help text)`` for the command and each of its subcommands, at 100 columns."""
    parser = cli_parser()
    with _columns(HELP_COLUMNS):
        out = [(parser.prog, parser.format_help())]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.append((f"{parser.prog} {name}", sub.format_help()))
    return out


class CliDirective(_Generated):
    def rst(self) -> list[str]:
        lines: list[str] = []
        for command, help_text in cli_helps():
            lines += [f".. rubric:: ``{command}``", "", "::", ""]
            lines += ["   " + line if line else "" for line in help_text.rstrip().splitlines()]
            lines.append("")
        return lines


# ------------------------------------------------------------------------------- the config keys


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"``{value}`` (``1 << {value.bit_length() - 1}``)"
    return f"``{value!r}``"


def _type(field: dataclasses.Field[Any]) -> str:
    t = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return f"``{t}``"


def config_sections() -> list[tuple[str, str, list[dataclasses.Field[Any]]]]:
    """``(key path, public class, init fields)`` of every section of a config file."""
    import mixer

    code_only = set(getattr(sys.modules[mixer.MixtureConfig.__module__], "CODE_ONLY", ()))
    sections = [
        ("(top level)", "MixtureConfig"),
        ("sources[i]", "Source"),
        ("sources[i].io_options", "IOOptions"),
        ("batching", "TokenBudget"),
        ("batching (packed: true)", "Packed"),
        ("fields.<name>", "Field"),
    ]
    out = []
    for path, cls_name in sections:
        cls = getattr(mixer, cls_name)
        fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in code_only]
        out.append((path, cls_name, fields))
    return out


class ConfigKeysDirective(_Generated):
    def rst(self) -> list[str]:
        lines: list[str] = []
        for path, cls_name, fields in config_sections():
            lines += [f".. rubric:: ``{path}``: :class:`mixer.{cls_name}`", ""]
            lines += [".. list-table::", "   :header-rows: 1", "   :widths: 25 45 30", ""]
            lines += ["   * - key", "     - type", "     - default"]
            if path == "batching (packed: true)":
                lines += [
                    "   * - ``packed``",
                    "     - ``bool``",
                    "     - ``false`` (``true`` selects :class:`mixer.Packed`)",
                ]
            for f in fields:
                lines += [f"   * - ``{f.name}``", f"     - {_type(f)}", f"     - {_default(f)}"]
            lines.append("")
        lines += self.schedule_keys() + self.nemo_keys()
        return lines

    @staticmethod
    def schedule_keys() -> list[str]:
        """The ``schedule:`` keys, from the key tuples of the module that parses them."""
        mod = defining_module("SCHEDULE_KEYS")
        sections = [
            ("schedule", "SCHEDULE_KEYS"),
            ("schedule.temperature", "TEMPERATURE_KEYS"),
            ("schedule.phases[i]", "PHASE_KEYS"),
            ("schedule.hierarchical", "HIERARCHICAL_KEYS"),
            ("schedule.adaptive", "ADAPTIVE_KEYS"),
        ]
        lines = []
        for path, attr in sections:
            keys = getattr(mod, attr, None)
            if keys:
                lines += [f".. rubric:: ``{path}``", "", ", ".join(f"``{k}``" for k in keys), ""]
        return lines

    @staticmethod
    def nemo_keys() -> list[str]:
        """NeMo's ``ConcatDataset`` keys, accepted at the top level as written or prefixed."""
        keys = getattr(defining_module("NEMO_KEYS"), "NEMO_KEYS")
        lines = [
            ".. rubric:: NeMo keys (top level)",
            "",
            ".. list-table::",
            "   :header-rows: 1",
            "",
            "   * - key",
            "     - or, as NeMo's ASR configs write it",
        ]
        for plain, prefixed in keys.items():
            lines += [f"   * - ``{plain}``", f"     - ``{prefixed}``"]
        return [*lines, ""]


# ------------------------------------------------------------------------------- the public API


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if callable(obj):
        return "autofunction"
    return "autodata"


_ROLE = re.compile(r":[\w:]+:`([^`]*)`")


def _flat(text: str) -> str:
    """Cross-reference roles as plain literals (a summary leaves the context its names are
    relative to): ``:class:`~mixer.x.Y``` -> ````Y````, ``:meth:`a <b>``` -> ````a````."""

    def literal(m: re.Match[str]) -> str:
        inner = m.group(1)
        title = re.match(r"(.*?)\s*<[^>]*>$", inner)
        shown = (
            title.group(1) if title else (inner[1:].rpartition(".")[2] if inner.startswith("~") else inner.lstrip("!."))
        )
        return f"``{shown}``"

    return _ROLE.sub(literal, text)


def summary(obj: Any) -> str:
    """The first sentence of an object's own docstring (a class's, not one it inherits: a
    ``Protocol`` has "Base class for protocol classes."), as one line of reST without references."""
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    doc = inspect.cleandoc(own) if isinstance(own, str) else ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    literal = False
    for i, ch in enumerate(paragraph):
        if paragraph.startswith("``", i):
            literal = not literal
        if ch == "." and not literal and (i + 1 == len(paragraph) or paragraph[i + 1] == " "):
            paragraph = paragraph[: i + 1]
            break
    if paragraph.endswith("::"):
        paragraph = paragraph[:-1]
    return _flat(paragraph)


class PublicApiDirective(_Generated):
    """A table of ``mixer.__all__`` with each name's first sentence, then each one's entry."""

    def rst(self) -> list[str]:
        import mixer

        names = list(mixer.__all__)
        lines = [".. currentmodule:: mixer", "", ".. list-table::", "   :widths: 25 75", ""]
        for name in names:
            lines += [f"   * - :py:obj:`{name}`", f"     - {summary(getattr(mixer, name)) or ' '}"]
        lines.append("")
        for name in names:
            kind = _kind(getattr(mixer, name))
            lines.append(f".. {kind}:: {name}")
            if kind in ("autoclass", "autoexception"):
                lines += ["   :members:", "   :special-members:", "   :show-inheritance:"]
            lines.append("")
        return lines


# ------------------------------------------------------------------------- one module's docstring


class ModuleDocDirective(_Generated):
    """The docstring of the module that defines the given name (no index entry: the internals
    pages hold the module's target)."""

    required_arguments = 1

    def rst(self) -> list[str]:
        mod = defining_module(self.arguments[0])
        return [f".. automodule:: {mod.__name__}", "   :no-index:", ""]


# ------------------------------------------------------------------- the internals API, generated


def public_names() -> dict[str, list[str]]:
    """The public names (``mixer.__all__``) by the module that defines them."""
    import mixer

    by_module: dict[str, list[str]] = {}
    for name in mixer.__all__:
        home = getattr(getattr(mixer, name), "__module__", None)
        if home:
            by_module.setdefault(home, []).append(name)
    return by_module


def api_stub(name: str, public: list[str]) -> str:
    """The page of one module: its docstring and everything it defines (an object re-exported from
    another module is documented there; a public one on the reference page, as ``mixer.X``)."""
    page = [f"# `{name}`", ""]
    if name == PACKAGE:
        page += [
            "The package's public names are documented in {doc}`/reference/api`.",
            "",
            "```{eval-rst}",
            f".. automodule:: {name}",
            "```",
            "",
        ]
        return "\n".join(page)
    mod = importlib.import_module(name)
    compiled = not str(getattr(mod, "__file__", "")).endswith(".py")
    options = [":members:", ":undoc-members:"]
    if not compiled:
        options += [":private-members:", ":special-members:", ":show-inheritance:", ":ignore-module-all:"]
    if public:
        links = ", ".join(f"{{py:obj}}`mixer.{n}`" for n in public)
        page += [f"Defined here and documented as public API: {links}.", ""]
        options.append(":exclude-members: " + ", ".join(public))
    page += ["```{eval-rst}", f".. automodule:: {name}", *("   " + o for o in options), ""]
    if not compiled:
        page += _data_entries(mod, set(public))
    page += ["```", ""]
    return "\n".join(page)


def _data_entries(mod: ModuleType, public: set[str]) -> list[str]:
    """Entries for the module's constants and type aliases that autodoc leaves out (it documents
    module-level data only with a ``#:`` comment): TypeVars as classes, the rest as data, with
    their value when it is short and plain."""
    from sphinx.pycode import ModuleAnalyzer

    try:
        commented = {name for (_, name) in ModuleAnalyzer.for_module(mod.__name__).find_attr_docs()}
    except Exception:  # no source
        commented = set()
    lines: list[str] = []
    for name in assigned_names().get(mod.__name__, []):
        if (
            (name.startswith("__") and name.endswith("__"))
            or name in commented
            or name in public
            or not hasattr(mod, name)
        ):
            continue
        value = getattr(mod, name)
        if inspect.isroutine(value) or inspect.isclass(value) or isinstance(value, ModuleType):
            continue  # automodule's members
        if isinstance(value, (TypeVar, NewType)):
            lines += [f"   .. autoclass:: {name}", ""]
            continue
        shown = repr(value)
        plain = len(shown) <= 120 and " at 0x" not in shown and "\n" not in shown
        lines += [f"   .. autodata:: {name}", *([] if plain else ["      :no-value:"]), ""]
    return lines


def write_api_stubs(app: Sphinx) -> None:
    """One page per module of the package under ``internals/api/``, and their index, rewritten on
    every build (a module moved or removed leaves no stale page; an unchanged page keeps its mtime,
    so an incremental build does not re-read it)."""
    out = Path(app.srcdir) / API_DIR
    out.mkdir(parents=True, exist_ok=True)
    public = public_names()
    modules = package_modules()
    pages = {
        "index": "\n".join(
            [
                "# Modules",
                "",
                "Generated at build time from the package: one page per module.",
                "",
                "```{toctree}",
                ":maxdepth: 1",
                "",
                *modules,
                "```",
                "",
            ]
        )
    }
    for name in modules:
        pages[name] = api_stub(name, public.get(name, []))
    for stale in out.glob("*.md"):
        if stale.stem not in pages:
            stale.unlink()
    for stem, text in pages.items():
        path = out / f"{stem}.md"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------- references by the names code uses


@functools.cache
def module_imports(modname: str) -> dict[str, str]:
    """The names a module of the package imports (also under ``if TYPE_CHECKING:``), each mapped to
    the full dotted name it stands for: ``np`` -> ``numpy``, ``Bucketer`` -> ``mixer.batchers.Bucketer``."""
    try:
        mod = importlib.import_module(modname)
        tree = ast.parse(inspect.getsource(mod))
    except (ImportError, OSError, TypeError, SyntaxError):
        return {}
    package = modname if hasattr(mod, "__path__") else modname.rpartition(".")[0]
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.partition(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


@functools.cache
def assigned_names() -> dict[str, list[str]]:
    """Top-level names assigned (not imported, not def/class) in each module's source."""
    out: dict[str, list[str]] = {}
    for modname in package_modules():
        try:
            tree = ast.parse(inspect.getsource(importlib.import_module(modname)))
        except (OSError, TypeError, SyntaxError):
            continue
        names: list[str] = []
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and t.id not in names:
                    names.append(t.id)
        out[modname] = names
    return out


def _lookup(full: str) -> tuple[bool, Any]:
    """``(found, object)`` for a dotted name of the package, imported the way Python would."""
    parts = full.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False, None
        return True, obj
    return False, None


def homes(full: str) -> list[str]:
    """The documented names an object of the package may have: the name used, where it is defined
    (its module and qualified name, or the module that assigns it), and its public ``mixer.X`` name."""
    out = [full]
    found, obj = _lookup(full)
    if not found:  # perhaps a name the module imports for type checking only
        parts = full.split(".")
        for i in range(len(parts) - 1, 0, -1):
            modname = ".".join(parts[:i])
            if modname in sys.modules:
                imported = module_imports(modname).get(parts[i])
                if imported and imported != full and _in_package(imported):
                    return [full, *homes(".".join([imported, *parts[i + 1 :]]))]
                break
        return out
    if isinstance(obj, ModuleType):
        out.append(obj.__name__)
    else:
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if isinstance(module, str) and isinstance(qualname, str):
            out.append(f"{module}.{qualname}")
        last = full.rpartition(".")[2]
        for modname, names in assigned_names().items():  # a constant or type alias, re-imported
            if last in names and getattr(sys.modules.get(modname), last, _MISSING) is obj:
                out.append(f"{modname}.{last}")
        import mixer

        out += [f"{PACKAGE}.{n}" for n in mixer.__all__ if getattr(mixer, n) is obj]
        parts = full.split(".")  # a member of a public class: mixer.batch.Batch.x -> mixer.Batch.x
        for i in range(len(parts) - 1, 1, -1):
            found_prefix, prefix = _lookup(".".join(parts[:i]))
            if found_prefix and inspect.isclass(prefix):
                out += [".".join([f"{PACKAGE}.{n}", *parts[i:]]) for n in mixer.__all__ if getattr(mixer, n) is prefix]
    return list(dict.fromkeys(h for h in out if h == PACKAGE or h.startswith(PACKAGE + ".")))


_MISSING = object()


def _in_package(name: str | None) -> bool:
    return bool(name) and (name == PACKAGE or str(name).startswith(PACKAGE + "."))


def _docstring_context(node: Any) -> tuple[str | None, str | None]:
    """``(module, class)`` where the docstring holding ``node`` was written: autodoc marks its
    source ``<file>:docstring of <defining module>.<qualified name>``, which for a public object
    documented as ``mixer.X`` differs from the page's context (``mixer``)."""
    m = re.search(r"docstring of ([\w.]+)", str(node.source or ""))
    if not m:
        return None, None
    parts = m.group(1).split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        if modname in sys.modules or _importable_module(modname):
            found, obj = _lookup(".".join(parts[: i + 1])) if i < len(parts) else (False, None)
            cls = parts[i] if found and inspect.isclass(obj) else None
            return modname, cls
    return None, None


def _importable_module(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def _candidates(target: str, contexts: list[tuple[str | None, str | None]]) -> list[str]:
    """Full names a reference written in each ``(module, class)`` context may mean."""
    if _in_package(target):
        return [target]
    out = []
    for modname, clsname in contexts:
        if not _in_package(modname):
            continue
        if clsname:
            out.append(f"{modname}.{clsname}.{target}")
        out.append(f"{modname}.{target}")
        first, _, rest = target.partition(".")
        imported = module_imports(modname).get(first)
        if imported:
            out.append(imported + ("." + rest if rest else ""))
    out.append(f"{PACKAGE}.{target}")
    return list(dict.fromkeys(out))


def resolve_by_code_names(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve a Python reference the domain did not find, by the names the code itself uses: a
    module-relative name, a name imported from another module (also for type checking only), a
    re-export (``mixer.storage.ShardList``), a public object by its defining module's name, a
    constant or type alias named by a class role (annotations). One that names the package and
    cannot be resolved stays a warning (:func:`warn_by_full_name`)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    contexts = [_docstring_context(node), (node.get("py:module"), node.get("py:class"))]
    domain = env.get_domain("py")
    exact = node.deepcopy()
    # An exact lookup of a full name: with ``refspecific`` set at all (even False) the domain searches
    # fuzzily, a scan of every object of the site per call (~40% of the build's CPU, measured).
    if exact.hasattr("refspecific"):
        del exact["refspecific"]
    exact["py:module"] = exact["py:class"] = None
    candidates = _candidates(target, contexts)
    for candidate in candidates:
        if not _in_package(candidate):
            continue
        for home in homes(candidate):
            if home not in domain.objects:
                continue
            for reftype in dict.fromkeys((node["reftype"], "obj")):
                exact["reftarget"] = home
                found = domain.resolve_xref(env, node["refdoc"], app.builder, reftype, home, exact, contnode)
                if found is not None:
                    return found
    # Last, a name the docstring's module neither defines nor imports: the one object of the
    # package that has that name, if there is exactly one. Noted, to be qualified in the code.
    if not _in_package(target) and not hasattr(builtins, target.partition(".")[0]):
        matches = _package_objects_named(domain, target)
        if len(matches) != 1:
            AMBIGUOUS[target] = matches
        if len(matches) == 1:
            exact["reftarget"] = matches[0]
            found = domain.resolve_xref(env, node["refdoc"], app.builder, "obj", matches[0], exact, contnode)
            if found is not None:
                written = next((m for m, _ in contexts if _in_package(m)), "?")
                UNQUALIFIED.append((str(node.source or "?"), node["reftype"], target, written, matches[0]))
                return found
    return None


def _package_objects_named(domain: Any, target: str) -> list[str]:
    """The package's own (not aliased) objects whose full name ends in ``.target``, sorted. From an
    index of every dotted tail of their names, built at the first such reference after the pages
    are read (:func:`forget_lookups`): a scan of the whole site per reference was ~10% of the
    build's CPU (cProfile)."""
    if not _TAILS:
        for name, entry in domain.objects.items():
            if _in_package(name) and not entry.aliased:
                parts = name.split(".")
                for i in range(1, len(parts)):
                    _TAILS.setdefault(".".join(parts[i:]), []).append(name)
        _TAILS.setdefault("", [])  # built, even for a site with no object of the package
    return sorted(_TAILS.get(target, ()))


#: ``{dotted tail: full names}`` of the package's objects, for :func:`_package_objects_named`.
_TAILS: dict[str, list[str]] = {}


class PythonDomainWithMemo(PythonDomain):
    """Sphinx's Python domain, each lookup answered once. A reference the domain marks "specific"
    (every annotation in a signature or a type field) that does not match a name exactly is looked
    for by a scan of every object of the site, and again for two fallback roles: ~15% of the
    build's CPU for names such as ``int`` or ``torch.Tensor`` that the site never defines. The
    answer depends only on the arguments and the objects, which are final once the pages are read:
    :func:`forget_lookups` drops what was answered before."""

    def find_obj(self, env: Any, modname: str, classname: str, name: str, type: str | None, searchmode: int = 0) -> Any:
        key = (modname, classname, name, type, searchmode)
        memo = self.__dict__.setdefault("_mixer_memo", {})
        if key not in memo:
            memo[key] = super().find_obj(env, modname, classname, name, type, searchmode)
        return list(memo[key])


def forget_lookups(app: Sphinx, env: Any) -> list[str]:
    """``env-updated``: every page is read and the objects are final; lookups answered while they
    were still being added (by the domain or :func:`_package_objects_named`) are forgotten."""
    _TAILS.clear()
    env.get_domain("py").__dict__.pop("_mixer_memo", None)
    return []


class SourceLinesMemo:
    """``inspect.getsourcelines`` answered once per object while the site builds. autodoc reads each
    documented function's source three times (its defaults as written, type comments, the
    arguments), and for a class Python 3.11 parses the class's whole module again each time: ~15%
    of the build's CPU (cProfile). Through ``inspect``'s module global, so ``inspect.getsource``
    and callers that imported it by name use it too. The sources do not change during a build;
    :meth:`uninstall` at its end puts the original back. Failures are not kept (each raises again)."""

    def __init__(self) -> None:
        self.original = inspect.getsourcelines
        self.memo: dict[int, tuple[Any, tuple[list[str], int]]] = {}  # id -> (the object, kept alive; lines)

    def __call__(self, obj: Any) -> tuple[list[str], int]:
        kept = self.memo.get(id(obj))
        if kept is None or kept[0] is not obj:
            kept = self.memo[id(obj)] = (obj, self.original(obj))
        lines, start = kept[1]
        return list(lines), start

    def install(self, app: Sphinx) -> None:
        inspect.getsourcelines = self  # type: ignore[assignment]

    def uninstall(self, app: Sphinx, exc: Exception | None) -> None:
        inspect.getsourcelines = self.original
        self.memo.clear()


AMBIGUOUS: dict[str, list[str]] = {}
KNOWN_SEEN: set[tuple[str, str, str | None]] = set()

#: References resolved only by the package-wide search: ``(source, role, target, module, resolved)``.
UNQUALIFIED: list[tuple[str, str, str, str, str]] = []


FULL_BUILD = [False]


def note_full_build(app: Sphinx, env: Any, docnames: list[str]) -> None:
    """Whether this run reads every page (then every docstring is read and every reference
    resolved, and an entry of conf.py's lists that nothing matched is stale)."""
    FULL_BUILD[0] = set(docnames) >= set(env.found_docs)


def report_unqualified(app: Sphinx, exc: Exception | None) -> None:
    """At the end of the build, the references that name an object their module neither defines
    nor imports (they resolve only because the name is unique in the package)."""
    if exc is not None:
        return
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    for key in sorted(set(app.config.mixer_docs_known_dangling) - KNOWN_SEEN if FULL_BUILD[0] else (), key=str):
        log.warning("mixer_docs_known_dangling lists %r, which no docstring has any more: remove it from conf.py", key)
    if not UNQUALIFIED:
        return
    rows = sorted(set(UNQUALIFIED))
    log.info(
        "%d reference(s) in docstrings to qualify or fix in the code (their module neither defines nor "
        "imports the name; resolved, if at all, by a package-wide search):",
        len(rows),
    )
    for source, role, target, written, resolved in rows:
        log.info("  :%s:`%s` in %s -> %s", role, target, source.rpartition(":docstring of ")[2] or written, resolved)
    if FULL_BUILD[0]:
        out = Path(app.outdir).parent / "unqualified-references.txt"
        out.write_text(
            "".join(f":{r}:`{t}` in {s.rpartition(':docstring of ')[2] or w} -> {res}\n" for s, r, t, w, res in rows),
            encoding="utf-8",
        )


def warn_by_full_name(app: Sphinx, domain: Any, node: Any) -> bool | None:
    """A Python reference left unresolved, named by its full name: one into another library that
    the code names through an import (``Figure``, imported from matplotlib for type checking)
    follows the ignore rules for third-party targets, as ``matplotlib.figure.Figure``; one into
    the package is reported with where it was written."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    contexts = [_docstring_context(node), (node.get("py:module"), node.get("py:class"))]
    candidates = _candidates(target, contexts)
    outside = [c for c in candidates if not _in_package(c)]
    if outside:
        kind = f"py:{node['reftype']}"
        if any(re.fullmatch(k, kind) and re.fullmatch(t, outside[0]) for k, t in app.config.nitpick_ignore_regex):
            return True
        return None
    written = next((m for m, _ in contexts if _in_package(m)), None)
    key = (node["reftype"], target, written)
    if key in app.config.mixer_docs_known_dangling:
        KNOWN_SEEN.add(key)
        UNQUALIFIED.append(
            (str(node.source or "?"), node["reftype"], target, str(written), "NOT FOUND (known, to fix in the code)")
        )
        return True
    if written and not _in_package(target):
        from sphinx.util import logging

        logging.getLogger(__name__).warning(
            "py:%s reference target not found: %s (written in %s)",
            node["reftype"],
            target,
            written,
            location=node,
            type="ref",
            subtype=node["reftype"],
        )
        return True
    return None


def _written_in_package(obj: Any) -> bool:
    """Whether a function's code is in the package's source (not generated, as a dataclass's
    ``__init__`` is, nor inherited from another library)."""
    code = getattr(inspect.unwrap(obj), "__code__", None) if callable(obj) else None
    if code is None:
        return False
    import mixer

    return any(code.co_filename.startswith(p) for p in mixer.__path__)


def skip_member(app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """With ``:special-members:``, the special methods the package writes itself
    (``Batch.__reduce__``), documented or not; not the generated or inherited ones."""
    if name.startswith("__") and name.endswith("__") and what in ("class", "exception"):
        return not _written_in_package(obj)
    return None


def data_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A constant has no docstring of its own: autodoc offers its type's (``dict``'s), or a type
    alias's origin's (``tuple``'s for ``tuple[int, ...]``)."""
    if what in ("data", "attribute") and _in_package(name):
        text = inspect.cleandoc("\n".join(lines))
        for cls in (type(obj), getattr(obj, "__origin__", None)):
            doc = inspect.getdoc(cls) if cls is not None else None
            if doc and text == doc:
                lines[:] = []


def drop_unparsable(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Leave out the text of the docstrings ``mixer_docs_unparsable`` names (by qualified name)."""
    qualname = getattr(obj, "__qualname__", None)
    if qualname in app.config.mixer_docs_unparsable and _in_package(name):
        UNPARSABLE_SEEN.add(qualname)
        lines[:] = []


UNPARSABLE_SEEN: set[str] = set()


def check_unparsable(app: Sphinx, exc: Exception | None) -> None:
    if exc is None and FULL_BUILD[0]:
        from sphinx.util import logging

        for qualname in sorted(set(app.config.mixer_docs_unparsable) - UNPARSABLE_SEEN):
            logging.getLogger(__name__).warning(
                "mixer_docs_unparsable lists %r, which no object has any more: remove it from conf.py", qualname
            )


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_domain(PythonDomainWithMemo, override=True)
    app.connect("env-updated", forget_lookups)
    source_lines = SourceLinesMemo()
    app.connect("builder-inited", source_lines.install)
    app.connect("build-finished", source_lines.uninstall)
    app.add_directive("mixer-cli", CliDirective)
    app.add_directive("mixer-config-keys", ConfigKeysDirective)
    app.add_directive("mixer-public-api", PublicApiDirective)
    app.add_directive("mixer-module-doc", ModuleDocDirective)
    app.connect("builder-inited", write_api_stubs)
    app.connect("env-before-read-docs", note_full_build)
    app.connect("warn-missing-reference", warn_by_full_name)
    app.connect("build-finished", report_unqualified)
    # (role, target, module it is written in): references into the package that resolve nowhere,
    # to fix in the docstrings; reported at the end of the build instead of failing it.
    app.add_config_value("mixer_docs_known_dangling", set(), "env", types=(set, frozenset))
    # {qualified name: why}: docstrings that are not valid reST yet; their text is left out.
    app.add_config_value("mixer_docs_unparsable", {}, "env", types=(dict,))
    app.connect("autodoc-process-docstring", drop_unparsable)
    app.connect("build-finished", check_unparsable)
    app.connect("autodoc-skip-member", skip_member)
    app.connect("autodoc-process-docstring", data_docstring)
    app.connect("missing-reference", resolve_by_code_names, priority=950)  # after the builtins
    # What the hooks note (references, docstrings seen) lives in this process: no parallel builds.
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": False}
