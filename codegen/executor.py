"""The plan executor: one native call per thread runs a whole plan of kernel calls.

    llb_run_plan__avx2(plan, n_ops, tid, n_threads, sync)
    llb_run_plan_timed__avx2(plan, n_ops, tid, n_threads, sync, stamps)   # the profiler's twin
    llb_read_tsc__avx2(out)                                               # out: u64, the TSC now

``plan`` is an array of fixed-size op records laid out ``[n_ops][n_threads]``:
thread ``tid`` reads record ``plan[op][tid]``, calls its kernel (if any) with
the record's arguments, and, when the record asks for it, waits at a barrier
until every thread has finished the op. The Python side (runtime/plan.py)
splits the work and writes each thread's arguments once, when the plan is
built; per token it only patches a few words.

Record (RECORD_BYTES = 128, two cache lines; offsets below):

    FN_OFFSET         u64      kernel address; 0 = nothing to do for this thread
    FLOAT_ARGS_OFFSET f32[2]   passed in xmm0, xmm1
    BARRIER_OFFSET    u32      nonzero: all threads wait here after the op
                               (the same value in every thread's record)
    INT_ARGS_OFFSET   u64[13]  integer/pointer args: rdi, rsi, rdx, rcx, r8, r9,
                               then 7 on the stack (System V order)

A non-empty plan ends with one more barrier: each thread returns only when
every thread has finished every op, so worker 0 coming back means the plan is
done and nobody waits for the others in Python.

Every slot is always passed: a kernel ignores the registers and stack slots
it does not declare, so the executor needs no per-op argument count.

The barrier is built from plain stores (PeachPy emits no LOCK prefix): the
``sync`` block holds one 64-byte line per thread after a control line,

    line 0           u64 abort flag (nonzero: spinning threads give up and return)
    line 1 + t       u64 epoch of thread t: how many barriers it has reached

Thread t counts its barriers in a register, publishes the count with one
store to its own line (MFENCE first, so the op's results -- including
non-temporal stores -- are visible before the count says they are) and spins
with PAUSE until every line shows at least that count. Each thread reads its
epoch from its line when the plan starts, so epochs carry over from plan to
plan; the pool zeroes the block once, and again only after an abort. A
thread can be at most one barrier ahead of the slowest one, so ``>=`` is
exact and the 64-bit counters never wrap in practice.

A spinner that has waited SPINS_BEFORE_YIELD pauses calls sched_yield: with
more threads than cores (or a busy machine) the thread it waits for may be
queued on its core, and a pure spinner would hold that core for a whole time
slice.

The timed twin runs the same plan and also writes time-stamp counter
readings into ``stamps``, u64 ``[n_threads][n_ops + 1][2]``: thread t's row
starts with its entry time (both words), then per op ``[kernel returned,
released]`` -- released being after the op's barrier, or the same reading
when it has none, and for the last op after the plan's closing barrier. So
``released[op] - released[op - 1]`` on thread 0 is what the op added to the
plan's time, waits included, and ``returned[op] - released[op - 1]`` is what
the kernel took on each thread. An LFENCE before each RDTSC keeps it from
reading the counter before the kernel's last instructions have run. A
reading costs ~15 ns (measured: a plan of tiny ops runs ~15 ns an op slower
timed, ~30 ns for one with a barrier). The untimed executor has none of
this: profiling costs nothing when it is off.
"""
import peachpy.stream
from peachpy.x86_64 import (LOAD, RETURN, Label, LABEL, MOV, LEA, ADD, SUB, AND, SHL, OR, XOR, IMUL, CMP, TEST,
                            JZ, JNZ, JE, JNE, JAE, JMP, CALL, PAUSE, MFENCE, LFENCE, SYSCALL, Loop, Block,
                            VMOVSS, GeneralPurposeRegister64, XMMRegister, YMMRegister,
                            qword, dword, rax, rbx, rcx, rdx, rsi, rdi, rbp, r8, r9, r10, r11, r12, r13,
                            r14, r15, eax, xmm0, xmm1)

# rsp is not exported by peachpy.x86_64: PeachPy owns the stack unless told otherwise.
from peachpy.x86_64.registers import rsp
from peachpy.x86_64.instructions import Instruction

from .common import LANES, Kernel, function, stream, symbol

from .contract import (RECORD_BYTES, FN_OFFSET, FLOAT_ARGS_OFFSET, BARRIER_OFFSET, INT_ARGS_OFFSET,
                       MAX_INT_ARGS, MAX_FLOAT_ARGS, STAMP_WORDS)
SYNC_LINE_BYTES = 64
ABORT_OFFSET = 0

INT_ARG_REGISTERS = (rdi, rsi, rdx, rcx, r8, r9)
STACK_ARGS = MAX_INT_ARGS - len(INT_ARG_REGISTERS)
# Stack slots for the call, rounded up to keep rsp 16-byte aligned at CALL.
STACK_ARGS_BYTES = (STACK_ARGS * 8 + 15) // 16 * 16
SPINS_BEFORE_YIELD = 256
SYS_SCHED_YIELD = 24
STAMP_BYTES = 8 * STAMP_WORDS

RECORD_SHIFT = RECORD_BYTES.bit_length() - 1
SYNC_LINE_SHIFT = SYNC_LINE_BYTES.bit_length() - 1

assert INT_ARGS_OFFSET + 8 * MAX_INT_ARGS <= RECORD_BYTES
assert RECORD_BYTES == 1 << RECORD_SHIFT and RECORD_BYTES % 64 == 0
assert SYNC_LINE_BYTES == 1 << SYNC_LINE_SHIFT


def emit_run_plan(isa, timed=False):
    """The executor (``timed``: its twin that stamps every op). Everything live
    across a kernel call sits in callee-saved registers (PeachPy saves them for
    us) or in our own frame, named here once:

        r12  this thread's record of the current op     r13  ops left
        r14  bytes from one op's records to the next's  r15  sync block
        rbx  this thread's epoch                        rbp  rsp at entry
        [rsp] n_threads, [rsp+8] address of this thread's epoch line,
        [rsp+16] (timed) where this thread's next op stamps go
    """
    sig = [("plan", "const uint8_t*"), ("n_ops", "size_t"), ("tid", "size_t"),
           ("n_threads", "size_t"), ("sync", "uint8_t*")]
    if timed:
        sig.append(("stamps", "uint8_t*"))
    fn, args = function(symbol("run_plan_timed" if timed else "run_plan", "", "", isa), sig, isa)
    plan, n_ops, tid, n_threads, sync = args[:5]
    record, ops_left, op_stride, sync_base, epoch, saved_rsp = r12, r13, r14, r15, rbx, rbp
    finished = Label("finished")
    with fn:
        LOAD.ARGUMENT(record, plan)
        LOAD.ARGUMENT(ops_left, n_ops)
        LOAD.ARGUMENT(op_stride, n_threads)
        LOAD.ARGUMENT(sync_base, sync)
        thread, my_line = rax, rdx          # needed only until the loop starts
        LOAD.ARGUMENT(thread, tid)
        if timed:
            stamp_row = r10
            LOAD.ARGUMENT(stamp_row, args[5])

        # Our own 16-byte-aligned frame, whatever PeachPy's prologue pushed.
        MOV(saved_rsp, rsp)
        AND(rsp, -16)
        SUB(rsp, 32 if timed else 16)
        MOV([rsp], op_stride)
        # Shifts, not IMUL: PeachPy encodes IMUL's immediates 128..255 as a
        # sign-extended imm8, i.e. IMUL(r, r, 128) multiplies by -128.
        LEA(my_line, [thread + 1])
        SHL(my_line, SYNC_LINE_SHIFT)
        ADD(my_line, sync_base)
        MOV([rsp + 8], my_line)
        MOV(epoch, [my_line])
        if timed:
            # stamp_row += tid * (n_ops + 1) * STAMP_BYTES (a register IMUL: no immediate)
            LEA(r11, [ops_left + 1])
            SHL(r11, STAMP_BYTES.bit_length() - 1)
            IMUL(r11, thread)
            ADD(stamp_row, r11)
            MOV([rsp + 16], stamp_row)

        SHL(thread, RECORD_SHIFT)
        ADD(record, thread)
        SHL(op_stride, RECORD_SHIFT)

        if timed:
            _stamp(0, 8)                    # entry
            ADD(qword[rsp + 16], STAMP_BYTES)
        TEST(ops_left, ops_left)
        JZ(finished)
        with Loop() as ops:
            _call_kernel(record)
            if timed:
                _stamp(0, 8)                # returned; released too, unless a barrier follows
            no_barrier = Block()
            with no_barrier:
                CMP(dword[record + BARRIER_OFFSET], 0)
                JE(no_barrier.end)
                _barrier(epoch, sync_base, finished)
                if timed:
                    _stamp(8)
            if timed:
                ADD(qword[rsp + 16], STAMP_BYTES)
            ADD(record, op_stride)
            SUB(ops_left, 1)
            JNZ(ops.begin)
        _barrier(epoch, sync_base, finished)
        if timed:
            _stamp(8 - STAMP_BYTES)         # the last op is released by the closing barrier
        LABEL(finished)
        MOV(rsp, saved_rsp)
        RETURN()
    return Kernel(fn, "executor", isa, args=sig)


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
    MOV(r10, [rsp + 16])
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


def _barrier(epoch, sync_base, finished):
    """Publish one more barrier reached; wait until every thread has too.

    The loop's registers are ones SYSCALL leaves alone (it clobbers rax, rcx, r11)."""
    line, threads_left, spins = rdi, rsi, r8
    ADD(epoch, 1)
    MFENCE()
    MOV(rax, [rsp + 8])
    MOV([rax], epoch)

    MOV(threads_left, [rsp])
    LEA(line, [sync_base + SYNC_LINE_BYTES])
    MOV(spins.as_dword, SPINS_BEFORE_YIELD)
    with Loop() as threads:
        with Loop() as spin:
            CMP(qword[line], epoch)
            JAE(spin.end)
            PAUSE()
            CMP(qword[sync_base + ABORT_OFFSET], 0)
            JNE(finished)
            SUB(spins, 1)
            JNZ(spin.begin)
            MOV(eax, SYS_SCHED_YIELD)
            SYSCALL()
            MOV(spins.as_dword, SPINS_BEFORE_YIELD)
            JMP(spin.begin)
        ADD(line, SYNC_LINE_BYTES)
        SUB(threads_left, 1)
        JNZ(threads.begin)


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
