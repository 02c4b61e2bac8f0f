"""The documentation holds together: the README stays a front page, and every relative link in it and
in docs/ (and the READMEs beside the scripts, configs and datasets) points to a file that exists and,
with a #fragment, to a heading of that file as GitHub renders its anchor."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "scripts" / "abci" / "README.md",
                REPO / "dataset" / "README.md", REPO / "ds_configs" / "README.md"])
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a link is a link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page's headings give, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = github_anchor(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_github_anchor_matches_githubs_rule():
    assert github_anchor("3. Check before queueing") == "3-check-before-queueing"
    assert github_anchor("Universal checkpoints (DeepSpeed)") == "universal-checkpoints-deepspeed"
    assert github_anchor("One job per `--save`") == "one-job-per---save"
    assert github_anchor("What `common.sh` does") == "what-commonsh-does"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not ours to check
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and fragment not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move reference text into docs/"
    first_screen = "\n".join(lines[:45])
    assert "make quickstart" in first_screen and "make test" in first_screen
    assert re.search(r"^(torchrun|deepspeed) .*pretrain_gpt\.py", first_screen, re.M), \
        "the first screen of README.md shows no hand-written training command"
