"""The docs hold together: every relative link of README.md and docs/*.md names a file of the
repository and, with an anchor (``page.md#section``), a heading of that page; every page of docs/
is in its index, and the README points to the index; every docs section a message of pycls or
its tools cites (``docs/page.md, "Heading"`` or ``docs/page.md#anchor``) is a heading there."""

import ast
import glob
import os
import re

import pytest

from tests.helpers import ROOT

PAGES = ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def _text(page, root):
    with open(os.path.join(root, page)) as f:
        return f.read()


def links(page, root=ROOT):
    """The link targets of a page, outside code blocks and code spans."""
    return _LINK.findall(_CODE_SPAN.sub("x", _FENCE.sub("", _text(page, root))))


def anchors(page, root=ROOT):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    seen, found = {}, set()
    for line in _FENCE.sub("", _text(page, root)).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page, root=ROOT):
    """What is wrong with each relative link of ``page``, one line each."""
    broken = []
    for target in links(page, root):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if resolved.startswith("..") or not os.path.exists(os.path.join(root, resolved)):
            broken.append(f"{page}: ({target}): no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved, root):
            broken.append(f"{page}: ({target}): no heading #{anchor} in {resolved}")
    return broken


def test_anchors_and_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "LICENSE").write_text("")
    (tmp_path / "docs" / "a.md").write_text(
        "# Engines (`TRAIN.PARALLEL`)\n## Upstream pycls's sweep files\n## A b\n## A b\n"
        "```\n# not a heading [x](nowhere.md)\n```\n"
    )
    assert anchors("docs/a.md", tmp_path) == {
        "engines-trainparallel", "upstream-pyclss-sweep-files", "a-b", "a-b-1"
    }  # fmt: skip
    (tmp_path / "docs" / "b.md").write_text(
        "[ok](a.md#a-b-1) [ok](../LICENSE) [ok](#b) [ok](https://example.com/x.md)\n# B\n"
        "[bad](c.md) [bad](a.md#nope) [bad](../../LICENSE) [bad](#nope) `[code](c.md)`\n"
    )
    assert broken_links("docs/b.md", tmp_path) == [
        "docs/b.md: (c.md): no file docs/c.md",
        "docs/b.md: (a.md#nope): no heading #nope in docs/a.md",
        "docs/b.md: (../../LICENSE): no file ../LICENSE",
        "docs/b.md: (#nope): no heading #nope in docs/b.md",
    ]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    assert not broken_links(page)


def test_every_page_is_in_the_index():
    listed = {
        os.path.normpath(os.path.join("docs", t.split("#")[0])) for t in links("docs/README.md")
    }
    missing = [
        p for p in PAGES if p.startswith("docs/") and p != "docs/README.md" and p not in listed
    ]
    assert not missing, f"pages docs/README.md does not list: {missing}"
    assert "docs/README.md" in links("README.md")


# A section cited in a message: docs/page.md, "Heading" (or docs/page.md#anchor)
_CITED = re.compile(r'docs/(\w+)\.md(?:,\s*"([^"]+)"|#([\w-]+))')


def _strings(path):
    """The text of every string a module writes, f-strings with their fields as {}, adjacent
    literals joined as Python joins them, runs of white space as one (a message wraps)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            yield " ".join("".join(parts).split())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield " ".join(node.value.split())


def cited_sections(root=ROOT):
    """(source file, page, heading or anchor as cited, its anchor) of every docs section the
    strings of pycls/ and tools/ cite."""
    found = []
    sources = glob.glob(os.path.join(root, "pycls", "**", "*.py"), recursive=True)
    for path in sorted(sources + glob.glob(os.path.join(root, "tools", "*.py"))):
        for text in _strings(path):
            for page, heading, anchor in _CITED.findall(text):
                slug = anchor or re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
                found.append((os.path.relpath(path, root), f"docs/{page}.md", heading or anchor,
                              slug))  # fmt: skip
    return found


def test_every_section_a_message_cites_is_a_heading_of_its_page():
    """A message that sends the user to a section that does not exist is a dead end: the
    message of a server without byte ranges cited docs/data_formats.md, "Servers without byte
    ranges", a heading that page did not have."""
    cited = cited_sections()
    assert len({c[2] for c in cited}) >= 3, cited  # the scan finds the citations there are
    missing = [
        f"{source}: {page}, {what!r}"
        for source, page, what, slug in cited
        if not os.path.exists(os.path.join(ROOT, page)) or slug not in anchors(page)
    ]
    assert not missing, "sections cited that are no heading of their page:\n" + "\n".join(missing)
