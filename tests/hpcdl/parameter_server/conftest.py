"""Every parameter-server test runs on the compiled exchange (hpcdl/parameter_server/hot.py), then
on the Python path alone."""
from __future__ import annotations

from typing import Any

import pytest

from hpcdl.parameter_server import hot


@pytest.fixture(autouse=True, params=["compiled", "python"])
def path(request: pytest.FixtureRequest) -> Any:
    """The test with workers and servers on the compiled path where it is built, then without it."""
    if request.param == "compiled" and not hot.COMPILED:
        pytest.skip("the compiled exchange is not built here (or HPCDL_COMPILED=0)")
    was = hot.enable(request.param == "compiled")
    yield request.param
    hot.enable(was)
