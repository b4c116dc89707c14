"""The import graph of pallas_kernels/ and kvcanary_jax/ has no circle and no upward import."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "kvcanary_jax")

# Lead-owned: sglang_jax <-> _sglang_parallel / _sglang_adopt import each other inside functions. Remove this
# exemption once that circle is broken.

# The layering of the upper package, bottom first: a module may import its own layer and those below it. The package's
# __init__ is the public face: integrations and demo sit above it and use it; __main__ is on top of all.
UPPER_RANKS = {
    "kvcanary_jax.core": 0,
    "kvcanary_jax.runtime": 1,
    "kvcanary_jax.sharded": 2,
    "kvcanary_jax.testing": 3,
    "kvcanary_jax": 4,
    "kvcanary_jax.integrations": 5,
    "kvcanary_jax.demo": 6,
    "kvcanary_jax.__main__": 7,
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Every import (top level, under TYPE_CHECKING, inside functions) between modules of PACKAGES."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                # `from pkg import mod` is an edge to the module mod; `from mod import name` to mod.
                candidates = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            for cand in candidates:
                # `import a.b.c` (or a name in a.b.c that is no module) is an edge to the deepest module named.
                while cand and cand not in modules:
                    cand = cand.rpartition(".")[0]
                if cand and cand != name:
                    targets.add(cand)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _upper_rank(module: str) -> int:
    if module in UPPER_RANKS:
        return UPPER_RANKS[module]
    for pkg, rank in UPPER_RANKS.items():
        if pkg != "kvcanary_jax" and _in(module, pkg):
            return rank
    raise AssertionError(f"{module} is in no layer of UPPER_RANKS; add its subpackage there")


# The op folders of pallas_kernels (verify/, write/, ...); its top-level modules are the shared code below them.
OPS = frozenset(d.name for d in (ROOT / "pallas_kernels").iterdir() if (d / "__init__.py").is_file())


def _pallas_op(module: str) -> str | None:
    """The op folder a pallas_kernels module belongs to (pallas_kernels.verify.api -> 'verify'), else None."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in OPS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if _in(src, "pallas_kernels"):
                if _in(dst, "kvcanary_jax"):
                    bad.append(f"{src} -> {dst}: pallas_kernels never imports kvcanary_jax")
                    continue
                # Shared modules (hash64, mosaic_io, ...) sit below every op folder.
                if src != "pallas_kernels" and _pallas_op(src) is None and _pallas_op(dst) is not None:
                    bad.append(f"{src} -> {dst}: a shared pallas_kernels module imports an op folder")
            elif _in(dst, "pallas_kernels"):
                # The privacy rule (docs/development.md): of an op folder, the upper layer imports only its api.
                if _pallas_op(dst) is not None and not dst.endswith(".api"):
                    bad.append(f"{src} -> {dst}: kvcanary_jax imports an op's internals, not its api")
            elif _in(dst, "kvcanary_jax"):
                if _upper_rank(dst) > _upper_rank(src):
                    bad.append(f"{src} -> {dst}: a lower layer imports a higher one")
                # The demo and the integrations use the public face: kvcanary_jax and kvcanary_jax.testing.
                if _upper_rank(src) > UPPER_RANKS["kvcanary_jax"] and _upper_rank(dst) < UPPER_RANKS["kvcanary_jax"]:
                    if not _in(dst, "kvcanary_jax.testing"):
                        bad.append(f"{src} -> {dst}: the demo and the integrations import the public face only")
    return bad


def test_graph_sees_known_edges():
    graph = import_graph()
    assert "pallas_kernels.hash64" in graph["pallas_kernels.verify.reference"]
    assert "kvcanary_jax.core._config" in graph["kvcanary_jax.runtime._canary"]


def test_no_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def op_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of pallas_kernels op folders: an op may build on another (phase fuses write and verify), one way."""
    ops: dict[str, set[str]] = {}
    for src, targets in graph.items():
        src_op = _pallas_op(src) if _in(src, "pallas_kernels") else None
        if src_op is None:
            continue
        ops.setdefault(src_op, set()).update(
            dst_op
            for dst in targets
            if _in(dst, "pallas_kernels") and (dst_op := _pallas_op(dst)) not in (None, src_op)
        )
    return ops


def test_no_cycles_between_ops():
    cycles = find_cycles(op_graph(import_graph()))
    assert not cycles, "pallas_kernels op folders import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports():
    bad = upward_imports(import_graph())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_find_cycles_detects_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
