"""Typed, validated run configuration.

One pydantic schema describes a whole run (:class:`Config`; the sections in ``_schema.py``). Every
model forbids unknown keys, so a typo is an error that names the key and lists the valid ones
instead of being silently dropped; a key the run's task does not read is an error too. YAML files
in ``configs/`` are presets of this schema; ``--set key.sub=value`` overrides any field.
Composition (``include:`` of files and packaged fragments), overrides, the task's defaults,
validation and error messages, and stored runs' configs are in ``_io.py``. Every public name is
imported from here.

Example:
    >>> cfg = load_config(None, overrides=["loss.name=multi_similarity", "optim.epochs=3"])
    >>> cfg.loss.name, cfg.optim.epochs
    ('multi_similarity', 3)
    >>> try:
    ...     load_config(None, overrides=["optim.learning_rate=0.1"])
    ... except ConfigError as err:
    ...     print(str(err).splitlines()[0])
    unknown key 'optim.learning_rate'
"""

from __future__ import annotations

from idml.app.config._io import (
    FRAGMENTS,
    INCLUDE_KEY,
    RUNTIME_KEYS,
    config_difference,
    config_to_dict,
    dump_config,
    fragment_names,
    fragment_overrides,
    load_config,
    merge_configs,
    read_fragment,
    read_only,
    stored_config_dict,
    to_overrides,
    validate_config,
)
from idml.app.config._schema import (
    DEFAULT_LOSS,
    DEFAULT_TASK,
    LOSS_CONFIGS,
    NAMED_SECTIONS,
    PUBLISHED_METRIC,
    RUN_KEYS,
    TASK_CONFIGS,
    CalibrationConfig,
    Config,
    ConfigError,
    DataConfig,
    LossConfig,
    LossSection,
    MixupConfig,
    NamedSection,
    NamedSections,
    OpenUnitInterval,
    OptimConfig,
    PublishedNumbers,
    Section,
    TaskConfig,
    TaskSection,
    UnitInterval,
    choices,
    config_keys,
    loss_section,
    reads_key,
)

__all__ = [
    "DEFAULT_LOSS",
    "DEFAULT_TASK",
    "FRAGMENTS",
    "INCLUDE_KEY",
    "LOSS_CONFIGS",
    "NAMED_SECTIONS",
    "PUBLISHED_METRIC",
    "RUNTIME_KEYS",
    "RUN_KEYS",
    "TASK_CONFIGS",
    "CalibrationConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LossConfig",
    "LossSection",
    "MixupConfig",
    "NamedSection",
    "NamedSections",
    "OpenUnitInterval",
    "OptimConfig",
    "PublishedNumbers",
    "Section",
    "TaskConfig",
    "TaskSection",
    "UnitInterval",
    "choices",
    "config_difference",
    "config_keys",
    "config_to_dict",
    "dump_config",
    "fragment_names",
    "fragment_overrides",
    "load_config",
    "loss_section",
    "merge_configs",
    "read_fragment",
    "read_only",
    "reads_key",
    "stored_config_dict",
    "to_overrides",
    "validate_config",
]
