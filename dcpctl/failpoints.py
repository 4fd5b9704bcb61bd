"""Named points where a test can have the process killed, to prove that a crash there is safe.

Set DCPCTL_FAILPOINT=<name> in the environment of a dcpctl process and it sends itself SIGKILL
when it reaches that point. Unset, a failpoint costs one comparison.
"""

import os
import signal

_ARMED = os.environ.get("DCPCTL_FAILPOINT")


def failpoint(name: str) -> None:
    """Die here, as if killed, when DCPCTL_FAILPOINT names this point."""
    if _ARMED == name:
        os.kill(os.getpid(), signal.SIGKILL)
