import os
import subprocess
import sys
from pathlib import Path

from shared.openmp import SPIN_COUNT, keep_spin_waits_short

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_spin_is_set_where_the_user_chose_none():
    env: dict[str, str] = {}
    keep_spin_waits_short(env)
    assert env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_a_spin_count_or_wait_policy_the_user_chose_wins():
    for chosen in ({"GOMP_SPINCOUNT": "INFINITE"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(chosen)
        keep_spin_waits_short(env)
        assert env == chosen


def test_a_service_process_has_it_before_torch_loads():
    """``python -m services.<role>`` imports the services package first: the setting is
    in the environment before torch (and its OpenMP runtime) is imported."""
    code = (
        "import os, sys\n"
        "import services\n"
        "assert 'torch' not in sys.modules\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    unset = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert out.stdout.strip() == str(SPIN_COUNT)
