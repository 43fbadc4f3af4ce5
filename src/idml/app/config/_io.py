"""Reading run configs (:mod:`idml.app.config`): YAML files and their ``include:`` fragments,
``--set`` overrides, the task's defaults, validation with errors that name the key, and stored
runs' configs (old spellings read as today's).

Composition: a YAML config may start with ``include:``, one entry or a list. An entry ending in
``.yaml``/``.yml`` is a file, relative to the including file; any other entry names a fragment
packaged with idml (:data:`FRAGMENTS`, listed by :func:`fragment_names`): ``method/<baseline|plain|
ism|mixup|idml|ssr|idml_ssr>``, ``dataset/<cub|cars|sop|digits_demo>``, ``loss/<name>`` (the loss
and the sampler the IDML paper trains it with), ``backbone/<resnet50|small_cnn>`` and
``task/<name>`` (a task's defaults). Fragments may include fragments. They merge deeply, in order,
then the file's own keys (later wins; mappings merge key by key, values and lists are replaced, and
a ``loss`` or ``task`` naming another entry replaces the whole section); ``--set`` overrides apply
after that, and the merged config goes on top of its task's defaults
(:attr:`idml.app.tasks.Task.defaults`), as if they were its first include. A missing file or name, an
include cycle, a fragment that is not a mapping and an unknown key inside a fragment are
errors (:class:`ConfigError`) naming the file and the chain of files that included it; the checks that
relate several keys run on the merged config. A run stores the merged config (no ``include:``),
so a run folder never depends on the fragments. ``method/idml`` is the one definition of "IDML =
uncertainty head + ISM + Mixup", for every task: the presets, ``idml ablate``'s
``method``/``metric``/``mixup`` axes, ``idml demo`` and the tests read it. A method fragment switches its own components on and
leaves every other key alone (``method/baseline`` switches all of them off).
"""

from __future__ import annotations

import copy
import difflib
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from idml.app.config._schema import (
    DEFAULT_TASK,
    NAMED_SECTIONS,
    Config,
    ConfigError,
    DataConfig,
    reads_key,
)
from idml.app.fragments import FRAGMENTS, fragment_names


# --------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML preset (or the defaults), resolve its ``include:``, apply ``key.sub=value``
    overrides and validate.

    Values in overrides are parsed as YAML scalars (``3``, ``1e-4``, ``true``, ``[1, 2]``).
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; see configs/ for the presets")
        raw, included = _resolve_file(path, chain=())
        source = str(path) + (f" (includes {', '.join(included)})" if included else "")
    data = raw.get("data")
    before: dict[str, Any] = copy.deepcopy(data) if isinstance(data, dict) else {}
    keys = set()
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        _set_path(raw, key.strip(), _parse_value(value))
        keys.add(key.strip())
    if "data.image_size" in keys and "data.resize_size" not in keys:
        _follow_image_size(raw, before)
    return validate_config(raw, source=source)


# --------------------------------------------------------------------------- composition
INCLUDE_KEY = "include"


def read_fragment(name: str) -> dict[str, Any]:
    """A packaged fragment with its own includes resolved: the partial config it stands for.

    >>> read_fragment("method/mixup")
    {'mixup': {'enabled': True}}
    """
    raw, _ = _resolve_file(_fragment_path(name, "read_fragment"), chain=(), check_keys=True)
    return raw


def fragment_overrides(name: str) -> list[str]:
    """A packaged fragment as ``key.sub=value`` overrides, in the fragment's order (for grids and
    override lists that build on another config).

    >>> fragment_overrides("method/idml")
    ['model.uncertainty.enabled=true', 'metric.introspective=true', 'mixup.enabled=true']
    """
    return to_overrides(read_fragment(name))


def to_overrides(raw: Mapping[str, Any]) -> list[str]:
    """A (partial) config mapping as ``key.sub=value`` overrides that :func:`load_config` reads
    back to it, one per value, in the mapping's order.

    >>> to_overrides({"data": {"resize_size": None, "train_crop_scale": [0.7, 1.0]}})
    ['data.resize_size=null', 'data.train_crop_scale=[0.7, 1.0]']
    """
    return [f"{key}={_yaml_scalar(value)}" for key, value in _flatten(raw)]


def merge_configs(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` merged into a copy of ``base``: mappings merge key by key, everything else
    (values, lists) is replaced. A ``loss`` that names another loss replaces the whole section,
    since the settings of one loss are unknown keys to another.

    >>> merge_configs({"optim": {"lr": 1e-4, "epochs": 60}}, {"optim": {"epochs": 3}})
    {'optim': {'lr': 0.0001, 'epochs': 3}}
    """
    merged = copy.deepcopy(dict(base))
    for key, value in update.items():
        old = merged.get(key)
        if key in NAMED_SECTIONS:  # ``task: classification`` is ``task: {name: classification}``
            old = {"name": old} if isinstance(old, str) else old
            value = {"name": value} if isinstance(value, str) else value
        if isinstance(old, dict) and isinstance(value, Mapping):
            if key in NAMED_SECTIONS and "name" in value and value["name"] != old.get("name"):
                merged[key] = copy.deepcopy(dict(value))
            else:
                merged[key] = merge_configs(old, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _fragment_path(name: str, where: str) -> Path:
    found = FRAGMENTS / f"{name}.yaml"
    if not found.is_file():
        raise ConfigError(
            f"{where}: no packaged fragment {name!r}; the fragments are "
            f"{', '.join(fragment_names())} (a file path ends in .yaml)"
        )
    return found


def _show(path: Path) -> str:
    """A fragment by its name when it is packaged, by its path otherwise."""
    try:
        return path.resolve().relative_to(FRAGMENTS.resolve()).with_suffix("").as_posix()
    except ValueError:
        return str(path)


def _read_yaml(path: Path, chain: tuple[str, ...]) -> dict[str, Any]:
    where = f"config file {path}" + "".join(f", included from {c}" for c in reversed(chain))
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
    except UnicodeDecodeError:
        raise ConfigError(
            f"{where} is not UTF-8 text (a binary file?); give a YAML config"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a mapping of keys, got {type(raw).__name__}")
    return raw


def _resolve_file(
    path: Path, chain: tuple[tuple[str, Path], ...], check_keys: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """The file's mapping with its includes merged in (in order, the file's own keys last), and
    the fragments it pulled in, depth first. ``chain``: the including files, outermost first, as
    (shown name, resolved path)."""
    shown = _show(path)
    raw = _read_yaml(path, tuple(name for name, _ in chain))
    inner = (*chain, (shown, path.resolve()))
    names = " -> ".join(name for name, _ in inner)
    if check_keys:
        _check_fragment_keys(raw, f"{shown} (include chain: {names})")
    entries = raw.pop(INCLUDE_KEY, None)
    if entries is None:
        return raw, []
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(
            f"{INCLUDE_KEY} in {names}: give a fragment name or a .yaml path, or a list of them; "
            f"got {entries!r}"
        )
    merged: dict[str, Any] = {}
    included: list[str] = []
    for entry in entries:
        if entry.endswith((".yaml", ".yml")):
            target = Path(entry) if Path(entry).is_absolute() else path.parent / entry
            if not target.is_file():
                raise ConfigError(
                    f"{INCLUDE_KEY} in {names}: {entry} does not exist (looked for {target}; "
                    "paths are relative to the including file)"
                )
        else:
            target = _fragment_path(entry, f"{INCLUDE_KEY} in {names}")
        if target.resolve() in {resolved for _, resolved in inner}:
            raise ConfigError(
                f"{INCLUDE_KEY} cycle: {names} -> {_show(target)}; a file cannot include itself"
            )
        part, nested = _resolve_file(target, inner, check_keys=True)
        merged = merge_configs(merged, part)
        included += [*nested, _show(target)]
    return merge_configs(merged, raw), included


def _check_fragment_keys(raw: dict[str, Any], where: str) -> None:
    """Unknown keys of one fragment, named with the file that holds them.

    Only unknown keys: a fragment is a partial config, so the checks that relate several keys
    (an ISM metric needs the uncertainty head) run on the merged result.
    """
    body = {k: v for k, v in raw.items() if k != INCLUDE_KEY}
    for key in NAMED_SECTIONS:
        section = body.get(key)
        if isinstance(section, dict) and "name" not in section:
            body.pop(key)  # which entry's keys these are depends on the fragments around it
    try:
        Config.model_validate(body)
    except ValidationError as err:
        unknown = [e for e in err.errors() if e["type"] in _UNKNOWN_KEY_ERRORS]
        if unknown:
            raise ConfigError(_explain(unknown, body, f"fragment {where}")) from None


_UNKNOWN_KEY_ERRORS = ("extra_forbidden", "unexpected_keyword_argument")


def _flatten(raw: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in raw.items():
        if isinstance(value, Mapping) and value:
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _yaml_scalar(value: Any) -> str:
    """``value`` as the YAML text an override reads back to it (``true``, ``0.5``, ``[1, 2]``)."""
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1 << 16)
        .removesuffix("\n...\n")
        .strip()
    )


def _follow_image_size(raw: dict[str, Any], before: dict[str, Any]) -> None:
    """``--set data.image_size=N`` alone: a resize_size that kept the recipe's 256/224 ratio to
    the old crop keeps it to the new one (a preset's 256 for 224 becomes 73 for 64); a resize
    that did not follow the ratio was chosen on purpose and stays."""
    from idml.data.transforms import eval_resize_size

    data = raw.get("data")
    fields = DataConfig.model_fields
    old_size = before.get("image_size", fields["image_size"].default)
    old_resize = before.get("resize_size", fields["resize_size"].default)
    if not isinstance(data, dict):
        return
    new_size = data.get("image_size")
    if not (isinstance(old_size, int) and isinstance(new_size, int) and new_size > 0):
        return
    if old_resize == eval_resize_size(old_size):
        data["resize_size"] = eval_resize_size(new_size)


def validate_config(raw: dict[str, Any], source: str = "config") -> Config:
    """Validate a raw mapping on top of its task's defaults; errors name the key, the problem and
    the valid keys. Keys of older versions are read as today's (:func:`_upgrade`) or refused
    naming the key that replaced them."""
    raw = _upgrade(raw, source)
    raw = merge_configs(_task_defaults(raw), raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err.errors(), raw, source)) from None


def _task_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults fragment of the task ``raw`` names (``{}`` for none, or an unknown task,
    which validation then names)."""
    from idml.app.tasks import TASKS

    entry = raw.get("task", DEFAULT_TASK)
    name = entry.get("name", DEFAULT_TASK) if isinstance(entry, Mapping) else entry
    task = TASKS.get(name) if isinstance(name, str) else None
    if task is None or task.defaults is None:
        return {}
    where = f"the defaults of task {name}"
    if str(task.defaults).endswith((".yaml", ".yml")):
        path = Path(task.defaults)
        if not path.is_file():
            raise ConfigError(f"{where}: {path} does not exist")
    else:
        path = _fragment_path(str(task.defaults), where)
    return _resolve_file(path, chain=(), check_keys=True)[0]


_LINEAR_HEAD_KEYS = ("normalize", "activation", "init_std")


def _keep_linear_head_of_old_runs(raw: dict[str, Any]) -> dict[str, Any]:
    """A run written before ``model.uncertainty.form`` existed spells out every key of its
    uncertainty head but ``form``; it was the linear head, so it stays one (its checkpoints hold
    that head's weights)."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return raw
    head = model.get("uncertainty")
    if isinstance(head, dict) and "form" not in head and all(k in head for k in _LINEAR_HEAD_KEYS):
        return {**raw, "model": {**model, "uncertainty": {**head, "form": "linear"}}}
    return raw


_BOUNDED_HEAD_KEYS = ("form", "max_norm", "init_level", *_LINEAR_HEAD_KEYS)


def _keep_direction_level_of_old_runs(raw: dict[str, Any]) -> dict[str, Any]:
    """A run written before ``model.uncertainty.level_input`` existed spells out every other key of
    its bounded head; its level read the unit feature direction, so it still does (its checkpoints
    hold no standardisation statistics)."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return raw
    head = model.get("uncertainty")
    if (
        isinstance(head, dict)
        and head.get("form") == "bounded"
        and "level_input" not in head
        and all(k in head for k in _BOUNDED_HEAD_KEYS)
    ):
        return {**raw, "model": {**model, "uncertainty": {**head, "level_input": "direction"}}}
    return raw


def _upgrade(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Old spellings as today's schema reads them: a run written before
    ``model.uncertainty.form`` existed keeps its linear head, one written before
    ``model.uncertainty.level_input`` keeps its level read from the feature direction, and each
    task reads its own old keys (:meth:`idml.app.tasks.Task.upgrade`)."""
    from idml.app.tasks import TASKS

    raw = _keep_linear_head_of_old_runs(raw)
    raw = _keep_direction_level_of_old_runs(raw)
    for task in TASKS.values():
        raw = task.upgrade(raw, source)
    return raw


RUNTIME_KEYS: frozenset[str] = frozenset(
    {"device", "data.num_workers", "tensorboard", "eval.batch_size", "optim.sync_every"}
    | {"mlflow.enabled", "mlflow.tracking_uri", "mlflow.experiment"}
    | {"published"}
)
"""Config keys that cannot change a run's numbers: where and how fast it goes, and ``published``
(a source's numbers to compare with, documentation only)."""


def config_difference(
    stored: Mapping[str, Any],
    wanted: Mapping[str, Any],
    ignore: Collection[str] = RUNTIME_KEYS,
    prefix: str = "",
) -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs between two config dicts,
    keys in ``ignore`` aside.

    >>> config_difference({"a": {"b": 1, "c": 2}, "device": "cpu"}, {"a": {"b": 1, "c": 3}, "device": "cuda"})
    ['a.c: 2 -> 3']
    """
    diffs: list[str] = []
    for key in sorted(set(stored) | set(wanted)):
        dotted = prefix + key
        if dotted in ignore:
            continue
        a, b = stored.get(key), wanted.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs.extend(config_difference(a, b, ignore, dotted + "."))
        elif a != b:
            diffs.append(f"{dotted}: {a!r} -> {b!r}")
    return diffs


def stored_config_dict(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A stored run's config (``state.json``, ``result.json``) as the current schema reads it.

    Keys added to the schema after the run was written take their defaults — chosen so that they
    keep the old behaviour (see :func:`_keep_linear_head_of_old_runs` and
    :func:`_keep_direction_level_of_old_runs`) — so comparing it with a
    config of today shows only real differences. A config the schema no longer accepts is
    returned as stored, and every difference shows.
    """
    try:
        return config_to_dict(validate_config(dict(raw)))
    except ConfigError:
        return dict(raw)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """JSON-compatible dict (paths as strings) that :func:`validate_config` reads back: every key
    the run's task reads, defaults included (a key it does not read is left out, since setting it
    would be an error)."""
    return read_only(cfg.model_dump(mode="json"), cfg.task.spec.reads)


def read_only(raw: dict[str, Any], reads: frozenset[str], prefix: str = "") -> dict[str, Any]:
    """The keys of a config mapping that a task reading ``reads`` reads (``task`` always)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        path = prefix + key
        if path == "task" or path in reads or any(path.startswith(r + ".") for r in reads):
            out[key] = value
        elif isinstance(value, dict) and reads_key(reads, path):
            out[key] = read_only(value, reads, path + ".")
    return out


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if isinstance(child, str) and node is raw and part in NAMED_SECTIONS:
            child = node[part] = {"name": child}  # ``task=classification``, then ``task.scale=20``
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _field_types(owner: Any) -> dict[str, Any]:
    """Field name → annotation of a pydantic model (empty otherwise)."""
    members = [a for a in typing.get_args(owner) if a is not type(None)]
    if len(members) == 1:  # an optional section, ``Section | None``
        owner = members[0]
    if isinstance(owner, type) and issubclass(owner, BaseModel):
        return {name: f.annotation for name, f in owner.model_fields.items()}
    return {}


def _owner_of(loc: tuple[Any, ...], raw: dict[str, Any]) -> Any:
    """The model that owns the key at ``loc[-1]``."""
    owner: Any = Config
    node: Any = raw
    for i, part in enumerate(loc[:-1]):
        if _is_named_tag(loc, i):
            owner = NAMED_SECTIONS[loc[0]][part]  # discriminated-union tag in the error location
            continue
        annotation = _field_types(owner).get(str(part))
        node = node.get(part, {}) if isinstance(node, dict) else {}
        if part in NAMED_SECTIONS and owner is Config:
            sections = NAMED_SECTIONS[part]
            name = node.get("name") if isinstance(node, dict) else node
            owner = sections[str(name)] if name in sections else sections[sections.default]
        elif _field_types(annotation):
            owner = annotation
        else:
            break
    return owner


def _is_named_tag(loc: tuple[Any, ...], i: int) -> bool:
    """Whether ``loc[i]`` is a named section's union tag (``loss.<name>[.<key>]``), not a key that
    happens to share a loss's name (``loss.margin.margin``: the margin loss's ``margin``)."""
    return i == 1 and loc[0] in NAMED_SECTIONS and loc[1] in NAMED_SECTIONS[loc[0]]


def _explain(errors: list[Any], raw: dict[str, Any], source: str) -> str:
    lines: list[str] = []
    for item in errors:
        loc = tuple(item["loc"])
        # Drop the discriminator tag from the printed key path.
        shown = ".".join(str(p) for i, p in enumerate(loc) if not _is_named_tag(loc, i))
        kind = item["type"]
        if kind in ("extra_forbidden", "unexpected_keyword_argument"):
            valid = sorted(_field_types(_owner_of(loc, raw)))
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown key {shown!r}{hint}")
            lines.append(f"  valid keys here: {', '.join(valid)}")
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            key = str(loc[0]) if loc and loc[0] in NAMED_SECTIONS else "loss"
            lines.append(f"{key}.name: {item['msg']}")
            lines.append(f"  valid {key} names: {', '.join(NAMED_SECTIONS[key])}")
        elif kind == "value_error" and not shown:
            lines.append(str(item["msg"]).removeprefix("Value error, "))
        else:
            given = item.get("input")
            message = str(item["msg"]).removeprefix("Value error, ")
            lines.append(f"{shown}: {message} (got {given!r})")
    lines.append(f"  in {source}")
    return "\n".join(lines)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the fully resolved config as YAML (so a run records every default it used)."""
    path.write_text(yaml.safe_dump(copy.deepcopy(config_to_dict(cfg)), sort_keys=False))
