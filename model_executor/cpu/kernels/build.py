"""Builds the CPU kernels once per machine, loads them, and says which paths this CPU takes.

The shared object is cached under ~/.cache/srt/kernels (SRT_KERNEL_CACHE overrides), keyed by
the sources, the compiler, its flags and the CPU's feature flags (it is built with
-march=native). Every rank of every process loads the same file; a build writes a temporary file
and renames it, so ranks that race build twice at worst, never read half a file.

The interface is srt_kernels.h: every .c file includes it, the build refuses an exported function
it does not declare (-Werror=missing-prototypes), and the ctypes signatures are read from it
(`signatures`). So a definition that disagrees with its declaration does not build, and a Python
call with an argument too many or too few raises TypeError instead of reading past the arguments.

When there is no C compiler, the build fails, or SRT_CPU_KERNELS=0, `kernels()` is None and the
layers keep their torch ops: same results within bf16 rounding, more time per step.

SRT_CPU_KERNEL_ISA forces the paths a CPU with fewer features takes, so they can be tested on this
one (`kernel_isa`): the kernels are built without the instructions that CPU lacks (-mno-...), so
their own #if fallbacks compile in and the probes below answer as they would there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("srt.kernels")

HEADER = Path(__file__).with_name("srt_kernels.h")
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.c",
        "cpu_amx.c",
        "cpu_bf16_linear.c",
        "cpu_avx2_linear.c",
        "cpu_int8_linear.c",
        "cpu_q4_linear.c",
        "cpu_q8_linear.c",
        "cpu_prefill_attention.c",
        "cpu_moe.c",
        "cpu_lora.c",
        "gguf_repack.c",
    )
)
HEADERS = (
    HEADER,
    *(
        Path(__file__).with_name(name)
        for name in (
            "simd_bf16.h",
            "simd_avx2.h",
            "dp_bf16.h",
            "prefill_tasks.h",
            "gguf_layouts.h",
            "gguf_widen.h",
            "scalar_bf16.h",
        )
    ),
)  # part of the build key
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Werror=missing-prototypes")

ISA_ENV = "SRT_CPU_KERNEL_ISA"
# The features each forced level takes away from -march=native (they only take away: a level above
# what this CPU has changes nothing), or None: no C kernels at all, every op on torch.
ISA_LEVELS: dict[str, tuple[str, ...] | None] = {
    "auto": (),  # what this CPU has
    "avx512_bf16": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),  # no AMX: the AVX-512 BF16 loops
    "avx512": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512bf16", "-mno-avx512vnni"),
    # no AVX-512 at all (-mno-avx512f takes every AVX-512 extension with it): the AVX2 and FMA loops
    "avx2": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512f"),
    "none": None,
}

Signature = tuple[Any, list[Any]]  # (restype, argtypes) as ctypes takes them
_RESULTS: dict[str, Any] = {"void": None, "int64_t": ctypes.c_int64}
_SCALARS: dict[str, Any] = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}
_DECLARATION = re.compile(r"(\w+)\s+(srt_\w+)\s*\(([^()]*)\)\s*;")


def signatures(header: str) -> dict[str, Signature]:
    """Each function srt_kernels.h declares -> its ctypes (restype, argtypes): a pointer of any
    type is c_void_p, int64_t c_int64, float c_float. Raises ValueError on anything else in the
    header (a type this table does not know, a declaration it cannot read), so a change to the
    header fails the load instead of passing a wrong argument."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M).replace("typedef uint16_t bf16;", " ")
    found: dict[str, Signature] = {}
    for match in _DECLARATION.finditer(text):
        result, name, params = match.groups()
        if result not in _RESULTS:
            raise ValueError(f"srt_kernels.h: {name} returns {result}; ctypes here takes void or int64_t")
        argtypes: list[Any] = []
        for param in [] if params.strip() == "void" else params.split(","):
            words = param.replace("const", " ").replace("*", " * ").split()
            if "*" in words:
                argtypes.append(ctypes.c_void_p)
            elif len(words) == 2 and words[0] in _SCALARS:
                argtypes.append(_SCALARS[words[0]])
            else:
                raise ValueError(
                    f"srt_kernels.h: {name} takes {param.strip()!r}; ctypes here takes a pointer, "
                    "int64_t or float"
                )
        if name in found:
            raise ValueError(f"srt_kernels.h: {name} is declared twice")
        found[name] = (_RESULTS[result], argtypes)
    leftover = _DECLARATION.sub(" ", text).strip()
    if leftover:
        raise ValueError(f"srt_kernels.h: cannot read {leftover[:200]!r} as a declaration")
    return found


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def kernel_isa() -> str:
    """SRT_CPU_KERNEL_ISA (default auto): the kernel paths to take, as if on a CPU with only these
    features. ValueError naming the variable for a value not in ISA_LEVELS."""
    isa = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if isa not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}; got {isa!r}")
    return isa


def _cflags() -> tuple[str, ...]:
    return (*CFLAGS, *(ISA_LEVELS[kernel_isa()] or ()))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def compile_shared_object(cc: str, sources: Sequence[Path], target: Path) -> None:
    """cc CFLAGS (less what SRT_CPU_KERNEL_ISA takes away) sources -> target; RuntimeError with the
    compiler's message where it fails."""
    proc = subprocess.run(
        [cc, *_cflags(), "-o", str(target), *map(str, sources), "-lm"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cc, version, *_cflags(), _cpu_flags()]).encode()).hexdigest()
    cache = Path(os.environ.get("SRT_KERNEL_CACHE") or Path.home() / ".cache" / "srt" / "kernels")
    target = cache / f"cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        compile_shared_object(cc, SOURCES, Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernels: %s", target)
    return target


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, each function typed from srt_kernels.h, or None where the torch
    ops are used instead."""
    if os.environ.get("SRT_CPU_KERNELS", "1") == "0" or ISA_LEVELS[kernel_isa()] is None:
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU kernels unavailable, using torch ops (slower)")
        return None
    declared = signatures(HEADER.read_text())  # a header ctypes cannot read fails here, loudly
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using torch ops (slower): %s", exc)
        return None
    for name, (restype, argtypes) in declared.items():
        fn = getattr(lib, name)  # AttributeError: declared in srt_kernels.h but defined nowhere
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernels run here: built for a CPU with AMX-BF16, and the OS lets this
    process use the tiles (SRT_AMX=0 turns them off). Asking grants the tiles to the process, and
    from then on srt_bf16_linear runs on them."""
    lib = kernels()
    return lib is not None and os.environ.get("SRT_AMX", "1") != "0" and bool(lib.srt_amx_init())


@functools.cache
def bf16_linear_available() -> bool:
    """Whether srt_bf16_linear runs here: on AMX tiles, or else on AVX-512 BF16 (cpu_bf16_linear.c),
    or else on AVX2 and FMA (cpu_avx2_linear.c)."""
    return bf16_linear_isa() is not None


def bf16_linear_isa() -> str | None:
    """What srt_bf16_linear runs on here ("AMX tiles", "AVX-512 BF16", "AVX2 FMA"), or None: the
    kernels are not loaded or this CPU has none of them (its bf16 linears stay on torch)."""
    lib = kernels()
    if lib is None:
        return None
    if amx_available():
        return "AMX tiles"
    if lib.srt_dp_linear_available():
        return "AVX-512 BF16"
    return "AVX2 FMA" if lib.srt_avx2_linear_available() else None


@functools.cache
def int8_available() -> bool:
    """Whether srt_int8_linear runs here: on AMX int8 tiles where AMX is granted, else on AVX-512 VNNI."""
    lib = kernels()
    if lib is None:
        return False
    return bool(lib.srt_amx_has_int8()) if amx_available() else bool(lib.srt_vnni_linear_available())


@functools.cache
def q4_available() -> bool:
    """Whether srt_q4_linear runs here (AVX-512 BF16, or else AVX2, FMA and F16C: cpu_q4_linear.c)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q4_linear_available())


@functools.cache
def q4k_available() -> bool:
    """Whether srt_q4k_linear runs here (GGUF Q4_K: AVX-512 BF16, or else AVX2, FMA and F16C:
    cpu_q4_linear.c)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q4k_linear_available())


@functools.cache
def q6ks_available() -> bool:
    """Whether srt_q6ks_linear runs here (GGUF Q6_K on the file's int8 scales: AVX-512 VNNI and
    BF16, cpu_q8_linear.c; elsewhere Q6_K keeps q8_pack's layout on srt_q6k_linear)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q6ks_linear_available())


@functools.cache
def q5k_available() -> bool:
    """Whether srt_q5k_linear runs here (GGUF Q5_K: wherever srt_q4k_linear does, cpu_q4_linear.c)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q5k_linear_available())


def q8_available() -> bool:
    """Whether srt_q8_linear runs here (AVX-512 BF16 and VNNI, or else AVX2, FMA and F16C:
    cpu_q8_linear.c)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q8_linear_available())


@functools.cache
def gguf_linear_available() -> bool:
    """Whether srt_gguf_linear runs here (any rows on a GGUF weight's blocks, widened to bf16 a task
    at a time: on AMX tiles, cpu_amx.c, or AVX-512 BF16, cpu_bf16_linear.c) with the bits
    srt_bf16_linear gives on a bf16 copy; where not, a GGUF weight keeps a bf16 copy."""
    lib = kernels()
    return lib is not None and bool(lib.srt_gguf_linear_available())


@functools.cache
def prefill_kernel_available() -> bool:
    """Whether srt_prefill_attention runs here: on AMX tiles, or else on AVX-512 BF16."""
    lib = kernels()
    return lib is not None and (amx_available() or bool(lib.srt_dp_prefill_attention_available()))


def describe_paths() -> str:
    """One start-up line: the path each kind of kernel takes on this CPU, so a slow machine says why."""
    isa = kernel_isa()
    forced = f" ({ISA_ENV}={isa} forces the paths of a CPU with fewer features)" if isa != "auto" else ""
    lib = kernels()
    if lib is None:
        why = f"{ISA_ENV}=none" if isa == "none" else "SRT_CPU_KERNELS=0 or no compiler"
        return f"CPU kernels off ({why}): every op runs on torch"
    avx512 = "avx512f" in _cpu_flags().split() and "-mno-avx512f" not in (ISA_LEVELS[isa] or ())
    bf16 = bf16_linear_isa() or "torch (this CPU has neither AVX-512 BF16 nor AVX2 and FMA)"
    int8 = (
        "AMX int8"
        if amx_available() and int8_available()
        else "AVX-512 VNNI"
        if int8_available()
        else "refused (no VNNI)"
    )
    prefill = "C kernel" if prefill_kernel_available() else "torch"
    loops = "AVX-512" if avx512 else "plain loops: this CPU has no AVX-512"
    q4 = "C kernel" if q4_available() else "bf16 (neither AVX-512 BF16 nor AVX2)"
    q4k = "C kernel" if q4k_available() else "bf16"
    q5k = "C kernel" if q5k_available() else "bf16"
    q8 = "C kernel" if q8_available() else "bf16 (neither AVX-512 VNNI nor AVX2)"
    return (
        f"CPU paths: bf16 linears on {bf16}; w8a8_int8 {int8}; gguf Q4_1 {q4}, Q4_K {q4k}, Q5_K {q5k}, Q8_0 / Q5_0 / Q4_0 / Q6_K {q8}; "
        f"prefill attention on {prefill}; "
        f"norms, rotary and decode attention in C ({loops}){forced}"
    )
