"""MkDocs hooks (mkdocs.yml `hooks:`): the benchmark page and its figures come from benchmarks/, not copies.

- The page `benchmarks/index.md` holds a marker that is replaced by `benchmarks/report.py`'s rendering of
  benchmarks/report/*.md over benchmarks/results/*.json: the same text as benchmarks/README.md (which
  tests/unit/test_report.py keeps equal to the rendering), so a figure is never typed twice.
- The pictures under benchmarks/ (loss curves, plan plots, compression curves) are added to the site at the same
  paths relative to that page, so the rendering's image links resolve as they do in benchmarks/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
REPORT_MARKER = "<!-- rendered by benchmarks/report.py -->"


def _report() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import report  # benchmarks/report.py, the one renderer of the figures
    finally:
        sys.path.remove(str(BENCHMARKS))
    return report


def on_files(files: Files, config: Any) -> Files:
    for picture in sorted(BENCHMARKS.rglob("*.png")):
        uri = "benchmarks/" + picture.relative_to(BENCHMARKS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(picture)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if REPORT_MARKER not in markdown:
        return markdown
    report = _report()
    rendered = report.render().removeprefix(report.HEADER)
    rendered = rendered.replace("\n# Benchmarks\n", "\n", 1)  # the page has its own title
    return markdown.replace(REPORT_MARKER, rendered)
