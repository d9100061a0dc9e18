"""Pictures the project draws (pipeline timeline, the plan's mesh and memory) sent to where runs are looked at:
the run's loggers, or a TensorBoard log directory of their own."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger

from lit_mesh.extras import pyplot


def read_rgb(png: Path) -> np.ndarray:
    """A PNG as (height, width, 3) uint8."""
    pixels = pyplot().imread(png)  # float in [0, 1], RGBA for PNGs written by matplotlib
    return (np.asarray(pixels)[..., :3] * 255).round().astype(np.uint8)


def log_image(trainer: Any, tag: str, png: Path, step: int) -> list[str]:
    """Send `png` to every logger of the run that takes images; returns the names of those that took it.

    TensorBoard gets it as an image summary; other Lightning loggers that define `log_image` (W&B, Neptune,
    Comet, ...) get the file; loggers without images (CSV) keep only the file beside them.
    """
    took = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, read_rgb(png), step, dataformats="HWC")
            logger.experiment.flush()
        elif callable(getattr(logger, "log_image", None)):
            logger.log_image(key=tag, images=[str(png)], step=step)
        else:
            continue
        took.append(type(logger).__name__)
    return took


def write_tensorboard_images(log_dir: Path, images: Mapping[str, Path]) -> Path:
    """Write PNGs as image summaries into a TensorBoard log directory (`tensorboard --logdir log_dir`)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(log_dir)) as writer:
        for tag, png in images.items():
            writer.add_image(tag, read_rgb(png), 0, dataformats="HWC")
    return log_dir
