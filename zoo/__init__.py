"""The model zoo: plain PyTorch models that declare a `parallel_plan()`, their LightningModules and data."""

import zoo.families  # noqa: F401  (registers the zoo's model families with lit-mesh's planner and command)
from zoo.gpt import GPT, GPTConfig
from zoo.gpt import PRESETS as GPT_PRESETS
from zoo.image_data import DigitsDataModule
from zoo.modules import GPTModule, ViTModule
from zoo.moe import PRESETS as MOE_PRESETS
from zoo.moe import MoEConfig, MoETransformer
from zoo.moe_module import MoEModule
from zoo.text_data import TextDataModule
from zoo.token_data import TokenDataModule
from zoo.vit import PRESETS as VIT_PRESETS
from zoo.vit import ViT, ViTConfig

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "MOE_PRESETS",
    "VIT_PRESETS",
    "DigitsDataModule",
    "GPTConfig",
    "GPTModule",
    "MoEConfig",
    "MoEModule",
    "MoETransformer",
    "TextDataModule",
    "TokenDataModule",
    "ViT",
    "ViTConfig",
    "ViTModule",
]
