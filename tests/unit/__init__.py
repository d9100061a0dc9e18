"""Fast tier: in-process and fake-process-group tests (python -m pytest -q tests/unit)."""
