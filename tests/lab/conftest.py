from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_lab_app())
