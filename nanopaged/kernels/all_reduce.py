"""All-reduce (sum) over tensor-parallel ranks through peer memory, in one kernel.

Every rank holds a buffer with a slot per rank and a pad of int64 words in memory the other
ranks can address (NVLink peer access; see nanopaged.distributed.parallel.PeerAllReduce).
Program p of every rank handles the same slice of x:

1. writes its slice of x into slot RANK of every peer's buffer (push; or, staging, into its
   own buffer for the peers to read);
2. tells each peer "slice p is written" and waits for each peer's same word;
3. sums the slice over the ranks in rank order, in fp32, and writes it back into x (every rank
   adds the same values in the same order, so all get the same bits);
4. tells each peer "done reading slice p" and waits for theirs, so no rank overwrites a
   buffer (the next call's step 1) while its owner may still read it.

The words carry a generation count instead of a flag: program p keeps how many barriers it
has passed in its own pad word p, and a peer's word for (p, rank) only grows (each barrier
stores the new generation there with release semantics; the waiter's thread 0 polls for at
least that value, then fences). Nothing is ever reset, so a CUDA graph replays the kernel any
number of times. A wait also reads an abort word in pinned host memory now and then: when a
peer dies the host sets it and the kernel returns (with a meaningless sum) instead of
spinning forever.

all_reduce_ref is the reference the kernel is checked against (tests/kernels).
"""

from __future__ import annotations

import torch

from nanopaged.kernels.rms_norm import rms_norm_ref

try:
    import triton
    import triton.language as tl

    from nanopaged.kernels.rms_norm import rms_normalize
except ImportError:  # CPU-only installs never use the peer all-reduce
    triton = None

# Elements per program per pass, at most this many programs, and pushing parts into the
# peers' buffers rather than staging them for the peers to read: among the fastest settings
# benchmarks/all_reduce_bench.py --tune tries for 1 to 1024 rows of 5120 bf16 on two H200s
# (within 0.5 us of the best at every size; pushing 8% faster than staging at 256 rows).
# The programs are all resident together (one per SM at most), so a waiting program never
# keeps a peer's program it waits for from starting.
BLOCK = 8192
MAX_PROGRAMS = 128
PUSH = True


def pad_words(world_size: int) -> int:
    """int64 words each rank's pad needs: a generation per program, then a word per
    (program, rank) that rank writes."""
    return MAX_PROGRAMS * (1 + world_size)


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' tensors summed in rank order in fp32, in their dtype."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


def all_reduce_rms_norm_ref(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual) * weight, sum + residual): the all-reduce, then rms_norm_ref."""
    return rms_norm_ref(all_reduce_ref(parts), weight, eps, residual)


if triton is not None:

    @triton.jit
    def _store_release(ptr, value):
        # Thread 0 of the program stores `value` (int64) with release semantics, system-wide.
        tl.inline_asm_elementwise(
            """{
            .reg .pred first;
            .reg .u32 tid;
            mov.u32 tid, %tid.x;
            setp.eq.u32 first, tid, 0;
            @first st.release.sys.global.b64 [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _wait_at_least(ptr, target, abort_ptr):
        # Thread 0 polls the word (relaxed loads) until it holds at least `target`, checking
        # the host's abort word every 1024 polls, then fences (acquire); the other threads
        # wait for it at the CTA barrier that follows. One poller per program keeps the spin
        # off the memory system.
        tl.inline_asm_elementwise(
            """{
            .reg .pred skip, ok, later;
            .reg .b64 value, aborted;
            .reg .b32 tid, polls, low;
            mov.u32 tid, %tid.x;
            setp.ne.u32 skip, tid, 0;
            @skip bra WAIT_END_${:uid};
            mov.u32 polls, 0;
            WAIT_POLL_${:uid}:
            ld.relaxed.sys.global.b64 value, [$1];
            setp.ge.s64 ok, value, $2;
            @ok bra WAIT_DONE_${:uid};
            add.u32 polls, polls, 1;
            and.b32 low, polls, 1023;
            setp.ne.u32 later, low, 0;
            @later bra WAIT_POLL_${:uid};
            ld.volatile.global.u64 aborted, [$3];
            setp.eq.u64 later, aborted, 0;
            @later bra WAIT_POLL_${:uid};
            WAIT_DONE_${:uid}:
            fence.acq_rel.sys;
            WAIT_END_${:uid}:
            mov.u32 $0, 0;
            }""",
            "=r,l,l,l", [ptr, target, abort_ptr], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _barrier(ptrs_ptr, pid, generation, abort_ptr,
                 RANK: tl.constexpr, WORLD: tl.constexpr, NUM_PROGRAMS: tl.constexpr):  # fmt: skip
        # Rank r's word for program p in a pad: NUM_PROGRAMS + p * WORLD + r.
        tl.debug_barrier()  # every thread's writes happen before thread 0's release below
        word = NUM_PROGRAMS + pid * WORLD
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                pad = tl.load(ptrs_ptr + WORLD + peer).to(tl.pointer_type(tl.int64))
                _store_release(pad + word + RANK, generation)
        own_pad = tl.load(ptrs_ptr + WORLD + RANK).to(tl.pointer_type(tl.int64))
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                _wait_at_least(own_pad + word + peer, generation, abort_ptr)
        tl.debug_barrier()  # the others go on once thread 0 has seen every peer's word

    @triton.jit
    def _send_part(x_ptr, ptrs_ptr, own, lo, hi,
                   RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                   SLOT: tl.constexpr, PUSH: tl.constexpr):  # fmt: skip
        # Elements [lo, hi) of x into slot RANK of every peer's buffer (push), or into slot 0
        # of this rank's buffer, where the peers read them.
        offs = tl.arange(0, BLOCK)
        dtype = x_ptr.dtype.element_ty
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            mask = idx < hi
            part = tl.load(x_ptr + idx, mask=mask)
            if PUSH:
                for peer in tl.static_range(WORLD):
                    if peer != RANK:
                        dst = tl.load(ptrs_ptr + peer).to(tl.pointer_type(dtype)) + RANK * SLOT
                        tl.store(tl.multiple_of(dst, 16) + idx, part, mask=mask)
            else:
                tl.store(own + idx, part, mask=mask)

    @triton.jit
    def _sum_parts(x_ptr, ptrs_ptr, own, idx, mask,
                   RANK: tl.constexpr, WORLD: tl.constexpr, SLOT: tl.constexpr,
                   PUSH: tl.constexpr):  # fmt: skip
        # Every rank's elements idx of x summed in rank order, in fp32.
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros(idx.shape, dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + idx, mask=mask).to(tl.float32)
            else:
                if PUSH:
                    src = tl.multiple_of(own + r * SLOT, 16)
                else:
                    src = tl.multiple_of(tl.load(ptrs_ptr + r).to(tl.pointer_type(dtype)), 16)
                # .cg: past L1, which may hold this address from an earlier call
                acc += tl.load(src + idx, mask=mask, cache_modifier=".cg").to(tl.float32)
        return acc

    @triton.jit
    def _peer_all_reduce_kernel(
        x_ptr,  # [numel], summed in place
        ptrs_ptr,  # int64 [2 * WORLD + 1]: every rank's buffer, every rank's pad, abort word
        numel,
        per_program,  # a multiple of BLOCK
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        BLOCK: tl.constexpr,
        SLOT: tl.constexpr,  # elements of one slot of a buffer
        PUSH: tl.constexpr,
        ALIGNED: tl.constexpr,  # numel % 16 == 0
    ):
        pid = tl.program_id(0)
        lo = pid * per_program
        hi = tl.minimum(lo + per_program, numel)
        if ALIGNED:  # whole 16-element groups: the accesses vectorize
            hi = tl.multiple_of(hi, 16)
        dtype = x_ptr.dtype.element_ty
        abort_ptr = tl.load(ptrs_ptr + 2 * WORLD).to(tl.pointer_type(tl.int64))
        # The buffers are page-aligned: say so, or their accesses are not vectorized.
        own = tl.multiple_of(tl.load(ptrs_ptr + RANK).to(tl.pointer_type(dtype)), 16)
        own_pad = tl.load(ptrs_ptr + WORLD + RANK).to(tl.pointer_type(tl.int64))
        generation = tl.load(own_pad + pid)  # only this program of this rank writes it
        _send_part(x_ptr, ptrs_ptr, own, lo, hi, RANK, WORLD, BLOCK, SLOT, PUSH)
        _barrier(ptrs_ptr, pid, generation + 1, abort_ptr, RANK, WORLD, NUM_PROGRAMS)
        offs = tl.arange(0, BLOCK)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            mask = idx < hi
            acc = _sum_parts(x_ptr, ptrs_ptr, own, idx, mask, RANK, WORLD, SLOT, PUSH)
            tl.store(x_ptr + idx, acc.to(dtype), mask=mask)
        _barrier(ptrs_ptr, pid, generation + 2, abort_ptr, RANK, WORLD, NUM_PROGRAMS)
        tl.store(own_pad + pid, generation + 2)

    @triton.jit
    def _peer_all_reduce_rms_norm_kernel(
        x_ptr,  # [num_rows, hidden] contiguous: this rank's part of the sum
        residual_ptr,  # [num_rows, hidden] contiguous
        weight_ptr,  # [hidden]
        out_ptr,  # [num_rows, hidden]: norm(sum + residual) * weight
        new_residual_ptr,  # [num_rows, hidden]: sum + residual
        ptrs_ptr,  # as _peer_all_reduce_kernel's
        num_rows,
        hidden,
        inv_hidden,
        eps,
        rows_per_program,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,  # covers the hidden size
        SLOT: tl.constexpr,
        PUSH: tl.constexpr,
    ):
        # Program p sums, adds and normalizes whole rows, so the barriers stay per program.
        pid = tl.program_id(0)
        row_lo = pid * rows_per_program
        row_hi = tl.minimum(row_lo + rows_per_program, num_rows)
        dtype = x_ptr.dtype.element_ty
        abort_ptr = tl.load(ptrs_ptr + 2 * WORLD).to(tl.pointer_type(tl.int64))
        own = tl.multiple_of(tl.load(ptrs_ptr + RANK).to(tl.pointer_type(dtype)), 16)
        own_pad = tl.load(ptrs_ptr + WORLD + RANK).to(tl.pointer_type(tl.int64))
        generation = tl.load(own_pad + pid)
        lo = row_lo.to(tl.int64) * hidden
        hi = row_hi.to(tl.int64) * hidden
        _send_part(x_ptr, ptrs_ptr, own, lo, hi, RANK, WORLD, BLOCK, SLOT, PUSH)
        _barrier(ptrs_ptr, pid, generation + 1, abort_ptr, RANK, WORLD, NUM_PROGRAMS)
        cols = tl.arange(0, BLOCK_N)[None, :]
        col_mask = cols < hidden
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
        for row in range(row_lo, row_hi):
            idx = row.to(tl.int64) * hidden + cols
            # The all-reduce's sum, rounded to x's dtype, then the residual added and rounded,
            # as all-reduce then rms_norm(x, residual) compute them.
            total = _sum_parts(x_ptr, ptrs_ptr, own, idx, col_mask, RANK, WORLD, SLOT, PUSH)
            r = tl.load(residual_ptr + idx, mask=col_mask, other=0.0)
            h = (total.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
            h = tl.where(col_mask, h, 0.0).to(dtype)
            tl.store(new_residual_ptr + idx, h, mask=col_mask)
            out = rms_normalize(h, w, inv_hidden, eps)
            tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=col_mask)
        _barrier(ptrs_ptr, pid, generation + 2, abort_ptr, RANK, WORLD, NUM_PROGRAMS)
        tl.store(own_pad + pid, generation + 2)


def peer_all_reduce(
    x: torch.Tensor,
    ptrs: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_programs: int = 0,
    block: int = BLOCK,
    num_warps: int = 8,
    push: bool = PUSH,
) -> None:
    """Sum contiguous x over the ranks, in place; every rank calls it with the same shape and
    the same launch settings.

    ptrs: int64 on x's device, [2 * world_size + 1]: each rank's buffer (world_size slots of
    slot_bytes, a slot at least x's bytes), each rank's pad (pad_words(world_size) int64
    zeros), the abort word's address. max_programs: at most this many programs (default and
    cap MAX_PROGRAMS); block: elements per program per pass (a power of two); push: write
    this rank's part into the peers' buffers (else stage it in its own, for them to read).
    """
    numel = x.numel()
    assert numel * x.element_size() <= slot_bytes and slot_bytes % x.element_size() == 0
    cap = min(max_programs, MAX_PROGRAMS) if max_programs > 0 else MAX_PROGRAMS
    programs = min(triton.cdiv(numel, block), cap)
    per_program = triton.cdiv(triton.cdiv(numel, programs), block) * block
    programs = triton.cdiv(numel, per_program)
    _peer_all_reduce_kernel[(programs,)](
        x, ptrs, numel, per_program,
        RANK=rank, WORLD=world_size, NUM_PROGRAMS=MAX_PROGRAMS, BLOCK=block,
        SLOT=slot_bytes // x.element_size(), PUSH=push, ALIGNED=numel % 16 == 0,
        num_warps=num_warps,
    )  # fmt: skip


def peer_all_reduce_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    ptrs: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    push: bool = PUSH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual): new_residual = x summed over the ranks + residual, out its RMSNorm
    times weight, in one kernel; x [num_rows, hidden] is left as it was, and ptrs and
    slot_bytes are as for peer_all_reduce. Every rank calls it with the same shapes."""
    assert x.dim() == 2 and x.is_contiguous() and residual.is_contiguous(), (x.shape, x.stride())
    assert residual.shape == x.shape and residual.dtype == x.dtype
    num_rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous() and weight.device == x.device
    assert x.numel() * x.element_size() <= slot_bytes and slot_bytes % x.element_size() == 0
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    new_residual = torch.empty_like(x)
    if num_rows == 0:
        return out, new_residual
    rows_per_program = triton.cdiv(num_rows, min(num_rows, MAX_PROGRAMS))
    block_n = triton.next_power_of_2(hidden)
    _peer_all_reduce_rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x, residual, weight, out, new_residual, ptrs,
        num_rows, hidden, 1.0 / hidden, eps, rows_per_program,
        RANK=rank, WORLD=world_size, NUM_PROGRAMS=MAX_PROGRAMS, BLOCK=BLOCK, BLOCK_N=block_n,
        SLOT=slot_bytes // x.element_size(), PUSH=push,
        num_warps=8 if block_n >= 4096 else 4,
    )  # fmt: skip
    return out, new_residual
