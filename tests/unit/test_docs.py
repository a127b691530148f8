"""The docs hold together: the index lists every page, and every relative link points at a file that exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) and [text](target#anchor)


def test_the_index_lists_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = set(LINK.findall(index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert len(pages) > 15  # a broken glob would pass the check below
    assert pages - linked == set(), "docs/README.md should link every page"


def test_every_relative_link_resolves():
    broken, checked = [], 0
    for page in [*DOCS.glob("*.md"), REPO / "README.md"]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            checked += 1
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert checked > 40  # the pattern finds the links (the index alone has over 20)
    assert broken == []


def test_the_readme_points_at_the_quickstart_and_the_index():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "](docs/quickstart.md)" in readme and "](docs/README.md)" in readme
