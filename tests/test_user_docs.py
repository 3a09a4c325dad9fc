"""User-facing text speaks of the product only: README.md, BENCHMARKS.md, docs/ and every
``treepack ... --help``. No issue numbers, no files that do not ship, nothing about how the
development machines were obtained, no reST markup in terminal help; every file they cite
exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from treepack.service.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "BENCHMARKS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

#: (what, pattern) of references a user cannot follow.
INTERNAL = [
    ("an issue number", r"(?i)\bissues?\s*#?\d+|(?<![\w&/])#\d+\b"),
    ("the development spec", r"\bSPEC\b|\bSTYLE\.md\b"),
    ("the development shared folder", r"(?<![\w.])shared/"),
    ("a development branch", r"\bi\d+-[a-z]+\b|\bworktree\b"),
    ("how a machine was lent", r"(?i)\blent\b|\bdevice (?:tool|call)\b|\brun tool\b|\bthis session\b|\bsame session\b"),
    ("a development path", r"/work/|\.whl/"),
]

#: Files the docs cite: a path with a folder, or a top-level document.
CITED = re.compile(r"(?<![\w./$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|yml|yaml|toml|json|jsonl)|[A-Z]+\.md)\b")


def internal_refs(text: str) -> list[str]:
    """Every internal reference in ``text``: ``what: 'match'`` per hit."""
    return [f"{what}: {m.group(0)!r}" for what, pat in INTERNAL for m in re.finditer(pat, text)]


def _help_texts() -> dict[str, str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "demo" in a.choices)
    return {
        "treepack --help": parser.format_help(),
        **{f"treepack {n} --help": p.format_help() for n, p in sub.choices.items()},
    }


def test_the_check_finds_what_it_looks_for():
    bad = (
        "see issue 12 and #7, SPEC section 4, /work/shared/SPEC.md, branch i21-newcomer; "
        "no GPU was lent to this session"
    )
    found = " ".join(internal_refs(bad))
    for what, _ in INTERNAL:
        assert what in found, (what, found)
    assert internal_refs("a silent branch point, `x[#]`, C# and issue-free text, version 2.6") == []


@pytest.mark.parametrize("doc", DOCS)
def test_user_docs_have_no_internal_references(doc):
    assert internal_refs((ROOT / doc).read_text()) == []


@pytest.mark.parametrize("doc", DOCS)
def test_files_the_docs_cite_exist(doc):
    text = (ROOT / doc).read_text()
    cited = set(CITED.findall(text))
    missing = sorted(c for c in cited if not (ROOT / c).exists() and not (ROOT / doc).parent.joinpath(c).exists())
    assert missing == [], missing


def test_help_is_plain_and_product_only():
    texts = _help_texts()
    assert {"treepack demo --help", "treepack plan --help", "treepack serve --help"} <= set(texts)
    for name, text in texts.items():
        assert internal_refs(text) == [], name
        assert not re.search(r":(?:class|func|mod|meth|attr):|``", text), (name, text)


@pytest.mark.parametrize("doc", DOCS)
def test_installs_are_from_the_clone(doc):
    """No package index serves treepack: the docs install ``".[extra]"`` from the clone."""
    assert re.findall(r"pip install -?e? ?['\"]?treepack\[", (ROOT / doc).read_text()) == []


#: Guides a newcomer installs the trainer from, and the one line that installs torch.
TORCH_FIRST = ("README.md", "docs/trl.md")


@pytest.mark.parametrize("doc", TORCH_FIRST)
def test_torch_is_installed_before_the_trainer_extra(doc):
    """pip would otherwise pull the default torch of the platform (on Linux x86-64 the CUDA
    build, several GB): every bash block installing the trainer extra installs torch first."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / doc).read_text(), re.M | re.S)
    checked = 0
    for block in blocks:
        lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
        extra = [i for i, ln in enumerate(lines) if re.match(r"pip install (-e )?['\"]\.\[[^]]*trainer", ln)]
        torch = [i for i, ln in enumerate(lines) if re.match(r"pip install torch\b", ln)]
        for i in extra:
            checked += 1
            assert torch and min(torch) < i, f"{doc}: install torch before line {lines[i]!r}"
    assert checked >= 1, doc  # the guide still installs the trainer extra somewhere
