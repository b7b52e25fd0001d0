"""The project's import graph: modules import one way, from the tools down to the library, and
docs/architecture.md, the map of it, says what each module imports."""

import ast
import importlib.util
import re

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast  # make test-fast

# The programs a user runs. Nothing imports them: what two of them share lives in a library
# module they both import.
TOOLS = {"main", "run_benchmarks", "verify", "benchmark", "collect_results", "plot_results"}
MODULES = {path.stem: path for path in sorted(REPO.glob("*.py"))}
ARCHITECTURE = REPO / "docs" / "architecture.md"


def imported_names(nodes) -> set[str]:
    """The top-level names of the modules that these nodes import (absolute imports)."""
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def project_imports(nodes) -> set[str]:
    return imported_names(nodes) & MODULES.keys()


def imports_of(path) -> tuple[set[str], set[str]]:
    """The project's modules a file imports when it loads, and those it imports only inside a
    function (they still tie the two modules); `if TYPE_CHECKING:` blocks never run."""
    tree = ast.parse(path.read_text())
    typing_only = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    skipped = {id(inner) for block in typing_only for inner in ast.walk(block)}
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    inside = {id(inner) for n in ast.walk(tree) if isinstance(n, scopes) for inner in ast.walk(n)}
    nodes = [n for n in ast.walk(tree) if id(n) not in skipped]
    at_load = project_imports(n for n in nodes if id(n) not in inside)
    return at_load - {path.stem}, project_imports(nodes) - at_load - {path.stem}


IMPORTS = {name: imports_of(path) for name, path in MODULES.items()}
GRAPH = {name: at_load | later for name, (at_load, later) in IMPORTS.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, as the modules along it, or None."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


def test_no_import_cycle_among_the_project_modules():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({**GRAPH, "utils": GRAPH["utils"] | {"main"}}) is not None


def test_no_module_imports_a_tool():
    importers = {name: sorted(GRAPH[name] & TOOLS) for name in GRAPH if GRAPH[name] & TOOLS}
    assert not importers, f"modules importing a tool script: {importers}"
    for tool in TOOLS:
        assert 'if __name__ == "__main__":' in MODULES[tool].read_text(), f"{tool} is no program"


def mapped_imports(text: str) -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's entries: module -> (its `Imports ...`, its `later ...`)."""
    mapped = {}
    for entry in re.split(r"^- (?=\*\*`)", text, flags=re.M)[1:]:
        module = re.match(r"\*\*`(\w+)\.py`\*\*", entry)
        said = re.search(r"Imports (none|[^.]*)\.", " ".join(entry.split()))
        if module and said:
            at_load, _, later = said.group(1).partition("; later ")
            mapped[module.group(1)] = tuple(
                set(re.findall(r"`(\w+)`", part)) for part in (at_load, later)
            )
    return mapped


def test_the_architecture_map_says_what_each_module_imports():
    mapped = mapped_imports(ARCHITECTURE.read_text())
    wrong = [
        f"{name}.py imports {sorted(at_load)}, later {sorted(later)}; the map says "
        + (str([sorted(part) for part in mapped[name]]) if name in mapped else "nothing")
        for name, (at_load, later) in IMPORTS.items()
        if mapped.get(name) != (at_load, later)
    ]
    assert not wrong, f"docs/{ARCHITECTURE.name} is out of date:\n" + "\n".join(wrong)


def test_the_map_reader_reads_imports_and_later_imports():
    text = "- **`a.py`**: one idea. Imports `b`, `c`; later `d`.\n- **`b.py`**: x. Imports none.\n"
    assert mapped_imports(text) == {"a": ({"b", "c"}, {"d"}), "b": (set(), set())}


def test_no_test_file_imports_another():
    """What two test files share lives in conftest.py, helpers.py or dist_harness.py: importing
    a test file would also collect its tests again under another name, and tie the two."""
    tests = sorted((REPO / "tests").glob("*.py"))
    found = {p.name: imported_names(ast.walk(ast.parse(p.read_text()))) for p in tests}
    imports = {
        name: sorted(n for n in names if n.startswith("test_")) for name, names in found.items()
    }
    assert not any(imports.values()), imports


# ----------------------------------------------------------------------------- .ci/cfg_walk.py

# Three modules: build_trainer hands `a.make` a field of cfg (twice: walked once), `helper` no
# part of it; `make` hands `b.build` the keys of a dict that carry it, and comes back.
WALKED = {
    "session": (
        "import a\nfrom b import helper\n"
        "def build_trainer(cfg, env):\n"
        "    a.make(cfg.model, cfg)\n    a.make(cfg.model, cfg)\n    helper(env)\n"
    ),
    "a": (
        "import b\n"
        "def make(name, cfg):\n"
        "    options = dict(width=cfg.width, seed=1)\n    return b.build(**options)\n"
    ),
    "b": "def build(width=0, seed=0):\n    return width\ndef helper(env):\n    return env\n",
}


def test_the_cfg_walk_follows_cfg_into_each_function_once_and_counts_the_climbs(
    monkeypatch, capsys
):
    spec = importlib.util.spec_from_file_location("cfg_walk", REPO / ".ci" / "cfg_walk.py")
    cfg_walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg_walk)
    trees = {module: ast.parse(text) for module, text in WALKED.items()}
    assert cfg_walk.walk(trees) == [
        ("call", "a", "make"),
        ("call", "b", "build"),
        ("return", "a", "make"),
        ("return", "session", "build_trainer"),
    ]
    monkeypatch.setattr(cfg_walk, "sources", lambda commit: WALKED)
    cfg_walk.main(["-v"])
    assert capsys.readouterr().out.splitlines() == [
        "a.make",
        "  b.build",
        "session -> a -> b -> a -> session",
        "2 modules entered (a, b); 4 moves, 2 returns, 1 climbs back up",
    ]
