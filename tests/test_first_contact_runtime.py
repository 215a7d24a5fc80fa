"""What a newcomer meets first at the command line: refusals in one line (Hydra's grammar, a missing Hydra
plugin), `python -m trainer.metrics` of a missing path and into a closed pipe, the sweep table's
units."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import REPO


def refusal(monkeypatch, capsys, *args: str) -> str:
    """`trainer ARGS` run in this process up to its refusal: the one line it printed (exit 2)."""
    from trainer.__main__ import main

    monkeypatch.setattr(sys, "argv", ["trainer", *args])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


def test_an_override_out_of_hydras_grammar_is_refused_in_one_line(monkeypatch, capsys):
    said = refusal(monkeypatch, capsys, "model=tiny", "...")  # a placeholder left in a copied command
    assert said.startswith("trainer: error: '...' is not an override (KEY=VALUE in Hydra's grammar"), said
    said = refusal(monkeypatch, capsys, "-m", "strategy.wrap=[Block")
    assert "'strategy.wrap=[Block' is not an override" in said, said


def test_a_missing_hydra_plugin_is_refused_naming_the_extra_that_installs_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hydra_plugins.hydra_optuna_sweeper", None)  # not installed
    said = refusal(monkeypatch, capsys, "-m", "hydra/sweeper=optuna_lr")
    assert said == ("trainer: error: hydra/sweeper=optuna_lr: needs the Hydra plugin hydra-optuna-sweeper, from the "
                    "'sweep' extra: pip install 'strategy-trainer[sweep]'")


def metrics_cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.metrics", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_trainer_metrics_says_a_missing_path_is_missing_and_stops_quietly_when_its_reader_does(tmp_path):
    missing = metrics_cli(str(tmp_path / "no-such-run"))
    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 2
    assert err == f"trainer.metrics: error: {tmp_path / 'no-such-run'} does not exist: give a run dir that holds " \
                  "metrics.jsonl, or the file\n"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(1, 50001)))
    head = metrics_cli(str(tmp_path))  # `| head -1`: the reader goes away after one line
    assert json.loads(head.stdout.readline()) == {"step": 1, "loss": 1.0}
    head.stdout.close()
    err = head.stderr.read()
    assert head.wait(timeout=60) == 0 and "BrokenPipeError" not in err, err


def test_the_sweep_tables_megabytes_are_the_recorded_bytes_over_a_million(tmp_path):
    from trainer.sweep import summary_table

    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.001\n")
    step = {"step": 1, "loss": 2.0, "tokens_per_s": 100.0, "mem": {"params": 2_500_000, "grads": 1_250_000,
                                                                    "optim": 5_000_000, "peak": None}}
    (job / "metrics.jsonl").write_text(json.dumps(step) + "\n" + json.dumps({"event": "end", "step": 1}) + "\n")
    header, row = summary_table(tmp_path).splitlines()
    assert "params MB" in header and "(what rank 0 holds; 1 MB = 10^6 bytes)" in header, header
    assert row.split()[-3:] == ["2.50", "1.25", "5.00"], row


def test_builds_run_the_environments_own_ninja_whatever_path_says():
    import os
    import sysconfig
    from pathlib import Path

    from trainer.distributed import environment_ninja_first

    scripts = sysconfig.get_path("scripts")
    if not (Path(scripts) / "ninja").is_file():
        pytest.skip("no ninja in this environment (DeepSpeed installs one)")
    env = {"PATH": os.pathsep.join(["/usr/bin", "/bin"])}  # the venv's python run by path: its bin/ not on PATH
    environment_ninja_first(env)
    assert env["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"]
    environment_ninja_first(env)  # once
    assert env["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"]


SETUP_BUILD = """import sys, torch.utils.cpp_extension as extensions
import trainer.distributed
extensions.load(name="stand_in", sources=[sys.argv[1]], is_standalone=True, is_python_module=False)"""


def test_the_setups_op_builds_are_the_ones_a_run_in_the_activated_environment_uses(tmp_path):
    """`make test`'s setup builds DeepSpeed's ops with the venv's python (its bin/ not on PATH); a
    later run in the activated venv must find nothing to do: one ninja for both. A stand-in op of
    one C++ file, built through torch's loader as DeepSpeed's builders do (seconds, not a minute)."""
    import os
    import sysconfig
    from pathlib import Path

    scripts = sysconfig.get_path("scripts")
    if not (Path(scripts) / "ninja").is_file():
        pytest.skip("no ninja in this environment (DeepSpeed installs one)")
    source = tmp_path / "stand_in.cpp"
    source.write_text("int main() { return 0; }\n")
    extensions = tmp_path / "torch_extensions"
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != scripts)
    setup = subprocess.run([sys.executable, "-c", SETUP_BUILD, str(source)], cwd=REPO, capture_output=True,
                           text=True, env={**os.environ, "PATH": path, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert setup.returncode == 0, setup.stderr[-3000:]
    activated = subprocess.run(["ninja", "-n", "-d", "explain", "-C", str(extensions / "stand_in")],
                               capture_output=True, text=True, env={**os.environ, "PATH": scripts + os.pathsep + path})
    assert "no work to do" in activated.stdout, activated.stdout + activated.stderr


