"""The fault matrix: chaos scenarios on a namespace lab (real etcd and lumend processes, each
in a network namespace of its own; see tests/chaos/), each under streaming load through a
gateway. Needs root (and nftables for the packet-loss rows and the peer-link delay rows;
the delay rows relay traffic through tests/chaos/delayproxy.py: lumend's to etcd, etcd
members' to each other, nodes' to each other; the full-disk rows mount small tmpfs).
Prints one row per scenario; asserts nothing. Every row is also a test in tests/chaos/: CI
runs the quick ones, the `slow_chaos` ones run with LUMEN_SLOW_CHAOS=1.

    .venv/bin/python bench/chaos.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import netlab
from tests.chaos.peer_faults import SCENARIOS as PEER_SCENARIOS
from tests.chaos.scenarios import HEADER, SCENARIOS, Row

ALL = {**SCENARIOS, **PEER_SCENARIOS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(ALL), default=None)
    args = parser.parse_args()
    why = netlab.available()
    if why is not None:
        sys.exit(f"bench/chaos.py: {why}")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for name in args.only or list(ALL):
        with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as workdir:
            try:
                row = ALL[name](Path(workdir))
            except Exception as exc:  # a scenario that could not finish is a row too
                row = Row(name, notes=[f"FAILED: {type(exc).__name__}: {exc}"[:300]])
                traceback.print_exc(file=sys.stderr)
        print("| " + " | ".join(row.cells()) + " |", flush=True)


if __name__ == "__main__":
    main()
