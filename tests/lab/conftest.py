from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app


@pytest.fixture(autouse=True, scope="session")
def no_warm_pools():
    """A lab's capacity planner keeps an idle pool's workers a minute for the next plan; the
    tests' labs (the module-scoped ones too) give them back as each plan ends, so no test waits
    on another's processes."""
    from servelab.lab import capacity_lesson

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capacity_lesson, "POOL_IDLE_S", 0.0)
        yield


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_lab_app())
