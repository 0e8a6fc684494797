"""Deploy fixtures: the Helm chart rendered once per scenario, shared by the chart's test files."""

from __future__ import annotations

import pytest
from helm_render import SCENARIOS, render


@pytest.fixture(scope="module", params=list(SCENARIOS))
def rendered(request) -> list[dict]:
    return render(SCENARIOS[request.param])
