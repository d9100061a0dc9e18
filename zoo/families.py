"""The zoo's model families, for `lit-mesh plan` and the `lit-mesh` command (lit_mesh.planner.families): declared
as entry points in pyproject.toml (group "lit_mesh.families"), and registered whenever zoo is imported."""

from __future__ import annotations

from lit_mesh.planner.families import ModelFamily, register_family
from zoo.gpt import GPT, GPTConfig
from zoo.gpt import PRESETS as GPT_PRESETS
from zoo.moe import PRESETS as MOE_PRESETS
from zoo.moe import MoEConfig, MoETransformer

# zoo's LightningModules and DataModules (zoo/__init__.py), known to LightningCLI by short name: --model=GPTModule
CLI_MODULES = ("zoo",)

GPT_FAMILY = ModelFamily(
    name="gpt",
    config_class=GPTConfig,
    presets=GPT_PRESETS,
    build=GPT,
    flops_per_token=GPTConfig.flops_per_token,
    lightning_module="zoo.GPTModule",
    data_module="zoo.TextDataModule",
    cli_modules=CLI_MODULES,
)
MOE_FAMILY = ModelFamily(
    name="moe",
    config_class=MoEConfig,
    presets=MOE_PRESETS,
    build=MoETransformer,
    flops_per_token=MoEConfig.flops_per_token,
    lightning_module="zoo.MoEModule",
    data_module="zoo.TextDataModule",
    cli_modules=CLI_MODULES,
)

for _family in (GPT_FAMILY, MOE_FAMILY):
    register_family(_family)
