"""The package layout, read from the source with ``ast`` (nothing is imported), as docs/architecture.md
states it: no import circle among the launcher's modules; topologies/ stands alone and the launcher
reaches it only through gossip.config; only the network layer (gossip/net/) touches zmq and it imports
nothing of the rest of the library; no module outside it but gossip/connect.py constructs a Transport; the
library (gossip/, topologies/) never reaches into the launcher; gossip, gossip.config and gossip.errors
load without torch or zmq; the pure parts (wire format, staleness math, aggregation, deadlines, the
coordinator's update rules) reach no socket. A failure names the file, line and import.

And no class in gossip/ is large (over MAX_METHODS methods or MAX_LINES lines) unless its docstring says
why: a sentence containing "methods because" or "lines because", e.g. "It has 20 methods because each
is one flag group's check."
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("gossip", "topologies", "launch")
NET = "gossip/net/"
NET_MAY_IMPORT = ("gossip.net", "gossip.errors", "gossip.alloc")  # the exception tree and malloc tuning
# The modules that compute without sockets (wire format, staleness weights, robust aggregation, deadlines,
# the coordinator's state machine and update rules): nothing they import, directly or not, reaches zmq.
PURE = ("gossip/net/wire.py", "gossip/staleness.py", "gossip/aggregate.py", "gossip/deadlines.py",
        "gossip/coordinator/core.py", "gossip/coordinator/sgd.py", "gossip/coordinator/dcasgd.py",
        "gossip/coordinator/averaging.py", "gossip/coordinator/pseudograd.py", "gossip/coordinator/normbound.py")
# What the launcher imports before it parses its flags (--help, flag errors) must not load these.
LIGHT = ("gossip", "gossip.config", "gossip.errors")
HEAVY = ("torch", "zmq")
MAX_METHODS, MAX_LINES = 15, 300
WHY_LARGE = re.compile(r"\b(methods|lines) because\b")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, function-local ones included. ``from P import N`` gives
    P.N when that is a module of ours, else P; relative imports are resolved against the file's package."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                file = ROOT / candidate.replace(".", "/")
                own = file.with_suffix(".py").exists() or (file / "__init__.py").exists()
                found.append((node.lineno, candidate if own else base))
    return found


def module_level_imports(path: Path) -> list[tuple[int, str]]:
    """The imports that run when the module loads: ``imports`` less those inside functions, classes and
    ``if TYPE_CHECKING:``; a module also loads its packages' ``__init__``."""
    def walk(body: list[ast.stmt]) -> list[ast.stmt]:
        found = []
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                found += walk(node.body) + walk(node.orelse)
            elif isinstance(node, ast.Try):
                found += walk(node.body) + walk(node.orelse) + walk(node.finalbody)
        return found

    lines = {node.lineno for node in walk(ast.parse(path.read_text(), str(path)).body)}
    parents = module_name(path).split(".")[:-1]
    return [(line, m) for line, m in imports(path) if line in lines] + \
        [(0, ".".join(parents[:i])) for i in range(1, len(parents) + 1)]


def file_of(module: str) -> Path | None:
    file = ROOT / module.replace(".", "/")
    return next((f for f in (file.with_suffix(".py"), file / "__init__.py") if f.is_file()), None)


def loads(module: str, imports_of=imports) -> dict[str, tuple[str, int, str]]:
    """Every module that loading ``module`` may load, each with one import that brings it in (importer, line,
    imported): through our own modules, following ``imports_of`` (all imports, or only the module-level ones)."""
    reached: dict[str, tuple[str, int, str]] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if (path := file_of(name)) is None:
            continue
        for line, target in imports_of(path):
            if target not in reached and target != module:
                reached[target] = (name, line, target)
                todo.append(target)
    return reached


def trail(reached: dict[str, tuple[str, int, str]], module: str) -> str:
    """How ``module`` came to be loaded: the chain of imports, each as file:line."""
    steps = []
    while module in reached:
        importer, line, imported = reached[module]
        steps.insert(0, f"{file_of(importer).relative_to(ROOT)}:{line} imports {imported}")
        module = importer
    return " -> ".join(steps)


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def where(path: Path, line: int, module: str) -> str:
    return f"{path.relative_to(ROOT)}:{line} imports {module}"


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_circle(edges: dict[str, list[tuple[int, str]]]) -> list[tuple[str, int, str]]:
    """One import circle in ``edges`` (module -> [(line, imported module)]) as (importer, line, imported)
    steps, or [] when there is none."""
    done: set[str] = set()

    def visit(name: str, trail: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
        for line, target in edges.get(name, []):
            step = trail + [(name, line, target)]
            starts = [i for i, (importer, _, _) in enumerate(step) if importer == target]
            if starts:
                return step[starts[0]:]
            if target not in done and (circle := visit(target, step)):
                return circle
        done.add(name)
        return []

    for name in sorted(edges):
        if name not in done and (circle := visit(name, [])):
            return circle
    return []


def test_the_launch_modules_import_each_other_without_a_circle():
    paths = {module_name(p): p for p in (ROOT / "launch").glob("*.py")}
    edges = {name: [(line, m) for line, m in imports(path) if m in paths and m != name] for name, path in paths.items()}
    circle = find_circle(edges)
    assert not circle, "import circle: " + " -> ".join(where(paths[a], line, b) for a, line, b in circle)


def test_topologies_import_nothing_from_gossip_or_launch():
    bad = [where(p, line, m) for p in sources("topologies") for line, m in imports(p)
           if within(m, "gossip") or within(m, "launch")]
    assert not bad, "topologies/ must stand alone:\n" + "\n".join(bad)


def test_only_the_network_layer_imports_zmq():
    bad = [where(p, line, m) for p in sources(*PACKAGES) for line, m in imports(p)
           if within(m, "zmq") and not str(p.relative_to(ROOT)).startswith(NET)]
    assert not bad, f"only {NET} may import zmq:\n" + "\n".join(bad)
    assert any(within(m, "zmq") for p in sources("gossip") for _, m in imports(p))  # (the check sees zmq)


def test_the_network_layer_imports_nothing_of_the_library_above_it():
    bad = [where(p, line, m) for p in sources("gossip") if str(p.relative_to(ROOT)).startswith(NET)
           for line, m in imports(p) if within(m, "gossip") and not any(within(m, ok) for ok in NET_MAY_IMPORT)]
    assert not bad, f"{NET} may import only {', '.join(NET_MAY_IMPORT)} of gossip:\n" + "\n".join(bad)


def test_the_library_imports_nothing_from_the_launcher():
    bad = [where(p, line, m) for p in sources("gossip", "topologies") for line, m in imports(p) if within(m, "launch")]
    assert not bad, "gossip/ and topologies/ must not import launch:\n" + "\n".join(bad)


def test_the_launcher_reaches_topologies_only_through_gossip_config():
    bad = [where(p, line, m) for p in sources("launch") for line, m in imports(p) if within(m, "topologies")]
    assert not bad, "launch/ must reach topologies/ through gossip.config:\n" + "\n".join(bad)


def test_only_connect_constructs_a_transport():
    """The rest of the library uses the network layer's pure parts (message format, addresses, keys) and
    gets its sockets from the one transport ``gossip/connect.py build_transport`` makes."""
    bad = [f"{p.relative_to(ROOT)}:{node.lineno} constructs a Transport" for p in sources("gossip", "launch")
           if not str(p.relative_to(ROOT)).startswith(NET) and p != ROOT / "gossip" / "connect.py"
           for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Call)
           and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "Transport"]
    assert not bad, "only gossip/connect.py may construct a Transport:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", LIGHT)
def test_the_config_and_errors_load_without_torch_or_zmq(module):
    reached = loads(module, module_level_imports)
    bad = [trail(reached, m) for m in sorted(reached) if any(within(m, heavy) for heavy in HEAVY)]
    assert not bad, f"loading {module} loads {' or '.join(HEAVY)} (the launcher's --help would wait for it):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("path", PURE)
def test_the_pure_parts_reach_no_socket(path):
    assert (ROOT / path).is_file(), f"{path} is gone: update PURE and docs/architecture.md"
    reached = loads(module_name(ROOT / path))
    bad = [trail(reached, m) for m in sorted(reached) if within(m, "zmq")]
    assert not bad, f"{path} computes without sockets, yet reaches zmq:\n" + "\n".join(bad)


def large_classes() -> list[str]:
    """Every class in gossip/ over MAX_METHODS methods or MAX_LINES lines whose docstring does not say why."""
    found = []
    for path in sources("gossip"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = sum(isinstance(part, (ast.FunctionDef, ast.AsyncFunctionDef)) for part in node.body)
            lines = node.end_lineno - node.lineno + 1
            if (methods > MAX_METHODS or lines > MAX_LINES) and not WHY_LARGE.search(ast.get_docstring(node) or ""):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {methods} methods, {lines} lines")
    return found


def test_no_class_is_large_without_saying_why():
    found = large_classes()
    assert not found, (f"over {MAX_METHODS} methods or {MAX_LINES} lines, and no sentence in the docstring with "
                       f"'methods because' or 'lines because':\n" + "\n".join(found))


def test_the_checks_see_function_local_imports_and_circles():
    """The checks above would pass vacuously if ``imports`` missed function-local imports or ``find_circle``
    missed a circle."""
    found = [m for _, m in imports(ROOT / "launch" / "cli.py")]
    assert {"launch.flags", "launch.local", "launch.hosts"} <= set(found)  # the last two inside main()
    edges = {"a": [(1, "b")], "b": [(2, "c"), (3, "d")], "c": [], "d": [(4, "b")]}
    assert find_circle(edges) == [("b", 3, "d"), ("d", 4, "b")]
    assert find_circle({"a": [(1, "b")], "b": [(2, "c")], "c": []}) == []
    module_level = {m for _, m in module_level_imports(ROOT / "launch" / "cli.py")}
    assert "launch.flags" in module_level and "launch.local" not in module_level  # (main's are left out)
    assert "torch" in loads("gossip.flat", module_level_imports)  # (and the closure follows our modules)
