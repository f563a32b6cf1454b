"""The repository's structure, checked on its sources (no import of the checked code):

    layers       no import circle among zbcompile's modules, none upward (docs/architecture.md's layers)
    torch        private torch modules (`torch._*`, `torch.*._*`) reached only through
                 zbcompile/_torch_internals.py
    value names  no value-name prefix (zbcompile/value_names.py's) written as a literal elsewhere
    sizes        zbcompile's files at most 500 lines, functions at most 80 (allow-lists that only shrink)
    line length  ruff's E501 at 120 characters selected in pyproject.toml, and the repository passing it

Each checker is a function of sources ({path: text}); each rule is also shown to fail on a small
source that breaks it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from zbcompile import value_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "zbcompile"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# path -> why it may pass MAX_FILE_LINES (an entry goes when its file is short enough)
LONG_FILES: dict[str, str] = {}
# "path::qualified name" -> why it may pass MAX_FUNCTION_LINES (at most 3; an entry goes when its function
# is short enough or gone)
LONG_FUNCTIONS: dict[str, str] = {
    "zbcompile/schedules/reference.py::_build": "the reference scheduler's one loop, kept as written in its source",
    "zbcompile/passes/trace.py::trace_model": "one trace's steps in order, each a call, with its error handling",
    "zbcompile/passes/partition.py::_build_stages": "one pass over the graph that builds every stage's graph",
}
# path -> why it may use private torch names directly (torch's own internals are what it compares against)
PRIVATE_TORCH_USERS: dict[str, str] = {
    "benchmarks/split_overhead.py": "times torch.distributed.pipelining's own split backward against ours",
    "tests/e2e/test_schedule_torch_csv.py": "checks our schedules against torch's private schedule IR (_Action)",
}


def repository_sources(*folders: str) -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` an import statement reads (`from a import b`: a.b if a module, else a)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names} & modules


def import_graph(sources: dict[str, str]) -> nx.DiGraph:
    """Module -> the modules of `sources` it imports, anywhere in its file (functions included)."""
    modules = {module_name(path): path for path in sources}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(sources[path])):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found = _imported(node, module, path.endswith("__init__.py"), set(modules))
                graph.add_edges_from((module, name) for name in found if name != module)
    return graph


def import_circles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(group) for group in nx.strongly_connected_components(graph) if len(group) > 1]


def read_layers(doc: str) -> list[tuple[str, list[str]]]:
    """docs/architecture.md's import layers, top first: (layer, [module or package/ ...])."""
    block = re.search(r"Import layers, top first.*?```text\n(.*?)```", doc, re.S)
    if block is None:
        raise ValueError("docs/architecture.md has no 'Import layers, top first' block")
    layers = []
    for line in block.group(1).strip().splitlines():
        name, members = line.split(":", 1)
        layers.append((name.strip(), [member.strip() for member in members.split(",")]))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int:
    """The module's layer, counted from the bottom (0)."""
    for height, (_, members) in enumerate(reversed(layers)):
        for member in members:
            dotted = PACKAGE if member == PACKAGE else f"{PACKAGE}.{member.rstrip('/').replace('/', '.')}"
            if module == dotted or (member.endswith("/") and module.startswith(dotted + ".")):
                return height
    raise ValueError(f"{module} is in no layer of docs/architecture.md's 'Import layers' list")


def upward_imports(graph: nx.DiGraph, layers: list[tuple[str, list[str]]]) -> list[str]:
    return sorted(
        f"{importer} imports {imported} (a layer above it)"
        for importer, imported in graph.edges
        if layer_of(imported, layers) > layer_of(importer, layers)
    )


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(part.startswith("_") and not part.startswith("__") for part in parts)


def _attribute_chain(node: ast.Attribute) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def private_torch_uses(sources: dict[str, str], adapter: str = "zbcompile/_torch_internals.py") -> list[str]:
    """Imports of private torch modules, and attribute chains through one (`torch._C.x`; op names
    such as `torch.ops.aten._to_copy` are public), outside the adapter module."""
    found = []
    for path, text in sources.items():
        if path == adapter:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Attribute) and not isinstance(node.value, ast.Attribute):
                chain = _attribute_chain(node)
                names = [chain] if chain and ".ops." not in chain else []
            else:
                continue
            found += [f"{path}:{node.lineno} {name}" for name in names if _private(name)]
    return sorted(set(found))


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
    }


def value_name_literals(sources: dict[str, str], prefixes: tuple[str, ...], home: str) -> list[str]:
    """String literals (f-string parts included, docstrings not) starting with a value-name prefix."""
    found = []
    for path, text in sources.items():
        if path == home:
            continue
        tree = ast.parse(text)
        docstrings = _docstrings(tree)
        found += [
            f"{path}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and node.value.startswith(prefixes)
        ]
    return found


def file_lengths(sources: dict[str, str]) -> dict[str, int]:
    return {path: len(text.splitlines()) for path, text in sources.items()}


def function_lengths(sources: dict[str, str]) -> dict[str, int]:
    """'path::Outer.inner' -> lines from the def to its last line (nested functions inside counted)."""
    lengths = {}

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[f"{path}::{name}"] = child.end_lineno - child.lineno + 1
                visit(child, path, f"{name}.")
            else:
                visit(child, path, prefix)

    for path, text in sources.items():
        visit(ast.parse(text), path, "")
    return lengths


def over_limit(lengths: dict[str, int], limit: int, allowed: dict[str, str]) -> list[str]:
    """What passes the limit without an allow-list entry, and allow-list entries no longer needed."""
    problems = [
        f"{name}: {n} lines (at most {limit})" for name, n in lengths.items() if n > limit and name not in allowed
    ]
    for name in allowed:
        if name not in lengths:
            problems.append(f"{name}: allow-listed but gone; remove its entry")
        elif lengths[name] <= limit:
            problems.append(f"{name}: allow-listed but {lengths[name]} lines now; remove its entry")
    return sorted(problems)


def long_lines(paths: list[str], cwd: Path, limit: int = 120) -> list[str]:
    """Lines over `limit` characters in `paths`, as ruff's E501 reports them (ruff's own config
    under `cwd`: its per-file ignores apply)."""
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "E501", "--line-length", str(limit)]
    result = subprocess.run([*command, "--output-format", "concise", *paths], cwd=cwd, capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if "E501" in line]


VALUE_PREFIXES = tuple(value for name, value in vars(value_names).items() if name.isupper() and isinstance(value, str))
LAYERS = read_layers((ROOT / "docs/architecture.md").read_text())


# --- the repository ---------------------------------------------------------------------------------------


def test_no_import_circle_and_no_upward_import():
    graph = import_graph(repository_sources(PACKAGE))
    assert graph.has_edge("zbcompile.api", "zbcompile.runtime.build")  # the graph is read at all
    assert import_circles(graph) == []
    assert upward_imports(graph, LAYERS) == []


RUNTIME_ROOMS = ["runtime/tuning/", "runtime/state/", "runtime/step/", "runtime/parallel/"]


def test_the_runtime_is_in_rooms_layered_top_first():
    """Each room of the runtime is a layer of its own, in this order (build.py and the cache of its
    compiles above them), and every other runtime module sits in one: an import from a lower room
    into a higher one fails the layers test above."""
    rooms = [members for _, members in LAYERS if any(member.startswith("runtime/") for member in members)]
    assert rooms == [["runtime", "runtime/build", "runtime/compile_cache"], *([room] for room in RUNTIME_ROOMS)]
    loose = [path for path in repository_sources(f"{PACKAGE}/runtime") if path.count("/") == 2]
    assert sorted(loose) == [
        "zbcompile/runtime/__init__.py", "zbcompile/runtime/build.py", "zbcompile/runtime/compile_cache.py"
    ]


MAX_TOP_LEVEL_MODULES = 12  # zbcompile/'s own modules: the API, the options, what every room shares
ROOMS = ["planner/", "rehearsal/", "runtime/", "passes/", "schedules/", "inspect/"]


def test_the_top_level_keeps_the_api_and_what_rooms_share():
    """zbcompile/ holds at most MAX_TOP_LEVEL_MODULES modules; the planner and the rehearsal are rooms
    (subpackages) of their own, each with its command, and api.py stays under 250 lines."""
    sources = repository_sources(PACKAGE)
    top = [path for path in sources if path.count("/") == 1]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)
    for room in ROOMS:
        assert f"{PACKAGE}/{room}__init__.py" in sources, f"{room} is not a package"
    assert {f"{PACKAGE}/planner/cli.py", f"{PACKAGE}/rehearsal/cli.py"} <= set(sources)
    assert sources["zbcompile/api.py"].count("\n") < 250


def test_private_torch_modules_only_through_the_adapter():
    uses = private_torch_uses(repository_sources(PACKAGE, "benchmarks", "tests", "examples"))
    users = {use.split(":")[0] for use in uses}
    assert [use for use in uses if use.split(":")[0] not in PRIVATE_TORCH_USERS] == []
    assert sorted(set(PRIVATE_TORCH_USERS) - users) == [], "allow-listed but no private use left: remove"


def test_value_name_prefixes_only_in_value_names():
    assert len(VALUE_PREFIXES) >= 9
    assert value_name_literals(repository_sources(PACKAGE), VALUE_PREFIXES, "zbcompile/value_names.py") == []


def test_file_and_function_sizes():
    sources = repository_sources(PACKAGE)
    assert len(LONG_FUNCTIONS) <= 3
    assert over_limit(file_lengths(sources), MAX_FILE_LINES, LONG_FILES) == []
    assert over_limit(function_lengths(sources), MAX_FUNCTION_LINES, LONG_FUNCTIONS) == []


def test_lines_at_most_120_characters():
    config = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^line-length = 120$", config, re.M)
    assert '"E501"' in re.search(r"^select = \[(.*)\]$", config, re.M).group(1)
    assert long_lines(["zbcompile", "tests", "benchmarks", "examples"], ROOT) == []


# --- each rule fails on a source that breaks it -------------------------------------------------------------

BROKEN_TREE = {
    "zbcompile/__init__.py": "",
    "zbcompile/value_names.py": "PARAM = 'param:'\n",
    "zbcompile/runtime/__init__.py": "",
    "zbcompile/runtime/stage.py": "from zbcompile.passes.cut import cut\n",
    "zbcompile/passes/__init__.py": "",
    "zbcompile/passes/cut.py": "def cut():\n    from ..runtime import stage\n    return stage\n",
    "zbcompile/passes/names.py": "NAME = f'param:{1}'\n",
}
BROKEN_LAYERS = [("runtime", ["runtime/"]), ("passes", ["passes/"]), ("foundation", ["zbcompile", "value_names"])]


def test_an_import_circle_and_an_upward_import_are_found():
    graph = import_graph(BROKEN_TREE)
    assert import_circles(graph) == [["zbcompile.passes.cut", "zbcompile.runtime.stage"]]
    assert upward_imports(graph, BROKEN_LAYERS) == [
        "zbcompile.passes.cut imports zbcompile.runtime.stage (a layer above it)"
    ]
    with pytest.raises(ValueError, match="zbcompile.other is in no layer"):
        layer_of("zbcompile.other", BROKEN_LAYERS)


def test_an_import_from_a_lower_room_of_the_runtime_into_a_higher_one_is_found():
    sources = {
        "zbcompile/runtime/step/runner.py": "from zbcompile.runtime.parallel.batch import split\n",
        "zbcompile/runtime/parallel/batch.py": "from zbcompile.runtime.step import runner\n",
        "zbcompile/runtime/build.py": "from zbcompile.runtime.step.runner import Runner\n",
    }
    layers = [("runtime", ["runtime/build"]), ("step", ["runtime/step/"]), ("parallel", ["runtime/parallel/"])]
    assert upward_imports(import_graph(sources), layers) == [
        "zbcompile.runtime.parallel.batch imports zbcompile.runtime.step.runner (a layer above it)"
    ]


def test_the_layers_block_is_read_top_first():
    doc = "Import layers, top first. Checked.\n\n```text\nface: api\nbase: schedules/, value_names\n```\n"
    assert read_layers(doc) == [("face", ["api"]), ("base", ["schedules/", "value_names"])]
    assert layer_of("zbcompile.schedules.ir", read_layers(doc)) == 0
    assert layer_of("zbcompile.api", read_layers(doc)) == 1


def test_a_private_torch_import_is_found():
    sources = {
        "tests/a.py": "import torch._dynamo\nfrom torch.utils import _pytree\nx = torch._C.TensorBase\n",
        "tests/b.py": "import torch\nop = torch.ops.aten._to_copy.default\nfrom torch.fx import GraphModule\n",
        "zbcompile/_torch_internals.py": "from torch._functorch import partitioners\n",
    }
    assert private_torch_uses(sources) == [
        "tests/a.py:1 torch._dynamo",
        "tests/a.py:2 torch.utils._pytree",
        "tests/a.py:3 torch._C",
    ]


def test_a_value_name_literal_is_found():
    assert value_name_literals(BROKEN_TREE, VALUE_PREFIXES, "zbcompile/value_names.py") == [
        "zbcompile/passes/names.py:1 'param:'"
    ]
    documented = {"zbcompile/x.py": '"""Reads param:<fqn>."""\n\ndef f():\n    """grad:x"""\n'}
    assert value_name_literals(documented, VALUE_PREFIXES, "zbcompile/value_names.py") == []


def test_long_files_and_functions_are_found_and_the_allow_lists_only_shrink():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    sources = {"zbcompile/a.py": f"class A:\n    def run(self):\n{body}".replace("\n    x", "\n        x")}
    assert function_lengths(sources) == {"zbcompile/a.py::A.run": 81}
    assert over_limit(function_lengths(sources), 80, {}) == ["zbcompile/a.py::A.run: 81 lines (at most 80)"]
    assert over_limit(function_lengths(sources), 80, {"zbcompile/a.py::A.run": "why"}) == []
    assert over_limit(function_lengths(sources), 81, {"zbcompile/a.py::A.run": "why"}) == [
        "zbcompile/a.py::A.run: allow-listed but 81 lines now; remove its entry"
    ]
    assert over_limit(file_lengths(sources), 80, {"zbcompile/gone.py": "why"}) == [
        "zbcompile/a.py: 82 lines (at most 80)",
        "zbcompile/gone.py: allow-listed but gone; remove its entry",
    ]


def test_a_long_line_is_found(tmp_path):
    (tmp_path / "wide.py").write_text(f"x = {'1' * 117}\ny = {'1' * 116}\n")  # 121 and 120 characters
    assert [line.split(":")[1] for line in long_lines(["wide.py"], tmp_path)] == ["1"]
