"""The limits a host-run harness process (and every process it starts) runs under.

A host-run harness reads what the agent's commands print: mini-swe-agent holds each action's whole
output in one string before it truncates it for the model. An agent printing gigabytes would grow
that process, on the host, without bound. Under an address-space limit the harness gets a
``MemoryError`` instead (its own handling, or its crash: the agent's outcome either way), and the
host keeps its memory. The limit is set by ``sh``'s ``ulimit`` just before the harness's ``exec``,
where nothing of the trial has run yet.
"""

from __future__ import annotations

from collections.abc import Mapping

# About 6x what mini-swe-agent's interpreter maps after importing litellm (~330 MB): room for its
# threads' stacks and arenas, well under what a few concurrent trials may take of a 24 GB host.
HOST_MEMORY_BYTES = 2 << 30


def under_limits(argv: list[str], env: Mapping[str, str], memory_bytes: int = HOST_MEMORY_BYTES) -> list[str]:
    """``argv`` exec'd under the address-space limit, with exactly ``env`` (``sh`` would add ``PWD``)."""
    keep = "" if "PWD" in env else "unset PWD; "
    return ["/bin/sh", "-c", f'{keep}ulimit -v {memory_bytes // 1024} && exec "$@"', "sh", *argv]
