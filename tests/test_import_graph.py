"""The package's import graph runs one way, from the commands down to the errors: a module imports only
from its own stage or a lower one, and no modules import each other in a circle. Lazy imports inside
functions count as much as those at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]

# The pipeline's stages, lowest first: capture -> trace -> dispatch and placement -> analysis -> SGLang.
STAGES = [
    ("errors", "parallel"),            # what every stage may raise; the layer-parallel worker pool
    ("model",),                        # what the model is
    ("cost", "trace"),                 # what a step costs; the trace formats and their readers
    ("files",),                        # placement files, atomic writes, output checks
    ("dispatch",),                     # per-step dispatch rules, their exact optimum and evaluation
    ("algorithms",),                   # placement algorithms
    ("analysis",),                     # metrics, report, advise, layouts, the fit-and-score job
    ("sglang", "moeplace_kernels"),    # the SGLang adapter and the GPU kernels it runs
    ("commands", "cli", "__main__"),   # the commands
]
STAGE = {name: level for level, names in enumerate(STAGES) for name in names}


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``module`` imports (``from a import b`` names module ``a.b`` where that is one)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != module)
    return out


def stage_of(module: str) -> int:
    parts = module.split(".")
    key = parts[0] if parts[0] != "moeplace" else (parts[1] if len(parts) > 1 else "__init__")
    if key == "__init__":
        return -1            # the package's own __init__ imports nothing of it
    if key not in STAGE:
        raise KeyError(f"{module} belongs to no stage: add its folder to STAGES")
    return STAGE[key]


def import_graph(packages: dict[str, Path]) -> nx.DiGraph:
    known: dict[str, Path] = {}
    for package, root in packages.items():
        known.update(package_modules(root, package))
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in imported_modules(module, path, known))
    return graph


def upward_imports(graph: nx.DiGraph) -> list[str]:
    return sorted(f"{a} -> {b}" for a, b in graph.edges if stage_of(a) < stage_of(b))


def circles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph({"moeplace": REPO / "moeplace", "moeplace_kernels": REPO / "kernels"})


def test_every_module_has_a_stage(graph):
    for module in graph.nodes:
        stage_of(module)


def test_no_import_from_a_lower_stage_up(graph):
    assert upward_imports(graph) == []


def test_no_circle(graph):
    assert circles(graph) == []


def test_the_graph_sees_the_package(graph):
    """A guard for the two tests above: a checker that read nothing would pass them."""
    assert ("moeplace.analysis.optimize", "moeplace.analysis.report") in graph.edges
    assert ("moeplace.sglang.balanced_dispatch", "moeplace_kernels.balanced_dispatch") in graph.edges
    assert graph.number_of_edges() > 100


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    root = tmp_path / "moeplace"
    for folder, text in {"trace": "from moeplace.analysis.report import x\n",
                         "analysis": "import moeplace.dispatch.loads\n",
                         "dispatch": "from moeplace.analysis import report\n"}.items():
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "trace" / "steps.py").write_text("from moeplace.analysis.report import x\n")
    (root / "analysis" / "report.py").write_text("import moeplace.dispatch.loads\n")
    (root / "dispatch" / "loads.py").write_text("from ..analysis import report\n")
    built = import_graph({"moeplace": root})
    assert upward_imports(built) == ["moeplace.dispatch.loads -> moeplace.analysis.report",
                                     "moeplace.trace.steps -> moeplace.analysis.report"]
    assert circles(built) == [["moeplace.analysis.report", "moeplace.dispatch.loads"]]


def test_every_folder_is_installed():
    """setup.cfg lists packages by hand: a new stage folder missing there would work from the checkout and
    break in a real install."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    folders = {".".join(("moeplace", *p.parent.relative_to(REPO / "moeplace").parts)).rstrip(".")
               for p in (REPO / "moeplace").rglob("__init__.py")}
    assert folders | {"moeplace_kernels"} == listed
