"""The house's width, read from the source as a newcomer meets it: the modules of `trainer/`, the
largest of them (lines), the Strategy's public names (methods, properties and the attributes its
constructor sets), and the modules one config passes through from a rank's entry: those a rank
imports (`trainer.training.run`, followed through every `trainer.*` import) that define a function
taking the whole `Config` (a parameter annotated `Config`).

    python bench/house.py [ROOT]     # ROOT: a checkout (default: this one); prints one JSON line
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

RANK_ENTRY = "trainer.training.run"


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """The `trainer.*` modules a module imports, anywhere in it (functions' imports too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("trainer")}


def takes_config(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(a.annotation is not None and ast.unparse(a.annotation).strip("'\"") == "Config" for a in args):
                return True
    return False


def strategy_names(tree: ast.Module) -> list[str]:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    names = {item.name for item in cls.body if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")}
    names |= {item.target.id for item in cls.body if isinstance(item, ast.AnnAssign) and not item.target.id.startswith("_")}
    init = next((item for item in cls.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"), None)
    for node in ast.walk(init) if init else []:
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and not node.attr.startswith("_")):
            names.add(node.attr)
    return sorted(names)


def measure(root: Path) -> dict:
    files = sorted((root / "trainer").rglob("*.py"))
    trees = {module_name(root, f): (f, ast.parse(f.read_text())) for f in files}
    lines = {name: len(f.read_text().splitlines()) for name, (f, _) in trees.items()}
    reached, todo = set(), [RANK_ENTRY]
    while todo:
        name = todo.pop()
        if name in reached or name not in trees:
            continue
        reached.add(name)
        f, tree = trees[name]
        todo += imported(tree, name, f.name == "__init__.py")
    passes_config = sorted(name for name in reached if takes_config(trees[name][1]))
    largest = max(lines, key=lines.get)
    base = root / "trainer" / "strategies" / "base.py"
    return {"modules": len(trees), "largest_module": {largest: lines[largest]},
            "strategy_public_names": strategy_names(ast.parse(base.read_text())),
            "modules_a_rank_imports": len(reached), "modules_the_config_passes_through": passes_config}


if __name__ == "__main__":
    result = measure(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
    result["strategy_public_names"] = f"{len(result['strategy_public_names'])}: {' '.join(result['strategy_public_names'])}"
    result["modules_the_config_passes_through"] = (f"{len(result['modules_the_config_passes_through'])}: "
                                                   f"{' '.join(result['modules_the_config_passes_through'])}")
    print(json.dumps(result, indent=1))
