"""The SIGBUS handler runtime/faults.py installs: one line naming the file, then exit.

    llb_sigbus_handler__avx2(sig, info, context)    an SA_SIGINFO handler

It is built with the kernels into the library (and so shipped in the wheel with it): a run
never generates it. The runtime does not call it where it lies in the library: it copies the
function's bytes (the manifest gives their length) into a page of its own with the address
of its table of mapped ranges written over ``TABLE_PLACEHOLDER``, the immediate of the first
instruction. The code is position independent (only jumps within itself), so the copy runs.

What it does: looks the fault address (``siginfo.si_addr``) up in the table, writes the
message of the range holding it (else the fallback message) to stderr with write(2) and ends
the process with exit_group(EXIT_STATUS), 128 + SIGBUS, as if the signal had killed it. It
calls no libc function and touches no Python state. No vector instruction: the avx2 job
holds it only because every library has one.

Table layout (u64 words)::

    [0] count  [1] fallback message address  [2] its length  [3] unused
    then the entries, each [start, end, message address, message length]

These constants are read by runtime/faults.py, which imports this module without PeachPy:
PeachPy is imported inside ``emit`` only.
"""
TABLE_PLACEHOLDER = 0x1122334455667788  # the table's address, written over by the runtime
HEADER_WORDS = 4
ENTRY_WORDS = 4
EXIT_STATUS = 128 + 7                   # 128 + SIGBUS (7 on Linux)
SI_ADDR_OFFSET = 16                     # siginfo_t.si_addr on x86-64 Linux
SYS_WRITE = 1
SYS_EXIT_GROUP = 231
STDERR = 2
SYMBOL = "llb_sigbus_handler__avx2"


def emit(isa):
    from peachpy.x86_64 import (ADD, CMP, JAE, JB, JMP, JZ, LABEL, LEA, MOV, RETURN, SUB, SYSCALL, TEST,
                                Label, eax, edi, qword, r8, r9, rax, rcx, rdx, rsi)
    from .common import Kernel, function

    signature = [("sig", "int32_t"), ("info", "uint8_t*"), ("context", "uint8_t*")]
    fn, _ = function(SYMBOL, signature, isa)
    with fn:
        # The arguments arrive in edi, rsi, rdx (System V): read in place, no LOAD.ARGUMENT,
        # so the code is the same bytes whatever PeachPy's register allocation would do.
        scan, next_entry, not_ours, report = Label("scan"), Label("next"), Label("not_ours"), Label("report")
        MOV(r8, TABLE_PLACEHOLDER)              # the table (this immediate is patched)
        MOV(rax, qword[rsi + SI_ADDR_OFFSET])   # info->si_addr
        MOV(rcx, qword[r8])                     # how many entries
        LEA(r9, [r8 + 8 * HEADER_WORDS])        # the first
        LABEL(scan)
        TEST(rcx, rcx)
        JZ(not_ours)
        CMP(rax, qword[r9])                     # start <= addr < end
        JB(next_entry)
        CMP(rax, qword[r9 + 8])
        JAE(next_entry)
        MOV(rsi, qword[r9 + 16])
        MOV(rdx, qword[r9 + 24])
        JMP(report)
        LABEL(next_entry)
        ADD(r9, 8 * ENTRY_WORDS)
        SUB(rcx, 1)
        JMP(scan)
        LABEL(not_ours)
        MOV(rsi, qword[r8 + 8])
        MOV(rdx, qword[r8 + 16])
        LABEL(report)
        MOV(eax, SYS_WRITE)                     # write(2, message, length)
        MOV(edi, STDERR)
        SYSCALL()
        MOV(eax, SYS_EXIT_GROUP)                # exit_group(128 + SIGBUS)
        MOV(edi, EXIT_STATUS)
        SYSCALL()
        RETURN()
    return [Kernel(fn, "sigbus", isa, tile="", args=signature)]
