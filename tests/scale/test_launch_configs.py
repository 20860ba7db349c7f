"""The shipped Accelerate launch configs load in Accelerate, are not mistaken for training recipes,
and document how to launch them on one machine and on several."""

from __future__ import annotations

import pytest

from drafttrain.config import RECIPES_DIR

LAUNCH_DIR = RECIPES_DIR / "accelerate"
CONFIGS = sorted(p.name for p in LAUNCH_DIR.glob("*.yaml"))


def test_every_engine_has_a_config():
    assert {"ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_in_accelerate_and_documents_launch(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(LAUNCH_DIR / name))
    assert cfg.distributed_type.value in ("MULTI_GPU", "DEEPSPEED", "FSDP")
    if cfg.distributed_type.value == "DEEPSPEED":
        assert cfg.deepspeed_config["zero_stage"] == int(name.split("zero")[1][0])
    header = "\n".join(ln for ln in (LAUNCH_DIR / name).read_text().splitlines() if ln.startswith("#"))
    assert f"accelerate launch --config_file recipes/accelerate/{name}" in header
    assert "drafttrain/train.py recipe=eagle" in header
    for flag in ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port"):
        assert flag in header, f"{name}: multi-node flag {flag} not documented"
    assert "target" in header.lower()  # says what happens to the frozen target


def test_launch_configs_are_not_training_recipes(capsys):
    """`drafttrain recipes` and the every-recipe-loads test only see recipes/*.yaml, not this subfolder."""
    from drafttrain.cli import main

    assert main(["recipes"]) == 0
    listed = {ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert "eagle" in listed
    assert not listed & {name.removesuffix(".yaml") for name in CONFIGS}
