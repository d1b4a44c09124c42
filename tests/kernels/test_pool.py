"""The C kernels' one thread pool (csrc/pool.c): callers from several threads take turns and get
their own results, a forked child starts its own workers instead of waiting on its parent's, and a
busy machine (a worker that waits for a core) sends jobs to the caller alone for a while."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch

from agentfold.kernels import int8_gemm, native, rowwise

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")


def _operands(seed: int) -> tuple[torch.Tensor, int8_gemm.PackedWeight, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (7, 577), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (1000, 577), dtype=torch.int8, generator=generator)
    return a, int8_gemm.pack(w), torch._int_mm(a, w.t())


def test_callers_on_several_threads_get_their_own_results():
    jobs = [_operands(seed) for seed in range(4)]
    norms = [torch.randn(33, 576, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    weight = torch.rand(576, generator=torch.Generator().manual_seed(9))
    expected = [rowwise.rms_norm(x, weight, 1e-6) for x in norms]
    failures: list[str] = []

    def caller(index: int) -> None:
        a, packed, product = jobs[index]
        for _ in range(200):
            if not torch.equal(int8_gemm.int_mm(a, packed, threads=2), product):
                failures.append(f"gemm {index}")
            if not torch.equal(rowwise.rms_norm(norms[index], weight, 1e-6), expected[index]):
                failures.append(f"norm {index}")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a caller hung"
    assert not failures, failures[:5]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_runs_the_pool():
    a, packed, product = _operands(5)
    assert torch.equal(int8_gemm.int_mm(a, packed, threads=2), product)  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # the child: its own workers, the same product
        ok = torch.equal(int8_gemm.int_mm(a, packed, threads=2), product)
        os._exit(0 if ok else 1)
    deadline_pid, status = 0, 0
    for _ in range(600):
        deadline_pid, status = os.waitpid(pid, os.WNOHANG)
        if deadline_pid:
            break
        threading.Event().wait(0.1)
    if not deadline_pid:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the pool")
    assert os.waitstatus_to_exitcode(status) == 0


TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)
POOL = {"pool_for": [ctypes.c_int, ctypes.c_int64, TASK, ctypes.c_void_p], "pool_alone": ([], ctypes.c_int)}


def test_a_worker_left_without_a_core_sends_jobs_to_the_caller_alone():
    """Workers that finish long after the caller ran out of tasks (as when another process holds their
    core) twice in a row put the pool in its alone mode: the next jobs run on the calling thread only
    (the workers sleep instead of taking CPU), and a while later the workers take part again. Once is
    not enough: an idle VM's host takes a vCPU away for a few ms now and then."""
    lib = native.load(POOL)
    time.sleep(0.3)  # any alone mode an earlier test left (callers on 4 threads over 2 cores) has ended
    assert lib.pool_alone() == 0
    caller = threading.get_ident()
    ran_on: list[int] = []

    def job(count: int, late_worker: bool) -> None:
        """count tasks on 2 threads; a task on the caller waits until one has started on a worker."""
        worker_started = threading.Event()

        def task(_context: object, _index: int) -> None:
            ran_on.append(threading.get_ident())
            if threading.get_ident() == caller:
                worker_started.wait(5.0)
            else:
                worker_started.set()
                if late_worker:
                    time.sleep(0.02)  # far past the caller's own work: a worker that waited for a core

        lib.pool_for(2, count, TASK(task), None)

    job(2, late_worker=True)
    assert set(ran_on) - {caller} and lib.pool_alone() == 0  # one straggler: no evidence yet
    job(2, late_worker=True)
    assert lib.pool_alone() == 1
    ran_on.clear()
    lib.pool_for(2, 8, TASK(lambda _c, _i: ran_on.append(threading.get_ident())), None)
    assert ran_on == [caller] * 8  # alone: every task on the caller
    time.sleep(0.3)  # past ALONE_NS (250 ms)
    ran_on.clear()
    job(2, late_worker=False)
    assert set(ran_on) - {caller}, "the workers did not take part again"
