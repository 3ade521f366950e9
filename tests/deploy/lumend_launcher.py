"""`lumend run ARGS...` with two fault switches that exist only in tests.

* `LUMEN_TEST_NO_SYSTEMD_PYTHON=1`: `import systemd` fails, as on a host without
  systemd-python, so lumend takes its own NOTIFY_SOCKET datagram path.
* `LUMEN_TEST_STALL_FILE=PATH`: while PATH exists, the HA loop's next cycle hangs in an
  await (as a lost RPC without a timeout would), while the event loop, the sd_notify task
  and the metrics server keep running. SIGSTOP cannot show the watchdog rule: it freezes
  the whole process, so even a watchdog that pinged blindly from a timer would fall silent.

Production code has no such switches; the stall wraps `ClusterAgent.cycle` from outside.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

if os.environ.get("LUMEN_TEST_NO_SYSTEMD_PYTHON"):
    sys.modules["systemd"] = None  # type: ignore[assignment]  # makes `import systemd` fail

_stall = os.environ.get("LUMEN_TEST_STALL_FILE")
if _stall:
    from lumend.cluster.agent import ClusterAgent

    _cycle = ClusterAgent.cycle

    async def _stalling_cycle(self: ClusterAgent) -> str:
        if _stall is not None and os.path.exists(_stall):  # noqa: ASYNC240
            logging.getLogger("test").warning("TEST: HA loop stalled while %s exists", _stall)
            while os.path.exists(_stall):  # noqa: ASYNC240 (the test's switch)
                await asyncio.sleep(0.05)
            logging.getLogger("test").warning("TEST: HA loop resumed")
        return await _cycle(self)

    ClusterAgent.cycle = _stalling_cycle  # type: ignore[method-assign]

from lumend.cli import main  # noqa: E402

sys.argv = ["lumend", "run", *sys.argv[1:]]
main()
