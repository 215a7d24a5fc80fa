"""bench/chaos.py --write-delay S: every process of a chaos job imports this (its dir is first on
PYTHONPATH), so that checkpoint.async's background writer holds each save's step dir unpublished
for S more seconds after a rank wrote its file. A tiny model's save is written in milliseconds, too
short for a random kill to land in; held open, a kill lands mid-write, which is the case to test:
the previous checkpoint must stay the newest, and the resume exact. Only the writer thread waits;
the training thread, saves in the step and every other process are untouched.
"""
import importlib.abc
import importlib.util
import os
import sys
import threading
import time

DELAY_S = float(os.environ.get("CHAOS_WRITE_DELAY_S") or 0)
MODULE = "trainer.checkpoint.manager"


def slowed(write_rank_file):
    def write(self, *args, **kwargs):
        outcome = write_rank_file(self, *args, **kwargs)
        if threading.current_thread().name == "checkpoint-writer":
            time.sleep(DELAY_S)
        return outcome
    return write


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the manager through the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            manager = module.CheckpointManager
            manager._write_rank_file = slowed(manager._write_rank_file)

        spec.loader.exec_module = exec_module
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, PatchOnImport())
