"""trainer/patches.py, the one home of replaced third-party internals: each still has the signature
it was checked against, and what the replacements do. DeepSpeed's op builds are said, and a load
never waits on a build lock whose holder is dead (a run killed while it built an op left every
later zero run hanging, silently). The op-build tests use a stand-in op of one C++ file (a few
seconds to build) in their own TORCH_EXTENSIONS_DIR, never the venv's built ops."""
from __future__ import annotations

import inspect
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import CPU_ONLY, REPO, records, run_cli
from trainer import patches


@pytest.mark.parametrize("internal", patches.REPLACED, ids=lambda internal: f"{internal.owner}.{internal.name}")
def test_each_replaced_internal_has_the_signature_it_was_checked_against(internal):
    pytest.importorskip(internal.owner.partition(":")[0].split(".")[0])  # transformers: an extra
    assert str(inspect.signature(internal.library_function())) == internal.signature, \
        f"{internal.owner} {internal.name} changed since {internal.checked}: check its replacement in trainer/patches.py"


@pytest.fixture
def torch_loader():
    """torch's loader functions put back after a test that installs the op-build replacements."""
    import torch.utils.cpp_extension as extensions

    own = {internal: getattr(extensions, internal.name) for internal in (patches.RUN_NINJA_BUILD, patches.JIT_COMPILE)}
    yield extensions
    for internal, function in own.items():
        setattr(extensions, internal.name, function)


def test_a_deepspeed_op_build_is_announced_when_ninja_has_work_to_do(tmp_path, torch_loader):
    """A build with work to do is said (once per build), one with nothing to do is silent. A
    stand-in build of one file."""
    if not shutil.which("ninja"):
        pytest.skip("no ninja here")
    build = tmp_path / "stand_in_op"
    build.mkdir()
    (build / "build.ninja").write_text("rule touch\n  command = touch $out\nbuild stand_in_op.so: touch\n")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainer").addHandler(handler)
    try:
        patches.watch_op_builds()
        patches.watch_op_builds()  # once installed, not twice
        torch_loader._run_ninja_build(str(build), False, "stand-in")
        assert (build / "stand_in_op.so").exists()
        assert said == [f"building DeepSpeed's op stand_in_op for this environment (once: about a minute; cached in "
                        f"{build})"]
        torch_loader._run_ninja_build(str(build), False, "stand-in")  # built: nothing to say
        assert len(said) == 1
    finally:
        logging.getLogger("trainer").removeHandler(handler)


LOAD_STAND_IN = """import sys, torch.utils.cpp_extension as extensions
from trainer.patches import watch_op_builds
watch_op_builds()
extensions.load(name="stand_in", sources=[sys.argv[1]], is_standalone=True, is_python_module=False)"""


def load_stand_in(extensions_dir: Path, stderr=subprocess.PIPE) -> subprocess.Popen:
    source = extensions_dir.parent / "stand_in.cpp"
    source.write_text("int main() { return 0; }\n")
    return subprocess.Popen([sys.executable, "-c", LOAD_STAND_IN, str(source)], cwd=REPO, text=True,
                            stderr=stderr, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir)})


def loaded(load: subprocess.Popen) -> str:
    """The stderr of a load that finishes: torch's own loader waits on a stale lock forever, so
    here a load still waiting after two minutes (a build takes seconds) fails the test."""
    try:
        _, err = load.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        load.kill()
        pytest.fail("the load still waits on the op's build lock after 120 s")
    assert load.returncode == 0, err
    return err or ""


@pytest.fixture
def stand_in(tmp_path) -> Path:
    """The build dir of a stand-in op, built once."""
    extensions = tmp_path / "torch_extensions"
    loaded(load_stand_in(extensions))
    return extensions / "stand_in"


def test_a_lock_left_by_a_killed_build_is_removed_with_a_line_and_the_op_builds_again(stand_in):
    """What a kill -9 during ninja leaves: torch's lock, and ninja's log and deps cut short."""
    (stand_in / "lock").touch()
    (stand_in / ".ninja_log").write_text((stand_in / ".ninja_log").read_text()[:30])
    (stand_in / ".ninja_deps").unlink()
    (stand_in / "stand_in").unlink()
    err = loaded(load_stand_in(stand_in.parent))
    assert f"removed {stand_in / 'lock'}, left by a killed build: no live process holds it" in err
    assert not (stand_in / "lock").exists()
    assert subprocess.run([stand_in / "stand_in"]).returncode == 0  # built again, and usable


HOLD = {  # a process in the middle of a build: holding torch's lock, inside the trainer or not
    "trainer": """import sys
from torch.utils.file_baton import FileBaton
from trainer.patches import op_build_lock
with op_build_lock(sys.argv[1]):
    assert FileBaton(sys.argv[1] + "/lock").try_acquire()
    print("held", flush=True)
    sys.stdin.read()""",
    "another program": """import sys
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1] + "/lock").try_acquire()
print("held", flush=True)
sys.stdin.read()""",
}


@pytest.mark.parametrize("holder", [h if h == "trainer" else pytest.param(h, marks=pytest.mark.slow) for h in HOLD])
def test_a_load_waits_for_a_live_holder_naming_it_and_goes_on_when_it_is_killed(stand_in, tmp_path, holder):
    hold = subprocess.Popen([sys.executable, "-c", HOLD[holder], str(stand_in)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert hold.stdout.readline() == "held\n"
    said = tmp_path / "load.err"
    with said.open("w") as err:
        load = load_stand_in(stand_in.parent, stderr=err)
        deadline = time.monotonic() + 60
        while f"waiting for {stand_in / 'lock'}: pid {hold.pid} " not in said.read_text():
            assert time.monotonic() < deadline, f"no line names the holder: {said.read_text()!r}"
            assert load.poll() is None, f"the load went on while pid {hold.pid} held the lock: {said.read_text()!r}"
            time.sleep(0.2)
        hold.kill()  # dies holding torch's lock, as a build killed by the OOM killer or a scheduler
        hold.wait()
        loaded(load)
    assert f"removed {stand_in / 'lock'}, left by a killed build" in said.read_text()
    assert subprocess.run([stand_in / "stand_in"]).returncode == 0


def test_a_zero_run_finds_the_lock_a_killed_build_of_deepspeeds_op_left_and_goes_on(tmp_path):
    """A job killed -9 while ninja built DeepSpeed's shared-memory op leaves torch's lock; the
    next zero run clears it with a line and loads the op. The op's build as the setup left it,
    copied into a fresh op cache of the test's own, with a lock nobody holds: what a killed build
    leaves of the compile itself (ninja's log and deps cut short) is the stand-in tests' part."""
    import trainer.distributed  # noqa: F401  (TORCH_EXTENSIONS_DIR: the venv's op cache unless set)

    built = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    assert (built / "deepspeed_shm_comm.so").exists(), f"no {built}: `make setup` builds it"
    extensions = tmp_path / "torch_extensions"
    shutil.copytree(built, extensions / "deepspeed_shm_comm")  # with the files' times: nothing for ninja to do
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.touch()
    run = ["strategy=zero2", "nproc=1", "model=tiny", "train.max_steps=1", "logger=jsonl"]
    next_run = run_cli(*run, f"hydra.run.dir={tmp_path / 'next'}", env={**CPU_ONLY, "TORCH_EXTENSIONS_DIR": str(extensions)},
                       timeout=240)
    assert next_run.returncode == 0, next_run.stdout + next_run.stderr
    assert f"removed {lock}, left by a killed build" in next_run.stdout + next_run.stderr
    assert [r["step"] for r in records(tmp_path / "next")] == [1]
