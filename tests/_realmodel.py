"""Real models and texts that can not be had: a skip on a developer's offline machine, a failure in CI.

``.ci/run`` sets ``KVBITS_REQUIRE_REAL_MODELS=1``: there the wheels come from PyPI, so a model that does
not load (a broken loader, a checksum mismatch, a renamed wheel) is a defect to see, not a skip to miss.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ENV = "KVBITS_REQUIRE_REAL_MODELS"


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it where ``$KVBITS_REQUIRE_REAL_MODELS`` is ``1``."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: real models must load here)")
    pytest.skip(reason)
