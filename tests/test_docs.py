"""The docs point at what exists: the tests each invariant names, the files each link names,
and the README's options table names every option."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from lightning_cg import CUDAGraphCallback
from lightning_cg.engine.config import BudgetConfig, GraphConfig

ROOT = Path(__file__).resolve().parents[1]
#: Documents whose invariants and links must resolve.
DOCUMENTS = ("README.md", "BENCHMARKS.md", "CHANGELOG.md", "docs/DESIGN.md", "docs/TESTING.md")
#: ``path/under/tests.py::test_name`` (or ``tests/path...``), as the docs name a test.
TEST_REFERENCE = re.compile(r"`([\w/]+\.py)::(\w+)")
#: A markdown link's target, without its ``#anchor``.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def named_tests(text: str) -> list[tuple[str, str]]:
    return TEST_REFERENCE.findall(text)


def missing_tests(text: str, tests_root: Path) -> list[str]:
    """The ``file::test`` references of ``text`` with no such test function."""
    missing = []
    for path, name in named_tests(text):
        source = tests_root / path.removeprefix("tests/")
        if not source.is_file() or not re.search(rf"def {name}\b", source.read_text()):
            missing.append(f"{path}::{name}")
    return missing


def broken_links(document: Path) -> list[str]:
    """The relative link targets of ``document`` that name no file or folder."""
    targets = LINK.findall(document.read_text())
    return [
        target
        for target in targets
        if "://" not in target and not (document.parent / target).exists()
    ]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_test_a_document_names_exists(document):
    assert missing_tests((ROOT / document).read_text(), ROOT / "tests") == []


def test_the_design_names_a_test_for_its_invariants():
    invariants = (ROOT / "docs/DESIGN.md").read_text().split("## Invariants", 1)[1]
    assert len(named_tests(invariants)) >= 20


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_link_of_a_document_resolves(document):
    assert broken_links(ROOT / document) == []


def test_a_renamed_test_and_a_removed_file_are_caught(tmp_path):
    tests_root = tmp_path / "tests"
    (tests_root / "core").mkdir(parents=True)
    (tests_root / "core/test_x.py").write_text("def test_kept():\n    pass\n")
    text = "`core/test_x.py::test_kept`, `core/test_x.py::test_renamed`, `core/test_y.py::test_a`"
    assert missing_tests(text, tests_root) == [
        "core/test_x.py::test_renamed",
        "core/test_y.py::test_a",
    ]
    assert missing_tests("`tests/core/test_x.py::test_kept`", tests_root) == []
    document = tmp_path / "doc.md"
    (tmp_path / "kept.json").write_text("[]")
    document.write_text("[a](kept.json) [b](gone.json#top) [c](https://example.org/x)")
    assert broken_links(document) == ["gone.json"]


def documented_names(readme: str) -> set[str]:
    """Every name written in backticks in the README's Options section, dotted parts apart."""
    section = readme.split("## Options", 1)[1].split("\n## ", 1)[0]
    names = set()
    for quoted in re.findall(r"`([^`]+)`", section):
        names.update(part for part in re.split(r"[.\s=]", quoted) if part)
    return names


def test_the_readme_options_table_names_every_option():
    options = {field.name for field in dataclasses.fields(GraphConfig)}
    options |= {field.name for field in dataclasses.fields(BudgetConfig)}
    options |= set(inspect.signature(CUDAGraphCallback).parameters) - {"config", "options"}
    documented = documented_names((ROOT / "README.md").read_text())
    assert sorted(options - documented) == []


def test_an_option_left_out_of_the_readme_is_caught():
    readme = (
        "## Options\n| `budgets.max_budget` | 1 | `ratio` with `pow2` |\n## Next\n`keep_graphs`"
    )
    assert documented_names(readme) == {"budgets", "max_budget", "ratio", "pow2"}
