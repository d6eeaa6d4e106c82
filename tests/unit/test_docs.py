"""The documentation holds together: a short README that links into docs/, every page in the site's nav.

`make test` builds the site itself (`mkdocs build --strict`, which also checks the links between pages)."""

import re
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200  # what llmopt is, the two commands, what a run prints, where to go next
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def nav_pages(nav: list) -> list[str]:
    """Every page a MkDocs nav lists, however deeply it is nested."""
    pages = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def site_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_the_readme_stays_under_two_hundred_lines():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_docs_page_is_in_the_site_nav_and_every_nav_entry_exists():
    config = site_config()
    docs = REPO / config.get("docs_dir", "docs")
    pages = nav_pages(config["nav"])
    on_disk = sorted(path.relative_to(docs).as_posix() for path in docs.rglob("*.md"))
    assert sorted(pages) == on_disk, "mkdocs.yml's nav and the files under docs/ differ"
    assert len(pages) == len(set(pages)), "a page is listed twice in the nav"


def test_every_relative_link_in_the_readme_points_to_an_existing_file():
    readme = (REPO / "README.md").read_text()
    targets = [t for t in LINK.findall(readme) if not re.match(r"[a-z]+:|#", t)]
    assert any(t.startswith("docs/") for t in targets), "the README links into docs/"
    missing = [t for t in targets if not (REPO / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_links_to_every_docs_page_and_the_results_page_to_every_dated_one():
    """The README reaches every page but the dated measurements (docs/results/), which docs/results.md lists."""
    readme = (REPO / "README.md").read_text()
    linked = {t.split("#")[0] for t in LINK.findall(readme) if t.startswith("docs/")}
    pages = {f"docs/{page}" for page in nav_pages(site_config()["nav"])}
    dated = {page for page in pages if page.startswith("docs/results/")}
    assert pages - dated <= linked, f"pages the README does not link to: {sorted(pages - dated - linked)}"
    results = (REPO / "docs" / "results.md").read_text()
    listed = {f"docs/{t.split('#')[0]}" for t in LINK.findall(results) if t.startswith("results/")}
    assert dated <= listed, f"dated pages docs/results.md does not list: {sorted(dated - listed)}"
    assert all(re.fullmatch(r"docs/results/\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", page) for page in dated), dated


def test_the_site_is_built_into_a_git_ignored_folder():
    site_dir = site_config()["site_dir"]
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{site_dir}/index.html"], cwd=REPO, check=False)
    assert ignored.returncode == 0, f"{site_dir} is not git-ignored: the built site would show up to commit"
