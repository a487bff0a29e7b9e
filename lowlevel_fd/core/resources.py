"""What the plans share about their lifetime: the resources they own, freed in one call."""
from __future__ import annotations

from typing import Any


def close_all(resources: dict[str, Any]) -> None:
    """Close every resource (DeviceArray, ErrorWord) and forget them: a plan's finalizer."""
    for resource in resources.values():
        resource.close()
    resources.clear()
