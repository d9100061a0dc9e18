"""benchmarks/report.py: tables come from result files, the README on disk is the rendering of what is in
benchmarks/results, and a run records the benchmark's last JSON line with its command (no benchmark runs here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import report  # noqa: E402

ENTRY = {
    "name": "toy",
    "command": "python benchmarks/toy.py --n 2",
    "argv": ["benchmarks/toy.py", "--n", "2"],
    "timeout_s": 60,
    "date": "2026-11-23 14:00 UTC",
    "wall_s": 12.3,
    "machine": {
        "machine": "x86_64",
        "cpu_count": 2,
        "accelerator": "no GPU",
        "python": "3.11.7",
        "torch": "2.13.0+cpu",
        "lightning": "2.6.6",
        "load_before": 1.25,
        "load_after": 2.5,
    },
    "result": {
        "rows": [
            {"mesh": {"dp_shard": 2, "tp": 1}, "bytes": 1234567, "ratio": 1.00049},
            {"mesh": {"dp_shard": 1, "tp": 2}, "bytes": 89, "ratio": 0.5},
        ],
        "goal_met": False,
    },
}
TEMPLATE = """{% set e = results.toy %}
## Toy

{{ cmd(e) }} ({{ e | about }})

| mesh | bytes | ratio |
|---|---|---|
{% for row in e.result.rows %}
| {{ row.mesh | mesh }} | {{ row.bytes | n }} | {{ row.ratio | r }} |
{% endfor %}

Goal met: {{ e.result.goal_met | yes }}
"""


def test_a_table_is_rendered_from_the_result_file(tmp_path: Path) -> None:
    (tmp_path / "report").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "report" / "10-toy.md").write_text(TEMPLATE)
    (tmp_path / "report" / "00-head.md").write_text("# Head\n")
    (tmp_path / "results" / "toy.json").write_text(json.dumps(ENTRY))
    text = report.render(tmp_path / "report", tmp_path / "results")
    assert text.index("# Head") < text.index("## Toy")  # sections in file-name order
    assert (
        "| mesh | bytes | ratio |\n|---|---|---|\n| dp_shard 2 | 1,234,567 | 1.000 |\n| tp 2 | 89 | 0.500 |\n\nGoal met: **no**\n"
    ) in text
    assert "`python benchmarks/toy.py --n 2` (2026-11-23 14:00 UTC, 2 CPU cores (x86_64), no GPU," in text
    assert "load average 1.2 before, 2.5 after; 12 s wall" in text


def test_a_figure_missing_from_the_results_fails_the_rendering(tmp_path: Path) -> None:
    (tmp_path / "report").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "report" / "10-toy.md").write_text(TEMPLATE)
    with pytest.raises(Exception, match="toy"):
        report.render(tmp_path / "report", tmp_path / "results")


def test_the_readme_on_disk_is_the_rendering_of_the_results() -> None:
    # if this fails: run `python benchmarks/report.py` (and edit benchmarks/report/*.md, never README.md)
    assert (REPO / "benchmarks" / "README.md").read_text() == report.render()


def test_every_result_file_has_its_command_and_machine() -> None:
    entries = report.load_results(report.RESULTS)
    assert entries, "no result files"
    for name, entry in entries.items():
        assert entry["name"] == name
        assert entry["command"] == "python " + " ".join(entry["argv"])
        script = entry["argv"][1].replace(".", "/") + ".py" if entry["argv"][0] == "-m" else entry["argv"][0]
        assert (REPO / script).exists(), entry["argv"]
        assert {"date", "wall_s", "timeout_s", "machine", "result"} <= set(entry)


def test_a_run_keeps_the_last_json_line_and_the_exact_command(tmp_path: Path) -> None:
    script = tmp_path / "fake_benchmark.py"
    script.write_text("import json, sys\nprint('chatter')\nprint(json.dumps({'argv': sys.argv[1:], 'x': 3}))\n")
    entry = report.run_benchmark("fake", [str(script), "--n", "2"], timeout=60, results=tmp_path / "results")
    saved = json.loads((tmp_path / "results" / "fake.json").read_text())
    assert saved == entry
    assert saved["result"] == {"argv": ["--n", "2"], "x": 3}
    assert saved["command"] == f"python {script} --n 2"
    assert saved["machine"]["cpu_count"] >= 1 and saved["timeout_s"] == 60


def test_tensorboard_scalars_reads_back_every_logged_value(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/tensorboard_scalars.py: how the GPU recipe's MeshMonitor figures come back from a bare host."""
    import tensorboard_scalars
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "version_0"))
    for step, value in [(9, 0.5), (19, 0.25)]:
        writer.add_scalar("monitor/mfu", value, step)
    writer.close()
    tensorboard_scalars.main([str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["scalars"]["monitor/mfu"]
    assert summary == {"last": 0.25, "mean": 0.375, "count": 2, "steps": [9, 19]}
    with pytest.raises(SystemExit, match="no TensorBoard scalars"):
        tensorboard_scalars.main([str(tmp_path / "empty")])
