"""Encodings that codegen/peachpy_ext.py adds to PeachPy, byte for byte against GNU as."""
import shutil
import subprocess

import pytest
from peachpy.x86_64 import qword, r9, r10, r13, rax, rbx, rdx, rsi
from peachpy.x86_64.registers import rsp

from llambda.codegen.peachpy_ext import LOCK_CMPXCHG, LOCK_XADD

# (instruction, the same in AT&T syntax, its bytes as GNU as 2.40 assembles it and objdump shows them)
LOCKED = [
    (lambda: LOCK_XADD([rax], rdx), "lock xadd %rdx, (%rax)", "f0480fc110"),
    (lambda: LOCK_XADD(qword[r13 + 0x48], r9), "lock xadd %r9, 0x48(%r13)", "f04d0fc14d48"),
    (lambda: LOCK_XADD([rbx + 8], rsi), "lock xadd %rsi, 8(%rbx)", "f0480fc17308"),
    (lambda: LOCK_CMPXCHG([rbx], rdx), "lock cmpxchg %rdx, (%rbx)", "f0480fb113"),
    (lambda: LOCK_CMPXCHG([rsp + 0x10], r10), "lock cmpxchg %r10, 0x10(%rsp)", "f04c0fb1542410"),
]


@pytest.mark.parametrize("make, att, want", LOCKED, ids=[att for _, att, _ in LOCKED])
def test_locked_instructions_encode_as_the_assembler_does(make, att, want):
    assert make().encode().hex() == want


@pytest.mark.skipif(shutil.which("as") is None or shutil.which("objcopy") is None, reason="no GNU as")
def test_the_recorded_bytes_are_what_as_emits_here(tmp_path):
    source = tmp_path / "locked.s"
    source.write_text("".join(att + "\n" for _, att, _ in LOCKED))
    subprocess.run(["as", str(source), "-o", str(tmp_path / "locked.o")], check=True)
    subprocess.run(["objcopy", "-O", "binary", "-j", ".text", str(tmp_path / "locked.o"),
                    str(tmp_path / "locked.bin")], check=True)
    assert (tmp_path / "locked.bin").read_bytes().hex() == "".join(want for _, _, want in LOCKED)


def test_locked_instructions_need_a_qword_in_memory_and_a_register():
    with pytest.raises(SyntaxError, match="LOCK_XADD: expected m64, r64"):
        LOCK_XADD(rax, rdx)
    with pytest.raises(SyntaxError, match="LOCK_CMPXCHG: expected m64, r64"):
        LOCK_CMPXCHG(rbx, rdx)
