"""The model zoo: plain PyTorch models that declare a `parallel_plan()`, their LightningModules and data."""

from zoo.gpt import GPT, GPTConfig
from zoo.gpt import PRESETS as GPT_PRESETS
from zoo.image_data import DigitsDataModule
from zoo.modules import GPTModule, ViTModule
from zoo.text_data import TextDataModule
from zoo.vit import PRESETS as VIT_PRESETS
from zoo.vit import ViT, ViTConfig

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "VIT_PRESETS",
    "DigitsDataModule",
    "GPTConfig",
    "GPTModule",
    "TextDataModule",
    "ViT",
    "ViTConfig",
    "ViTModule",
]
