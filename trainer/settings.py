"""`python -m trainer.settings`: every setting of `trainer` (its key, type, default, allowed values
and meaning) as a markdown page, read from the schema (the dataclasses of trainer/config.py, the
comments on their fields and enum values) and the default config groups (conf/). docs/settings.md
is its output, so the page cannot drift from the code: tests/test_settings.py regenerates it and
compares.

    python -m trainer.settings > docs/settings.md
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from enum import Enum
from importlib import resources
from typing import Any

import yaml

from trainer import config as schema
from trainer.config import CONFIG_MODULE, MODEL_KEYS, Config, ModelConfig, ModelKind, known_keys

# The nodes of Config in the order of the page, and what each is for.
SECTIONS = {
    "strategy": "how the model is spread over the ranks ([strategies](strategies.md))",
    "model": "what trains ([models and data](models-and-data.md))",
    "peft": "adapters instead of full training ([fine-tuning](fine-tuning.md))",
    "objective": "what the loss is",
    "data": "what it trains on ([models and data](models-and-data.md), [fine-tuning](fine-tuning.md#chat-datachat))",
    "eval": "validation ([watching a run](watching.md#evaluation-and-early-stopping))",
    "optim": "AdamW and the learning-rate schedule ([checkpoints](checkpoints.md#resuming) for schedules)",
    "train": "the loop ([strategies](strategies.md), [watching a run](watching.md))",
    "checkpoint": "saving and resuming ([checkpoints](checkpoints.md))",
    "logger": "where records go ([watching a run](watching.md#loggers)); each node exists once its logger is chosen",
    "plan": "the memory planner, `python -m trainer.plan` and `strategy=auto` ([planning](planning.md))",
}


def comments(source: str) -> dict[int, str]:
    """Line number (1-based) -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def member_comments(cls: type) -> dict[str, str]:
    """The comment of each field (or enum member) of a class: the one at the end of its line, else
    the block of comment lines right above it."""
    lines, _ = inspect.getsourcelines(cls)
    notes = comments("".join(lines))
    out = {}
    for n, line in enumerate(lines, 1):
        # a field, or one named by a keyword (config.keyword_field)
        name = re.match(r"^\s+(?:(\w+)\s*[:=]|keyword_field\(locals\(\), \"(\w+)\")", line)
        if not name or line.strip().startswith("#"):
            continue
        field_name = name.group(1) or name.group(2)
        if n in notes and not line.strip().startswith(notes[n]):
            out[field_name] = notes[n]
            continue
        above, k = [], n - 1
        while k in notes and lines[k - 1].strip().startswith("#"):
            above.insert(0, notes[k])
            k -= 1
        if above:
            out[field_name] = " ".join(above)
    return out


def conf_yaml(*parts: str) -> tuple[str, dict]:
    """A file of conf/: the comment lines it begins with (what it is) and its content."""
    text = resources.files(CONFIG_MODULE).joinpath(*parts).read_text()
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            head.append(line.lstrip("#").strip())
    return " ".join(head), yaml.safe_load(text) or {}


def default_config() -> dict:
    """What `trainer` with no overrides composes: the schema under the default groups."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    schema.register_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return OmegaConf.to_container(compose(config_name="config"))


def default_choices() -> dict[str, str]:
    _, top = conf_yaml("config.yaml")
    return {k: v for d in top["defaults"] if isinstance(d, dict) for k, v in d.items()}


def type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(hint) in (list, typing.List):
        item = node_class(args[0])
        return "list of " + ("{" + ", ".join(f.name for f in dataclasses.fields(item)) + "}" if item else
                             type_name(args[0]))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in hint)
    return {Any: "any"}.get(hint, getattr(hint, "__name__", str(hint)))


def show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def node_class(hint: Any) -> type | None:
    """The dataclass of a node of the schema (StrategyConfig for `strategy`), or None for a plain key."""
    return next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)


def enum_of(hint: Any) -> type[Enum] | None:
    return next((t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and issubclass(t, Enum)), None)


def meaning(note: str, hint: Any) -> str:
    """A field's comment, and its enum's values with theirs."""
    enum = enum_of(hint)
    note = note or (inspect.getdoc(enum) if enum is not None and enum.__doc__ else "")
    parts = [note] if note else []
    item = node_class(typing.get_args(hint)[0]) if typing.get_origin(hint) in (list, typing.List) else None
    if item is not None:  # a list of settings (data.sources): each item's keys
        item_notes = member_comments(item)
        parts.append("each item: " + "; ".join(f"`{f.name}`: {item_notes[f.name]}" if f.name in item_notes else
                                               f"`{f.name}`" for f in dataclasses.fields(item)))
    if enum is not None:
        values = member_comments(enum)
        said = [f"`{m.value}`: {values[m.name]}" for m in enum if m.name in values]
        if said:
            parts.append("; ".join(said))
    return ". ".join(p.rstrip(".") for p in parts)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def rows(cls: type, prefix: str, defaults: dict, keys: list[str] | None = None, kinds: dict | None = None):
    """(key, type, default, meaning) of each field of `cls` (into nested dataclasses)."""
    hints, notes = typing.get_type_hints(cls), member_comments(cls)
    for f in dataclasses.fields(cls):
        name = "_target_" if (cls is ModelConfig and f.name == "target") else f.name
        if keys is not None and name not in keys:
            continue
        hint = hints[f.name]
        nested = node_class(hint) if typing.get_origin(hint) not in (list, typing.List) else None
        if nested is not None:
            yield from rows(nested, f"{prefix}{name}.", defaults.get(name) or {})
            continue
        default = defaults[name] if name in defaults else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        note = notes.get(f.name, "")
        if kinds is not None:
            note = f"({', '.join(kinds[name])}) {note}".strip()
        yield f"{prefix}{name}", type_name(hint), show(default), meaning(note, hint)


def group_rows() -> list[str]:
    """Each config group's options, the default first, with the first line of its file."""
    choices, out = default_choices(), []
    root = resources.files(CONFIG_MODULE)
    groups = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__"))
    groups.sort(key=lambda g: list(SECTIONS).index(g) if g in SECTIONS else len(SECTIONS))
    for group in [*groups, "hydra/launcher", "hydra/sweeper"]:
        folder = root.joinpath(*group.split("/"))
        if not folder.is_dir():
            continue
        options = sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
        options.sort(key=lambda o: o != choices.get(group))
        for option in options:
            description, _ = conf_yaml(*group.split("/"), f"{option}.yaml")
            mark = " (default)" if choices.get(group) == option else ""
            out.append(f"| `{group}={option}`{mark} | {cell(description)} |")
    return out


def page() -> str:
    defaults = default_config()
    hints = typing.get_type_hints(Config)
    model_kinds: dict[str, list[str]] = {}
    for kind in ModelKind:
        for key in MODEL_KEYS[kind]:
            model_kinds.setdefault(key, []).append(kind.value)
    lines = [
        "# Settings",
        "",
        "Every setting of `trainer` (and `python -m trainer.plan`): its key, type, default, allowed values and "
        "meaning, generated from the schema. [Back to the README](../README.md)",
        "",
        "This page is the output of `python -m trainer.settings` (run it to see the settings of the version you "
        "have): the dataclasses of `trainer/config.py`, the comments on their fields, and the config groups of "
        "`conf/`. A default is what `trainer` with no overrides uses (the groups marked default below); a group "
        "option sets its own values for some keys (`model=small` its shape, `data=chat` its data keys). "
        "Set a key with `key=value`, pick a group option with `group=option` "
        "([configuration](configuration.md#overrides)); a key, group option or enum value that does not "
        "exist is refused before any rank starts, and so are values out of range "
        "([refusals](troubleshooting.md#refusals-checked-before-any-rank-starts)).",
        "",
        "## Config groups",
        "",
        "| option | what it sets |",
        "|---|---|",
        *group_rows(),
        "",
    ]
    nodes = [f.name for f in dataclasses.fields(Config) if f.name == "model" or node_class(hints[f.name])]
    for node in nodes:
        about = SECTIONS.get(node) or (inspect.getdoc(node_class(hints[node])) or f"the {node} settings")
        lines += [f"## {node}", "", about[0].upper() + about[1:].rstrip(".") + ".", ""]
        if node == "model":
            lines += ["Defaults are those of `model=tiny` (the default preset); in parentheses, the kinds of "
                      "model that read a key (`model=custom` passes every other key to its factory).", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        if node == "model":
            keys = [k.removeprefix("model.") for k in known_keys() if k.startswith("model.")]
            found = rows(ModelConfig, "model.", defaults["model"], keys, model_kinds)
        else:
            found = rows(node_class(hints[node]), f"{node}.", defaults.get(node) or {})
        lines += [f"| `{k}` | {cell(t)} | `{cell(d)}` | {cell(m)} |" for k, t, d, m in found]
        lines.append("")
    top = [f for f in dataclasses.fields(Config) if f.name not in nodes]
    notes = member_comments(Config)
    lines += ["## Top-level keys", "", "The launch and the run's process ([launching](launching.md), "
              "[when things go wrong](troubleshooting.md)).", "",
              "| key | type | default | meaning |", "|---|---|---|---|"]
    for f in top:
        lines.append(f"| `{f.name}` | {cell(type_name(hints[f.name]))} | `{show(defaults[f.name])}` | "
                     f"{cell(meaning(notes.get(f.name, ''), hints[f.name]))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(page())


if __name__ == "__main__":
    main()
