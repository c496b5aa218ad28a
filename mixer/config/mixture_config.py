"""Configuration files: YAML (or the same structure as a dict) → a validated :class:`MixtureConfig`
→ a :class:`~mixer.Mixture`.

There is one definition of every setting: the library's own configuration classes. A section of
the file is turned into its class generically (its keys are the dataclass's fields; an unknown key
gets a "did you mean" hint from them) and the class checks its values itself (:mod:`mixer._check`),
so a value gets the same message from code and from a file, located by the key path here
(``sources[2].weight: must be >= 0, got -1``) and by class and field in code (``Source('web').weight``).
:func:`parse_config` lists no shard and imports no ``decode``/``length`` (an import path stays an
:class:`ImportPath` until :func:`build_mixture`), so a config can be checked and its schedule printed
without touching the data. NeMo's ``ConcatDataset`` keys are accepted with NeMo's meaning, also with
the ``concat_`` prefix of NeMo's ASR configs; see :data:`NEMO_KEYS`.

Every keyword of :class:`~mixer.Mixture`, :class:`~mixer.Source`, :class:`~mixer.TokenBudget`,
:class:`~mixer.Packed` and :class:`~mixer.Field` has a key of the same name, except deployment
(``rank``, ``world_size``, ``dp_group``) and ``allow_pipe`` (code only: a file must not run shell
commands). Beyond the obvious ones:

* ``batching``: a :class:`~mixer.TokenBudget`, or with ``packed: true`` a :class:`~mixer.Packed`; an
  option of the other kind is an error.
* ``fields: {audio: {dtype: float32, pad: 0}, text: {dtype: int32, pad: -1}}``: multi-field
  samples (``Mixture(fields=...)``; not with ``packed``). A source's ``length`` is then either an
  import path or the name of a field.
* ``schedule``: see :mod:`mixer.config.schedule_config`.
* ``profile_cache``: a directory for the sources' up-front profiles (``Mixture(profile_cache=)``),
  so a restarted job reads no shard to start; ``profile_share``: whether rank 0 profiles for all.
* ``sources[i].io_options``: :class:`mixer.IOOptions` keys (``timeout``, ``retries``, ``backoff``,
  ``block_size``, ``read_ahead``, ``max_connections``, ``max_open_shards``): how shards are read.
* ``sources[i].index``: ``true`` (the index files next to the shards) or an index file's path or URL
  (``Source(index=...)``; build one with ``mixer index``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from mixer import _check
from mixer.config.nemo import NEMO_KEYS, apply_nemo, nemo_options, nemo_values
from mixer.config.schedule_config import parse_schedule, schedule_to_dict
from mixer.errors import ConfigError
from mixer.mixing.options import OPTIONS, check_options
from mixer.mixing.schedule import Schedule
from mixer.spec.budget import Field, Packed, TokenBudget, check_fields
from mixer.spec.source import Source
from mixer.storage import IOOptions

if TYPE_CHECKING:
    from mixer.mixing.mixture import Mixture

__all__ = ["ImportPath", "MixtureConfig", "build_mixture", "load_config", "parse_config"]


def _keys_of(cls: type, *, but: Sequence[str] = ()) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init and f.name not in but)


CODE_ONLY = ("allow_pipe",)  # a config file must not run shell commands
SOURCE_KEYS = _keys_of(Source, but=CODE_ONLY)
BATCHING_KEYS = ("packed", *_keys_of(TokenBudget))
PACKED_KEYS = ("packed", *_keys_of(Packed))
FIELD_KEYS = _keys_of(Field)

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class ImportPath:
    """A function named in a config file as ``"package.module:function"``. Imported when the
    mixture is built (:func:`build_mixture` puts the function itself in the source, with an error
    naming the key if it cannot); calling it imports it too (once)."""

    path: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _resolve_cached(self.path)(*args, **kwargs)


@functools.cache
def _resolve_cached(path: str) -> Callable[..., Any]:
    return resolve_import(path, path)


@dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    """A validated configuration: the sources, the batching, the schedule and the
    :class:`~mixer.Mixture`'s options, as the library's own objects (NeMo keys already translated;
    no shard listed). ``to_dict()`` gives the canonical config back
    (``parse_config(config.to_dict()) == config``)."""

    sources: tuple[Source, ...]
    batching: TokenBudget | Packed
    schedule: Schedule | None = None
    # The Mixture's options, their defaults from its table (mixer.mixing.options.OPTIONS).
    selector: str = OPTIONS["selector"].default
    unit: str = OPTIONS["unit"].default
    mix: str = OPTIONS["mix"].default
    stop: str = OPTIONS["stop"].default
    seed: int = OPTIONS["seed"].default
    shuffle_buffer: int = OPTIONS["shuffle_buffer"].default
    pad_id: int = OPTIONS["pad_id"].default
    dtype: str = OPTIONS["dtype"].default
    state_every: int = OPTIONS["state_every"].default
    buffer_budget: int | str | None = OPTIONS["buffer_budget"].default
    fields: Mapping[str, Field] | None = None
    profile_cache: str | None = OPTIONS["profile_cache"].default
    profile_share: bool | None = OPTIONS["profile_share"].default

    def __post_init__(self) -> None:
        checked = check_options({k: getattr(self, k) for k in OPTIONS})  # the Mixture's own check
        for key, value in checked.items():
            object.__setattr__(self, key, value)

    def mixture_options(self) -> dict[str, Any]:
        """The keywords of :class:`~mixer.Mixture` besides the sources."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seed": self.seed,
            "sources": [_source_to_dict(s, i) for i, s in enumerate(self.sources)],
        }
        batching = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in _values(self.batching).items() if v is not None
        }
        out["batching"] = {"packed": True, **batching} if isinstance(self.batching, Packed) else batching
        if self.schedule is not None:
            out["schedule"] = schedule_to_dict(self.schedule)
        # Every option that decides the stream (seed first, above), then fields, then the others when set.
        out.update({k: getattr(self, k) for k, o in OPTIONS.items() if o.decides_stream and k != "seed"})
        if self.fields is not None:
            out["fields"] = {name: _field_to_dict(f) for name, f in self.fields.items()}
        out.update(
            {k: getattr(self, k) for k, o in OPTIONS.items() if not o.decides_stream and getattr(self, k) is not None}
        )
        return out


def _field_to_dict(f: Field) -> dict[str, Any]:
    """A field's keys, YAML-ready: ``feature_shape`` as a list, and left out for a 1-D field."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in _values(f).items() if v != ()}


NATIVE_KEYS = tuple(f.name for f in dataclasses.fields(MixtureConfig))
ROOT_KEYS = tuple(dict.fromkeys(NATIVE_KEYS + tuple(NEMO_KEYS) + tuple(NEMO_KEYS.values())))


def _values(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _function_to_dict(fn: Any, where: str) -> Any:
    if fn is None or isinstance(fn, str):
        return fn
    if isinstance(fn, ImportPath):
        return fn.path
    raise ConfigError(f"{where}: {fn!r} has no config form (only an import path 'package.module:function')")


def _source_to_dict(s: Source, i: int) -> dict[str, Any]:
    urls = tuple(s.urls)
    out: dict[str, Any] = {"name": s.name, "urls": urls[0] if len(urls) == 1 else list(urls), "weight": s.weight}
    for key in ("size", "decode", "length", "group"):
        value = (
            getattr(s, key) if key in ("size", "group") else _function_to_dict(getattr(s, key), f"sources[{i}].{key}")
        )
        if value is not None:
            out[key] = value
    if s.storage_options:
        out["storage_options"] = dict(s.storage_options)
    if s.on_error != "raise":
        out["on_error"] = s.on_error
    if s.index:
        out["index"] = s.index
    given, default = _values(IOOptions.of(s.io_options)), _values(IOOptions())
    if given != default:
        out["io_options"] = {k: v for k, v in given.items() if v != default[k]}
    return out


# ------------------------------------------------------------------------ mapping → dataclass


def _build(
    cls: Any,
    m: Mapping[str, Any],
    path: str,
    *,
    owners: Sequence[str],
    allowed: Sequence[str] | None = None,
    convert: Mapping[str, Callable[[Any, str], Any]] | None = None,
    **code: Any,
) -> Any:
    """``cls(**m)``: the keys checked against the dataclass's fields (``allowed``, default: all but
    ``code``, the keywords only code passes), values the file gives as text turned into objects by
    ``convert``, and the class's own errors relabelled from ``<owner>.<field>`` to the key path."""
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in code]
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    _check.keys(m, path, allowed if allowed is not None else [f.name for f in fields], required)
    convert = convert or {}
    kwargs = {k: (convert[k](v, _check.at(path, k)) if k in convert and v is not None else v) for k, v in m.items()}
    try:
        return cls(**kwargs, **code)
    except ConfigError as exc:
        for owner in owners:
            relabelled = _check.relabel(exc, owner, path)
            if relabelled is not exc:
                raise relabelled from None
        raise


def _import_path(value: Any, path: str) -> ImportPath:
    if not isinstance(value, str) or not _IMPORT_PATH.match(value):
        _check.fail(path, f"must be an import path 'package.module:function', got {_check.show(value)}")
    return ImportPath(value)


def _length(value: Any, path: str) -> ImportPath | str:
    # A field name is an identifier, an import path has a colon: the two never overlap.
    if isinstance(value, str) and value.isidentifier():
        return value
    if not isinstance(value, str) or not _IMPORT_PATH.match(value):
        _check.fail(
            path, f"must be an import path 'package.module:function' or the name of a field, got {_check.show(value)}"
        )
    return ImportPath(value)


def _source_owners(m: Mapping[str, Any]) -> tuple[str, ...]:
    return (f"Source({m.get('name')!r})", "Source")


def _sources(value: Any, allow_pipe: bool) -> tuple[list[Source], list[bool]]:
    """The sources and whether each set ``weight`` explicitly."""
    if not isinstance(value, list) or not value:
        _check.fail("sources", f"must be a non-empty list of sources, got {_check.show(value)}")
    sources: list[Source] = []
    seen: dict[str, int] = {}
    convert = {"decode": _import_path, "length": _length, "io_options": _check.mapping}
    for i, item in enumerate(value):
        path = _check.at("sources", i)
        m = _check.mapping(item, path)
        if "allow_pipe" in m:
            raise ConfigError(
                f"{_check.at(path, 'allow_pipe')}: not a config key: 'pipe:' URLs run shell commands, so only code "
                "can allow them (build_mixture(spec, allow_pipe=True) or load_config(path, allow_pipe=True)), never a "
                "config file alone"
            )
        source = _build(Source, m, path, owners=_source_owners(m), convert=convert, allow_pipe=allow_pipe)
        if source.name in seen:
            _check.fail(f"{path}.name", f"duplicate of sources[{seen[source.name]}].name, got {source.name!r}")
        seen[source.name] = i
        sources.append(source)
    return sources, ["weight" in m for m in value]


def _batching(value: Any) -> TokenBudget | Packed:
    path = "batching"
    m = _check.mapping(value, path)
    packed = _check.entry(m, "packed", False, _check.boolean, path)
    for key in m:
        if packed and key not in PACKED_KEYS and key in BATCHING_KEYS:
            _check.fail(_check.at(path, key), "a TokenBudget option, not used with packed: true")
        if not packed and key not in BATCHING_KEYS and key in PACKED_KEYS:
            _check.fail(
                _check.at(path, key), f"a Packed option; set {_check.at(path, 'packed')}: true to pack documents"
            )
    cls = Packed if packed else TokenBudget
    rest = {k: v for k, v in m.items() if k != "packed"}
    _check.keys(m, path, PACKED_KEYS if packed else BATCHING_KEYS)
    return _build(cls, rest, path, owners=(cls.__name__,))  # type: ignore[no-any-return]


def _fields(value: Any, path: str) -> dict[str, Field]:
    m = _check.mapping(value, path)
    if not m:
        _check.fail(path, "must name at least one field, got {}")
    check_fields({name: Field() for name in m}, path)  # the names, before the entries
    return {
        name: _build(Field, _check.mapping(entry, _check.at(path, name)), _check.at(path, name), owners=("Field",))
        for name, entry in m.items()
    }


def _check_fields(
    fields: Mapping[str, Field] | None, batching: TokenBudget | Packed, sources: Sequence[Source]
) -> None:
    """What the Mixture would refuse later: fields with packing, a source length naming no field."""
    if fields is not None and isinstance(batching, Packed):
        raise ConfigError(
            "fields: multi-field samples are batched by a token budget (padded per field), not with batching.packed: "
            "true"
        )
    for i, s in enumerate(sources):
        if not isinstance(s.length, str):
            continue
        p = f"sources[{i}].length"
        if fields is None:
            raise ConfigError(
                f"{p}: {s.length!r} names a field, but there is no 'fields' key; add fields, or give an import path "
                "'package.module:function'"
            )
        if s.length not in fields:
            close = _check.hint(s.length, list(fields)) or f" (fields: {', '.join(fields)})"
            raise ConfigError(f"{p}: names no field of 'fields', got {s.length!r}{close}")


# ---------------------------------------------------------------------------------------------- API


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, plus two fixes: ``1e12`` / ``2.0e11`` are floats (YAML 1.1 wants
    ``2.0e+11``, so plain PyYAML reads them as strings), and a duplicate key is an error."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+|[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789."),
)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The raw YAML document of a config file."""
    with open(path, encoding="utf-8") as f:
        try:
            return yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ConfigError(f"{os.fspath(path)}: not valid YAML: {exc}") from exc


def parse_config(config: Mapping[str, Any] | str | os.PathLike[str], *, allow_pipe: bool = False) -> MixtureConfig:
    """Validate a config (a mapping, or the path of a YAML file) into a :class:`MixtureConfig`,
    without listing any shard or importing ``decode``/``length``. ``allow_pipe``: see
    :class:`~mixer.Source` (code only, never a file)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            return _parse(read_yaml(config), allow_pipe)
        except ConfigError as exc:
            message = str(exc)
            prefix = f"{os.fspath(config)}: "
            raise ConfigError(message if message.startswith(prefix) else prefix + message) from None
    return _parse(config, allow_pipe)


def _parse(config: Any, allow_pipe: bool) -> MixtureConfig:
    m = _check.mapping(config, "")
    _check.keys(m, "", ROOT_KEYS, required=("sources", "batching"))
    nemo = nemo_values(m)
    sources, explicit_weight = _sources(m["sources"], allow_pipe)
    names = [s.name for s in sources]
    batching = _batching(m["batching"])
    fields = _check.entry(m, "fields", None, _fields, "")
    _check_fields(fields, batching, sources)
    native = apply_nemo(m, nemo, sources, explicit_weight)
    if "weights" in native:
        sources = [dataclasses.replace(s, weight=w) for s, w in zip(sources, native["weights"])]
    if not any(s.weight > 0 for s in sources):
        raise ConfigError("sources: every weight is 0; at least one must be > 0")
    schedule = native["schedule"] if "schedule" in native else parse_schedule(m.get("schedule"), names)
    options = {k: m[k] for k in OPTIONS if k in m and k != "seed"}  # seed: a NeMo key too (nemo_options)
    options.update(nemo_options(m, nemo, default_shuffle_buffer=OPTIONS["shuffle_buffer"].default))
    if "selector" in native:
        options["selector"] = native["selector"]
    try:
        return MixtureConfig(sources=tuple(sources), batching=batching, schedule=schedule, fields=fields, **options)
    except ConfigError as exc:
        raise _check.relabel(exc, "Mixture", "") from None


def resolve_import(path: str, where: str) -> Callable[..., Any]:
    """``"package.module:function"`` → the function, with an error naming ``where``."""
    if not _IMPORT_PATH.match(path):
        raise ConfigError(f"{where}: must be an import path 'package.module:function', got {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{where}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{where}: {path!r} is not callable, got {obj!r}")
    return obj


def build_mixture(
    config: MixtureConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    dp_group: Any = None,
    allow_pipe: bool = False,
) -> Mixture:
    """The :class:`~mixer.Mixture` of ``config``: imports the ``decode``/``length`` functions it names,
    then the mixture lists every source's shards. ``rank``/``world_size``/``dp_group`` are deployment,
    not configuration; see ``Mixture``. ``allow_pipe=True`` lets every source use ``pipe:`` URLs
    (shell commands): code only, never a file."""
    from mixer.mixing.mixture import Mixture

    sources = []
    for i, s in enumerate(config.sources):
        path = f"sources[{i}]"
        changes: dict[str, Any] = {"allow_pipe": allow_pipe}
        for key in ("decode", "length"):
            value = getattr(s, key)
            if isinstance(value, ImportPath):
                changes[key] = resolve_import(value.path, f"{path}.{key}")
        try:
            sources.append(dataclasses.replace(s, **changes))
        except ConfigError as exc:
            raise _check.relabel(exc, f"Source({s.name!r})", path) from None
    return Mixture(sources, **config.mixture_options(), rank=rank, world_size=world_size, dp_group=dp_group)


def load_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    dp_group: Any = None,
    allow_pipe: bool = False,
) -> Mixture:
    """``build_mixture(parse_config(config))``: a YAML file's path or a dict → a ready Mixture."""
    config_ = parse_config(config, allow_pipe=allow_pipe)
    return build_mixture(config_, rank=rank, world_size=world_size, dp_group=dp_group, allow_pipe=allow_pipe)
