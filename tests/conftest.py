"""Shared test setup: small thread pools (CI has 2 cores) and the GPU marker's skip rule."""

import os
import sys

import pytest
import torch

# Under pytest-xdist (CI runs the slow tests side by side, `-n 2`) the cores are split between the workers, and the
# runs a test starts as subprocesses (`rl-multilora run`) inherit the same share through OMP_NUM_THREADS: two
# workers with two threads each on two cores lose more to barrier waits than they gain.
# A run that sets OMP_NUM_THREADS itself (CI's side-by-side streams of slow tests) keeps it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, os.cpu_count() or 1) // _workers)
if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    _threads = int(os.environ["OMP_NUM_THREADS"])
elif _workers > 1:
    os.environ["OMP_NUM_THREADS"] = str(_threads)
torch.set_num_threads(_threads)
# The provisioning scripts the tests run (examples/multi_lora/provision*.sh) use this interpreter, not whichever
# `rl-multilora` or `python` comes first on PATH (a shell without the venv activated).
os.environ.setdefault("PYTHON", sys.executable)
# The tinker SDK's telemetry thread flushes to the server a test started, and keeps trying after that server has
# stopped: its "Dropping telemetry batch" warning, a traceback, then lands in whichever test is running (a CLI test
# that asserts its stderr has no traceback failed on it in CI). The server's telemetry endpoint is tested directly
# (tests/test_tinker_fuzz.py).
os.environ.setdefault("TINKER_TELEMETRY", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
