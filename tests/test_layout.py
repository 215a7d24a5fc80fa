"""The import rules of the layout (docs/architecture.md), read from the source of every
module under trainer/, every import counted (one inside a function too: it runs when the function is
called; one under `if TYPE_CHECKING` too: a type named is a room known): no import circle among
modules, none among rooms (a top-level module or package of trainer/: so no import runs back up from
a lower room to a higher one), and the rooms that must not know each other do not."""
from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parent.parent / "trainer"
BACKENDS = ("trainer.strategies.ddp", "trainer.strategies.fsdp", "trainer.strategies.deepspeed",
            "trainer.strategies.ds_", "trainer.strategies.torch_native")
MODEL_FAMILIES = ("trainer.models.hf", "trainer.models.lora", "trainer.models.custom")


def module_name(path: Path) -> str:
    parts = path.relative_to(TRAINER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in TRAINER.rglob("*.py")}


def imports(source: str, importer: str) -> list[tuple[str, bool]]:
    """(module imported, at module level) for each import: one inside a function runs when the
    function is called; one under `if TYPE_CHECKING` never runs, but names a room this one knows.
    `from a import b` imports module a.b where that is a module, else a."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        top, parent = True, parents.get(node)
        while parent is not None:
            top = top and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            parent = parents.get(parent)
        if isinstance(node, ast.Import):
            found += [(alias.name, top) for alias in node.names]
            continue
        assert not node.level, f"{importer}: a relative import ({ast.unparse(node)}); the trainer's are absolute"
        base = node.module
        found += [(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base, top) for alias in node.names]
    return [(name, top) for name, top in found if name == "trainer" or name.startswith("trainer.")]


GRAPH = {name: imports(path.read_text(), name) for name, path in MODULES.items()}


def room(name: str) -> str:
    """The room a module stands in: trainer.models.hf -> trainer.models, trainer.plan -> trainer.plan."""
    return ".".join(name.split(".")[:2])


def cycles(graph: dict[str, list[tuple[str, bool]]], of=lambda name: name) -> list[list[str]]:
    """The import circles, every import counted, among modules (or among what `of` maps them to:
    `room`), one path around each."""
    edges: dict[str, set[str]] = {of(name): set() for name in graph}
    for name, found in graph.items():
        edges[of(name)] |= {of(m) for m, _ in found if m in graph and of(m) != of(name)}
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(edges[name]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    return found


def upward(graph: dict[str, list[tuple[str, bool]]]) -> list[str]:
    """Imports that run back up: from one room to another that imports it, directly or not (each import
    of a circle of rooms, both ways: which way is up is the layout's to say, and there is none)."""
    rooms: dict[str, set[str]] = {}
    for name, found in graph.items():
        rooms.setdefault(room(name), set()).update(room(m) for m, _ in found if m in graph and room(m) != room(name))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(rooms.get(here, ()))
        return False

    return sorted(f"{name} imports {m}" for name, found in graph.items() for m, _ in found
                  if m in graph and room(m) != room(name) and reaches(room(m), room(name)))


def violations(graph: dict[str, list[tuple[str, bool]]]) -> list[str]:
    """Imports that run back up, or into what a room must not know."""
    def under(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    bad = []
    for importer, found in graph.items():
        for imported, _ in found:
            if under(importer, "trainer.checkpoint") and (under(imported, "trainer.training")
                                                          or under(imported, "trainer.strategies")):
                bad.append(f"{importer} imports {imported}: the checkpoint package stands below training and the "
                           "backends (what it needs of a strategy: checkpoint.holder.StateHolder)")
            if under(importer, "trainer.strategies") and (imported in MODEL_FAMILIES
                                                          or under(imported, "trainer.training")):
                bad.append(f"{importer} imports {imported}: a backend knows no model family and not the loop")
            if importer == "trainer.training.loop" and imported.startswith(BACKENDS):
                bad.append(f"{importer} imports {imported}: the loop talks to the Strategy interface only")
    return bad


def test_the_import_graph_has_no_circle_and_no_import_that_runs_back_up():
    assert len(MODULES) > 40 and "trainer.checkpoint.format" in MODULES and "trainer.training.loop" in MODULES
    assert cycles(GRAPH) == []
    assert cycles(GRAPH, of=room) == []
    assert upward(GRAPH) == []
    assert violations(GRAPH) == []


def test_the_rules_catch_each_kind_of_wrong_import():
    """The same checks on the graph with one wrong import added each time: every rule bites."""
    def adding(importer: str, imported: str, top: bool = True) -> dict:
        return {**GRAPH, importer: GRAPH[importer] + [(imported, top)]}

    assert cycles(adding("trainer.checkpoint.format", "trainer.training.loop"))  # loop imports the format
    assert cycles(adding("trainer.models.hf_sequence", "trainer.models.hf", top=False))  # inside a function too
    assert "trainer.data.tokenized imports trainer.checks" in upward(adding("trainer.data.tokenized", "trainer.checks",
                                                                            top=False))  # round 2's circle
    assert cycles(adding("trainer.losses.objectives", "trainer.plan.activations"), of=room)  # the trace runs the losses
    assert not upward(adding("trainer.training.loop", "trainer.saved_bytes"))  # the counter stands below the loop
    assert violations(adding("trainer.checkpoint.convert", "trainer.training.loop", top=False))  # at run time
    assert violations(adding("trainer.checkpoint.manager", "trainer.strategies.base"))
    assert violations(adding("trainer.strategies.deepspeed", "trainer.models.hf", top=False))
    assert violations(adding("trainer.strategies.base", "trainer.training.faults"))
    assert violations(adding("trainer.training.loop", "trainer.strategies.ds_state"))
    assert not violations(adding("trainer.training.loop", "trainer.strategies"))  # build_strategy: fine
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.strategies.base import Strategy\n"
    assert violations({"trainer.checkpoint.manager": imports(source, "trainer.checkpoint.manager")})  # a type too
    assert imports("def f():\n    from trainer.training import loop\n", "trainer.checkpoint.convert") == [
        ("trainer.training.loop", False)]
