"""Run a README section's ``python`` blocks as one doctest, so the README's examples stay true."""

from __future__ import annotations

import doctest
import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def run_readme_section(heading: str, globs: dict[str, Any] | None = None) -> doctest.TestResults:
    """Run the ``python`` blocks under ``heading`` (e.g. ``"## Extending idml"``, up to the next
    heading of the same level) with ``globs`` predefined; return the doctest's counts."""
    level = heading.split(" ", 1)[0]
    match = re.search(rf"{re.escape(heading)}\n(.*?)\n{level} ", README.read_text(), re.S)
    assert match, f"README lost its '{heading}' section"
    blocks = "\n".join(re.findall(r"```python\n(.*?)```", match.group(1), re.S))
    test = doctest.DocTestParser().get_doctest(blocks, dict(globs or {}), "README", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    return runner.run(test)
