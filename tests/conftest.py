"""Test-session settings shared by every test module."""

import os

# One BLAS thread per process: the tests spawn several ranks on a machine with few cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
