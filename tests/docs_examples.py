"""The Python examples of the documentation (docs/*.md), as the suite runs them.

A page's ```python blocks run in order, in one namespace per page, so a block may use the names of the blocks above
it. A block that cannot run here (it needs GPUs or several processes) is preceded by a line
`<!-- docs: skip (why) -->`: it is still compiled, so its syntax cannot rot, and the reason must be given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"<!-- docs: skip \((?P<why>[^)]+)\) -->\s*$")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str  # why the block does not run here; "" if it runs


def examples_of(page: Path) -> list[Example]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        if "docs: skip" in before and skip is None:
            raise ValueError(f"{page}: a skip marker must say why, as <!-- docs: skip (needs 8 GPUs) -->: {before!r}")
        line = text.count("\n", 0, match.start()) + 1
        found.append(Example(page, line, match.group(1), skip.group("why") if skip else ""))
    return found


def run_page(page: Path) -> list[Example]:
    """Compile every block of the page and run those not skipped; return the skipped ones."""
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    skipped = []
    for example in examples_of(page):
        code = compile(example.code, f"{page}:{example.line}", "exec")
        if example.skip:
            skipped.append(example)
            continue
        exec(code, namespace)
    return skipped
