"""The package's imports go down its layers only, and no modules import each other in a cycle.

Every import counts, at module level or inside a function (an import put off to run later still
ties the two modules together), read from the source with `ast`, so nothing is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

PACKAGE_DIR = REPO_ROOT / "dcpctl"

# Lowest first: a module may import modules of its own layer or below, never above.
LAYERS = [
    ("base", ["dcpctl.version", "dcpctl.errors", "dcpctl.failpoints", "dcpctl.stopping",
              "dcpctl.cycle_collector", "dcpctl.allocator", "dcpctl.unpickling_memory",
              "dcpctl.library_logs", "dcpctl.wording", "dcpctl.thread_pools"]),
    ("foundations", ["dcpctl.pipeline", "dcpctl.storage", "dcpctl.format.dtypes",
                     "dcpctl.format.file_names"]),
    ("file formats", ["dcpctl.format.metadata", "dcpctl.format.torch_save",
                      "dcpctl.format.safetensors", "dcpctl.format.state_dict_layouts"]),
    ("codecs", ["dcpctl.format.codecs"]),
    ("checkpoint view", ["dcpctl.format.checkpoint"]),
    ("execution", ["dcpctl.execution"]),
    ("operations", ["dcpctl.ops"]),
    ("command line", ["dcpctl.cli", "dcpctl.__main__"]),
    ("public API", ["dcpctl"]),
]
# What only the command line may use: below it nothing prints or draws progress bars.
COMMAND_LINE_ONLY = ("click", "tqdm")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def imported_names(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module an import statement anywhere in the file names (a `from package import
    module` names the module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in modules)
    return found


def internal_imports() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: {imported for imported in imported_names(path, modules)
                   if imported in modules and imported != name}
            for name, path in modules.items()}


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer():
    for module in all_modules():
        layer_of(module)


def test_imports_never_go_up_a_layer():
    upward = []
    for module, imported in internal_imports().items():
        for target in imported:
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_the_command_line_reaches_the_format_only_through_operations():
    skipping = sorted(f"{module} imports {target}"
                      for module, imported in internal_imports().items()
                      if module.startswith("dcpctl.cli")
                      for target in imported
                      if 0 < layer_of(target) < layer_of("dcpctl.ops"))
    assert not skipping, "\n".join(skipping)


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively."""
    index_of, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in graph:
        if root in index_of:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index_of[root] = low[root] = len(index_of)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index_of:
                    index_of[child] = low[child] = len(index_of)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index_of[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_no_import_cycles():
    cycles = [component for component in strongly_connected_components(internal_imports())
              if len(component) > 1]
    assert not cycles, "modules that import each other: " + "; ".join(map(str, cycles))


def test_only_the_command_line_uses_click_and_tqdm():
    offenders = []
    for module, path in all_modules().items():
        if layer_of(module) >= layer_of("dcpctl.cli"):
            continue
        for imported in imported_names(path, {}):
            if imported.split(".")[0] in COMMAND_LINE_ONLY:
                offenders.append(f"{module} imports {imported}")
    assert not offenders, "\n".join(offenders)


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The rules above can fail: a made-up cycle is found, and cli is above format."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in strongly_connected_components(graph) if len(c) > 1] == [
        ["a", "b", "c"]]
    assert layer_of("dcpctl.cli.main") > layer_of("dcpctl.format.checkpoint.view")
