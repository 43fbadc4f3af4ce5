"""The axes of an ablation grid: the presets named after the papers' ablations
(:data:`PRESETS`), parsing ``key=v1,v2,…`` axes (:func:`parse_grid`) and expanding them into
cells of config overrides (:func:`expand_grid`); :mod:`idml.app.ablation` describes the grammar."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from idml.app.config import (
    RUNTIME_KEYS,
    Config,
    merge_configs,
    read_fragment,
    reads_key,
    to_overrides,
)

IGNORED_KEYS: frozenset[str] = RUNTIME_KEYS
"""Config keys that cannot change a run's numbers (where and how fast it ran): ignored on reuse."""


@dataclass(frozen=True)
class ChoicePreset:
    """A named axis whose values each expand to a fixed list of config overrides.

    ``choices`` maps a canonical value to ``(overrides, table label)``; ``synonyms`` maps other
    spellings (``true``, ``yes``, ``ism-dis``) to canonical values. ``switch`` marks on/off axes,
    drawn as ``✓``/``–`` columns like the papers' ablation tables.
    """

    name: str
    description: str
    choices: Mapping[str, tuple[tuple[str, ...], str]]
    synonyms: Mapping[str, str] = field(default_factory=dict)
    switch: bool = False

    def canonical(self, value: str) -> str:
        """The canonical spelling of ``value``; ``ValueError`` listing the choices if unknown."""
        key = value.strip().lower()
        key = self.synonyms.get(key, key)
        if key not in self.choices:
            raise ValueError(
                f"--grid {self.name}={value}: unknown value {value!r}; choose from "
                f"{', '.join(self.choices)}"
            )
        return key

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """The config overrides of one (canonical) value, less those of keys the base config's
        task does not read: a component a task does not have is off already (``method=baseline``
        of a classification config switches no SSR off)."""
        overrides = self.choices[value][0]
        if base is None:
            return overrides
        reads = base.task.spec.reads
        return tuple(o for o in overrides if reads_key(reads, o.partition("=")[0]))

    def label(self, value: str) -> str:
        """How the value appears in the table."""
        if self.switch:
            return "✓" if value == "on" else "–"
        return self.choices[value][1]


@dataclass(frozen=True)
class AliasPreset:
    """A short name for one config key (``gamma`` → ``metric.gamma``); values are YAML scalars."""

    name: str
    key: str
    description: str

    def canonical(self, value: str) -> str:
        """The value in one spelling (see :func:`canonical_value`)."""
        return canonical_value(value)

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """``key=value`` for the aliased key."""
        return (f"{self.key}={value}",)

    def label(self, value: str) -> str:
        """The value itself."""
        return value


@dataclass(frozen=True)
class BatchSizePreset:
    """The batch size ``B`` whatever the sampler: ``P = B / K`` classes of the balanced sampler.

    For the IDML paper's batch-size ablation (Wang et al. 2022, Table 6): the balanced sampler keeps
    ``K`` (``sampler.images_per_class``) and draws ``P = B / K`` classes; the random sampler takes
    ``sampler.batch_size = B``.
    """

    name: str = "batch_size"
    description: str = "batch size B (balanced sampler: B / images_per_class classes per batch)"

    def canonical(self, value: str) -> str:
        """The batch size as a decimal integer; ``ValueError`` unless positive."""
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size <= 0:
            raise ValueError(f"--grid batch_size={value}: batch sizes must be positive integers")
        return str(size)

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """Sampler settings for batch size ``value`` given the base config's sampler."""
        size = int(value)
        if base is None or base.sampler.kind == "random":
            return (f"sampler.batch_size={size}",)
        per_class = base.sampler.images_per_class
        if size % per_class:
            raise ValueError(
                f"--grid batch_size={value}: the balanced sampler draws {per_class} images per "
                f"class (sampler.images_per_class), so the batch size must be a multiple of "
                f"{per_class}"
            )
        return (f"sampler.classes_per_batch={size // per_class}", f"sampler.batch_size={size}")

    def label(self, value: str) -> str:
        """The batch size itself."""
        return value


Preset = ChoicePreset | AliasPreset | BatchSizePreset

_ON_OFF_SYNONYMS = {"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off", "0": "off"}


def _method(*names: str, variant: str | None = None) -> tuple[str, ...]:
    """Packaged fragments merged in order (``method/baseline``, ``method/idml``) as overrides;
    ``variant`` pins ISM's ``metric.variant``, so the value means one metric whatever the base
    config says."""
    merged: dict[str, Any] = {}
    for name in names:
        merged = merge_configs(merged, read_fragment(name))
    if variant is not None:
        merged = merge_configs(merged, {"metric": {"variant": variant}})
    return tuple(to_overrides(merged))


def _full(method: str) -> tuple[str, ...]:
    """``method=…``: every component off (``method/baseline``), then the method's own on."""
    ism = method in ("idml", "idml_ssr")
    return _method("method/baseline", f"method/{method}", variant="soft" if ism else None)


def _switch(name: str, description: str, key: str) -> ChoicePreset:
    return ChoicePreset(
        name,
        description,
        {"on": ((f"{key}=true",), "on"), "off": ((f"{key}=false",), "off")},
        _ON_OFF_SYNONYMS,
        switch=True,
    )


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        ChoicePreset(
            "metric",
            "training metric: plain, ISM (IDML eq. 5-7), ISM-Dis (uncertainty pushes pairs "
            "apart; IDML Table 4) or ISM's strict indicator form",
            {
                "plain": (_method("method/plain"), "plain"),
                "ism": (_method("method/ism", variant="soft"), "ISM"),
                "ism_dis": (_method("method/ism", variant="dissimilar"), "ISM-Dis"),
                "ism_strict": (_method("method/ism", variant="strict"), "ISM-strict"),
            },
            {
                "baseline": "plain",
                "ism-dis": "ism_dis",
                "dis": "ism_dis",
                "dissimilar": "ism_dis",
                "ism-strict": "ism_strict",
                "strict": "ism_strict",
            },
        ),
        ChoicePreset(
            "mixup",
            "Mixup images with set labels (IDML §III-C, Table 2)",
            {"on": (_method("method/mixup"), "on"), "off": (("mixup.enabled=false",), "off")},
            _ON_OFF_SYNONYMS,
            switch=True,
        ),
        ChoicePreset(
            "mix",
            "mixed images with set labels: none, Mixup or CutMix (Yun et al. 2019), any task",
            {
                "none": (("mixup.enabled=false",), "none"),
                "mixup": ((*_method("method/mixup"), "mixup.kind=mixup"), "Mixup"),
                "cutmix": ((*_method("method/mixup"), "mixup.kind=cutmix"), "CutMix"),
            },
            {"off": "none"},
        ),
        _switch("ssr", "self-supervised ranking auxiliary task (Fu et al. 2021)", "ssr.enabled"),
        _switch(
            "test_ism",
            "rank with ISM at test time (Wang et al. 2022 Table 5)",
            "eval.introspective",
        ),
        ChoicePreset(
            "method",
            "baseline, IDML (uncertainty head + ISM + Mixup), SSR, or IDML with SSR",
            {
                "baseline": (_full("baseline"), "baseline"),
                "idml": (_full("idml"), "IDML"),
                "ssr": (_full("ssr"), "SSR"),
                "idml_ssr": (_full("idml_ssr"), "IDML+SSR"),
            },
            {"plain": "baseline", "idml+ssr": "idml_ssr", "idml-ssr": "idml_ssr"},
        ),
        BatchSizePreset(),
        AliasPreset("gamma", "metric.gamma", "ISM introspective bias γ"),
        AliasPreset("tau", "metric.tau", "ISM weakening degree τ"),
        AliasPreset("ssr_weight", "ssr.task.weight", "SSR ranking-loss weight γ_r"),
        AliasPreset("embedding_dim", "model.embedding_dim", "embedding size d"),
        AliasPreset("loss", "loss.name", "loss function"),
    )
}
"""Named grid axes. Keys without a dot must be one of these (or a top-level config key)."""


def describe_presets() -> str:
    """One line per preset: name, values and what it sets (for ``idml ablate --help``)."""
    lines = []
    for name, preset in PRESETS.items():
        values = ", ".join(preset.choices) if isinstance(preset, ChoicePreset) else "<value>"
        lines.append(f"  {name}={values}: {preset.description}")
    return "\n".join(lines)


@dataclass(frozen=True)
class GridAxis:
    """One axis of the grid: a preset or a raw config key, and its values (canonical spelling)."""

    key: str
    values: tuple[str, ...]

    @property
    def preset(self) -> Preset | None:
        """The named preset of this axis (``None`` for a raw config key)."""
        return PRESETS.get(self.key)

    def label(self, value: str) -> str:
        """The value as the table shows it."""
        preset = self.preset
        return preset.label(value) if preset is not None else value

    def overrides(self, value: str, base: Config | None) -> tuple[str, ...]:
        """Config overrides of one value of this axis."""
        preset = self.preset
        if preset is not None:
            return preset.overrides(value, base)
        return (f"{self.key}={value}",)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a value per axis and the overrides they expand to."""

    assignment: tuple[tuple[str, str], ...]
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        """Human-readable, e.g. ``metric=ism mixup=on``."""
        return " ".join(f"{key}={value}" for key, value in self.assignment)

    @property
    def id(self) -> str:
        """Folder-safe identifier, e.g. ``metric-ism__mixup-on`` (a hash suffix when it had to be
        shortened or characters were replaced, so distinct cells never share a folder)."""
        raw = "__".join(f"{key}-{value}" for key, value in self.assignment) or "base"
        safe = re.sub(r"[^A-Za-z0-9._+-]", "_", raw)
        if safe != raw or len(safe) > 96:
            digest = hashlib.sha1(raw.encode()).hexdigest()[:8]
            safe = f"{safe[:80]}_{digest}"
        return safe


def canonical_value(text: str) -> str:
    """A raw override value in one canonical spelling (``0.10`` and ``0.1`` are the same value).

    Values are YAML scalars, as in ``idml train --set``; strings stay as typed.

    >>> canonical_value("0.10"), canonical_value("[0.8, 1.0]"), canonical_value("margin")
    ('0.1', '[0.8,1.0]', 'margin')
    """
    text = text.strip()
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(parsed, str):
        return text
    return json.dumps(parsed, separators=(",", ":"))


def split_values(text: str) -> list[str]:
    """Split ``v1,v2,…`` at top-level commas (commas inside ``[]``/``{}`` or quotes stay).

    >>> split_values("0.1,[0.8, 1.0],'a,b'")
    ['0.1', '[0.8, 1.0]', "'a,b'"]
    """
    parts: list[str] = []
    depth, quote, start = 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_grid(specs: Sequence[str]) -> list[GridAxis]:
    """Parse ``--grid`` arguments (``key=v1,v2,…``) into axes, validating keys and values.

    Raises:
        ValueError: malformed spec, empty or repeated value, repeated axis, ``seed`` as an axis
            (use ``seeds``), ``name`` or a key of :data:`IGNORED_KEYS` (every value would give the
            same runs), or a dot-less key that is not a preset.
    """
    axes: list[GridAxis] = []
    seen: set[str] = set()
    for spec in specs:
        key, sep, rest = spec.partition("=")
        key = key.strip()
        if not sep or not key or not rest.strip():
            raise ValueError(f"--grid {spec!r} must look like key=v1,v2 (e.g. metric=plain,ism)")
        if key == "seed":
            raise ValueError("--grid seed=… is not an axis; use --seeds N to repeat every cell")
        if key in seen:
            raise ValueError(f"--grid {key} is given twice; list all its values in one --grid")
        if key == "name" or key in IGNORED_KEYS:
            # name is set per cell and seed; the others cannot change a run's numbers.
            raise ValueError(
                f"--grid {key}=… cannot be an axis: every value would give the same runs "
                f"(name is set per cell; {', '.join(sorted(IGNORED_KEYS))} do not change results)"
            )
        if "." not in key and key not in PRESETS:
            raise ValueError(
                f"--grid {key}: not a preset and not a config key; presets are "
                f"{', '.join(PRESETS)}, config keys look like section.key (e.g. metric.gamma)"
            )
        seen.add(key)
        preset = PRESETS.get(key)
        values: list[str] = []
        for value in split_values(rest):
            if not value:
                raise ValueError(f"--grid {spec!r} has an empty value; remove the extra comma")
            canon = preset.canonical(value) if preset is not None else canonical_value(value)
            if canon in values:
                raise ValueError(f"--grid {spec!r} lists the value {value!r} twice")
            values.append(canon)
        axes.append(GridAxis(key, tuple(values)))
    return axes


def expand_grid(axes: Sequence[GridAxis], base: Config | None = None) -> list[Cell]:
    """The Cartesian product of the axes (first axis slowest), each cell with its overrides.

    ``base`` is the config the overrides apply to (the ``batch_size`` preset needs its sampler).

    Raises:
        ValueError: two axes setting one config key to different values in some cell (e.g.
            ``method=idml`` and ``mixup=off``) — the cell would silently depend on axis order.
    """
    cells = []
    for combo in itertools.product(*(axis.values for axis in axes)):
        assignment = tuple((axis.key, value) for axis, value in zip(axes, combo, strict=True))
        overrides: list[str] = []
        owner: dict[str, tuple[str, str]] = {}
        for axis, value in zip(axes, combo, strict=True):
            for item in axis.overrides(value, base):
                key, _, setting = item.partition("=")
                previous = owner.get(key)
                if previous is not None and previous[1] != setting:
                    raise ValueError(
                        f"--grid {previous[0]} and --grid {axis.key}={value} both set {key} "
                        f"({previous[1]} vs {setting}); drop one of the two axes"
                    )
                owner[key] = (f"{axis.key}={value}" if previous is None else previous[0], setting)
                overrides.append(item)
        cells.append(Cell(assignment, tuple(overrides)))
    return cells
