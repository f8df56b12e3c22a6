"""The package's import graph keeps the architecture: no cycle, no import of a higher layer,
no private name across modules, no fusedattn import hidden inside a function.

Layers, top to bottom (a module may import its own layer or lower ones):
entry points and drop-ins > dispatch > context_parallel > backends, block_sparse > leaves.
"""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
TOP = ("fusedattn", "fusedattn.__main__", "fusedattn.api", "fusedattn.small_seq_api",
       "fusedattn.jax_nn", "fusedattn.flax", "fusedattn.fp8")
LAYERS = {"dispatch": 4, "context_parallel": 3, "backends": 2, "block_sparse": 2}


def layer(module: str) -> int:
    if module in TOP:
        return 5
    parts = module.split(".")
    return LAYERS.get(parts[1], 1) if len(parts) > 1 else 5


def modules():
    for path in sorted((SRC / "fusedattn").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if package else parts), package, path


KNOWN = {name for name, _, _ in modules()}


def imports(module: str, package: bool, tree):
    """(line, target module, imported name or None, inside a function?) per fusedattn import."""
    base = module.split(".") if package else module.split(".")[:-1]
    scopes = [(node, False) for node in tree.body]
    while scopes:
        node, nested = scopes.pop()
        inner = nested or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        scopes += [(child, inner) for child in ast.iter_child_nodes(node)]
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fusedattn":
                    yield node.lineno, alias.name, None, nested
        elif isinstance(node, ast.ImportFrom):
            src = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            if not src or src.split(".")[0] != "fusedattn":
                continue
            for alias in node.names:
                full = f"{src}.{alias.name}"
                yield (node.lineno, full, None, nested) if full in KNOWN else \
                      (node.lineno, src, alias.name, nested)


def graph():
    edges, problems = {}, []
    for module, package, path in modules():
        tree = ast.parse(path.read_text())
        bound = set()
        for line, target, name, nested in imports(module, package, tree):
            where = f"{path.relative_to(SRC)}:{line}: {module} -> {target}"
            edges.setdefault(module, set()).add(target)
            if name is None:
                bound.add(target.rsplit(".", 1)[-1])
            if nested:
                problems.append(f"{where}: fusedattn import inside a function")
            if layer(target) > layer(module):
                problems.append(f"{where}: upward import (layer {layer(module)} -> {layer(target)})")
            if name and name.startswith("_") and not name.startswith("__"):
                problems.append(f"{where}: private name {name} imported across modules")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                problems.append(f"{path.relative_to(SRC)}:{node.lineno}: {module} uses private "
                                f"{node.value.id}.{node.attr}")
    return edges, problems


def cycles(edges):
    found, state = [], {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2
    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_cycle_no_upward_no_private_import():
    edges, problems = graph()
    problems += [f"import cycle: {c}" for c in cycles(edges)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("bad, rule", [
    ("fusedattn.backends.cudnn.kernels", "upward"), ("fusedattn.config", "leaf")])
def test_layers_rank_as_documented(bad, rule):
    assert (layer(bad) < layer("fusedattn.dispatch.plan")) if rule == "upward" else layer(bad) == 1
