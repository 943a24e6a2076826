"""Compile a Triton kernel for sm90 without a GPU and read its resources (the ``--offline`` modes of
``bench/moe_gemm_tune.py`` and ``bench/paged_decode_variants.py``).

``triton.compile`` with an explicit target runs the whole pipeline to a cubin (ptxas ships in the
triton wheel); ``cuobjdump`` from the same wheel reports registers, stack and local memory per
thread (LOCAL 0 = no spills). Needs no CUDA device.
"""
from __future__ import annotations

import os
import subprocess
import tempfile


def compile_sm90(kernel, signature: dict, constants: dict, attrs: dict, num_warps: int, num_stages: int,
                 max_registers: int = 0):
    """``kernel`` (a ``@triton.jit`` function) compiled for sm90: the ``CompiledKernel`` (``.asm``
    holds "ptx" and "cubin", ``.metadata.shared`` the shared-memory bytes). ``max_registers`` > 0: Triton's
    ``maxnreg``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages}
                          | ({"maxnreg": max_registers} if max_registers else {}))


def register_usage(compiled) -> str:
    """``"REG:n STACK:n LOCAL:n"`` of the compiled kernel, as ``cuobjdump --dump-resource-usage`` says."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(w for line in usage.splitlines() if "REG:" in line for w in line.split()
                    if w.split(":")[0] in ("REG", "STACK", "LOCAL"))


def first_instructions(compiled, opcodes: tuple[str, ...]) -> dict:
    """Index in the kernel's SASS of the first instruction of each of ``opcodes`` (matched on the opcode's name
    before its first dot, e.g. ``UTMALDG`` for ``UTMALDG.2D``); absent ones are left out. Orders what a kernel
    issues: e.g. under ``engine/pdl.py`` the weight prefetch (``UBLKPF``) and the grid-dependency wait
    (``ACQBULK``) before any load (``UTMALDG``, ``LDG``, ``LDGSTS``)."""
    import re

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, flags=re.M)
    first = {}
    for i, op in enumerate(ops):
        if op in opcodes:
            first.setdefault(op, i)
    return first
