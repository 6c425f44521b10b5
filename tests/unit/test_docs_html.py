"""The documentation site as a browser gets it: build it with mkdocs into a temporary folder
and check every table cell of every page (the generated references included).

A cell is wrong when

* ``attr_list`` took text in braces for attributes (``{"bucket_cap_mb": 50}`` became
  ``<td 50 _bucket_cap_mb_:>``): the cell has an attribute no table cell is given;
* a backslash before a pipe is shown (``N\\|MIN:MAX``): an escape the table did not consume;
* Markdown was left unrendered in its text (outside code): ``**``, a backtick, ``](``.

Skipped where MkDocs (the ``docs`` extra) is not installed.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest

from harness import docs_site

MISSING = docs_site.missing()

pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"the docs extra is not installed ({', '.join(MISSING)}): pip install -e '.[docs]'",
)

#: Attributes Python-Markdown's tables and mkdocstrings give a cell.
CELL_ATTRIBUTES = {"align", "style", "class", "colspan", "rowspan", "id", "title"}
UNRENDERED = ("**", "`", "](")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return docs_site.build(tmp_path_factory.mktemp("site"))


class Cells(HTMLParser):
    """Every ``td`` / ``th``: its start tag's attributes, its whole text, and its text outside
    ``code`` / ``pre``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[dict[str, object]] = []
        self._open: list[dict[str, object]] = []
        self._code = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("td", "th"):
            cell: dict[str, object] = {
                "tag": self.get_starttag_text(),
                "attrs": [a for a, _ in attrs],
                "text": "",
                "prose": "",
            }
            self.cells.append(cell)
            self._open.append(cell)
        elif tag in ("code", "pre", "script", "style"):
            self._code += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._open:
            self._open.pop()
        elif tag in ("code", "pre", "script", "style") and self._code:
            self._code -= 1

    def handle_data(self, data: str) -> None:
        for cell in self._open[-1:]:
            cell["text"] = str(cell["text"]) + data
            if not self._code:
                cell["prose"] = str(cell["prose"]) + data


def cells_of(page: Path) -> list[dict[str, object]]:
    parser = Cells()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.cells


def test_every_table_cell_is_whole(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20, f"the site has only {len(pages)} pages"
    problems: list[str] = []
    counted = 0
    for page in pages:
        where = page.relative_to(site)
        for cell in cells_of(page):
            counted += 1
            odd = [a for a in cell["attrs"] if a not in CELL_ATTRIBUTES]  # type: ignore[attr-defined]
            if odd:
                problems.append(
                    f"{where}: a cell with attributes {odd} (attr_list?): {cell['tag']}"
                )
            text, prose = str(cell["text"]), str(cell["prose"])
            if "\\|" in text:
                problems.append(
                    f"{where}: a backslash before a pipe is shown: {text.strip()[:120]!r}"
                )
            for mark in UNRENDERED:
                if mark in prose:
                    problems.append(
                        f"{where}: unrendered Markdown {mark!r}: {prose.strip()[:120]!r}"
                    )
    assert counted > 200, f"only {counted} table cells found: the check looks at the wrong pages"
    assert not problems, "\n".join(problems)


def test_the_generated_references_are_there(site: Path) -> None:
    # <wbr>: where docs/hooks.py lets a name in a table cell break
    settings = (site / "reference" / "settings" / "index.html").read_text(encoding="utf-8")
    settings = settings.replace("<wbr>", "")
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    cli = cli.replace("<wbr>", "")
    assert 'id="ddp_kwargs"' in settings and "bucket_cap_mb" in settings
    assert "<code>N|MIN:MAX</code>" in cli
    assert "subcommands (" in cli and "four subcommands" not in cli


def test_the_readmes_links_land_on_built_pages(site: Path) -> None:
    """The README links to the site (mkdocs.yml's site_url), not to docs/*.md, which a
    repository host shows unbuilt (snippet lines, empty generated tables); each link names a
    page of the built site, and its anchor is there."""
    import re

    import yaml

    site_url = str(yaml.safe_load((docs_site.ROOT / "mkdocs.yml").read_text())["site_url"])
    links = re.findall(r"\]\(([^)\s]+)\)", (docs_site.ROOT / "README.md").read_text())
    raw = [link for link in links if link.startswith("docs/") and ".md" in link]
    assert not raw, f"README links to unbuilt pages (link to {site_url}... instead): {raw}"
    ours = [link for link in links if link.startswith(site_url)]
    assert len(ours) > 20, f"only {len(ours)} README links to {site_url}"
    problems = []
    for link in ours:
        path, _, anchor = link[len(site_url) :].partition("#")
        page = site / path / "index.html"
        if not page.is_file():
            problems.append(f"{link}: no page {path or '(home)'} in the built site")
        elif anchor and f'id="{anchor}"' not in page.read_text(encoding="utf-8"):
            problems.append(f"{link}: no anchor #{anchor} on {path or '(home)'}")
    assert not problems, "\n".join(problems)
