"""`ps` tells a rank from its data loader workers: a worker, forked from its rank, takes a title of
its own (`trainer loader worker W of rank R/N: ...`), so a kill meant for the rank, found by the
rank's title (`trainer rank R/N: ...`), finds the rank alone."""
from __future__ import annotations

import os
from pathlib import Path

import setproctitle
import torch
from torch.utils.data import Dataset

from trainer.data.stream import BatchStream


class TitleOfTheReader(Dataset):
    """Rows of zeros; each read writes the title of the process that reads it to `out`/<pid>."""

    def __init__(self, out: Path):
        self.out = out

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        (self.out / str(os.getpid())).write_text(setproctitle.getproctitle())
        return torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)


def test_a_ranks_loader_worker_has_a_title_of_its_own(tmp_path):
    rank_title = "trainer rank 1/2: python -m trainer nproc=2"
    before = setproctitle.getproctitle()
    setproctitle.setproctitle(rank_title)  # as distributed.init names a rank
    try:
        stream = BatchStream(TitleOfTheReader(tmp_path), 2, 1, 0, 1, seed=0, num_workers=1)
        stream.next_step()
        stream.close()
    finally:
        setproctitle.setproctitle(before)
    titles = {int(f.name): f.read_text() for f in tmp_path.iterdir()}
    assert os.getpid() not in titles, "read in the worker, not the rank"
    assert list(titles.values()) == ["trainer loader worker 0 of rank 1/2: python -m trainer nproc=2"], titles
