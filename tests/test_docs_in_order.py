"""Following the docs in order, as a new user does: the shell commands of every page (found as
tests/test_docs.py finds them), run one after another in one fresh directory that holds a clone's
files and no outputs yet. Each must exit 0 and none may say `nothing to do` (a page that reuses
another's output dir resumes a finished run, or refuses to convert into an existing dir).

A block is a test, run in reading order in the same directory. The whole sequence takes far
longer than a test should (dozens of trainings), so this runs the
first command of each shell block plus every command that reads what an earlier one wrote (it
names a path that exists in the directory and is not a file of the clone): the chains of
outputs between commands and pages are followed in full. What cannot run in a test at all is
listed in NOT_RUN, with why; a command left for the reader to fill in (a run dir of theirs) ends
with `# template: ...`, which the reader sees and this test skips, and a placeholder without it
fails. tests/test_docs_anywhere.py runs the pages that need nothing of the clone from outside it."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import CPU_ONLY, REPO
from tests.test_docs import shell_lines

# The order a reader follows: the README, then the pages as they build on each other.
PAGES = ["README.md", "docs/guides.md", "docs/models-and-data.md", "docs/fine-tuning.md", "docs/checkpoints.md",
         "docs/watching.md", "docs/strategies.md", "docs/launching.md", "docs/planning.md",
         "docs/troubleshooting.md", "docs/configuration.md", "docs/benchmarks.md"]
# The clone's files that the commands name (the rest of the repo is the installed package).
CLONE = ("examples", "launch", "bench", "conf")
NOT_RUN = [
    (r"\bNODE0\b|^sbatch |hydra/launcher=slurm|--hostfile", "needs a cluster"),
    (r"--nproc_per_node 8|--num_gpus 8|torchrun\.sh 8", "needs eight GPUs"),
    (r"^make |^python bench/|^bench/", "builds a venv, runs the test suites or the benchmarks"),
    (r"^pip ", "installs packages"),
    # `pkill` too: run here it would kill whatever else on the machine has the title it names
    (r"&\s*(#.*)?$|\bp?kill\b|train\.max_steps=2000", "a run made to be stopped by a signal (tests/test_faults.py)"),
    (r"hydra/sweeper=optuna", "an Optuna search: six jobs (tests/test_launchers.py)"),
    (r"model\.path=Qwen/|data\.path=HuggingFaceH4/", "downloads from the Hugging Face Hub (tests/test_first_contact.py "
                                                       "trains from a Hub cache, offline)"),
]


# A command to fill in (your own run dir, say) ends with this comment, which a reader sees; never run.
TEMPLATE = "# template:"
PLACEHOLDER = r"\.\.\.|outputs/20\d\d-"  # what a command left to fill in holds


def command_of(line: str) -> str:
    return re.split(r"\s#", line.strip(), maxsplit=1)[0]  # a comment's `...` is no placeholder


def why_not_run(line: str) -> str | None:
    if TEMPLATE in line:
        return "a template to fill in"
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command_of(line))), None)


def blocks(page: Path) -> list[list[tuple[int, str]]]:
    """A page's shell commands, (line number, line), grouped by fenced block."""
    out, last = [], None
    for n, line in shell_lines(page):
        if last is None or not page_lines_between_are_code(page, last, n):
            out.append([])
        out[-1].append((n, line))
        last = n
    return out


def page_lines_between_are_code(page: Path, a: int, b: int) -> bool:
    lines = page.read_text().splitlines()[a:b - 1]
    return not any(re.match(r"^\s*(```+|~~~+)", line) for line in lines)


def reads_output(line: str, workdir: Path) -> bool:
    """Whether the command names a path that an earlier command wrote (not a file of the clone)."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return False
    for token in tokens:
        for part in token.split("=", 1)[-1:] + [token]:
            path = part.split("/", 1)[0]
            if path and path not in CLONE and path not in (".", "..") and (workdir / path).exists():
                return True
    return False


def run(line: str, workdir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **CPU_ONLY, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TRAINER_RUN_DIR", None)
    return subprocess.run(["bash", "-c", line], cwd=workdir, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """One fresh directory for every page, in order: a clone's files and no outputs yet."""
    workdir = tmp_path_factory.mktemp("clone")
    for name in CLONE:
        (workdir / name).symlink_to(REPO / name)
    return workdir


BLOCKS = [(page, block) for page in PAGES for block in blocks(REPO / page)]


@pytest.mark.docs_in_order
@pytest.mark.parametrize("page,block", BLOCKS, ids=[f"{page}:{block[0][0]}" for page, block in BLOCKS])
def test_a_blocks_commands_after_those_before_it(page, block, clone):
    """The blocks in reading order, in the same directory: a block a test, each its own time."""
    run_block(page, block, clone)


def run_block(page: str, block: list[tuple[int, str]], workdir: Path) -> None:
    """A block's first command, and those that read what an earlier one wrote, run in `workdir`:
    each must exit 0 without `nothing to do`."""
    ran, left_out, failures = [], [], []
    first = True
    for n, line in block:
        where = f"{page}:{n}"
        why = why_not_run(line)
        if why:
            left_out.append(f"{where}: {why}")
            continue
        if not (first or reads_output(line, workdir)):
            continue
        first = False
        started = time.monotonic()
        result = run(line, workdir)
        ran.append(f"{where} ({time.monotonic() - started:.0f} s)")
        said = result.stdout + result.stderr
        if result.returncode != 0 or "nothing to do" in said:
            failures.append(f"{where}: {line.strip()}\n  exit {result.returncode}: {said.strip()[-1500:]}")
    print(f"\nran {', '.join(ran) or 'nothing'}; left out: {'; '.join(left_out) or 'nothing'}", flush=True)
    assert not failures, "\n".join(failures)


def test_every_command_left_to_fill_in_is_marked_a_template():
    """A placeholder (`...`, a dated run dir) in a command that is not marked `# template:` reads as a
    command, and fails as one (`'...' is not an override`)."""
    unmarked = [f"{page}:{n}: {line.strip()}" for page in PAGES for block in blocks(REPO / page) for n, line in block
                if re.search(PLACEHOLDER, command_of(line)) and TEMPLATE not in line]
    assert not unmarked, "write them as commands that run, or end them with `# template: ...`:\n" + "\n".join(unmarked)
