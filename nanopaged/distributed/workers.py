"""Tensor-parallel worker processes: rank 0 is the caller's process, ranks 1..N-1 are its children.

Every step rank 0 sends each worker one packed int64 buffer (StepInputs) over a pipe; the
worker runs the same forward pass on its heads, and the ranks meet in the model's all-reduces
(NCCL on CUDA, gloo on CPU). Only rank 0 samples.

A worker that fails sends its traceback over the same pipe and exits; a monitor thread in the
driver turns that (or a worker that just dies) into a WorkerError raised by the driver's next
collective or step. Workers ignore Ctrl-C (the driver decides), exit when their pipe closes or
their parent dies, and are stopped by TPWorkers.shutdown (at the latest at interpreter exit).

How workers start (worker_start_method): on a machine without CUDA devices the first group of
a process is forked, so nothing of the caller's main module runs again and a script with one
tensor-parallel LLM needs no `if __name__ == "__main__":`; later groups, and any with CUDA
devices, are spawned (a forked child cannot use CUDA once this
process has queried it), which imports the main module again and so needs that guard (checked
before anything starts). NANOPAGED_WORKER_MULTIPROC_METHOD=fork or spawn picks one.
"""

from __future__ import annotations

import ast
import atexit
import linecache
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import numpy as np
import torch
import torch.distributed as dist

from nanopaged.distributed.parallel import TensorParallel
from nanopaged.engine.step_inputs import StepInputs
from nanopaged.platform import CUDA, Platform, platform_of

# A collective that waits longer than this fails; generous, since one rank may be compiling
# kernels or capturing CUDA graphs while another waits. A dead worker is noticed at once.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
STARTUP_TIMEOUT_S = 120.0
# How long a shutdown waits for another thread's step to issue its collectives before it stops
# the workers anyway (a step stuck on a dead worker ends sooner, through the worker's error).
STEP_WAIT_S = 60.0
# Test hook: "RANK:STEP" makes worker RANK raise at its STEP-th step (0-based).
FAULT_ENV = "NANOPAGED_TP_FAULT"

START_METHOD_ENV = "NANOPAGED_WORKER_MULTIPROC_METHOD"
START_METHODS = ("fork", "spawn")

_STEP, _SWAP_SPACE, _STOP, _ZERO_BLOCKS = 0, 1, 2, 3


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed; the message carries its traceback."""


class TPWorkers:
    """Ranks 1..N-1 of a tensor-parallel group, seen from rank 0 (the caller's process)."""

    def __init__(self, size: int, device: torch.device, runner_kwargs: dict) -> None:
        """Start the workers, wait for them, and join the process group as rank 0.

        runner_kwargs: ModelRunner's arguments except device, tp and workers.
        """
        if dist.is_initialized():
            raise RuntimeError(
                "one tensor-parallel LLM per process at a time: shut the other down first "
                "(LLM.shutdown(), or `with LLM(...) as llm:`)"
            )
        method, reason = worker_start_method()
        if method == "spawn":
            _check_main_module_guarded(reason)
        self.size = size
        self.platform = platform_of(device)
        self.backend = self.platform.dist_backend
        self.error: WorkerError | None = None
        self._failed = threading.Event()
        # _closed: no step may start; _step_open: a published step's collectives are not all
        # issued yet; _out_of_step: a step broke off, so the workers may wait in a collective.
        # The condition guards them and the sends, so that a shutdown from another thread (at
        # interpreter exit, with a generate running in a daemon thread) waits for the step
        # under way instead of taking the group and the workers away under it.
        self._closed = False
        self._step_open = False
        self._out_of_step = False
        self._steps = threading.Condition()
        # Set by rank 0's ModelRunner, a weak reference to its method that drops its CUDA
        # graphs (they hold NCCL work).
        self.before_leave: weakref.WeakMethod | None = None
        if self.backend == "nccl":
            # On a collective error NCCL's watchdog would by default kill the whole process,
            # i.e. the caller's: only abort the communicator, so a WorkerError can be raised.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self._store: dist.TCPStore | None = None
        self._monitor: threading.Thread | None = None
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        try:
            self._start(method, runner_kwargs)
        except BaseException:
            self.shutdown(abort=True)
            raise
        _live_workers.add(self)
        self._guard = _CollectiveGuard(self)
        self.tp = TensorParallel(0, size, dist.group.WORLD, self._collective_failed,
                                 guard=self._guard)  # fmt: skip
        self._monitor = threading.Thread(target=self._watch, name="nanopaged-tp-monitor",
                                         daemon=True)  # fmt: skip
        self._monitor.start()

    # ---- start-up and failure detection -------------------------------------------------
    def _start(self, method: str, runner_kwargs: dict) -> None:
        """Start ranks 1..size-1 with `method`, wait until each is ready, and join the process
        group with them as rank 0."""
        ctx = mp.get_context(method)
        forked = method == "fork"
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                # A forked worker closes its copies of the earlier workers' pipe ends: each
                # worker must see EOF when rank 0 goes.
                args=(rank, self.size, self.platform, runner_kwargs, theirs, os.getpid(),
                      forked, tuple(self.conns) if forked else ()),
                name=f"nanopaged-tp-rank{rank}",
                daemon=True,
            )  # fmt: skip
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        # Made once the workers exist, so that no forked worker holds a copy of its listening
        # socket; they learn its port over their pipes.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
        for conn in self.conns:
            try:
                conn.send(self._store.port)
            except OSError:
                pass  # the worker is gone: _wait_ready says how
        self._wait_ready()
        global _groups_made
        _groups_made = True
        dist.init_process_group(
            self.backend, store=self._store, rank=0, world_size=self.size,
            timeout=COLLECTIVE_TIMEOUT,
        )  # fmt: skip

    def _wait_ready(self) -> None:
        """Each worker says "ready" before joining the group; one that dies first is an error
        here, instead of a rendezvous that waits for it until a timeout."""
        pending = dict(enumerate(self.conns, start=1))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"tensor-parallel workers {sorted(pending)} did not start")
            sentinels = {self.procs[r - 1].sentinel: r for r in pending}
            for obj in wait([*pending.values(), *sentinels], timeout=left):
                rank = sentinels.get(obj)
                if rank is not None and rank in pending:
                    conn = pending[rank]
                    if not conn.poll(1.0):
                        raise self._exited(rank)
                    obj = conn
                if obj in pending.values():
                    rank = next(r for r, c in pending.items() if c is obj)
                    try:
                        kind, payload = obj.recv()
                    except EOFError:  # closed without a word: it died
                        raise self._exited(rank) from None
                    if kind == "error":
                        raise WorkerError(f"tensor-parallel worker {rank} failed:\n{payload}")
                    del pending[rank]

    def _exited(self, rank: int) -> WorkerError:
        code = self.procs[rank - 1].exitcode
        return WorkerError(f"tensor-parallel worker {rank} exited (exit code {code})")

    def _watch(self) -> None:
        """Monitor thread: the first worker error or death becomes self.error."""
        conns = dict(enumerate(self.conns, start=1))
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while (conns or sentinels) and not self._closed:
            for obj in wait([*conns.values(), *sentinels], timeout=1.0):
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = conns.get(rank)
                    if conn is not None and conn.poll(1.0):
                        continue  # its report is waiting: read it on the next pass
                    if not self._closed:
                        code = self.procs[rank - 1].exitcode
                        self._fail(rank, f"the process exited unexpectedly (exit code {code})")
                    continue
                rank = next(r for r, c in conns.items() if c is obj)
                try:
                    kind, payload = obj.recv()
                except (EOFError, OSError):
                    del conns[rank]
                    continue
                if kind == "error" and not self._closed:
                    self._fail(rank, payload)

    def _fail(self, rank: int, detail: str) -> None:
        # Recorded while no call of rank 0 is inside the group (TensorParallel.guard); a call
        # stuck there past GUARD_WAIT_S is left to the abort below.
        entered = self._guard.lock.acquire(timeout=GUARD_WAIT_S)
        try:
            if self.error is None:
                self.error = WorkerError(f"tensor-parallel worker {rank} failed:\n{detail}")
        finally:
            if entered:
                self._guard.lock.release()
        # Peer all-reduces and NCCL would wait for the dead rank forever: abort both so rank
        # 0's kernels return, and only then wake the driver thread, which must not abort the
        # same group concurrently.
        self.tp.abort()
        _abort_nccl()
        self._failed.set()

    def _collective_failed(self, error: BaseException) -> None:
        """Rank 0's collective failed: raise the worker's error if one failed (or does soon)."""
        if error is self.error:  # the guard refused the call
            raise error
        self._failed.wait(timeout=10.0)
        if self.error is not None:
            raise self.error from error

    # ---- steps --------------------------------------------------------------------------
    def _send(self, buf: bytes) -> None:
        """Send buf to every worker; the caller holds self._steps."""
        if self.error is not None:
            raise self.error
        if self._closed:
            raise RuntimeError(
                "this LLM's tensor-parallel workers were stopped (shutdown, or an error or "
                "interruption during a step); create a new LLM"
            )
        for conn in self.conns:
            try:
                conn.send_bytes(buf)
            except OSError as e:
                self._failed.wait(timeout=10.0)
                raise (self.error or WorkerError("a tensor-parallel worker is gone")) from e

    def publish(self, step: StepInputs) -> None:
        """Send the step to every worker; they run it while rank 0 runs its own share."""
        buf = np.concatenate(([_STEP], step.pack())).astype(np.int64).tobytes()
        with self._steps:
            self._send(buf)
            self._step_open = True

    def step_done(self) -> None:
        """Rank 0 has issued every collective of the published step."""
        with self._steps:
            self._step_open = False
            self._steps.notify_all()

    def allocate_swap_space(self, num_blocks: int) -> None:
        with self._steps:
            self._send(np.array([_SWAP_SPACE, num_blocks], dtype=np.int64).tobytes())

    def zero_blocks(self, block_ids: list[int]) -> None:
        with self._steps:
            self._send(np.array([_ZERO_BLOCKS, *block_ids], dtype=np.int64).tobytes())

    def after_error(self) -> None:
        """The driver's step loop failed: stop the workers unless they are still in step with
        rank 0 (an error between steps leaves them usable). When a worker failed, its error is
        the one to raise, whatever rank 0 saw (an aborted NCCL kernel, say)."""
        with self._steps:
            broke_off = self._step_open
            self._out_of_step |= broke_off
            self._step_open = False
            self._steps.notify_all()
        if broke_off or self.error is not None:
            self.shutdown(abort=True)
        if self.error is not None:
            raise self.error

    # ---- shutdown -----------------------------------------------------------------------
    def shutdown(self, abort: bool = False) -> None:
        """Stop every worker and leave the process group; idempotent. abort: kill at once (a
        worker may be stuck in a collective rank 0 will never join)."""
        with self._steps:
            if self._closed:
                return
            self._closed = True
            if not abort and self._step_open:  # another thread's step is under way
                self._steps.wait_for(lambda: not self._step_open, timeout=STEP_WAIT_S)
            abort = abort or self._step_open or self._out_of_step
        _live_workers.discard(self)
        # Only live workers can leave the group together with rank 0.
        orderly = not abort and self.error is None and all(p.is_alive() for p in self.procs)
        tp = getattr(self, "tp", None)  # None while the workers are still starting
        if tp is not None and not orderly:
            tp.abort()  # rank 0's queued peer all-reduces must not wait for killed workers
        if orderly:
            leave = self.before_leave() if self.before_leave is not None else None
            if leave is not None:
                leave()
            if tp is not None:
                tp.release()
            for conn in self.conns:
                try:
                    conn.send_bytes(np.array([_STOP], dtype=np.int64).tobytes())
                except OSError:
                    pass
            # Every rank leaves the group together: NCCL's destroy finalizes the communicator
            # with the peers, so rank 0 must not wait for the workers to exit first.
            _leave_group(abort=False)
            deadline = time.monotonic() + 10.0
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
        # The monitor sees _closed and the workers' ends within one wait; it must be gone
        # before the pipes it waits on are closed.
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        _leave_group(abort=True)
        self._store = None  # its server thread ends with it

    @property
    def alive(self) -> bool:
        return not self._closed and self.error is None


# How long a worker's failure waits for a call of rank 0 into the group to return before
# aborting the group anyway (an enqueue takes microseconds; one blocked on the dead peer would
# otherwise keep the failure from ever being recorded).
GUARD_WAIT_S = 2.0


class _CollectiveGuard:
    """TensorParallel.guard on rank 0: entering raises the failed worker's error, if any, and
    otherwise holds the lock that TPWorkers._fail takes before recording a failure."""

    def __init__(self, workers: TPWorkers) -> None:
        self.workers = workers
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        self.lock.acquire()
        if self.workers.error is not None:
            self.lock.release()
            raise self.workers.error

    def __exit__(self, *exc) -> None:
        self.lock.release()


# Aborting a NCCL group can itself block (while a CUDA graph holds its kernels, say), and two
# threads aborting one group at once deadlock inside it: one abort runs at a time, in its own
# thread, and nothing waits on it longer than this, so an error always reaches the caller.
ABORT_WAIT_S = 10.0
_abort_lock = threading.Lock()
_abort_thread: threading.Thread | None = None


def _abort_default_group() -> None:
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # best effort; the collective timeout is the backstop
        pass


def _abort_nccl() -> bool:
    """Abort the default NCCL group (aborting also removes it); False while the abort is still
    blocked after ABORT_WAIT_S. Nothing to do for gloo or no group."""
    global _abort_thread
    with _abort_lock:
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return True
        if _abort_thread is None or not _abort_thread.is_alive():
            _abort_thread = threading.Thread(
                target=_abort_default_group, name="nanopaged-nccl-abort", daemon=True
            )
            _abort_thread.start()
        thread = _abort_thread
    thread.join(ABORT_WAIT_S)
    return not thread.is_alive()


def _leave_group(abort: bool) -> None:
    """Destroy the default process group if there is one; abort: its peers are gone, so a
    NCCL group is aborted rather than finalized with them."""
    if abort and not _abort_nccl():
        return  # the abort is stuck; destroying the group would block the same way
    with _abort_lock:
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group()
        except Exception:  # an aborted NCCL group may refuse; nothing is left to free
            pass


# ---- how workers start, and how they end at exit -------------------------------------------
def worker_start_method() -> tuple[str, str]:
    """How workers start, and why: NANOPAGED_WORKER_MULTIPROC_METHOD if set, else fork on a
    Linux machine without CUDA devices, else spawn."""
    forced = os.environ.get(START_METHOD_ENV)
    if forced:
        if forced not in START_METHODS:
            raise ValueError(
                f"{START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {forced!r}"
            )
        if forced not in mp.get_all_start_methods():
            raise ValueError(f"{START_METHOD_ENV}={forced}: not available on {sys.platform}")
        return forced, f"{START_METHOD_ENV}={forced}"
    if sys.platform != "linux":
        return "spawn", f"fork is not used on {sys.platform}"
    # Not only an initialised CUDA: once this process has asked the CUDA runtime anything
    # (whether a device is available, as device="auto" does), a forked child cannot initialise
    # CUDA at all, and that cannot be seen from here. device_count() asks NVML, not CUDA.
    if CUDA.device_count() > 0:
        return "spawn", "this machine has CUDA devices, which a forked worker cannot use"
    if _groups_made:
        # A child forked after this process ran a gloo group (its threads, since stopped)
        # inherits that library's state half-torn: it died at start now and then.
        return "spawn", "this process already ran a tensor-parallel group"
    return "fork", "the default"


def _check_main_module_guarded(reason: str) -> None:
    """RuntimeError when spawned workers would create this LLM again: spawn imports the
    caller's main module in each worker, and its top-level code is creating this LLM outside
    `if __name__ == "__main__":`. Silent whenever that cannot be told for sure."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return  # multiprocessing leaves a package's __main__ alone
    if spec_name is None and getattr(main, "__file__", None) is None:
        return  # interactive, -c or stdin: nothing to import again
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
    ):
        frame = frame.f_back
    if frame is None:
        return  # the main module's top level is not what creates the LLM
    filename, line = frame.f_code.co_filename, frame.f_lineno
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return
    if not tree.body:
        return  # no source to read
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
            and node.lineno <= line <= (node.end_lineno or node.lineno)
        ):
            return
    raise RuntimeError(
        f"tensor-parallel workers start with spawn here ({reason}), which runs the main "
        f"module {filename} again in every worker, and its line {line} would create this LLM "
        'again: put the script\'s top-level code under `if __name__ == "__main__":`'
    )


# The TPWorkers not yet shut down.
_live_workers: weakref.WeakSet[TPWorkers] = weakref.WeakSet()
# Whether this process has made a tensor-parallel process group (worker_start_method).
_groups_made = False


def _shutdown_live_workers() -> None:
    for workers in list(_live_workers):
        workers.shutdown()


# At exit, multiprocessing terminates daemonic children (SIGTERM) from a hook registered when it
# was imported, which runs before every hook registered earlier: weakref.finalize's (and with
# it the LLM's), if a finalizer existed before multiprocessing was imported. Workers killed so
# leave rank 0 in a group with dead peers. This hook, registered after multiprocessing's
# (imported above), runs before it and shuts them down in order.
atexit.register(_shutdown_live_workers)


def check_device_count(size: int, device: torch.device) -> None:
    """ValueError unless the machine has a device for every rank."""
    platform = platform_of(device)
    count = platform.device_count()
    if count is not None and size > count:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} CUDA devices, this machine has {count}"
        )
    if platform.gpu and device.index not in (None, 0):
        raise ValueError(
            f"with tensor_parallel_size > 1, rank r runs on cuda:r; pass device='cuda', "
            f"got {device}"
        )


# ---- the worker process --------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives the process that started it (even one killed by SIGKILL)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _worker_main(
    rank: int,
    size: int,
    platform: Platform,
    runner_kwargs: dict,
    conn: Connection,
    parent_pid: int,
    forked: bool,
    inherited: tuple[Connection, ...],
) -> None:
    """A worker process. forked: started by fork, with the caller's state copied, including
    inherited, rank 0's ends of the earlier workers' pipes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if not forked:
        _run_worker(rank, size, platform, runner_kwargs, conn)
        return
    for other in inherited:
        other.close()
    # The caller's handlers do not apply here: terminate means exit, and a wake-up fd (an
    # event loop's) belongs to the caller.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    # The work runs in a thread of its own: the forking thread's OpenMP pool (GNU libgomp)
    # lost its threads in the fork, and a parallel region started from that thread would
    # wait for them forever; a new thread starts a pool of its own.
    work = threading.Thread(target=_run_worker, args=(rank, size, platform, runner_kwargs, conn),
                            name=f"nanopaged-tp-rank{rank}")  # fmt: skip
    work.start()
    work.join()


def _run_worker(
    rank: int, size: int, platform: Platform, runner_kwargs: dict, conn: Connection
) -> None:
    """Join the group, build this rank's runner and serve the driver's steps."""
    try:
        device = platform.bind_rank(rank, size)
        from nanopaged.engine.model_runner import ModelRunner

        conn.send(("ready", None))
        port = conn.recv()
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                              timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
        dist.init_process_group(platform.dist_backend, store=store, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
        tp = TensorParallel(rank, size, dist.group.WORLD)
        runner = ModelRunner(**runner_kwargs, device=device, tp=tp)
        _serve(runner, conn, rank)
        runner.release_graphs()
        tp.release()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        # Skip interpreter teardown: peers may be mid-collective with us, so just go.
        os._exit(1)
    dist.destroy_process_group()
    conn.close()


def _serve(runner, conn: Connection, rank: int) -> None:
    """Run the driver's steps until it says stop or goes away."""
    fault = os.environ.get(FAULT_ENV, "")
    fault_step = int(fault.split(":")[1]) if fault.startswith(f"{rank}:") else -1
    num_steps = 0
    while True:
        try:
            buf = np.frombuffer(conn.recv_bytes(), dtype=np.int64)
        except EOFError:  # the driver is gone
            return
        kind = int(buf[0])
        if kind == _STOP:
            return
        if kind == _SWAP_SPACE:
            runner.allocate_swap_space(int(buf[1]))
            continue
        if kind == _ZERO_BLOCKS:
            runner.zero_blocks(buf[1:].tolist())
            continue
        if num_steps == fault_step:
            raise RuntimeError(f"injected fault in tensor-parallel rank {rank}, step {num_steps}")
        num_steps += 1
        runner.execute(StepInputs.unpack(buf[1:]), None)
