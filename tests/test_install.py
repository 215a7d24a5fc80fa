"""The installed package: the wheel, installed into a fresh environment, trains, plans and exports from
a directory with no clone in sight; a DeepSpeed older than pyproject.toml's minimum is refused naming
the version it needs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, records
from trainer.errors import ConfigError


@pytest.mark.slow
def test_the_wheel_trains_plans_and_exports_from_another_directory(tmp_path):
    """`pip wheel .`, installed into a fresh venv (its dependencies lent by this one through a
    .pth file, so nothing is downloaded), then run from a directory with no conf/ in sight."""
    import sysconfig

    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = wheels.glob("strategy_trainer-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "lent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                                str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": ""}
    where = subprocess.run([str(python), "-c", "import trainer, trainer.conf; print(trainer.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env)
    assert where.stdout.startswith(purelib), where.stdout + where.stderr  # the wheel, not this checkout
    trained = subprocess.run([str(venv / "bin" / "trainer"), "train.max_steps=2", "checkpoint.dir=ckpt",
                              "checkpoint.every_steps=2", "hydra.run.dir=run"], capture_output=True, text=True,
                             cwd=elsewhere, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert len(records(elsewhere / "run")) == 1
    planned = subprocess.run([str(python), "-m", "trainer.plan", "model=gpt_1b"], capture_output=True, text=True,
                             cwd=elsewhere, env=env)
    assert planned.returncode == 0 and "<- chosen" in planned.stdout, planned.stderr[-2000:]
    exported = subprocess.run([str(python), "-m", "trainer.export", "ckpt", "w.safetensors"], capture_output=True,
                              text=True, cwd=elsewhere, env=env)
    assert exported.returncode == 0 and (elsewhere / "w.safetensors").is_file(), exported.stderr[-2000:]


def test_an_old_deepspeed_is_refused_with_the_version_it_needs():
    from trainer.strategies import MIN_DEEPSPEED, check_deepspeed_version

    with pytest.raises(ConfigError, match=f"DeepSpeed 0.17.0 is installed.*>= {MIN_DEEPSPEED}"):
        check_deepspeed_version("0.17.0")
    check_deepspeed_version(MIN_DEEPSPEED)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"deepspeed>={MIN_DEEPSPEED},' in pyproject
