"""The docs' commands run from anywhere, as the trainer does: every page whose commands name no file
of the clone (its `examples/`, `launch/`, `bench/`, `conf/` or the example modules) is run in
reading order, as tests/test_docs_in_order.py runs it, in a fresh directory outside the clone that
holds nothing of it. A new user who stands in a scratch directory with the clone's venv active gets
what the pages say; a template (`# template:`) is shown, not run."""
from __future__ import annotations

import re

import pytest

from tests.harness import REPO
from tests.test_docs_in_order import CLONE, PAGES, blocks, command_of, run_block, why_not_run

# What names the clone's own files: a path under one of its folders, or a module of examples/
NEEDS_THE_CLONE = re.compile(rf"(^|[\s=])({'|'.join(CLONE)})/|\bexamples\.")


def needs_the_clone(page: str) -> bool:
    """Whether a command of the page that runs (see NOT_RUN) names the clone's files."""
    return any(NEEDS_THE_CLONE.search(command_of(line)) and not why_not_run(line)
               for block in blocks(REPO / page) for _, line in block)


ANYWHERE = [page for page in PAGES if not needs_the_clone(page)]
BLOCKS = [(page, block) for page in ANYWHERE for block in blocks(REPO / page)]


def test_the_pages_run_from_anywhere_include_those_a_new_user_tried():
    """The pages of issue 60's walk-through need nothing of the clone (the demo is `python -m
    trainer.demo`), and a page that names the clone's files is left out here, not missed."""
    assert {"docs/checkpoints.md", "docs/strategies.md", "docs/troubleshooting.md", "docs/watching.md"} <= set(ANYWHERE)
    assert needs_the_clone("docs/launching.md") and needs_the_clone("docs/models-and-data.md")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One fresh directory outside the clone, with nothing of it, for every page in order."""
    workdir = tmp_path_factory.mktemp("scratch")
    assert REPO not in workdir.parents and not any(workdir.iterdir())
    return workdir


@pytest.mark.docs_in_order
@pytest.mark.parametrize("page,block", BLOCKS, ids=[f"{page}:{block[0][0]}" for page, block in BLOCKS])
def test_a_blocks_commands_from_a_directory_outside_the_clone(page, block, scratch):
    run_block(page, block, scratch)
