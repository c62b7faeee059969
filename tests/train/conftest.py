"""Every training here, in this process or in a child, runs on one torch thread, whatever the
caller's environment."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_training():
    """`attn train` takes OMP_NUM_THREADS's count when it is set, else every core. Set here to 1
    for the commands run in this process and the processes started from it (their
    environment), so that:
    - a result compared bitwise (a resumed run against the uninterrupted one, 1-rank DDP
      against no DDP) is computed on the same thread count on both sides: the CPU's sums
      depend on it (8,180 of a tiny model's 8,192 weights differed, by up to 2e-5, between 1
      and 2 threads);
    - a result judged by a bound (test_loop's reversal) comes from the arithmetic its bound was
      measured with, not from the caller's OMP_NUM_THREADS;
    - a tiny model does not run on two threads beside another busy process, 10-100x slower
      (OpenMP's waiting at every op).
    Module-wide, for the modules' own trained fixtures too. torchrun's processes divide the
    cores among themselves whatever the variable says."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield
