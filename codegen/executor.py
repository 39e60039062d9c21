"""The plan executor: one native call per thread runs a whole plan of kernel calls.

    llb_run_plan__avx2(plan, n_ops, tid, n_threads, sync, chunks, state, run)
    llb_run_plan_timed__avx2(plan, n_ops, tid, n_threads, sync, chunks, state, run, stamps)
    llb_read_tsc__avx2(out)                                   # out: u64, the TSC now

``plan`` is an array of fixed-size op records laid out ``[n_ops][n_threads]``.
An op is one of two kinds, told by its CHUNKS_OFFSET word (the same in every
thread's record of the op):

- static (0): thread ``tid`` calls the kernel of its own record
  ``plan[op][tid]`` (if any) with the record's arguments;
- dynamic (n > 0): the op is n chunk records, ``chunks[first .. first + n)``
  (``first`` in the op record's first integer slot), and every thread claims
  chunks one at a time until none is left. Whichever thread claims a chunk
  calls the same kernel on the same arguments, so what a chunk computes does
  not depend on who ran it or when.

Record (RECORD_BYTES = 128, two cache lines; offsets below):

    FN_OFFSET         u64      kernel address; 0 = nothing to do for this thread
    FLOAT_ARGS_OFFSET f32[2]   passed in xmm0, xmm1
    BARRIER_OFFSET    u32      nonzero: wait here until the op is finished
                               (the same value in every thread's record)
    CHUNKS_OFFSET     u32      0: static; n: dynamic, n chunk records
    INT_ARGS_OFFSET   u64[13]  integer/pointer args: rdi, rsi, rdx, rcx, r8, r9,
                               then 7 on the stack (System V order)

Every slot is always passed: a kernel ignores the registers and stack slots
it does not declare, so the executor needs no per-op argument count.

Waiting counts work, not threads. ``state`` holds two 64-byte lines per op:
CLAIMED_OFFSET, the chunks claimed, and DONE_OFFSET, the records finished
(a dynamic op's chunks; a static op's records, one per thread, idle ones
included), both counted over every run of the plan. ``run`` numbers the runs
from 1 (the pool counts them), so in run r an op is finished when its done
count reaches r * n (n = its chunks, or n_threads for a static op). A barrier
after op j waits until every op since the previous barrier is finished; it
does not wait for the other threads to arrive. So a thread whose core is
taken by another process holds the others up only while it holds a claimed
chunk (or at a static op): when it comes back, it finds the ops it missed
finished and catches up without doing anything. A non-empty plan ends with
one more such wait, so every thread returns only once the whole plan is done.

A chunk is claimed with LOCK CMPXCHG, never past the run's last chunk: in
run r, op j's claim count goes from (r-1)*n to exactly r*n, and ticket t is
chunk ``t - (r-1)*n``. Claims never overshoot, so nothing is reset between
runs, and a straggler still walking run r-1 when run r starts compares the
counts against its own run's end, finds every chunk of it claimed and done,
and claims nothing. Finished records are counted with LOCK XADD after an
SFENCE (the kernel's non-temporal stores are visible before the count says
they are; the locked instruction orders the rest).

The ``sync`` block's first u64 is the abort flag (nonzero: waiting threads
give up and return); the pool raises it only to recover from an interrupted
run, and then resets the plan's state.

A waiter that has spun SPINS_BEFORE_YIELD pauses calls sched_yield: with
more threads than cores (or a busy machine) the thread it waits for may be
queued on its core, and a pure spinner would hold that core for a whole time
slice.

The timed twin runs the same plan and also writes time-stamp counter
readings into ``stamps``, u64 ``[n_threads][n_ops + 1][2]``: thread t's row
starts with its entry time (both words), then per op ``[kernel returned,
released]`` -- returned being when the thread ran out of chunks to claim (or
its static kernel returned), released after the op's barrier, or the same
reading when it has none, and for the last op after the plan's closing wait. So
``released[op] - released[op - 1]`` on thread 0 is what the op added to the
plan's time, waits included, and ``returned[op] - released[op - 1]`` is what
the kernels took on each thread. An LFENCE before each RDTSC keeps it from
reading the counter before the kernel's last instructions have run. A
reading costs ~15 ns (measured: a plan of tiny ops runs ~15 ns an op slower
timed, ~30 ns for one with a barrier). The untimed executor has none of
this: profiling costs nothing when it is off.
"""
import peachpy.stream
from peachpy.x86_64 import (LOAD, RETURN, Label, LABEL, MOV, LEA, ADD, SUB, AND, SHL, OR, XOR, IMUL, CMP, TEST,
                            JZ, JNZ, JE, JNE, JAE, JBE, JS, JMP, PUSH, POP, CALL, PAUSE, SFENCE, LFENCE, SYSCALL,
                            Loop, Block,
                            VMOVSS, GeneralPurposeRegister64, XMMRegister, YMMRegister,
                            qword, dword, rax, rbx, rcx, rdx, rsi, rdi, rbp, r8, r9, r10, r11, r12, r13,
                            r14, r15, eax, edx, esi, xmm0, xmm1)

# rsp is not exported by peachpy.x86_64: PeachPy owns the stack unless told otherwise.
from peachpy.x86_64.registers import rsp
from peachpy.x86_64.instructions import Instruction

from .common import LANES, Kernel, function, stream, symbol

from .contract import (RECORD_BYTES, FN_OFFSET, FLOAT_ARGS_OFFSET, BARRIER_OFFSET, CHUNKS_OFFSET,
                       INT_ARGS_OFFSET, MAX_INT_ARGS, MAX_FLOAT_ARGS, STAMP_WORDS, STATE_LINE_BYTES,
                       CLAIMED_OFFSET, DONE_OFFSET)
from .peachpy_ext import LOCK_CMPXCHG, LOCK_XADD
ABORT_OFFSET = 0

INT_ARG_REGISTERS = (rdi, rsi, rdx, rcx, r8, r9)
STACK_ARGS = MAX_INT_ARGS - len(INT_ARG_REGISTERS)
# Stack slots for the call, rounded up to keep rsp 16-byte aligned at CALL.
STACK_ARGS_BYTES = (STACK_ARGS * 8 + 15) // 16 * 16
SPINS_BEFORE_YIELD = 256
YIELDS_BEFORE_SLEEP = 16
SLEEP_NS = 20_000
SYS_SCHED_YIELD = 24
SYS_FUTEX = 202
FUTEX_WAIT_PRIVATE = 128
STAMP_BYTES = 8 * STAMP_WORDS

RECORD_SHIFT = RECORD_BYTES.bit_length() - 1

assert INT_ARGS_OFFSET + 8 * MAX_INT_ARGS <= RECORD_BYTES
assert RECORD_BYTES == 1 << RECORD_SHIFT and RECORD_BYTES % 64 == 0
assert CHUNKS_OFFSET == BARRIER_OFFSET + 4 and CHUNKS_OFFSET + 4 <= INT_ARGS_OFFSET


# The executor's own frame (16-byte aligned below the saved rsp):
FRAME_N_THREADS = 0         # n_threads: a static op's record count
FRAME_RUN = 8               # this run's number (from 1)
FRAME_STAMPS = 16           # (timed) where this thread's next op stamps go
FRAME_PHASE_RECORD = 24     # this thread's record of the first op not yet waited for
FRAME_PHASE_LINE = 32       # that op's state line
FRAME_CHUNKS = 40           # the chunk records
FRAME_TIMEOUT = 48          # struct timespec {0 s, SLEEP_NS}: a waiter's nap
FRAME_BYTES = 64


def emit_run_plan(isa, timed=False):
    """The executor (``timed``: its twin that stamps every op). Everything live
    across a kernel call sits in callee-saved registers (PeachPy saves them for
    us) or in our own frame (FRAME_*):

        r12  this thread's record of the current op     r13  ops left
        r14  bytes from one op's records to the next's  r15  sync block
        rbx  the current op's state line                rbp  rsp at entry
    """
    sig = [("plan", "const uint8_t*"), ("n_ops", "size_t"), ("tid", "size_t"),
           ("n_threads", "size_t"), ("sync", "uint8_t*"), ("chunks", "const uint8_t*"),
           ("state", "uint8_t*"), ("run", "size_t")]
    if timed:
        sig.append(("stamps", "uint8_t*"))
    fn, args = function(symbol("run_plan_timed" if timed else "run_plan", "", "", isa), sig, isa)
    plan, n_ops, tid, n_threads, sync, chunks, state, run = args[:8]
    record, ops_left, op_stride, sync_base, line, saved_rsp = r12, r13, r14, r15, rbx, rbp
    finished = Label("finished")
    with fn:
        LOAD.ARGUMENT(record, plan)
        LOAD.ARGUMENT(ops_left, n_ops)
        LOAD.ARGUMENT(op_stride, n_threads)
        LOAD.ARGUMENT(sync_base, sync)
        LOAD.ARGUMENT(line, state)
        thread = rax                        # needed only until the loop starts
        LOAD.ARGUMENT(thread, tid)
        LOAD.ARGUMENT(rdx, run)
        LOAD.ARGUMENT(rcx, chunks)
        if timed:
            stamp_row = r10
            LOAD.ARGUMENT(stamp_row, args[8])

        # Our own 16-byte-aligned frame, whatever PeachPy's prologue pushed.
        MOV(saved_rsp, rsp)
        AND(rsp, -16)
        SUB(rsp, FRAME_BYTES)
        MOV([rsp + FRAME_N_THREADS], op_stride)
        MOV([rsp + FRAME_RUN], rdx)
        MOV([rsp + FRAME_CHUNKS], rcx)
        MOV(qword[rsp + FRAME_TIMEOUT], 0)
        MOV(qword[rsp + FRAME_TIMEOUT + 8], SLEEP_NS)
        if timed:
            # stamp_row += tid * (n_ops + 1) * STAMP_BYTES (a register IMUL: no immediate)
            LEA(r11, [ops_left + 1])
            SHL(r11, STAMP_BYTES.bit_length() - 1)
            IMUL(r11, thread)
            ADD(stamp_row, r11)
            MOV([rsp + FRAME_STAMPS], stamp_row)

        # Shifts, not IMUL: PeachPy encodes IMUL's immediates 128..255 as a
        # sign-extended imm8, i.e. IMUL(r, r, 128) multiplies by -128.
        SHL(thread, RECORD_SHIFT)
        ADD(record, thread)
        SHL(op_stride, RECORD_SHIFT)
        MOV([rsp + FRAME_PHASE_RECORD], record)
        MOV([rsp + FRAME_PHASE_LINE], line)

        if timed:
            _stamp(0, 8)                    # entry
            ADD(qword[rsp + FRAME_STAMPS], STAMP_BYTES)
        TEST(ops_left, ops_left)
        JZ(finished)
        with Loop() as ops:
            static, after = Label(), Label()
            CMP(dword[record + CHUNKS_OFFSET], 0)
            JE(static)
            _claim_chunks(record, line)
            JMP(after)
            LABEL(static)
            _call_kernel(record)
            _count_done(line)
            LABEL(after)
            if timed:
                _stamp(0, 8)                # returned; released too, unless a barrier follows
            no_barrier = Block()
            with no_barrier:
                CMP(dword[record + BARRIER_OFFSET], 0)
                JE(no_barrier.end)
                _wait_finished(line, op_stride, sync_base, finished)
                if timed:
                    _stamp(8)
            if timed:
                ADD(qword[rsp + FRAME_STAMPS], STAMP_BYTES)
            ADD(record, op_stride)
            ADD(line, STATE_LINE_BYTES)
            SUB(ops_left, 1)
            JNZ(ops.begin)
        SUB(line, STATE_LINE_BYTES)         # the last op: wait for it and those before it
        _wait_finished(line, op_stride, sync_base, finished)
        if timed:
            _stamp(8 - STAMP_BYTES)         # the last op is released by the closing wait
        LABEL(finished)
        MOV(rsp, saved_rsp)
        RETURN()
    return Kernel(fn, "executor", isa, args=sig)


def _claim_chunks(record, line):
    """Claim chunks of the dynamic op whose record is ``record`` until none is left; run each.

    In run r the op's claim count runs from start = (r-1)*n to end = r*n; a claim
    moves it up by one with LOCK CMPXCHG, and only while it is below end."""
    claim, no_more = Label(), Label()
    n, end, ticket, bumped = r8, r9, rax, rdx
    LABEL(claim)
    MOV(n.as_dword, dword[record + CHUNKS_OFFSET])
    MOV(end, [rsp + FRAME_RUN])
    IMUL(end, n)
    MOV(ticket, [line + CLAIMED_OFFSET])
    with Loop() as retry:
        CMP(ticket, end)
        JAE(no_more)
        LEA(bumped, [ticket + 1])
        LOCK_CMPXCHG(qword[line + CLAIMED_OFFSET], bumped)    # failed: ticket = the count now
        JNZ(retry.begin)
    # chunk record = chunks + (first + ticket - (end - n)) * RECORD_BYTES
    SUB(end, n)
    SUB(ticket, end)
    ADD(ticket, [record + INT_ARGS_OFFSET])
    SHL(ticket, RECORD_SHIFT)
    ADD(ticket, [rsp + FRAME_CHUNKS])
    MOV(r11, ticket)
    _call_kernel(r11)
    _count_done(line)
    JMP(claim)
    LABEL(no_more)


def _count_done(line):
    """One more record of this op finished, its results visible before the count."""
    SFENCE()
    MOV(eax, 1)
    LOCK_XADD(qword[line + DONE_OFFSET], rax)

class _RDTSC(Instruction):
    """RDTSC (0F 31: edx:eax = time-stamp counter), which every x86-64 CPU has.

    PeachPy's own RDTSC is tagged with an ISA extension that its Haswell target
    does not list, so it refuses to emit it there; this one carries no tag."""

    def __init__(self):
        super().__init__("RDTSC")
        self.encodings.append((0x00, lambda _: bytearray([0x0F, 0x31])))
        self._implicit_out_regs = {0: 7, 2: 7}      # rax, rdx
        if peachpy.stream.active_stream is not None:
            peachpy.stream.active_stream.add_instruction(self)


def _read_tsc():
    """rdx = the TSC, read once every earlier instruction has run. Clobbers rax."""
    LFENCE()
    _RDTSC()
    SHL(rdx, 32)
    OR(rdx, rax)


def _stamp(*offsets):
    """Store the TSC at [the frame's stamp cursor + each offset]. Clobbers rax, rdx, r10."""
    _read_tsc()
    MOV(r10, [rsp + FRAME_STAMPS])
    for offset in offsets:
        MOV([r10 + offset], rdx)


def emit_read_tsc(isa):
    """out: u64 = the time-stamp counter (the profiler converts ticks to seconds with it)."""
    sig = [("out", "uint8_t*")]
    fn, (out,) = function(symbol("read_tsc", "", "", isa), sig, isa)
    with fn:
        # Physical registers, none of them the argument's (see emit_echo_args).
        LOAD.ARGUMENT(r11, out)
        _read_tsc()
        MOV([r11], rdx)
        RETURN()
    return Kernel(fn, "executor", isa, args=sig)


def _call_kernel(record):
    """Call the record's kernel, if it has one, with all its argument slots."""
    idle = Block()
    with idle:
        MOV(rax, [record + FN_OFFSET])
        TEST(rax, rax)
        JZ(idle.end)
        SUB(rsp, STACK_ARGS_BYTES)
        for slot in range(STACK_ARGS):
            MOV(r10, [record + INT_ARGS_OFFSET + 8 * (len(INT_ARG_REGISTERS) + slot)])
            MOV([rsp + 8 * slot], r10)
        for i, reg in enumerate(INT_ARG_REGISTERS):
            MOV(reg, [record + INT_ARGS_OFFSET + 8 * i])
        VMOVSS(xmm0, dword[record + FLOAT_ARGS_OFFSET])
        VMOVSS(xmm1, dword[record + FLOAT_ARGS_OFFSET + 4])
        CALL(rax)
        ADD(rsp, STACK_ARGS_BYTES)


def _wait_finished(last_line, op_stride, sync_base, finished):
    """Wait until every op from the frame's phase start through ``last_line``'s op is
    finished in this run; the phase then starts at the op after it.

    An op is finished when its done count reaches run * (its chunks, or n_threads
    for a static op). The loop's registers are ones SYSCALL leaves alone (it
    clobbers rax, rcx, r11); the futex call's own arguments are saved around it."""
    op_record, op_line, target, spins, yields = rdi, rsi, r8, r9, rdx
    each_op, check, counted = Label(), Label(), Label()
    MOV(op_record, [rsp + FRAME_PHASE_RECORD])
    MOV(op_line, [rsp + FRAME_PHASE_LINE])
    JMP(check)                          # the phase may be empty: the plan's last op had a barrier
    LABEL(each_op)
    MOV(target.as_dword, dword[op_record + CHUNKS_OFFSET])
    TEST(target, target)
    JNZ(counted)
    MOV(target, [rsp + FRAME_N_THREADS])
    LABEL(counted)
    IMUL(target, [rsp + FRAME_RUN])
    MOV(spins.as_dword, SPINS_BEFORE_YIELD)
    MOV(yields.as_dword, YIELDS_BEFORE_SLEEP)
    with Loop() as spin:
        CMP(qword[op_line + DONE_OFFSET], target)
        JAE(spin.end)
        PAUSE()
        CMP(qword[sync_base + ABORT_OFFSET], 0)
        JNE(finished)
        SUB(spins, 1)
        JNZ(spin.begin)
        MOV(spins.as_dword, SPINS_BEFORE_YIELD)
        nap = Label()
        SUB(yields, 1)
        JS(nap)
        MOV(eax, SYS_SCHED_YIELD)
        SYSCALL()
        JMP(spin.begin)
        LABEL(nap)
        # futex(&done, FUTEX_WAIT_PRIVATE, done's low half as just read, &timeout): returns
        # at once if the count moved, else after SLEEP_NS; nobody wakes it. Sleeping, not
        # yielding, leaves this CPU idle, so the scheduler can move the thread we wait
        # for onto it when another process holds that thread's CPU.
        MOV(yields.as_dword, 0)             # from now on every spell of spinning ends in a nap
        PUSH(rdi)
        PUSH(rsi)
        PUSH(yields)
        MOV(edx, dword[op_line + DONE_OFFSET])
        LEA(r10, [rsp + 24 + FRAME_TIMEOUT])
        LEA(rdi, [op_line + DONE_OFFSET])
        MOV(esi, FUTEX_WAIT_PRIVATE)
        MOV(eax, SYS_FUTEX)
        SYSCALL()
        POP(yields)
        POP(rsi)
        POP(rdi)
        JMP(spin.begin)
    ADD(op_record, op_stride)
    ADD(op_line, STATE_LINE_BYTES)
    LABEL(check)
    CMP(op_line, last_line)
    JBE(each_op)
    MOV([rsp + FRAME_PHASE_RECORD], op_record)
    MOV([rsp + FRAME_PHASE_LINE], op_line)


def emit_copy(isa):
    """dst[i] = src[i] for i < n: the plan tests' workhorse (chains of dependent copies)."""
    sig = [("src", "const float*"), ("dst", "float*"), ("n", "size_t")]
    fn, args = function(symbol("copy", "f32", "", isa), sig, isa)
    with fn:
        src, dst, n, index = (GeneralPurposeRegister64() for _ in range(4))
        for reg, arg in zip((src, dst, n), args):
            LOAD.ARGUMENT(reg, arg)
        XOR(index.as_dword, index.as_dword)

        def step(v):
            x = YMMRegister()
            v.load(x, src)
            v.store(dst, x)

        stream(n, [index], step, unroll=1)
        RETURN()
    return Kernel(fn, "executor", isa, tile=f"{LANES}", args=sig)


def emit_echo_args(isa):
    """Test kernel: writes back every argument it was called with, and rsp mod 16 at entry.

    out: u64[12] = a1..a12, then f32 f0, f32 f1 (bytes 96..103), then u64 rsp % 16
    (bytes 104..111; 8 when the caller kept the System V alignment). The floats
    sit between the integers in the signature: System V assigns the two classes
    independently, which is what the executor relies on."""
    ints = [(f"a{k}", "size_t") for k in range(1, 13)]
    sig = [("out", "uint8_t*")] + ints[:5] + [("f0", "float")] + ints[5:] + [("f1", "float")]
    fn, args = function(symbol("echo_args", "", "", isa), sig, isa)
    by_name = {a.name: a for a in args}
    with fn:
        # Physical registers outside the argument set: PeachPy's allocator does not
        # know argument registers are live before their LOAD.ARGUMENT. No
        # callee-saved register and no locals, so no prologue moves rsp.
        out, value, f = r11, rax, XMMRegister()
        MOV(value, rsp)
        AND(value, 15)
        LOAD.ARGUMENT(out, by_name["out"])
        MOV([out + 104], value)
        for k in range(1, 13):
            LOAD.ARGUMENT(value, by_name[f"a{k}"])
            MOV([out + 8 * (k - 1)], value)
        for i, name in enumerate(("f0", "f1")):
            LOAD.ARGUMENT(f, by_name[name])
            VMOVSS(dword[out + 96 + 4 * i], f)
        RETURN()
    return Kernel(fn, "executor", isa, args=sig)


def emit(isa):
    return [emit_run_plan(isa), emit_run_plan(isa, timed=True), emit_read_tsc(isa),
            emit_copy(isa), emit_echo_args(isa)]
