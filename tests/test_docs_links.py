"""The README and the pages under docs/ link to each other: every relative link names a file of the repository, and
every #anchor a heading of the page it points to (GitHub's slugs), so a page moved or a heading renamed breaks here
and not in a reader's browser."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fenced, out = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.*)", line)):
            out.add(_slug(m.group(1)))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:", t)]


def test_slugs_follow_githubs_rule():
    assert _slug("The GPU session (benchmarks/gpu_session.sh)") == "the-gpu-session-benchmarksgpu_sessionsh"
    assert _slug("A decode step (for the decode workload)") == "a-decode-step-for-the-decode-workload"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_page_under_docs_is_reachable_from_the_readme():
    readme_links = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md") if t.partition("#")[0]}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in readme_links]
    assert not missing, f"docs pages the README does not link: {missing}"
