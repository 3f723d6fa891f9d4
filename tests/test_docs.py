"""The docs a newcomer reads (issue 60): every relative Markdown link in a tracked .md file names
a file that exists, every page is reached from README.md by links, and the pages keep their
lengths (README.md <= 250 lines, docs/MAP.md <= 120, docs/DESIGN.md <= 800, all Markdown <= 3,200),
counted as `git ls-files '*.md' | xargs wc -l` counts them."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMITS = {"README.md": 250, "docs/MAP.md": 120, "docs/DESIGN.md": 800}
TOTAL = 3200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked_markdown() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / line for line in out.splitlines() if line and (REPO / line).is_file()]


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")  # what wc -l counts


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link outside fenced code blocks."""
    found, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        for target in LINK.findall(prose):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
                found.append((number, target))
    return found


def resolve(page: Path, target: str) -> Path:
    return (page.parent / target.split("#", 1)[0]).resolve()


def test_every_relative_link_names_a_file_that_exists():
    broken = [f"{page.relative_to(REPO)}:{number}: {target}"
              for page in tracked_markdown() for number, target in links(page)
              if not resolve(page, target).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_page_is_reached_from_the_readme():
    pages = set(tracked_markdown())
    seen, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page not in pages:
            continue
        seen.add(page)
        todo += [resolve(page, target) for _, target in links(page)]
    assert not pages - seen, "pages no link from README.md reaches: " + ", ".join(
        sorted(str(p.relative_to(REPO)) for p in pages - seen))


def test_the_pages_keep_their_lengths():
    counts = {str(p.relative_to(REPO)): lines(p) for p in tracked_markdown()}
    for name, limit in LIMITS.items():
        assert counts.get(name, 0) <= limit, f"{name}: {counts.get(name)} lines, at most {limit}"
    assert sum(counts.values()) <= TOTAL, (
        f"all tracked Markdown: {sum(counts.values())} lines, at most {TOTAL}: "
        + ", ".join(f"{n} {c}" for n, c in sorted(counts.items(), key=lambda x: -x[1])))
