"""DESIGN.md and the code's references to it stay true: every path, file and name DESIGN.md cites
exists, and every section or constraint the code cites is in DESIGN.md."""
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = (ROOT / "DESIGN.md").read_text()
# A repository path as prose cites it (not the tail of an absolute path such as /opt/kiln/cache).
PATH = re.compile(r"(?<![\w/.-])((?:kiln|tests|benchmarks|examples|deploy|csrc)/[\w./-]*\w)")
CITATION = re.compile(r'DESIGN\.md[,:]\s*"([^"]+)"')
CONSTRAINT = re.compile(r"DESIGN\.md, constraint (\d+)")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".cpp", ".h", ".pbtxt", ".yaml", "Makefile"))
            and not n.startswith("models/")]


def exists(path: str) -> bool:
    full = ROOT / "kiln" / "plugins" / path if path.startswith("csrc/") else ROOT / path
    return full.exists() or full.with_suffix("").exists()  # a module named without .py, or a folder


def test_every_cited_repository_path_exists():
    missing = {f"{f.relative_to(ROOT)}: {p}" for f in tracked_text_files() for p in PATH.findall(f.read_text())
               if not exists(p)}
    assert not missing, sorted(missing)


def test_every_file_design_names_exists():
    files = set(re.findall(r"`([\w]+\.(?:py|cpp|h))`", DESIGN))
    present = {p.name for p in (ROOT / "kiln").rglob("*") if p.is_file()}
    assert files - present == set()


def _defined(name: str) -> bool:
    """`Class.attr`, `module.attr` or `kiln.module.NAME`, looked up where kiln defines it."""
    if name.startswith("kiln."):
        module, _, attr = name.rpartition(".")
        if (ROOT / name.replace(".", "/")).with_suffix(".py").is_file():
            return True
        return hasattr(importlib.import_module(module), attr)
    owner, attr = name.split(".", 1)
    for f in (ROOT / "kiln").rglob("*.py"):
        text = f.read_text()
        if f.stem == owner or re.search(rf"^class {owner}\b", text, re.M):
            if re.search(rf"(def |^\s*){attr}\b", text, re.M):
                return True
    return False


def test_every_name_design_cites_is_defined():
    names = set(re.findall(r"`((?:kiln\.)?[A-Za-z_]\w*(?:\.[a-z_A-Z]\w*)+)`", DESIGN))
    code = {n for n in names if not re.search(r"\.(py|cpp|h|so|json|weight|safetensors|engine)$", n)
            and not n.startswith(("transformer.", "moe.", "mlp.", "torch."))}
    assert code, "the pattern found no names: it is broken"
    assert [n for n in sorted(code) if not _defined(n)] == []


def test_the_sections_and_constraints_the_code_cites_exist():
    headings = {h.strip() for h in re.findall(r"^#+ (.+)$", DESIGN, re.M)}
    plain = {re.sub(r"\s*\(`[^`]*`\)$", "", h) for h in headings}  # "The engine format (`kiln/engine/`)"
    constraints = len(re.findall(r"^\d+\. ", DESIGN.split("Constraints learned", 1)[1].split("\n## ", 1)[0], re.M))
    bad = []
    for f in tracked_text_files():
        text = f.read_text()
        bad += [f"{f.relative_to(ROOT)}: section {s!r}" for s in CITATION.findall(text) if s not in plain | headings]
        bad += [f"{f.relative_to(ROOT)}: constraint {n}" for n in CONSTRAINT.findall(text)
                if not 1 <= int(n) <= constraints]
    assert not bad, bad


# Spelled in two parts, so that this file does not cite a section itself.
@pytest.mark.parametrize("text, found", [("see (DESIGN" + '.md, "No such section")', ["No such section"]),
                                         ("(DESIGN.md, constraint 4)", []), ("/opt/kiln/cache", [])])
def test_the_checks_find_what_they_look_for(text, found):
    assert CITATION.findall(text) == found
    assert PATH.findall(text) == []
