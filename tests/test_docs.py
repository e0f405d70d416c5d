"""Every relative link and #anchor in README.md, CHANGELOG.md and docs/*.md leads somewhere, as GitHub
renders them: a link is relative to the file it is in, and an anchor is a heading's GitHub slug."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped but '-' and '_', spaces to '-', a
    repeated slug numbered (-1, -2, ...). A `{#id}` suffix is not honoured: it stays in the text."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda g: g.group(1) or "", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans hold example syntax, not links
    return [a or b for a, b in LINK.findall(text)]


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = {str(p.relative_to(ROOT)): broken(p) for p in PAGES}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_checker_catches_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    (tmp_path / "docs" / "b.md").write_text("# Title\n## Two words `here`\n## Two words here\n")
    page.write_text(
        "[ok](b.md#two-words-here) [ok2](b.md#two-words-here-1) [self](#top) [gone](docs/b.md) "
        "[bad anchor](b.md#nope) ![img](missing.png)\n# Top\n```\n[in code](nowhere.md)\n```\n"
    )
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert broken(page) == [
            "docs/b.md: no file docs/docs/b.md",
            "b.md#nope: no heading #nope in docs/b.md",
            "missing.png: no file docs/missing.png",
        ]
    finally:
        ROOT = old
