"""Every relative link and #anchor in README.md, CHANGELOG.md and docs/*.md leads somewhere, as GitHub
renders them: a link is relative to the file it is in, and an anchor is a heading's GitHub slug."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from tests.fakes import FakeClock

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


# ------------------------------------------------------------------ docs/tensorboard.md's tag table


def tag_table() -> list[tuple[list[str], list[str], str]]:
    """docs/tensorboard.md's table of tags: per row, its run patterns, tag patterns and its "when"."""
    text = (ROOT / "docs" / "tensorboard.md").read_text()
    table = text[text.index("| run | tag | when | value |") :].split("\n\n")[0].splitlines()[2:]
    rows = []
    for line in table:
        run, tag_, when = line.split(" | ")[:3]
        rows.append((re.findall(r"`([^`]+)`", run) or [run.strip("| ")], re.findall(r"`([^`]+)`", tag_), when))
    return rows


def pattern(doc: str) -> re.Pattern[str]:
    """A run or tag of the table as a regex: `<clock>` is host or gpu, `<row>` and `<tag>` any name,
    `...` anything; the log dir's own run is `.`."""
    rx = re.escape(doc.replace("<log dir>/", "").replace("<log dir>", "."))
    for holder, any_ in (("<clock>", "(host|gpu)"), ("<row>", ".+"), ("<tag>", ".+"), ("\\.\\.\\.", ".*")):
        rx = rx.replace(re.escape(holder) if holder.startswith("<") else holder, any_)
    return re.compile(rx)


def test_the_tag_table_lists_every_tag_a_run_writes(tmp_path: Path, clock: FakeClock) -> None:
    """A host-only run with nested phases, samples, tokens, FLOPs, warm-up and a slow step, read back
    with TensorBoard's reader: each (run, tag) it wrote matches a row of the table, and each row that
    such a run should write (not CUDA's, Lightning's, torch.distributed's) matches one it wrote."""
    from steptimer import StepTimer
    from tests.tb import accumulator

    t = StepTimer(log_dir=tmp_path, cuda=False, log_every_n_steps=4, warmup_steps=2, print_summary=False)
    for i in t.data(iter(range(14))):
        clock.advance_ms(0.5)
        with t.step(samples=4, tokens=64, flops=1e9):
            with t.phase("forward"), t.phase("attn"):
                clock.advance_ms(30.0 if i == 9 else 1.0)
            with t.phase("backward"):
                clock.advance_ms(2.0)
    t.close()
    written = set()
    for run in {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}:
        tags = accumulator(run).Tags()
        name = run.relative_to(tmp_path).as_posix()
        written |= {(name, tag) for kind in ("scalars", "histograms", "tensors") for tag in tags[kind]}
    assert ("steptimer/forward/attn", "steptimer/host_ms") in written  # a nested phase's run

    table = [([pattern(r) for r in runs], [pattern(t) for t in tags], when) for runs, tags, when in tag_table()]

    def in_row(runs: list[re.Pattern[str]], tags: list[re.Pattern[str]], run: str, tag: str) -> bool:
        return any(r.fullmatch(run) for r in runs) and any(t.fullmatch(tag) for t in tags)

    unlisted = {(run, tag) for run, tag in written if not any(in_row(rs, ts, run, tag) for rs, ts, _ in table)}
    assert unlisted == set()
    expected = [(rs, ts) for rs, ts, when in table if not re.search("CUDA|Lightning|distributed", when)]
    not_written = [[t.pattern for t in ts] for rs, ts in expected if not any(in_row(rs, ts, *w) for w in written)]
    assert not_written == []


def test_the_tag_tables_patterns_read_runs_as_tensorboard_shows_them() -> None:
    rows = tag_table()
    assert len(rows) >= 15 and all(tags for _, tags, _ in rows)
    listed = [pattern(t) for _, tags, _ in rows for t in tags]
    assert any(p.fullmatch("steptimer-tails/gpu_p90_ms") for p in listed)
    assert not any(p.fullmatch("steptimer/host/forward_ms") for p in listed)  # the whole tag is not in a run


def test_the_readmes_option_defaults_are_the_options_defaults() -> None:
    from steptimer._options import Options

    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("### Options") :].split("\n\n")[1]
    said = dict(re.findall(r"`(\w+)`\s+\(([^:;)]+):", paragraph))
    assert set(said) == {"warmup_steps", "lag", "memory"}, said
    assert said == {name: repr(getattr(Options, name)) for name in said}
