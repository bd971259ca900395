"""Every parameter-server test runs on the compiled exchange (hpcdl/parameter_server/hot.py), then
on the Python path alone; a test marked `own_job` once (the job it launches takes its own path,
whatever this process's switch says)."""
from __future__ import annotations

from typing import Any

import pytest

from hpcdl.parameter_server import hot


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "own_job: launches a job of its own (run once, not per path)")


@pytest.fixture(autouse=True, params=["compiled", "python"])
def path(request: pytest.FixtureRequest) -> Any:
    """The test with workers and servers on the compiled path where it is built, then without it."""
    if request.param == "python" and request.node.get_closest_marker("own_job") is not None:
        pytest.skip("launches its own job, which takes the default path: run once")
    if request.param == "compiled" and not hot.COMPILED:
        pytest.skip("the compiled exchange is not built here (or HPCDL_COMPILED=0)")
    was = hot.enable(request.param == "compiled")
    yield request.param
    hot.enable(was)
