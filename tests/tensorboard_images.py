"""Read back the image summaries a TensorBoard log directory holds."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator


def image_tags(log_dir: Path) -> set[str]:
    tags: set[str] = set()
    for events in Path(log_dir).rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={IMAGES: 0})
        accumulator.Reload()
        tags |= set(accumulator.Tags()[IMAGES])
    return tags
