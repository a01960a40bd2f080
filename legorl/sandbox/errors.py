"""The sandbox's own error."""

from __future__ import annotations

from legorl.core.errors import LegorlError


class SandboxError(LegorlError):
    """A container could not be created, reached or read."""
