"""The zoo's DataModules in one import: `from zoo.data import TextDataModule, DigitsDataModule`."""

from zoo.global_batches import GlobalBatchDataModule, GlobalBatches, dp_rank_and_size
from zoo.image_data import DigitsDataModule
from zoo.text_data import TextDataModule

__all__ = ["DigitsDataModule", "GlobalBatchDataModule", "GlobalBatches", "TextDataModule", "dp_rank_and_size"]
