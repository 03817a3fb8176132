"""Baton services: gateway, prefill, decode and the KV store, one package each.

Every service process starts here, before any of its modules loads torch: the
OpenMP spin setting (:mod:`shared.openmp`) must be in the environment by then."""

from shared.openmp import keep_spin_waits_short

keep_spin_waits_short()
