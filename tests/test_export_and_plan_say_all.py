"""What export and the planner print is the whole of what they wrote or planned:
export's line names every file of the folder it wrote, and `plan.json=true` carries the budget
line of the text plan."""
from __future__ import annotations

import json
import os

import pytest

from tests.test_first_contact import CHAT_TEMPLATE, hf_portable


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_exports_line_names_every_file_of_the_folder(hf_assets, tmp_path, adapters):
    from trainer.checkpoint.export import write_weights

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    out = tmp_path / "export"
    said = write_weights(hf_portable(hf_assets, tmp_path, template, lora_settings=adapters), out, False, tmp_path,
                         "step 3")
    files = sorted(os.listdir(out))
    assert "chat_template.jinja" in files and ("generation_config.json" in files) != adapters
    assert f"to {out}/ ({', '.join(files)}; the tokenizer with the run's data.chat_template)" in said


def test_the_json_plan_holds_the_budget_line_of_the_text_plan(capsys):
    from trainer.plan import main

    settings = ["model=tiny", "plan.world_size=2", "plan.gpu_memory_gb=24", "train.precision=bf16"]
    main(settings)
    budget = capsys.readouterr().out.splitlines()[0]
    assert budget.startswith("136,960 parameters, world size 2, 24.0 GB per GPU (plan.gpu_memory_gb), bf16 "
                             "with fp32 master weights;"), budget
    main(settings + ["plan.json=true"])
    plan = json.loads(capsys.readouterr().out)
    assert {k: plan[k] for k in ("params", "world_size", "gpu_memory_bytes", "memory_source", "precision",
                                 "master_weights")} == {
        "params": 136_960, "world_size": 2, "gpu_memory_bytes": 24 * 10 ** 9,
        "memory_source": "plan.gpu_memory_gb", "precision": "bf16", "master_weights": True}
    assert plan["flops_per_s"] == 4e14 and plan["link_gbps"] == 400 and plan["pcie_gbps"] == 256
