"""Local ranks on the CPU are forked from one rank server (distributed.start_rank_server): they start
with its imports made, and with the launching process's environment as it is at each launch."""
from __future__ import annotations

import os
import sys

from tests.harness import on_ranks

CHANGED = "TRAINER_TEST_CHANGED_AFTER_THE_SERVER_STARTED"
REMOVED = "TRAINER_TEST_REMOVED_AFTER_THE_SERVER_STARTED"


def what_a_rank_finds(env) -> dict:
    return {"parent": os.getppid(), "imported": "transformers.modeling_utils" in sys.modules,
            "changed": os.environ.get(CHANGED), "removed": os.environ.get(REMOVED),
            "rank": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]), "env_rank": env.rank}


def test_ranks_are_forked_from_one_server_with_its_imports_and_the_launchers_environment_now(monkeypatch):
    monkeypatch.setenv(CHANGED, "before")
    monkeypatch.setenv(REMOVED, "there")
    on_ranks(2, what_a_rank_finds)  # the server, if this test process had none, starts with these
    monkeypatch.setenv(CHANGED, "after")
    monkeypatch.delenv(REMOVED)
    found = on_ranks(2, what_a_rank_finds)
    assert {r["parent"] for r in found.values()} != {os.getpid()} and len({r["parent"] for r in found.values()}) == 1
    assert all(r["imported"] for r in found.values())  # tests.harness.RANK_MODULES, imported by the server
    assert [(r["changed"], r["removed"]) for r in found.values()] == [("after", None)] * 2
    assert [(r["rank"], r["env_rank"]) for r in found.values()] == [(("0", "0", "2"), 0), (("1", "1", "2"), 1)]
