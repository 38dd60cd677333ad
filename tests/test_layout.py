"""The package layout, read from the source with ``ast`` (nothing is imported): no import circle among the
launcher's modules, topologies/ stands alone, only the network layer (gossip/net/) touches zmq and it
imports nothing of the rest of the library, and the library (gossip/, topologies/) never reaches into the
launcher. A failure names the file, line and import."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("gossip", "topologies", "launch")
NET = "gossip/net/"
NET_MAY_IMPORT = ("gossip.net", "gossip.errors", "gossip.alloc")  # the exception tree and malloc tuning


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


def test_the_checks_see_function_local_imports_and_circles():
    """The checks above would pass vacuously if ``imports`` missed function-local imports or ``find_circle``
    missed a circle."""
    found = [m for _, m in imports(ROOT / "launch" / "cli.py")]
    assert {"launch.flags", "launch.local", "launch.hosts"} <= set(found)  # the last two inside main()
    edges = {"a": [(1, "b")], "b": [(2, "c"), (3, "d")], "c": [], "d": [(4, "b")]}
    assert find_circle(edges) == [("b", 3, "d"), ("d", 4, "b")]
    assert find_circle({"a": [(1, "b")], "b": [(2, "c")], "c": []}) == []
