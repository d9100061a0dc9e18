"""Print the scalars of the TensorBoard event files under a directory: each tag's last value, mean and count,
and one JSON object as the last line (the recipe's MeshMonitor figures, read back from the logger).

    python benchmarks/tensorboard_scalars.py lightning_logs/gpu/version_0
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file under log_dir."""
    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={SCALARS: 0})
        accumulator.Reload()
        for tag in accumulator.Tags()[SCALARS]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return found


def main(argv: list[str]) -> None:
    found = scalars(Path(argv[0]))
    if not found:
        raise SystemExit(f"no TensorBoard scalars under {argv[0]}")
    summary = {}
    for tag, points in sorted(found.items()):
        values = [v for _, v in points]
        summary[tag] = {
            "last": values[-1],
            "mean": statistics.fmean(values),
            "count": len(values),
            "steps": [s for s, _ in points],
        }
        print(f"{tag:40s} last {values[-1]:.6g}  mean {statistics.fmean(values):.6g}  ({len(values)} points)")
    print(json.dumps({"benchmark": "tensorboard_scalars", "log_dir": argv[0], "scalars": summary}))


if __name__ == "__main__":
    main(sys.argv[1:])
