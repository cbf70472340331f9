"""The module graph of kiln/ keeps DESIGN.md's import rules: no cycles (function-level imports
included), build/ and runtime/ meet only in kiln/engine/, and the runtime's rooms import downwards
only (frontend -> core -> executor -> kiln/engine)."""
import ast
from pathlib import Path

import pytest

KILN = Path(__file__).parents[1] / "kiln"


def module_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its code (a function-level import
    counts as any other). `from a import b` names module a.b where there is one, else a."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package_of.split(".")[:len(package_of.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in map(resolve, targets) if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return module_graph(KILN)


def imports_of(graph, prefix: str) -> set[tuple[str, str]]:
    return {(a, b) for a, bs in graph.items() if a == prefix or a.startswith(prefix + ".") for b in bs}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_cycles(graph):
    assert len(graph) > 50 and graph["kiln.runtime.core.engine_core"]  # the whole tree was read
    assert cycles(graph) == []


def test_the_checker_finds_a_cycle_closed_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("from . import a\n\ndef g():\n    pass\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    assert cycles(module_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("importer, forbidden", [
    ("kiln.build", "kiln.runtime"), ("kiln.runtime", "kiln.build"),  # they meet in kiln.engine
    ("kiln.engine", "kiln.build"), ("kiln.engine", "kiln.runtime"),
    ("kiln.runtime.core", "kiln.runtime.frontend"),
    ("kiln.runtime.executor", "kiln.runtime.core"), ("kiln.runtime.executor", "kiln.runtime.frontend"),
    ("kiln.runtime.messages", "kiln.runtime.core"), ("kiln.runtime.messages", "kiln.runtime.frontend"),
    # convert and runtime share their rooms below both (kiln.lora, kiln.tokenizer_files), not each other
    ("kiln.runtime", "kiln.convert"), ("kiln.convert", "kiln.runtime"),
    ("kiln.lora", "kiln.runtime"), ("kiln.lora", "kiln.convert"), ("kiln.lora", "kiln.build"),
    # a model is built from a checkpoint's tensors and config, whoever read them
    ("kiln.models", "kiln.convert"), ("kiln.models", "kiln.build"), ("kiln.models", "kiln.runtime"),
    # the model calls its op set, never a kernel family (kiln/models/ops/)
    ("kiln.models.llama", "kiln.plugins"), ("kiln.models.attention", "kiln.plugins"),
])
def test_rooms_import_downwards(graph, importer, forbidden):
    assert {(a, b) for a, b in imports_of(graph, importer) if under(b, forbidden)} == set()


def test_the_frontend_meets_the_core_in_the_core_client(graph):
    reached = {(a, b) for a, b in imports_of(graph, "kiln.runtime.frontend") if under(b, "kiln.runtime.core")}
    assert reached == {("kiln.runtime.frontend.core_client", "kiln.runtime.core.engine_core"),
                       ("kiln.runtime.frontend.core_client", "kiln.runtime.core.core_process")}


def test_request_groups_are_policies_the_core_picks(graph):
    """n > 1 sampling and beam search sit behind request_group.py's hook: only the core knows them."""
    for policy in ("kiln.runtime.core.beam_search", "kiln.runtime.core.parallel_sampling"):
        assert {a for a, bs in graph.items() if policy in bs} == {"kiln.runtime.core.engine_core"}


def test_no_module_over_600_lines():
    """Short modules with one job each (../shared/STYLE.md): a module past 600 lines holds two."""
    long = {str(p.relative_to(KILN.parent)): n for p in KILN.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
