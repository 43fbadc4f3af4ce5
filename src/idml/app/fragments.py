"""The config fragments packaged with idml (``include: method/idml``; :mod:`idml.app.config`):
where they are and their names.

Apart from :mod:`idml.app.config`, which imports torch through the schema, so that ``idml train
--help`` lists the methods without loading torch.

Example:
    >>> "method/idml" in fragment_names() and "idml" in method_names()
    True
"""

from __future__ import annotations

from pathlib import Path

FRAGMENTS = Path(__file__).parent / "config" / "fragments"
"""The packaged fragments: ``include: method/idml`` reads ``FRAGMENTS / "method/idml.yaml"``."""


def fragment_names() -> list[str]:
    """Names of the packaged fragments (``method/idml``, ``dataset/cub``, …), sorted."""
    return sorted(
        p.relative_to(FRAGMENTS).with_suffix("").as_posix() for p in FRAGMENTS.rglob("*.yaml")
    )


def method_names() -> list[str]:
    """The methods, ``method/<name>`` fragments, by name (``baseline``, ``idml``, …), sorted."""
    return [name.removeprefix("method/") for name in fragment_names() if name.startswith("method/")]
