"""The documentation site as a reader sees it: built once, served on a free port of this machine
and opened in headless Chromium (Playwright driving the system's browser) at 1280x900 and at
390 px wide, a phone. What is asserted is what the page shows, measured in the browser:

* a code block in a language (a ``language-*`` class, or highlighted tokens) never wraps its
  lines: a long line scrolls sideways and the indentation stays as written; so does output
  whose columns line up (```output). A ```text or plain block (a quoted message) may wrap,
  and then the copy button covers none of its text;
* at 1280 px no table and no code block is wider than the text column: a table fits without
  sideways scrolling, a code block's long lines scroll inside it, nothing is cut off;
* every image is legible: drawn at >= 60 % of its natural width (an SVG's natural width is its
  ``viewBox``), at 390 px inside a box that scrolls sideways where the column is narrower;
* on the home page at 1280x900, without scrolling, a link to each of getting started, install,
  launch, migrating from Accelerate, verify, the reference and the repository.

Skipped, with the reason, where the ``docs`` extra (MkDocs, Playwright) or a Chromium is
missing: scripts/test.sh installs Debian's ``chromium`` when it runs as root. External
requests (web fonts) are refused, so the test needs no network.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from harness import docs_site

#: The pages a newcomer opens first, and the references they come back to.
PAGES = (
    "",
    "install/",
    "getting-started/",
    "examples/",
    "faq/",
    "guide/",
    "checkpoints/",
    "memory-and-nodes/",
    "parallelism/",
    "clusters/",
    "migrating-from-accelerate/",
    "verify/",
    "benchmark/",
    "concepts/window/",
    "concepts/sync-policies/",
    "concepts/audit/",
    "reference/accelerator/",
    "reference/settings/",
    "reference/cli/",
    "contributing/",
)
WIDE = {"width": 1280, "height": 900}
NARROW = {"width": 390, "height": 844}
LEGIBLE = 0.6  # an image drawn at less than this share of its natural width is too small to read

#: The home page's key links: name -> the targets that count (site paths, "#" a fragment).
#: "repository" is mkdocs.yml's repo_url.
KEY_LINKS = {
    "getting started": ("getting-started/",),
    "install": ("install/", "getting-started/#install"),
    "launch": ("getting-started/#launch", "reference/cli/#gradsync-launch"),
    "migrating from Accelerate": ("migrating-from-accelerate/",),
    "verify": ("verify/",),
    "reference": ("reference/",),
}


def _chromium() -> str | None:
    for name in (os.environ.get("GRADSYNC_CHROMIUM", ""), "chromium", "chromium-browser"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _skip_reason() -> str | None:
    absent = docs_site.missing()
    if importlib.util.find_spec("playwright") is None:
        absent.append("playwright")
    if absent:
        return f"the docs extra is not installed ({', '.join(absent)}): pip install -e '.[docs]'"
    if _chromium() is None:
        return (
            "no Chromium (apt-get install chromium, as root: scripts/test.sh does it; or set "
            "GRADSYNC_CHROMIUM to a Chromium binary)"
        )
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

#: Run in the page: every measurement the tests assert on, for one page at one width.
MEASURE = """
async () => {
  const article = document.querySelector('article.md-content__inner');
  for (const d of article.querySelectorAll('details')) d.open = true;
  const col = article.getBoundingClientRect();
  const shown = (el) => el.getClientRects().length > 0 && el.getBoundingClientRect().width > 0;
  const short = (el) => (el.textContent || '').trim().replace(/\\s+/g, ' ').slice(0, 60);
  const out = {column: col.width, blocks: [], tables: [], images: []};
  for (const code of article.querySelectorAll('div.highlight pre > code')) {
    if (!shown(code)) continue;
    const block = code.closest('div.highlight');
    // language-text: a quoted message or a plain block, allowed to wrap
    const cls = [...block.classList].find((c) => c.startsWith('language-') && c !== 'language-text') || '';
    const tokens = code.querySelectorAll('span[class]').length;
    const height = code.getBoundingClientRect().height;
    const before = code.style.whiteSpace;
    code.style.whiteSpace = 'pre';
    const unwrapped = code.getBoundingClientRect().height;
    code.style.whiteSpace = before;
    const box = block.getBoundingClientRect();
    let clipped = null;
    for (let a = code; a && a !== article; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if ((o === 'hidden' || o === 'clip') && a.scrollWidth > a.clientWidth + 1) clipped = a.tagName;
    }
    let covered = false;
    const button = block.querySelector('.md-clipboard');
    if (button && shown(button)) {
      const b = button.getBoundingClientRect();
      const range = document.createRange();
      range.selectNodeContents(code);
      for (const r of range.getClientRects()) {
        if (r.width > 0 && r.left < b.right && r.right > b.left && r.top < b.bottom && r.bottom > b.top)
          covered = true;
      }
    }
    out.blocks.push({
      language: cls.replace('language-', '') || (tokens ? '(highlighted)' : ''),
      wraps: height > unwrapped + 1,
      left: box.left - col.left, right: box.right - col.right,
      scrolls: code.scrollWidth > code.clientWidth + 1,
      overflow: getComputedStyle(code).overflowX,
      clipped, covered, text: short(code),
    });
  }
  for (const table of article.querySelectorAll('table')) {
    if (!shown(table)) continue;
    const r = table.getBoundingClientRect();
    out.tables.push({width: r.width, left: r.left - col.left, text: short(table.rows[0] || table)});
  }
  for (const img of article.querySelectorAll('img')) {
    if (!shown(img)) continue;
    let natural = img.naturalWidth;
    const src = img.currentSrc || img.src;
    if (src.endsWith('.svg')) {
      const svg = new DOMParser().parseFromString(await (await fetch(src)).text(), 'image/svg+xml');
      const box = (svg.documentElement.getAttribute('viewBox') || '').split(/[\\s,]+/).map(Number);
      if (box.length === 4) natural = box[2];
    }
    let scroller = null;
    for (let a = img.parentElement; a && a !== article; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if (o === 'auto' || o === 'scroll') { scroller = a; break; }
    }
    out.images.push({
      src: img.getAttribute('src'), natural, drawn: img.getBoundingClientRect().width,
      fits: scroller === null
        ? img.getBoundingClientRect().right <= col.right + 1
        : scroller.getBoundingClientRect().right <= col.right + 1,
    });
  }
  return out;
}
"""

#: Run in the home page: each link's resolved address and whether a reader sees it unscrolled.
LINKS = """
() => [...document.querySelectorAll('a[href]')].map((a) => {
  const r = a.getBoundingClientRect();
  let seen = r.width > 0 && r.height > 0 && r.top >= 0 && r.bottom <= innerHeight
    && r.left >= 0 && r.right <= innerWidth && a.checkVisibility({visibilityProperty: true});
  if (seen) {
    const hit = document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2);
    seen = hit !== null && (a.contains(hit) || hit.contains(a));
  }
  return {href: a.href, text: a.textContent.trim().slice(0, 40), seen};
})
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The built site, served from a free port of 127.0.0.1 for the module's tests."""
    site = docs_site.build(tmp_path_factory.mktemp("site"))
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=_chromium(), args=args)
        try:
            yield chromium
        finally:
            chromium.close()


def _open(browser: Any, base_url: str, viewport: dict[str, int]) -> Any:
    """A page of this size that loads only from the local server."""
    context = browser.new_context(viewport=viewport)
    context.route(
        "**/*",
        lambda route: (
            route.continue_() if route.request.url.startswith(base_url) else route.abort()
        ),
    )
    return context.new_page()


@pytest.fixture(scope="module")
def measured(browser: Any, base_url: str) -> dict[tuple[int, str], dict[str, Any]]:
    """(viewport width, page) -> what MEASURE found there."""
    found: dict[tuple[int, str], dict[str, Any]] = {}
    for viewport in (WIDE, NARROW):
        page = _open(browser, base_url, viewport)
        for path in PAGES:
            response = page.goto(base_url + path, wait_until="load")
            assert response is not None and response.ok, f"{path or 'home'}: {response}"
            found[viewport["width"], path or "home"] = page.evaluate(MEASURE)
        page.context.close()
    return found


def test_the_pages_hold_what_is_measured(measured: dict[tuple[int, str], dict[str, Any]]) -> None:
    blocks = sum(len(m["blocks"]) for (w, _), m in measured.items() if w == WIDE["width"])
    tables = sum(len(m["tables"]) for (w, _), m in measured.items() if w == WIDE["width"])
    images = sum(len(m["images"]) for (w, _), m in measured.items() if w == WIDE["width"])
    assert blocks > 100 and tables > 50 and images >= 3, (blocks, tables, images)


def test_no_code_block_in_a_language_wraps(measured: dict[tuple[int, str], dict[str, Any]]) -> None:
    problems = []
    for (width, page), found in measured.items():
        for block in found["blocks"]:
            if block["language"] and block["wraps"]:
                problems.append(
                    f"{page} at {width} px: a {block['language']} block wraps: {block['text']!r}"
                )
            if block["covered"] and block["wraps"]:
                problems.append(
                    f"{page} at {width} px: the copy button covers text: {block['text']!r}"
                )
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_tables_and_code_blocks_fit_the_column(
    measured: dict[tuple[int, str], dict[str, Any]],
) -> None:
    problems = []
    for (width, page), found in measured.items():
        if width != WIDE["width"]:
            continue
        column = found["column"]
        for table in found["tables"]:
            if table["width"] > column + 1 or table["left"] < -1:
                problems.append(
                    f"{page}: a table {table['width']:.0f} px wide in a {column:.0f} px column: "
                    f"{table['text']!r}"
                )
        for block in found["blocks"]:
            if block["right"] > 1 or block["left"] < -1:
                problems.append(f"{page}: a code block runs out of the column: {block['text']!r}")
            if block["clipped"] or (
                block["scrolls"] and block["overflow"] not in ("auto", "scroll")
            ):
                problems.append(f"{page}: a code block is cut off: {block['text']!r}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_images_are_legible(measured: dict[tuple[int, str], dict[str, Any]]) -> None:
    problems = []
    for (width, page), found in measured.items():
        for image in found["images"]:
            share = image["drawn"] / image["natural"] if image["natural"] else 0.0
            if share < LEGIBLE:
                problems.append(
                    f"{page} at {width} px: {image['src']} drawn {image['drawn']:.0f} px wide, "
                    f"{share:.0%} of its {image['natural']} px"
                )
            if not image["fits"]:
                problems.append(f"{page} at {width} px: {image['src']} runs out of the column")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def _repo_url() -> str | None:
    import yaml

    config = yaml.safe_load((docs_site.ROOT / "mkdocs.yml").read_text())
    url = config.get("repo_url")
    return str(url) if url else None


def test_the_home_pages_key_links_are_above_the_fold(browser: Any, base_url: str) -> None:
    page = _open(browser, base_url, WIDE)
    page.goto(base_url, wait_until="load")
    links = page.evaluate(LINKS)
    page.context.close()
    seen = [link["href"] for link in links if link["seen"]]
    missing = [
        f"{name} ({' or '.join(targets)})"
        for name, targets in KEY_LINKS.items()
        if not any(href.startswith(base_url + target) for href in seen for target in targets)
    ]
    repo = _repo_url()
    if repo is None:
        missing.append("repository (mkdocs.yml has no repo_url)")
    elif not any(h.rstrip("/") == repo.rstrip("/") for h in seen):
        missing.append(f"repository ({repo})")
    assert not missing, (
        "not in view on the home page at 1280x900: "
        + ", ".join(missing)
        + f"\nlinks in view: {sorted(set(seen))}"
    )
