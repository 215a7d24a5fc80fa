"""Soak: the multi-process start/stop paths of tests/test_faults.py, again and again (not part of
`make test`; `make soak`). Prints each failure as it happens and the count at the end.

    python tests/soak.py [--launches 100]
"""
from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import test_faults as t  # noqa: E402

# (name, launches of the trainer per try, the test that tries it; each gets the reference losses)
SCENARIOS = [
    ("sigterm to one rank, then resume", 2,
     t.test_a_stop_signal_to_one_rank_stops_every_rank_with_a_checkpoint_and_resuming_is_the_run_that_never_stopped),
    ("sigterm to the launcher (zero3)", 1,
     lambda tmp, reference: t.test_sigterm_to_the_launcher_of_zero3_ranks_saves_and_exits_without_a_traceback(tmp)),
    ("kill -9 a rank, max_restarts=2", 1, functools.partial(
        t.test_a_rank_killed_mid_run_is_restarted_and_the_group_resumes_with_the_losses_of_a_run_never_killed,
        launcher="nproc")),
    ("kill -9 a rank, torchrun --max-restarts 2", 1, functools.partial(
        t.test_a_rank_killed_mid_run_is_restarted_and_the_group_resumes_with_the_losses_of_a_run_never_killed,
        launcher="torchrun")),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=100, help="trainer launches in all (each try makes 1-2)")
    args = p.parse_args()
    launches, tries, failures = 0, {name: 0 for name, _, _ in SCENARIOS}, {name: 0 for name, _, _ in SCENARIOS}
    started = time.monotonic()
    reference = t.reference_losses(Path(tempfile.mkdtemp(prefix="soak-reference-")))
    launches += 1
    while launches < args.launches:
        for name, cost, scenario in SCENARIOS:
            if launches >= args.launches:
                break
            tmp = Path(tempfile.mkdtemp(prefix="soak-"))
            try:
                scenario(tmp, reference)
            except Exception as e:
                failures[name] += 1
                print(f"FAILED {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
                traceback.print_exc(limit=2)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            tries[name] += 1
            launches += cost
            print(f"{launches} launches, {sum(failures.values())} failed tries", flush=True)
    print(f"\n{launches} launches in {time.monotonic() - started:.0f} s")
    for name, _, _ in SCENARIOS:
        print(f"  {name}: {failures[name]} failed of {tries[name]}")
    print(f"failures: {sum(failures.values())}")
    sys.exit(1 if any(failures.values()) else 0)


if __name__ == "__main__":
    main()
