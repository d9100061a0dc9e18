"""Scripts run on every rank by the tests (launched with torchrun, see tests/launch.py)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_skipping_teardown() -> NoReturn:
    """Leave a worker whose results are written and whose process groups are destroyed, without C++ teardown.

    Under heavy load, torch 2.13 + gloo sometimes aborts after the script has finished ("terminate called without
    an active exception", no Python frame on the stack): a native thread destroyed while joinable. The results
    are complete by then; this keeps that crash from failing a test that passed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
