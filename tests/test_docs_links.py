"""The documentation's links and citations lead somewhere (issue 43): every relative link of the Markdown pages names a
tracked file (and, with ``#anchor``, one of its headings), and every citation of a page's section in the repository's
files (``docs/privacy_model.md, "Precision and paths"``) names a heading of that page."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
PAGES = [f for f in TRACKED if f.endswith(".md")]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
#: ``page.md, "Section"`` (straight or curly quotes), as the code and docs cite a section
CITATION = re.compile(r"([\w./-]+\.md),?\s+[\u201c\"]([^\"\u201d\n]{3,80})[\u201d\"]")


def _headings(page: Path):
    return [re.sub(r"^#+\s+", "", line).strip() for line in page.read_text().splitlines() if re.match(r"^#+\s", line)]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_leads_to_a_tracked_file_and_heading(page):
    text = FENCE.sub("", (ROOT / page).read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (ROOT / page).parent / path if path else ROOT / page
        relative = resolved.resolve().relative_to(ROOT).as_posix() if resolved.resolve().is_relative_to(ROOT) else None
        if relative not in TRACKED and not any(t.startswith(f"{relative}/") for t in TRACKED):
            broken.append(f"{target} (no such tracked file)")
        elif anchor and resolved.suffix == ".md" and anchor not in {_anchor(h) for h in _headings(resolved)}:
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page}: {broken}"


def test_every_cited_section_exists():
    missing, cited = [], 0
    for name in TRACKED:
        if not name.endswith((".py", ".md", ".toml", ".yaml")) or name == "tests/test_docs_links.py":  # its examples
            continue
        for target, section in CITATION.findall((ROOT / name).read_text(errors="ignore")):
            page = next((p for p in (ROOT / target, (ROOT / name).parent / target, ROOT / "docs" / Path(target).name)
                         if p.is_file()), None)
            cited += 1
            headings = _headings(page) if page is not None else []
            if not any(section.lower().rstrip(".") in h.lower() for h in headings):
                missing.append(f"{name}: {target}, {section!r}")
    assert cited > 10  # the pattern still finds the repository's citations (the check can fail)
    assert not missing, missing


def test_the_check_finds_a_broken_link(tmp_path):
    """The control: a link to a missing file and to a missing heading are both found."""
    text = "[a](nowhere.md) [b](README.md#no-such-heading) [c](README.md#trl_userdp)"
    found = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if path not in TRACKED:
            found.append(target)
        elif anchor and anchor not in {_anchor(h) for h in _headings(ROOT / path)}:
            found.append(target)
    assert found == ["nowhere.md", "README.md#no-such-heading"]
