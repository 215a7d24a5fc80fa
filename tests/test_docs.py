"""The docs (README.md and docs/*.md) say what runs: every relative link leads to a file (and a
heading, when it names one), and every command in a fenced shell block that runs the trainer
(`trainer ...`, `python -m trainer ...`, under torchrun, accelerate, deepspeed, sbatch, or
`make train ARGS=...`) has overrides that the trainer accepts: the same override check, Hydra
composition, typed config and validation as `trainer` runs before any rank starts, in this
process. Checks that need files the commands make (a model folder, a checkpoint) are left out."""
from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import open_dict

# What `trainer` itself calls before any rank starts (trainer/__main__.py), wherever they live.
from trainer.__main__ import CONFIG_MODULE, ConfigError, check_overrides, register_configs, to_config
from trainer.checks import validate  # check_before_work's, through check_settings

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console", "zsh"}
LAUNCHERS = {"torchrun", "accelerate", "deepspeed"}  # their own options first, then `-m/--module trainer ...`
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
HYDRA_FLAGS = {"-m", "--multirun", "--resolve"}
PATH_PREFIXES = ("launch/", "bench/", "examples/", "conf/", "tests/", "trainer/", "docs/")
# Companion commands with an argument parser of their own (`parser()`), which parses each documented one.
PARSED_MODULES = ("trainer.convert", "trainer.export", "trainer.metrics", "trainer.verify")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---------------------------------------------------------------- commands in fenced shell blocks

@dataclass
class Command:
    where: str  # page:line
    text: str
    tokens: list[str]


def shell_lines(page: Path):
    """(line number, line) of the fenced shell blocks of a page, continuation lines joined."""
    fence, pending, start = None, "", 0
    for n, line in enumerate(page.read_text().splitlines(), 1):
        mark = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if mark and (fence is None or mark.group(1) == fence[0]):
            fence = None if fence else (mark.group(1), mark.group(2).lower())
            continue
        if fence is None or fence[1] not in SHELL_FENCES:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def split_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at ; && || | &), comments dropped, quotes removed."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split, lex.commenters = True, "#"
    commands, current = [], []
    for token in lex:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def collect() -> list[Command]:
    out = []
    for page in PAGES:
        for n, line in shell_lines(page):
            for tokens in split_commands(line):
                while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value cmd
                    tokens = tokens[1:]
                if tokens:
                    out.append(Command(f"{rel(page)}:{n}", line.strip(), tokens))
    return out


COMMANDS = collect()


def mentions_trainer(tokens: list[str]) -> bool:
    return any(t == "trainer" or t.endswith("/trainer") or t.startswith("trainer.") or t.startswith("ARGS=")
               for t in tokens)


def after_module(tokens: list[str], module: str = "trainer") -> list[str] | None:
    """The arguments after `-m MODULE` / `--module MODULE`, or None."""
    for i, t in enumerate(tokens[:-1]):
        if t in ("-m", "--module") and tokens[i + 1] == module:
            return tokens[i + 2:]
    return None


def classify(tokens: list[str]) -> tuple[str, list[str]]:
    """What a command is: ("train", overrides), ("plan", overrides), ("module", [name, *args]),
    ("script", [path]), ("make", [target]), or ("other", [])."""
    prog, name = tokens[0], Path(tokens[0]).name
    if name == "trainer":
        return "train", tokens[1:]
    if re.fullmatch(r"python[0-9.]*", name):
        if len(tokens) > 2 and tokens[1] == "-m":
            module = tokens[2]
            if module == "trainer":
                return "train", tokens[3:]
            if module == "trainer.plan":
                return "plan", tokens[3:]
            return "module", tokens[2:]
        return ("script", [tokens[1]]) if len(tokens) > 1 else ("other", [])
    if name in LAUNCHERS:
        args = after_module(tokens)
        return ("train", args) if args is not None else ("other", [])
    if prog.endswith("torchrun.sh"):
        return "train", tokens[2:]  # launch/torchrun.sh NPROC overrides...
    if name == "sbatch":
        script = next((i for i, t in enumerate(tokens) if t.endswith(".sbatch")), None)
        return ("train", tokens[script + 1:]) if script is not None else ("other", [])
    if name == "make":
        args = next((t.split("=", 1)[1] for t in tokens if t.startswith("ARGS=")), None)
        target = tokens[1] if len(tokens) > 1 and "=" not in tokens[1] else ""
        if target == "train" and args is not None:
            return "train", shlex.split(args)
        return "make", [target]
    return "other", []


def override_sets(args: list[str]) -> list[list[str]]:
    """The overrides of a command line: Hydra's flags taken out, `...` placeholders dropped, and a
    sweep (-m a=x,y b=z,w) expanded into each of its jobs."""
    overrides, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in HYDRA_FLAGS_WITH_VALUE:
            skip = True
        elif a in ("--config-dir", "-cd"):  # the user's config groups: searched as Hydra does
            overrides.append(f"hydra.searchpath=[file://{REPO / args[args.index(a) + 1]}]")
            skip = True
        elif a in HYDRA_FLAGS or a == "...":
            continue
        elif a.startswith("-"):
            raise AssertionError(f"a flag the docs test does not know: {a}")
        else:
            overrides.append(a)
    choices = []
    for o in overrides:
        key, _, value = o.partition("=")
        simple = not any(c in value for c in "[](){}$'\"")
        choices.append([f"{key}={v}" for v in value.split(",")] if simple and "," in value else [o])
    return [list(c) for c in itertools.product(*choices)]


def check_overrides_compose(overrides: list[str], plan: bool = False) -> None:
    """What `trainer OVERRIDES` checks before any rank starts and needs no file for (plan: what
    `python -m trainer.plan` checks). Raises ConfigError or Hydra's error."""
    check_overrides(overrides)
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)  # hydra/* groups too
    with open_dict(cfg):
        del cfg["hydra"]
    typed = to_config(cfg)
    if not plan:  # the planner also reads shape-only models, which training refuses
        validate(typed)


def parse_module_command(module: str, args: list[str]):
    """`python -m MODULE ARGS` as the module's own parser reads it; SystemExit(2) where it refuses."""
    return importlib.import_module(module).parser().parse_args(args)


def check_paths(tokens: list[str]) -> None:
    for t in tokens:
        path = t.split("=", 1)[-1]
        if path.startswith(PATH_PREFIXES) and not any(c in path for c in "*<>"):
            assert (REPO / path).exists(), f"{path}: no such file in the repo"


@pytest.fixture(scope="module", autouse=True)
def schema():
    register_configs()


def test_the_docs_have_trainer_commands_and_each_is_understood():
    """The parser below finds the commands (a parser that found none would pass everything), and
    no command that mentions the trainer is left unclassified."""
    kinds = [classify(c.tokens)[0] for c in COMMANDS]
    assert kinds.count("train") >= 40 and kinds.count("plan") >= 3, kinds
    unknown = [c.where + ": " + c.text for c, k in zip(COMMANDS, kinds) if k == "other" and mentions_trainer(c.tokens)]
    assert not unknown, "commands that run the trainer in a way this test does not know:\n" + "\n".join(unknown)
    pages_with_commands = {c.where.split(":")[0] for c, k in zip(COMMANDS, kinds) if k in ("train", "plan")}
    assert {"README.md", "docs/launching.md", "docs/checkpoints.md"} <= pages_with_commands
    modules = {classify(c.tokens)[1][0] for c, k in zip(COMMANDS, kinds) if k == "module"}
    assert set(PARSED_MODULES) <= modules, modules  # each parser below has documented commands to read


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command(command):
    kind, args = classify(command.tokens)
    check_paths(command.tokens)
    if kind in ("train", "plan"):
        for overrides in override_sets(args):
            try:
                check_overrides_compose(overrides, plan=kind == "plan")
            except Exception as e:  # ConfigError, or Hydra's own for a bad hydra/* override
                pytest.fail(f"{command.where}: {command.text}\n  overrides {overrides}: {type(e).__name__}: {e}")
    elif kind == "module":
        assert importlib.util.find_spec(args[0]) is not None, f"{command.where}: no module {args[0]}"
        if args[0] in PARSED_MODULES:
            try:
                parse_module_command(args[0], args[1:])
            except SystemExit as e:  # argparse's refusal (its message is on stderr)
                pytest.fail(f"{command.where}: {command.text}\n  {args[0]} refuses its arguments (exit {e.code})")
    elif kind == "script":
        assert (REPO / args[0]).is_file(), f"{command.where}: no script {args[0]}"
    elif kind == "make":
        makefile = (REPO / "Makefile").read_text()
        assert re.search(rf"^{re.escape(args[0])}:", makefile, re.M), f"{command.where}: no make target {args[0]!r}"


def unquoted_brackets(line: str) -> bool:
    """Whether a shell line has a `[` outside quotes (before its comment): zsh takes it for a file
    pattern and stops with `no matches found`."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return False
        elif c == "[":
            return True
    return False


def test_brackets_are_quoted_for_zsh():
    assert unquoted_brackets("trainer strategy.wrap=[ToyBlock]") and not unquoted_brackets("trainer 'a=[b]'  # c=[d]")
    found = [f"{c.where}: {c.text}" for c in COMMANDS if unquoted_brackets(c.text)]
    assert not found, "quote overrides with [...] ('key=[a,b]'), as zsh needs:\n" + "\n".join(sorted(set(found)))


@pytest.mark.parametrize("line", [
    "trainer strategy=zero4",  # no such group option
    "trainer train.precision=fp8",  # outside the enum
    "trainer trian.max_steps=10",  # no such key
    "trainer train.max_steps=-1",  # refused by validate
    "trainer nproc=2 strategy=ddp strategy.offload_optimizer=true",
    "torchrun --standalone --nproc_per_node 8 -m trainer model=llama2_7b",  # shape-only: plan only
    "trainer -m strategy=ddp,zero9 nproc=2",  # one job of a sweep
    "trainer -m hydra/sweeper=optuna_lrx",  # Hydra's own group
    'make train ARGS="nproc=2 strategy.shard=FULL_SHARD"',
])
def test_a_wrong_command_fails_the_check(line):
    """The check above can fail: commands a doc must not show are refused."""
    (tokens,) = split_commands(line)
    kind, args = classify(tokens)
    assert kind == "train"
    with pytest.raises(Exception) as e:  # noqa: B017 (ConfigError, or Hydra's errors for hydra/* groups)
        for overrides in override_sets(args):
            check_overrides_compose(overrides)
    assert e.type is ConfigError or "hydra" in type(e.value).__module__, e.value


@pytest.mark.parametrize("line", [
    "python -m trainer.convert ckpt out --to onnx",  # no such format
    "python -m trainer.convert ckpt out",  # --to is required
    "python -m trainer.convert ckpt --to dcp",  # no destination
    "python -m trainer.export ckpt",  # no OUT
    "python -m trainer.export ckpt out --merged",  # no such flag
    "python -m trainer.metrics",  # no run dir
    "python -m trainer.verify",  # no checkpoint dir
    "python -m trainer.metrics run-a run-b",  # one run dir
])
def test_a_wrong_companion_command_fails_to_parse(line):
    """The module parsers above can fail: commands a doc must not show are refused."""
    (tokens,) = split_commands(line)
    kind, args = classify(tokens)
    assert kind == "module" and args[0] in PARSED_MODULES
    with pytest.raises(SystemExit) as e:
        parse_module_command(args[0], args[1:])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------- links

def without_code_blocks(text: str) -> str:
    return re.sub(r"^\s*(```+|~~~+).*?^\s*\1\s*$", "", text, flags=re.M | re.S)


def without_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", without_code_blocks(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_code(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(page)}:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme_and_links_back():
    readme_links = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    for page in PAGES[1:]:
        assert page.resolve() in readme_links, f"README.md does not link to {rel(page)}"
        head = page.read_text().split("\n\n", 2)
        assert head[0].startswith("# ") and "](../README.md)" in head[1], \
            f"{rel(page)}: a title, then a one-line summary with a link back to the README"


def test_the_code_cites_sections_of_the_design_page():
    """A comment's `docs/design.md, <Section>` names a heading of docs/design.md, and nothing cites a
    design file outside the repository by section number."""
    headings = set(re.findall(r"^## (.+)$", (REPO / "docs" / "design.md").read_text(), re.M))
    cited, unknown, outside = 0, [], []
    for path in sorted(p for d in ("trainer", "tests", "conf", "bench") for p in (REPO / d).rglob("*.*")
                       if p.suffix in {".py", ".yaml"}):
        text = path.read_text()
        outside += [rel(path)] * ("DESIGN \N{SECTION SIGN}" in text)
        for names in re.findall(r"docs/design\.md[,:] ((?:[A-Z][\w' -]*?(?:, )?)+)(?=[)\].;]|$)", text, re.M):
            cited += 1
            unknown += [f"{rel(path)}: {name}" for name in names.split(", ") if name not in headings]
    assert cited >= 20 and not unknown and not outside, (cited, unknown, outside)


def test_the_readme_names_the_test_commands():
    """CI (.ci/run) runs `make lint`, then the README's test command, `make test-all`."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Test command", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^```bash\nmake test-all\n```$", section, re.M), section
    assert "`make test`" in section and "`make lint`" in section
    ci = (REPO / ".ci" / "run").read_text()
    assert "make lint" in ci and "make test-all" in ci


def unsupported(readme: str) -> list[str]:
    """What the README's scope line says is not supported, one phrase each: "tensor, pipeline and
    expert parallelism" is three (tensor parallelism, ...); parentheses are left out."""
    line = " ".join(readme.split("Not supported yet:", 1)[1].split("[Every setting]", 1)[0].split())
    line = re.sub(r"\s*\([^)]*\)", "", line).rstrip(". ")
    phrases = []
    for run in re.split(r",\s*", line):
        found = re.fullmatch(r"(.+) and ([\w/-]+) parallelism", run)
        phrases += run.split(" and ") if found is None else [f"{w} parallelism" for w in found.group(1).split("/")
                                                              + [found.group(2)]]
    last = max((i for i, p in enumerate(phrases) if p.endswith(" parallelism")), default=-1)
    # "tensor" of "tensor, pipeline and expert parallelism": one word before the run's end
    return [f"{p} parallelism" if i < last and " " not in p else p for i, p in enumerate(phrases)]


def test_the_scope_line_names_nothing_the_settings_offer_as_unsupported():
    """Issue 40: the README said sequence parallelism was not supported after strategy.sp had shipped.
    Each thing its "Not supported yet" list names must be absent from the settings reference."""
    settings = (REPO / "docs" / "settings.md").read_text().lower()
    named = unsupported((REPO / "README.md").read_text())
    assert "pipeline parallelism" in named and "fp8" in [n.lower() for n in named], named
    offered = [n for n in named if n.lower() in settings]
    assert offered == [], f"README.md's scope line says {offered} are not supported; docs/settings.md offers them"
    old = "Not supported yet: tensor, pipeline, sequence/context and expert parallelism, FP8. [Every setting]"
    assert "sequence parallelism" in unsupported(old) and "sequence parallelism" in settings  # the rule bites
