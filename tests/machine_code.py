"""The compiled extension's x86-64 machine code, for the tests that check it statically (objdump)."""

from __future__ import annotations

import functools
import platform
import re
import shutil
import subprocess

import pytest


@functools.lru_cache(maxsize=1)
def disassembly() -> str:
    """``objdump -d -C`` of ``sequoia_kernels._C`` (skips the test off x86-64 or without objdump)."""
    import sequoia_kernels._C as ext

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("needs x86-64 and binutils' objdump")
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", ext.__file__], capture_output=True,
                          text=True, timeout=300).stdout


def function_body(name: str, *, skip_missing: bool = False) -> str:
    """The instructions of the first function whose demangled name contains ``name``; a missing one
    fails the test (or skips it: code a compiler without the intrinsics does not build)."""
    m = re.search(rf"<[^>]*{re.escape(name)}[^>]*>:\n(.*?)\n\n", disassembly(), re.S)
    if m is None:
        if skip_missing:
            pytest.skip(f"no {name} in this build (a compiler without its intrinsics)")
        pytest.fail(f"no {name} in the extension")
    return m.group(1)
