"""The zoo's DataModules in one import: `from zoo.data import TextDataModule, TokenDataModule, DigitsDataModule`."""

from zoo.global_batches import GlobalBatchDataModule, GlobalBatches, dp_rank_and_size
from zoo.image_data import DigitsDataModule
from zoo.text_data import TextDataModule
from zoo.token_data import TokenDataModule

__all__ = [
    "DigitsDataModule",
    "GlobalBatchDataModule",
    "GlobalBatches",
    "TextDataModule",
    "TokenDataModule",
    "dp_rank_and_size",
]
