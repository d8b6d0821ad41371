"""The stack: every module of varlen_attn imports only from layers below its own.

The import graph is read from the source (``ast``), imports inside functions included, so a
cycle hidden behind a function-level import fails too. Optional third-party packages and the
oracle package ``varlen_attn_ref`` are outside ``varlen_attn`` and not part of the graph.
"""

import ast
import pathlib


import varlen_attn

ROOT = pathlib.Path(varlen_attn.__file__).parent

# Bottom up; a module may import only from layers strictly below its own (docs/design.md).
LAYERS = [
    ["varlen_attn._errors", "varlen_attn._stats"],
    ["varlen_attn.masks"],
    ["varlen_attn.plan"],
    ["varlen_attn.pack"],
    ["varlen_attn.padding", "varlen_attn.kernels._base"],
    ["varlen_attn.kernels.flash", "varlen_attn.kernels.reference", "varlen_attn.kernels.split_sdpa",
     "varlen_attn.kernels.torch_varlen"],
    ["varlen_attn.kernels"],
    ["varlen_attn.policy", "varlen_attn.fused", "varlen_attn.costs"],
    ["varlen_attn.execution"],
    ["varlen_attn.op"],
    ["varlen_attn.functional"],
    ["varlen_attn.hook", "varlen_attn.parallel", "varlen_attn.trim"],
    ["varlen_attn.model", "varlen_attn.processor"],
    ["varlen_attn.launch"],
    ["varlen_attn", "varlen_attn.__main__"],
]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports (at module level or inside functions)."""
    mods = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        package = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # "from . import scope" imports the submodule; "from .plan import X" the module.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for target in names:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != m:
                    graph[m].add(target)
    return graph


def test_every_module_has_a_layer():
    graph = import_graph()
    assert sorted(set(graph) - set(RANK)) == [], "add new modules to LAYERS (and docs/design.md)"
    assert sorted(set(RANK) - set(graph)) == [], "LAYERS names a module that does not exist"


def test_imports_only_go_down():
    graph = import_graph()
    upward = sorted(f"{m} (layer {RANK[m]}) imports {t} (layer {RANK[t]})"
                    for m, targets in graph.items() for t in targets
                    if m != "varlen_attn" and RANK[t] >= RANK[m])
    assert upward == [], "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t, path + [t])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_reader_finds_a_cycle_hidden_in_a_function(tmp_path):
    """The old layout's shape: ``low`` imports ``high`` inside a function, ``high`` imports
    ``low`` at module level, through the three import forms the package uses."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .high import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "low.py").write_text("def f():\n    from ..high import g\n    return g\n")
    (pkg / "high.py").write_text("from .sub import low\n\ndef g():\n    return low\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.low"] == {"pkg.high"} and graph["pkg.high"] == {"pkg.sub.low"}
    assert find_cycle(graph) == ["pkg.high", "pkg.sub.low", "pkg.high"]
