"""The gateways' admission lines (`[gateway] log_admissions`), read back from lumend's logs.

One line per placement decision (lumend.gateway.server.log_admission):

    admission: request cmpl-1f3c to node-2-w0, checkpoint on node-1-w0 (coordinator epoch 1: ...)

`first_admissions` keeps, per request id, its first decision (the one made without
exclusions: where the request was first sent), which the validation bench
(bench/validate_sim.py) sets beside the simulator's admission of the same request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_ADMISSION = re.compile(
    r"admission: request (?P<rid>\S+) to (?P<worker>[^,]+), checkpoint "
    r"(?:on (?P<holder>\S+)|none)(?:, excluding (?P<excluding>.+?))? \((?P<by>.*)\)\s*$")
NO_WORKER = "no worker"


@dataclass(frozen=True)
class AdmissionLine:
    node: str  # whose gateway decided
    request_id: str  # the id the client's response carries
    worker: str | None  # None: no worker could take it
    holder: str | None  # where its checkpoint went; None: no checkpoint
    excluding: tuple[str, ...]  # workers a retry left out
    decided_by: str  # the coordinator's epoch and reason, or the gateway's own view


def parse_admission(node: str, line: str) -> AdmissionLine | None:
    found = _ADMISSION.search(line)
    if found is None:
        return None
    worker = found["worker"]
    excluding = found["excluding"]
    return AdmissionLine(node, found["rid"], None if worker == NO_WORKER else worker,
                         found["holder"],
                         tuple(excluding.split(", ")) if excluding else (), found["by"])


def read_admissions(logs: Iterable[tuple[str, Path]]) -> list[AdmissionLine]:
    """Every admission line in the (node name, log file) pairs, in each file's order."""
    found = []
    for node, path in logs:
        with path.open(errors="replace") as f:
            for line in f:
                admission = parse_admission(node, line)
                if admission is not None:
                    found.append(admission)
    return found


def first_admissions(lines: Iterable[AdmissionLine]) -> dict[str, AdmissionLine]:
    """Per request id, its first admission without exclusions (later ones are retries)."""
    first: dict[str, AdmissionLine] = {}
    for line in lines:
        if not line.excluding:
            first.setdefault(line.request_id, line)
    return first
