"""Import cycles among kvcompile's modules: prints each strongly connected group of files.

    python scripts/import_cycles.py [ROOT]      # ROOT: the package folder (default: kvcompile)

Every import counts, at module level or inside a function, under TYPE_CHECKING too: a lazy
import is still a dependency. `import a.b.c` names a/b/c.py (not the packages above it).
Exit code 1 when there is a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    base = root.parent
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                pkg = name.split(".")
                pkg = pkg if is_pkg else pkg[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                mod = ".".join(pkg + ([mod] if mod else []))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif mod in known:
                    out.add(mod)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "kvcompile").resolve()
    known = modules(root)
    graph = {m: imports(p, m, known) for m, p in known.items()}
    found = cycles(graph)
    for group in found:
        inner = [f"{a} -> {b}" for a in group for b in sorted(graph[a]) if b in group]
        print(f"cycle of {len(group)}: " + "; ".join(inner))
    print(f"{len(found)} import cycle(s) among {len(known)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
