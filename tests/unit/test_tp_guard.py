"""Rank 0's calls into the process group and a worker's failure never overlap: the failure is
recorded between calls (so the NCCL abort that follows never holds the group while rank 0
enters it), and every call made after it raises the worker's error without entering."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from nanopaged.distributed import workers
from nanopaged.distributed.parallel import TensorParallel
from nanopaged.distributed.workers import TPWorkers, WorkerError, _CollectiveGuard


def _rank0(monkeypatch) -> tuple[TPWorkers, list]:
    """A TPWorkers with no processes behind it, and the collectives its tp has entered."""
    w = TPWorkers.__new__(TPWorkers)
    w.error, w._failed, w._closed = None, threading.Event(), False
    w._guard = _CollectiveGuard(w)
    w.tp = TensorParallel(0, 2, None, w._collective_failed, guard=w._guard)
    entered = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None, **kw: entered.append(x))
    return w, entered


def test_a_failure_waits_for_the_call_inside_the_group(monkeypatch):
    w, entered = _rank0(monkeypatch)
    inside, leave = threading.Event(), threading.Event()

    def slow_all_reduce(x, group=None, **kw):
        inside.set()
        leave.wait(5.0)
        entered.append(x)

    monkeypatch.setattr(dist, "all_reduce", slow_all_reduce)
    call = threading.Thread(target=w.tp.all_reduce, args=(torch.zeros(4),))
    call.start()
    assert inside.wait(5.0)
    fail = threading.Thread(target=w._fail, args=(1, "boom"))
    fail.start()
    time.sleep(0.3)
    assert w.error is None  # not recorded while rank 0 is inside the group
    leave.set()
    call.join(5.0)
    fail.join(5.0)
    assert len(entered) == 1 and isinstance(w.error, WorkerError) and w._failed.is_set()


def test_calls_after_a_failure_raise_its_error_without_entering(monkeypatch):
    w, entered = _rank0(monkeypatch)
    w._fail(1, "injected fault")
    for call in (lambda: w.tp.all_reduce(torch.zeros(4)),
                 lambda: w.tp.broadcast(torch.zeros(4))):  # fmt: skip
        with pytest.raises(WorkerError, match="injected fault") as info:
            call()
        assert info.value is w.error
    assert entered == []
    w._guard.lock.acquire(blocking=False)  # the guard released its lock on raising
    w._guard.lock.release()


def test_a_call_stuck_in_the_group_does_not_keep_the_failure_out(monkeypatch):
    w, _ = _rank0(monkeypatch)
    monkeypatch.setattr(workers, "GUARD_WAIT_S", 0.2)
    w._guard.lock.acquire()  # a call that never returns
    w._fail(1, "boom")
    assert isinstance(w.error, WorkerError) and w._failed.is_set()
