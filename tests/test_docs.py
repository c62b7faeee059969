"""The documentation as a newcomer meets it: a README short enough to read to the end, which
links every page of docs/; links that lead somewhere; and no page naming a path of one machine or
a tool that is not the project's or a dependency's."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import REPO

README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
READMES = [README, *PAGES, REPO / "benchmarks" / "README.md", REPO / "checks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# What belongs to the machines this project was built on, not to its users.
FOREIGN = re.compile(r"/tmp/|/work/|farm-bench|farm-studio|\.library\b")


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the reference to docs/"
    commands = [line.split("#")[0].strip() for line in lines[:8] if line.startswith("make ")]
    assert commands == ["make demo", "make test"]


def test_every_docs_page_is_linked_from_the_readme():
    links = set(LINK.findall(README.read_text(encoding="utf-8")))
    assert PAGES, "docs/ holds no page"
    missing = [page.name for page in PAGES
               if not any(link.split("#")[0] == f"docs/{page.name}" for link in links)]
    assert not missing, f"pages the README does not link: {missing}"


def test_every_relative_link_leads_to_a_file_and_its_heading():
    broken = []
    for page in READMES:
        for link in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {link}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings."""
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_no_page_names_a_machine_path_or_a_workplace_tool():
    found = [f"{page.relative_to(REPO)}:{number}: {line.strip()}"
             for page in READMES
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if FOREIGN.search(line)]
    assert not found, "\n".join(found)


def test_every_file_a_page_names_exists():
    """A moved module or test leaves no page pointing at its old place (`X` is a pattern's
    placeholder, `tests/test_X.py`)."""
    path = re.compile(r"\b(?:attn_cli|tests|benchmarks|checks|examples)/[\w/.-]+\.(?:py|md|mk)\b")
    missing = [f"{page.relative_to(REPO)}: {name}"
               for page in READMES for name in path.findall(page.read_text(encoding="utf-8"))
               if "X" not in Path(name).stem and not (REPO / name).exists()]
    assert not missing, "\n".join(missing)
