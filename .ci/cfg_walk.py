"""The walk of `cfg` from session.build_trainer, read from the code (docs/development.md).

    .venv/bin/python .ci/cfg_walk.py [COMMIT] [-v]    # the working tree, or a commit's

A step of the walk is a call that hands a top-level function of another project module `cfg`,
a field of it (`cfg.x`; `**d` for the keys of a `d = dict(...)` that are), or a name through
which the calling function received one of those (a parameter, `*args` and `**kwargs` too);
the walk follows it into that function, each function once, in the order of the source. It
prints the modules the walk passes through, the modules entered, the moves from one module to
another, the returns among them, and the climbs back up: the returns that land in a module
other than session.py (the walk goes back up to a module in between, not to build_trainer).
With -v, the functions walked, as a tree.
"""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sources(commit: str | None) -> dict[str, str]:
    """module -> source of the repository's top-level Python, at a commit or as it stands."""
    if commit is None:
        return {p.stem: p.read_text() for p in REPO.glob("*.py")}
    git = ["git", "-C", str(REPO)]
    names = subprocess.check_output([*git, "ls-tree", "--name-only", commit], text=True).split()
    return {
        n[:-3]: subprocess.check_output([*git, "show", f"{commit}:{n}"], text=True)
        for n in names
        if n.endswith(".py")
    }


def walk(trees: dict[str, ast.Module]) -> list[tuple[str, str, str]]:
    """("call", module, function) and ("return", module, function) in the order walked."""
    defs = {
        m: {n.name: n for n in t.body if isinstance(n, ast.FunctionDef)} for m, t in trees.items()
    }

    def callee(module, call):
        names = {}
        for node in ast.walk(trees[module]):
            if isinstance(node, ast.Import):
                names |= {a.asname or a.name: a.name for a in node.names if a.name in trees}
            elif isinstance(node, ast.ImportFrom) and node.module in trees:
                names |= {a.asname or a.name: node.module for a in node.names}
        f = call.func
        if isinstance(f, ast.Name):
            target = (names.get(f.id, module), f.id)
        elif isinstance(f, ast.Attribute) and getattr(f.value, "id", None) in trees:
            target = (names.get(f.value.id), f.attr)
        else:
            return None
        return target if target[1] in defs.get(target[0], {}) else None

    def carries(node, carriers):
        while isinstance(node, (ast.Attribute, ast.Starred)):
            node = node.value
        return isinstance(node, ast.Name) and node.id in carriers

    path, seen = [], set()

    def visit(module, name, carriers):
        fn, dicts = defs[module][name], {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
                if carries(n.value, carriers):
                    carriers = carriers | {n.targets[0].id}
                elif isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "dict":
                    keys = {k.arg for k in n.value.keywords if carries(k.value, carriers)}
                    dicts[n.targets[0].id] = keys
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
            target = callee(module, call)
            if not target or target in seen:
                continue
            args = defs[target[0]][target[1]].args
            positional = [a.arg for a in (*args.posonlyargs, *args.args)]
            params = {*positional, *(a.arg for a in args.kwonlyargs)}
            rest = args.vararg.arg if args.vararg else None, args.kwarg.arg if args.kwarg else None
            taken = {
                positional[i] if i < len(positional) else rest[0]
                for i, a in enumerate(call.args)
                if carries(a, carriers)
            }
            for k in call.keywords:
                if k.arg and carries(k.value, carriers):
                    taken.add(k.arg if k.arg in params else rest[1])
                elif k.arg is None and isinstance(k.value, ast.Name):
                    taken |= dicts.get(k.value.id, set()) & params
            taken.discard(None)
            if taken:
                seen.add(target)
                path.append(("call", *target))
                visit(*target, taken)
                path.append(("return", module, name))

    visit("session", "build_trainer", {"cfg"})
    return path


def main(argv: list[str]) -> None:
    commit = next((a for a in argv if not a.startswith("-")), None)
    path = walk({m: ast.parse(text) for m, text in sources(commit).items()})
    stops, depth, moves, returns, climbs = ["session"], 0, 0, 0, 0
    for kind, module, name in path:
        if kind == "call" and "-v" in argv:
            print("  " * depth + f"{module}.{name}")
        depth += 1 if kind == "call" else -1
        if module != stops[-1]:
            stops.append(module)
            moves += 1
            returns += kind == "return"
            climbs += kind == "return" and module != "session"
    entered = sorted(set(stops) - {"session"})
    print(" -> ".join(stops))
    print(f"{len(entered)} modules entered ({', '.join(entered)}); {moves} moves, ", end="")
    print(f"{returns} returns, {climbs} climbs back up")


if __name__ == "__main__":
    main(sys.argv[1:])
