"""Every citation resolves inside the repository.

The code, the YAML and the docs cite the five papers ("seed 001 eq. 2", "seed 004 app. B.3") and the
method contract ("SPEC 11"). Their texts are not shipped with the repository: docs/papers.md is where
such a citation resolves, one heading per cited item. These checks keep it so:

* no file names a path outside the repository (the papers' and the contract's own files);
* every "seed 00N" + equation / table / appendix citation in src/ and conf/ has its heading;
* every "SPEC N" cited anywhere has its heading.

Pure text reads, no imports of the package: fast.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ROOT / "docs" / "papers.md"
SUFFIXES = {".py", ".yaml", ".yml", ".md", ".toml", ".cfg", ".txt", ".sh"}
SHIPPED = ["src", "conf", "analysis", "benchmarks", "hydra_plugins", "launch", "docs", "README.md"]
OUTSIDE = re.compile(r"shared/seeds|\.\./shared|/work/|shared/SPEC")

# One cited item: its kind (carried over a list: "Tables 3-4", "eqs. 5-6") and its number.
KIND = (r"eqs?\.|equations?|tables?|figures?|figs?\.|app\.|appendix|appendices|sec\.|sections?|def\.|lemma"
        r"|algorithm|l\.|lines?|footnote|listing")
ITEM = rf"(?:(?:{KIND})\s*)?(?:[A-Z]\.)?\d+(?:\.\d+)*(?:\s*-\s*\d+)?"
CITATION = re.compile(rf"\bseed (00[0-4])(?:'s)?,?\s*\(?({ITEM}(?:\s*(?:,|;|/|and|or)\s*{ITEM})*)", re.I)
ATOM = re.compile(rf"({KIND})?\s*(?:([A-Z])\.)?(\d+(?:\.\d+)*)(?:\s*-\s*(\d+))?", re.I)
CHECKED = {"eq", "table", "appendix"}
SPEC = re.compile(r"\bSPEC ?(\d+)")
KINDS = {"eq": "eq", "eqs": "eq", "equation": "eq", "equations": "eq", "table": "table", "tables": "table",
         "app": "appendix", "appendix": "appendix", "appendices": "appendix", "figure": "figure",
         "figures": "figure", "fig": "figure", "figs": "figure", "sec": "section", "section": "section",
         "sections": "section", "l": "line", "line": "line", "lines": "line"}


def cited_items(text: str) -> set[tuple[str, str, str]]:
    """(seed, kind, item) for each paper item a text cites; "Tables 3-4" gives tables 3 and 4.

    A number after a letter ("D.2", "B.3") is an appendix whatever word precedes it; a bare number
    takes the kind before it in the same list ("eq. 9, 10").
    """
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # a citation may wrap over comment lines
    found = set()
    for match in CITATION.finditer(text):
        seed, kind = match.group(1), ""
        for atom in ATOM.finditer(match.group(2)):
            word, letter, number, last = atom.groups()
            if word:
                word = word.lower().rstrip(".")
                kind = KINDS.get(word, word)
            if letter:
                found.add((seed, "appendix", f"{letter.upper()}.{number}"))
            elif last and "." not in number:
                found.update((seed, kind, str(n)) for n in range(int(number), int(last) + 1))
            else:
                found.add((seed, kind, number))
    return found


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{2,4} ", line)]


def _files(roots: list[str]):
    for name in roots:
        path = ROOT / name
        for file in ([path] if path.is_file() else sorted(path.rglob("*"))):
            if file.is_file() and file.suffix in SUFFIXES and "__pycache__" not in file.parts:
                yield file


def _code_citations() -> dict[tuple[str, str, str], str]:
    cited: dict[tuple[str, str, str], str] = {}
    for file in _files(["src", "conf"]):
        for item in cited_items(file.read_text()):
            cited.setdefault(item, str(file.relative_to(ROOT)))
    return {item: where for item, where in cited.items() if item[1] in CHECKED}


def _documented(text: str) -> set[tuple[str, str, str]]:
    return set().union(*(cited_items(h) for h in headings(text) if h.lower().startswith("seed ")))


def test_the_parser_reads_the_forms_the_code_uses():
    assert cited_items("(seed 002 sec. 3.2, eq. 3)") == {("002", "section", "3.2"), ("002", "eq", "3")}
    assert cited_items("seed 004 Tables 3-4, Figure 5") == {("004", "table", "3"), ("004", "table", "4"),
                                                           ("004", "figure", "5")}
    assert cited_items("seed 001 D.2 training") == {("001", "appendix", "D.2")}
    assert cited_items("seed 001 section 3.2, appendix D.3 and\n# eq. 1-2") == {
        ("001", "section", "3.2"), ("001", "appendix", "D.3"), ("001", "eq", "1"), ("001", "eq", "2")}
    assert cited_items("seed 003's Lemma 4.2") == {("003", "lemma", "4.2")}
    assert ("001", "appendix", "D.2") in _documented("### seed 001 appendix D.2: training settings\n")


@pytest.mark.parametrize("root", SHIPPED)
def test_nothing_names_a_path_outside_the_repository(root):
    hits = [f"{file.relative_to(ROOT)}:{n}: {line.strip()}"
            for file in _files([root]) if file != PAPERS
            for n, line in enumerate(file.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "cite the paper by seed and docs/papers.md instead:\n" + "\n".join(hits)


def test_every_paper_citation_in_src_and_conf_has_a_heading():
    cited = _code_citations()
    assert len(cited) > 20, sorted(cited)  # the parser still finds the citations
    documented = _documented(PAPERS.read_text())
    missing = {f"seed {s} {k} {i}": where for (s, k, i), where in cited.items() if (s, k, i) not in documented}
    assert not missing, f"cited without a heading in docs/papers.md (first place cited): {missing}"


def test_every_spec_section_cited_has_a_heading():
    cited = {n for file in _files(SHIPPED + ["tests"]) for n in SPEC.findall(file.read_text())}
    documented = {m.group(1) for h in headings(PAPERS.read_text()) if (m := re.match(r"SPEC (\d+)\b", h))}
    assert cited and not cited - documented, f"SPEC sections cited without a heading: {sorted(cited - documented)}"
