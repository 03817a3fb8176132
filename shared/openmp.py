"""How long OpenMP's idle workers spin: short, so that a step's end frees its cores.

GNU OpenMP (torch's runtime, which the native kernels share) keeps each worker
spinning for ``GOMP_SPINCOUNT`` turns after a parallel region before it sleeps:
300,000 by default, 8-10 ms of a core on the AMD EPYC hosts. So every engine step
ended with a core held for that long, on a machine whose cores the roles share.
At one request in flight, a prompt that came just after a stream ended found
decode's worker still spinning; prefill's elastic threads took it for a busy
decode engine and started the prompt on one thread (TTFT p50 260-288 ms back to
back, 204-213 ms with the short spin; ``benchmarks/served_prefill.py``). A
step's own regions are tens of microseconds of Python apart, well inside the
short spin, so they keep their workers awake as before.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# ~1 ms of spinning here (the default's tenth)
SPIN_COUNT = 30_000


def keep_spin_waits_short(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``GOMP_SPINCOUNT`` unless the user chose a spin count or a wait policy.
    Only a process that has not loaded OpenMP yet (torch not imported) is affected:
    the runtime reads its environment once, as it loads."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
