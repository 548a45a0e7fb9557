"""The layers hold and no import cycle remains between the product's modules.

Every module of core/, adapters/, proxy/ and fingerprint/ is parsed with ``ast`` (nothing is
imported). The graph has one edge per module-level import of a project module: imports
under ``if TYPE_CHECKING:`` never run, and imports inside a function are the deliberate lazy
ones (optional extras: redis, llama-cpp-python; the CLI's subcommands), so neither is an
edge. ``import a.b`` and ``from a.b import c`` point at ``a.b.c`` when that is a module, else
at ``a.b`` (a package's ``__init__``).

The layer rules are checked on every import, wherever it is: a lazy or type-only import
across a layer boundary is still a dependency the layering forbids.

    fingerprint   imports no project package (pure: tokens in, a chain out)
    core          imports nothing from proxy/, adapters/, fingerprint/
    adapters      imports core/ only (never proxy/)
    proxy         anything
    proxy.speed   imported by the listener: never by the request path's rooms (pipeline,
                  session, engine, parking, codecs, cluster), proxy.ops, adapters, core
                  or fingerprint

and no package imports another's private module (``_name``). The packages install under one
import name, ``prefixpin`` (``prefixpin.proxy``, ...): the graph names modules without it, and
no module of the product, the tests or the benches imports a package by its bare name.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "adapters", "proxy", "fingerprint")
DISTRIBUTION = "prefixpin"  # the one import name the packages install under

# package -> project packages it must never import
FORBIDDEN: dict[str, frozenset[str]] = {
    "core": frozenset({"proxy", "adapters", "fingerprint"}),
    "adapters": frozenset({"proxy"}),
    "fingerprint": frozenset({"proxy", "adapters", "core"}),
}


@dataclass(frozen=True, slots=True)
class Import:
    target: str  # the project module imported
    line: int
    module_level: bool  # runs when the module is imported (not lazy, not TYPE_CHECKING)
    lazy: bool = False  # inside a function: runs when called (a deliberate deferral)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(path, root): path
            for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _visits(node: ast.AST, module_level: bool, lazy: bool = False
            ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under ``node``, with whether it runs when the module is
    imported (not inside a function, not under ``if TYPE_CHECKING:``; its ``else`` does)
    and whether it is inside a function."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, module_level, lazy
        return
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        module_level, lazy = False, True
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _visits(child, False, lazy)
        for child in node.orelse:
            yield from _visits(child, module_level, lazy)
        return
    for inner in ast.iter_child_nodes(node):  # class bodies, try, with, other ifs: run
        yield from _visits(inner, module_level, lazy)


def in_product(absolute: str) -> str:
    """``prefixpin.proxy.listen.app`` -> ``proxy.listen.app``; "" outside the product."""
    head, _, rest = absolute.partition(".")
    return rest if head == DISTRIBUTION else ""


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return in_product(node.module or "")
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(source: str, importer: str, modules: Mapping[str, object], *,
               is_package: bool = False) -> list[Import]:
    """The project modules ``source`` (module ``importer``) imports."""
    found = []
    tree = ast.parse(source)
    for node, module_level, lazy in _visits(tree, True):
        if isinstance(node, ast.Import):
            targets = [in_product(alias.name) for alias in node.names]
        else:
            package = _absolute(node, importer, is_package)
            targets = [f"{package}.{alias.name}" if f"{package}.{alias.name}" in modules
                       else package for alias in node.names]
        for target in dict.fromkeys(targets):
            if target.split(".")[0] not in PACKAGES:
                continue
            while target not in modules and "." in target:  # a name inside a module
                target = target.rsplit(".", 1)[0]
            if target in modules:
                found.append(Import(target, node.lineno, module_level, lazy))
    return found


def import_graph(root: Path = ROOT, *, type_only: bool = False) -> dict[str, dict[str, int]]:
    """module -> {module it imports at import time: the line of the first such import};
    with ``type_only``, the imports under ``if TYPE_CHECKING:`` too (a function's own
    imports, deferred on purpose, never)."""
    modules = project_modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for imp in imports_of(path.read_text(), name, modules,
                              is_package=path.name == "__init__.py"):
            if (imp.module_level or (type_only and not imp.lazy)) and imp.target != name:
                edges.setdefault(imp.target, imp.line)
    return graph


def components(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # graphs of a few hundred modules: recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """One cycle through each component: a shortest path from its first module back."""
    return [_cycle_in(graph, set(c), c[0]) for c in components(graph)]


def _cycle_in(graph: Mapping[str, Mapping[str, int]], members: set[str],
              start: str) -> list[str]:
    """The shortest path from ``start`` back to itself inside its component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph.get(node, {})):
                if succ == start:
                    return [*paths[node], start]
                if succ in members and succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a component without a cycle")  # pragma: no cover


def describe(cycle: list[str], graph: Mapping[str, Mapping[str, int]]) -> str:
    modules = project_modules()
    steps = [f"{a} ({modules[a].relative_to(ROOT)}:{graph[a][b]}) -> {b}"
             for a, b in itertools.pairwise(cycle)]
    return "\n    ".join(steps)


# ---------------------------------------------------------------- the product's modules

@pytest.mark.parametrize("type_only", [False, True], ids=["at-import", "with-type-only"])
def test_no_import_cycle(type_only: bool) -> None:
    """No module imports, at import time, a module that (transitively) imports it; nor
    does one when the imports for the type checker count too (a seam, not a loop)."""
    graph = import_graph(type_only=type_only)
    found = components(graph)
    assert not found, "import cycles (each edge: importer (file:line) -> imported):\n  " + \
        "\n  ".join(f"cycle {i + 1} (among {', '.join(c)}):\n    "
                    f"{describe(_cycle_in(graph, set(c), c[0]), graph)}"
                    for i, c in enumerate(found))


MAX_MODULES_PER_FOLDER = 15


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    """Rooms a newcomer can read: every folder of the package holds at most 15 modules
    (its ``__init__`` counted), so a stage that grows splits into rooms of its own."""
    sizes = {str(folder.relative_to(ROOT)): len(list(folder.glob("*.py")))
             for package in PACKAGES for folder in [ROOT / package,
                                                     *(ROOT / package).rglob("*")]
             if folder.is_dir() and (folder / "__init__.py").is_file()}
    assert sizes["proxy"] <= MAX_MODULES_PER_FOLDER  # (the graph is not vacuous)
    crowded = {folder: n for folder, n in sizes.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, crowded


def test_the_records_every_stage_reads_are_a_leaf() -> None:
    """``proxy.pipeline.records`` (Plan, Incoming, Backend, Outcome, ...) runs nothing when
    imported: what it imports at import time imports nothing of the project itself."""
    graph = import_graph()
    loaded = graph["proxy.pipeline.records"]
    assert set(loaded) == {"proxy.session.identity"}  # (the graph is not vacuous)
    assert not [module for module in loaded if graph[module]], loaded


def test_no_module_reaches_an_engine_through_its_parts() -> None:
    """One engine is one object, the lane (``proxy.engine.lane.Lane``): the rest of the
    product reads its adapter, pool, policies and generations from it, never through the
    request path it holds (``lane.service.backend.adapter``)."""
    modules = project_modules()
    offenders = []
    for name, path in modules.items():
        if name == "proxy.engine.lane":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "service"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: .service.{node.attr}")
    assert not offenders, "\n".join(offenders)
    lane = ast.parse(modules["proxy.engine.lane"].read_text())
    assert any(isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
               and node.value.attr == "service" for node in ast.walk(lane))  # (not vacuous)


def test_layers() -> None:
    """core, adapters and fingerprint import nothing from the layers they sit below, not
    even lazily or for type checking."""
    modules = project_modules()
    offenders = []
    for name, path in modules.items():
        forbidden = FORBIDDEN.get(name.split(".")[0], frozenset())
        offenders += [f"{path.relative_to(ROOT)}:{imp.line}: {name} imports {imp.target}"
                      for imp in imports_of(path.read_text(), name, modules,
                                            is_package=path.name == "__init__.py")
                      if imp.target.split(".")[0] in forbidden]
    assert not offenders, "\n".join(offenders)


SPEED = "proxy.speed"
# The rooms a request passes through and those beside them: none of them may know the speed
# package, which sits behind the listener's frame sink.
SPEED_BLIND = ("proxy.pipeline", "proxy.session", "proxy.engine", "proxy.parking",
               "proxy.codecs", "proxy.cluster", "proxy.ops", "adapters", "core", "fingerprint")


def in_room(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(f"{room}.") for room in rooms)


def test_nothing_on_the_request_path_imports_the_speed_package() -> None:
    """``proxy/speed/`` makes the listener cheaper per event and changes nothing a client
    receives: only the listener plugs it in. No module of the pipeline, the sessions, the
    engines, parking, the codecs, the cluster, the operator's side, the adapters, core or
    the fingerprint imports it, not even lazily or for type checking."""
    modules = project_modules()
    offenders = []
    for name, path in modules.items():
        if not in_room(name, SPEED_BLIND):
            continue
        offenders += [f"{path.relative_to(ROOT)}:{imp.line}: {name} imports {imp.target}"
                      for imp in imports_of(path.read_text(), name, modules,
                                            is_package=path.name == "__init__.py")
                      if in_room(imp.target, (SPEED,))]
    assert not offenders, "\n".join(offenders)
    # (not vacuous: the rooms hold modules, and the listener does import the package)
    assert {room for room in SPEED_BLIND if any(in_room(m, (room,)) for m in modules)} == \
        set(SPEED_BLIND)
    assert "proxy.speed.client_writes" in import_graph()["proxy.listen.http_limits"]
    assert in_room("proxy.speed.collector", (SPEED,))
    assert not in_room("proxy.speedy", (SPEED,))


def private_module(target: str) -> bool:
    """A module whose name (past its package) starts with an underscore: its package's own."""
    return any(part.startswith("_") and part != "__init__" for part in target.split(".")[1:])


def test_no_package_imports_another_packages_private_module() -> None:
    """What a package offers the others is its public modules: ``adapters.http`` may be
    imported by proxy/, a ``_name`` module only by its own package."""
    modules = project_modules()
    offenders = []
    for name, path in modules.items():
        offenders += [f"{path.relative_to(ROOT)}:{imp.line}: {name} imports {imp.target}"
                      for imp in imports_of(path.read_text(), name, modules,
                                            is_package=path.name == "__init__.py")
                      if imp.target.split(".")[0] != name.split(".")[0]
                      and private_module(imp.target)]
    assert not offenders, "\n".join(offenders)
    assert private_module("adapters._private")
    assert not private_module("adapters.http")


def bare_imports(source: str) -> list[int]:
    """The lines of ``source`` that import a product package by its bare name
    (``import proxy``, ``from core.sse import ...``) rather than under ``prefixpin``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [node.lineno for name in names if name.split(".")[0] in PACKAGES]
    return found


def test_every_import_names_the_one_distribution() -> None:
    """Installed, the packages exist only as ``prefixpin.*``: a bare ``import proxy`` would
    work in a checkout (the folders sit at its root) and fail everywhere else."""
    sources = [path for folder in (*PACKAGES, "tests", "bench")
               for path in sorted((ROOT / folder).rglob("*.py"))]
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in sources
                 for line in bare_imports(path.read_text())]
    assert not offenders, "bare imports of a product package:\n" + "\n".join(offenders)
    assert bare_imports("import proxy.app\nfrom core import sse\nfrom prefixpin import core\n"
                        "from .core import x\n") == [1, 2]


def test_the_graph_sees_the_modules_it_must() -> None:
    """The graph is not vacuous: it holds every package and known edges, and leaves out
    a type-only import and a lazy one."""
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert "proxy.engine.lane" in graph["proxy.pipeline.router"]
    assert "proxy.pipeline.service" in graph["proxy.engine.lane"]
    assert "core.errors" in graph["adapters.llama_server"]
    assert "proxy.parking.index" in graph["proxy.parking"]
    assert "proxy.cluster.core" not in graph["proxy.engine.lane"]  # under TYPE_CHECKING
    assert "proxy.cluster.core" in import_graph(type_only=True)["proxy.engine.lane"]
    assert "proxy.cluster.core" not in graph["proxy.pipeline.router"]  # inside open_router
    assert "adapters.embedded" not in graph["proxy.engine.engines"]  # inside open_embedded_adapter


# ---------------------------------------------------------------- the settings

SETTINGS = "proxy.settings"
# What the settings may import besides the standard library and the product's leaves.
SETTINGS_LIBRARIES = frozenset({"pydantic", "pydantic_settings"})


def leaves(modules: Mapping[str, Path]) -> set[str]:
    """The product's modules that import no product module at all (not even lazily or for
    type checking) and nothing outside the standard library: constants and plain
    definitions, nothing that runs."""
    return {name for name, path in modules.items()
            if not any(imp.target != name for imp in imports_of(
                path.read_text(), name, modules, is_package=path.name == "__init__.py"))
            and all(library in sys.stdlib_module_names
                    for library, _ in libraries_imported(path.read_text()))}


def packages_of(module: str) -> list[str]:
    """The packages importing ``module`` imports first: ``core.defaults`` -> ``core``."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def libraries_imported(source: str) -> list[tuple[str, int]]:
    """The top-level names of the modules outside the product ``source`` imports when it
    is imported (not in a function, not for type checking), with their lines."""
    found = []
    for node, module_level, _ in _visits(ast.parse(source), True):
        if not module_level or (isinstance(node, ast.ImportFrom) and node.level):
            continue
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""])
        found += [(name.split(".")[0], node.lineno) for name in names
                  if name.split(".")[0] != DISTRIBUTION]
    return found


def test_the_settings_import_nothing_that_runs() -> None:
    """Reading the settings (their defaults, the flags made of them) loads no engine client,
    relay or pipeline: ``proxy.settings`` imports, of the product, only leaf modules (even
    lazily) in leaf packages, and when imported, nothing outside the standard library but
    pydantic."""
    modules = project_modules()
    path, leaf = modules[SETTINGS], leaves(modules)
    offenders = [f"{path.relative_to(ROOT)}:{imp.line}: {SETTINGS} imports {target}"
                 for imp in imports_of(path.read_text(), SETTINGS, modules)
                 for target in [*packages_of(imp.target), imp.target] if target not in leaf]
    offenders += [f"{SETTINGS}'s package {package} is not a leaf"
                  for package in packages_of(SETTINGS) if package not in leaf]
    offenders += [f"{path.relative_to(ROOT)}:{line}: {SETTINGS} imports {name}"
                  for name, line in libraries_imported(path.read_text())
                  if name not in sys.stdlib_module_names and name not in SETTINGS_LIBRARIES]
    assert not offenders, "\n".join(offenders)
    assert "core.defaults" in import_graph()[SETTINGS]  # the graph sees its imports
    assert "core.defaults" in leaf
    assert "adapters.h1" not in leaf
    assert "proxy.speed.uvicorn_seam" not in leaf  # no product module, but uvicorn
    assert packages_of("proxy.parking.index") == ["proxy", "proxy.parking"]


def test_libraries_imported_leaves_out_lazy_type_only_and_own_imports() -> None:
    source = ("import os.path\nfrom pydantic import Field\nimport prefixpin.core\n"
              "from . import x\nif TYPE_CHECKING:\n    import httpx\n"
              "def f() -> None:\n    import httpx\n")
    assert libraries_imported(source) == [("os", 1), ("pydantic", 2)]


# ---------------------------------------------------------------- the checker itself

SAMPLE = '''
from __future__ import annotations
import os
import prefixpin.proxy.a
from prefixpin.proxy import b
from prefixpin.proxy.c import name
from . import d
from .e import thing
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from prefixpin.proxy import f
else:
    from prefixpin.proxy import g
try:
    from prefixpin.proxy import h
except ImportError:
    from prefixpin.proxy import i
class K:
    from prefixpin.proxy import j
def lazy() -> None:
    from prefixpin.proxy import k
'''


def test_imports_of_sorts_module_level_from_lazy_and_type_only() -> None:
    """Absolute and relative imports resolve to modules; TYPE_CHECKING and function bodies
    are not module level; class bodies, try/except and else branches are."""
    modules = {f"proxy.{n}": None for n in "abcdefghijk"} | {"proxy": None, "proxy.x": None}
    imported = imports_of(SAMPLE, "proxy.x", modules)
    found = {imp.target: imp.module_level for imp in imported}
    assert found == {"proxy.a": True, "proxy.b": True, "proxy.c": True, "proxy.d": True,
                     "proxy.e": True, "proxy.f": False, "proxy.g": True, "proxy.h": True,
                     "proxy.i": True, "proxy.j": True, "proxy.k": False}
    assert {imp.target for imp in imported if imp.lazy} == {"proxy.k"}


def test_cycles_are_found_and_reported_as_paths() -> None:
    """A cycle in a hand-made graph is found, as a path from its first module back to it;
    an acyclic graph has none."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"d": 5}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


# ---------------------------------------------------------------- the environment, getattr

def environment_reads(source: str) -> list[int]:
    """Lines reading the process environment: ``os.environ[...]``, ``os.environ.get``,
    ``os.getenv`` (``setdefault`` for a library's own variable is a write, not counted)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.expr) and _reads_environment(node)]


def _reads_environment(node: ast.expr) -> bool:
    if isinstance(node, ast.Subscript):
        return _is_environ(node.value) and isinstance(node.ctx, ast.Load)
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr == "getenv":
        return isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
    return node.func.attr == "get" and _is_environ(node.func.value)


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def test_only_the_settings_read_the_environment() -> None:
    """Every setting has one source, ``proxy/settings.py`` (``Settings`` and its
    ``environment``): no other module of the product reads a variable behind its back."""
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for name, path in project_modules().items() if name != "proxy.settings"
                 for line in environment_reads(path.read_text())]
    assert not offenders, offenders
    assert environment_reads("import os\nos.environ.get('A')\nos.getenv('B')\n"
                             "x = os.environ['C']\nos.environ['D'] = '1'\n"
                             "os.environ.setdefault('E', '1')\n") == [2, 3, 4]


def private_getattrs(source: str) -> list[int]:
    """Lines that reach a private attribute by name: ``getattr(x, "_name", ...)``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")]


def test_nothing_reaches_a_private_attribute_through_getattr() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for path in project_modules().values()
                 for line in private_getattrs(path.read_text())]
    assert not offenders, offenders
    assert private_getattrs("getattr(a, '_x', None)\ngetattr(a, 'x')\n") == [1]
