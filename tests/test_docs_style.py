"""Docs explain, they do not log: short module docstrings, no commit ids in code, a README a newcomer reads quickly,
guides in short sentences.

Measurement history (machines, commits, timings) belongs in docs/measurements.md, where each figure has its context.
The checks parse code with ast and tokenize, and ask git whether a hex word in a comment or docstring is a commit.
"""

from __future__ import annotations

import ast
import io
import re
import statistics
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("service", "client", "drafter_trainer", "bench", "examples", "tests")
MAX_MODULE_DOCSTRING_LINES = 15
MAX_README_LINES = 150
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")
MAX_MEDIAN_SENTENCE_WORDS = 25
RECORDS = ("measurements.md",)  # the one place figures keep their machine, commit and command: not a guide
SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z(*])")


def _modules() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if "_gen" not in p.parts)


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    source = path.read_text()
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                out.append((node.body[0].lineno, doc))
    return out


def _commits(words: set[str]) -> set[str]:
    """The words that name a commit of this repository (git answers for all of them in one call)."""
    if not words:
        return set()
    ordered = sorted(words)
    proc = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], input="".join(
        f"{w}^{{commit}}\n" for w in ordered), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return set()
    return {w for w, line in zip(ordered, proc.stdout.splitlines(), strict=False) if line.split()[1:2] == ["commit"]}


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def module_docstring_problems(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=True)
        if doc and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            problems.append(f"{_name(path)}: module docstring of {len(doc.splitlines())} lines")
    return problems


def commit_id_problems(paths: list[Path]) -> list[str]:
    found: dict[str, list[str]] = {}
    for path in paths:
        for line, text in _prose(path):
            for word in HEX_WORD.findall(text):
                if re.search(r"[a-f]", word) and re.search(r"\d", word):
                    found.setdefault(word, []).append(f"{_name(path)}:{line}")
    return [f"{where}: names commit {w}" for w in sorted(_commits(set(found))) for where in found[w]]


def sentence_lengths(markdown: str) -> list[int]:
    """Words per sentence of a Markdown text's prose: code blocks, tables and headings left out, each list item
    and paragraph split at sentence ends, inline code counted as one word."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    blocks, current = [], []
    for line in [*text.splitlines(), ""]:
        line = line.strip()
        item = re.match(r"^([-*]|\d+\.)\s+", line)
        if not line or line.startswith(("|", "#")) or item:
            if current:
                blocks.append(" ".join(current))
            current = []
            line = line[item.end():] if item else ""
        if line:
            current.append(line)
    lengths = []
    for block in blocks:
        for sentence in SENTENCE_END.split(re.sub(r"`[^`]*`", "code", block)):
            if len(sentence.split()) >= 3:  # not a label such as "Before:"
                lengths.append(len(sentence.split()))
    return lengths


def sentence_problems(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        lengths = sentence_lengths(path.read_text())
        if lengths and statistics.median(lengths) > MAX_MEDIAN_SENTENCE_WORDS:
            problems.append(f"{_name(path)}: median sentence of {statistics.median(lengths)} words")
    return problems


def test_module_docstrings_are_short():
    problems = module_docstring_problems(_modules())
    assert not problems, "module docstrings over 15 lines (move history to docs/):\n" + "\n".join(problems)


def test_no_commit_ids_in_code():
    problems = commit_id_problems(_modules())
    assert not problems, "commit ids in comments or docstrings (they go in docs/measurements.md):\n" + "\n".join(
        problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; guides go in docs/"


def test_readme_and_guides_speak_in_short_sentences():
    guides = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in RECORDS]
    problems = sentence_problems([ROOT / "README.md", *guides])
    assert not problems, f"median sentence over {MAX_MEDIAN_SENTENCE_WORDS} words:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_claim(tmp_path):
    """The checkers themselves: a long module docstring, a comment naming a real commit and a guide of long
    sentences are reported; a short docstring, a hex word that is no commit and short sentences are not."""
    long_doc = tmp_path / "long.py"
    long_doc.write_text('"""' + "\n".join(f"line {i}" for i in range(20)) + '"""\n')
    clean = tmp_path / "clean.py"
    clean.write_text('"""One line."""\n# a hex word that is no commit: deadbeef1234\nX = 1\n')
    assert len(module_docstring_problems([long_doc, clean])) == 1
    assert commit_id_problems([clean]) == []
    long_words, short_words = tmp_path / "long.md", tmp_path / "short.md"
    long_words.write_text("# Title\n\n" + " ".join(["This sentence goes on " + "and on " * 15 + "to its end."] * 3))
    short_words.write_text("# Title\n\n- One short item here.\n- Another short one. It has two sentences.\n\n"
                           "```\n" + "code " * 100 + "\n```\n| a table " + "cell " * 60 + "|\n")
    assert len(sentence_problems([long_words, short_words])) == 1
    assert sentence_lengths(short_words.read_text()) == [4, 3, 4]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    if head:  # a checkout with history: a comment naming HEAD is a commit id
        cited = tmp_path / "cited.py"
        cited.write_text(f'"""Measured at {head}."""\n# again at {head}\nX = 1\n')
        assert len(commit_id_problems([cited])) == 2
