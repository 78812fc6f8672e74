"""Native CPU kernels: plain C built on first use with the system C compiler, loaded with ctypes.

Decode attention over an fp32, fp16 or bf16 KV cache (csrc/decode_attention.c), causal prefill
attention (csrc/prefill_attention.c), the per-layer elementwise ops (csrc/layer_ops.c: residual
add + RMSNorm, SwiGLU, RoPE with the K/V store; and the sampler's row-wise argmax), linears
straight from GGUF blocks (csrc/block_quant_linear.c, used by block_quant.py), linears over bf16 or
fp16 weights with fp32 sums (csrc/half_linear.c, linear.HalfLinear), int8 dot products over the
GGUF blocks for many-row steps (csrc/q8_block_linear.c, block_quant.py) and the opt-in int8 and
bf16 linears (csrc/int8_linear.c and bf16_linear.c, used by quantization.py). Attention, the linears
and the argmax split their work over torch.get_num_threads() threads of our own pool
(csrc/parallel.c).

The same sources are built once per ISA level (ISA_LEVELS: the compiler flags and the CPU
features they need: portable, avx2, avx512 (F/BW/VL/DQ), avx512_vnni, avx512_bf16);
`native_kernels()` loads the best level this CPU has, or a lower one named by $SERVELAB_ISA, and
logs its choice once; `build()` makes a build of its own (other compiler flags or sources), for
benchmarks that compare builds. Each build is cached
under $SERVELAB_CACHE_DIR, else $XDG_CACHE_HOME/servelab, else ~/.cache/servelab, keyed by a hash
of the sources, the compiler and its flags, so it costs a compile once per machine. Everything
here is optional: without a C compiler (or with SERVELAB_NATIVE=0) `native_kernels()` returns
None, `load_error` says why, and the model runs on the PyTorch ops (runtime/ops.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import overload

import torch

from servelab.errors import InvalidArgument

_SOURCES = (
    "decode_attention.c",
    "prefill_attention.c",
    "layer_ops.c",
    "block_quant_linear.c",
    "int8_linear.c",
    "parallel.c",
    "decode_stack.c",
    "half_linear.c",
    "bf16_linear.c",
    "q8_block_linear.c",
)
_HEADERS = ("vec_exp.h", "parallel.h", "half.h", "fp.h", "isa.h")
# KV-cache dtypes the attention and K/V-store kernels read and write (their kv_format codes, half.h)
KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_lock = threading.Lock()
_builds: dict[str, NativeKernels | str] = {}  # ISA level -> its kernels, or why they cannot load
load_error: str | None = None  # why the default level's kernels are not in use, for diagnostics
_logged: set[str] = set()  # the default levels whose choice has been logged
logger = logging.getLogger("servelab.runtime")


@dataclass(frozen=True, slots=True)
class IsaLevel:
    """One build of the kernels: the compiler flags, and the CPU features their instructions need."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


# Lowest first; the default is the last one the CPU has (SERVELAB_ISA can lower it). A level is
# a row here and the SL_* macros of csrc/isa.h that its flags define.
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX2_NEEDS = frozenset({"avx2", "fma", "f16c"})
_AVX512_NEEDS = _AVX2_NEEDS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ISA_LEVELS = (
    # the scalar paths: runs on any CPU (on x86, nothing past the baseline even if the compiler
    # defaults to more)
    IsaLevel("portable", ("-mno-avx2", "-mno-fma", "-mno-f16c") if _is_x86() else (), frozenset()),
    # no AVX-512 either if the compiler defaults to it (-march=x86-64-v4)
    IsaLevel("avx2", (*_AVX2, "-mno-avx512f"), _AVX2_NEEDS),
    IsaLevel("avx512", _AVX512, _AVX512_NEEDS),
    IsaLevel("avx512_vnni", (*_AVX512, "-mavx512vnni"), _AVX512_NEEDS | {"avx512vnni"}),
    IsaLevel("avx512_bf16", (*_AVX512, "-mavx512vnni", "-mavx512bf16"), _AVX512_NEEDS | {"avx512vnni", "avx512bf16"}),
)
_LEVELS = {level.name: level for level in ISA_LEVELS}

# torch.cpu.get_capabilities()'s names (cpuinfo's probe of cpuid and the OS's saved registers)
# for the features our levels name; /proc/cpuinfo uses the names on the right.
_TORCH_FEATURES = {
    "avx2": "avx2",
    "fma3": "fma",
    "f16c": "f16c",
    "avx512_f": "avx512f",
    "avx512_bw": "avx512bw",
    "avx512_vl": "avx512vl",
    "avx512_dq": "avx512dq",
    "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16",
}
_PROC_FEATURES = {"avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16"}
_features_of: tuple[object, frozenset[str]] = (None, frozenset())  # (torch's mapping, our features)
_ENV = "SERVELAB_ISA"  # lowers the default level, e.g. SERVELAB_ISA=avx2 on an AVX-512 host


def _proc_cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(_PROC_FEATURES.get(flag, flag) for flag in line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_features() -> frozenset[str]:
    """The CPU features our ISA levels name that this CPU (and its OS) has: from torch's cpuinfo
    probe, else /proc/cpuinfo's flags."""
    global _features_of
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return _proc_cpuinfo_flags() & frozenset(_TORCH_FEATURES.values())
    caps = get()  # one cached mapping: converted once (the sampler's native_kernels() asks every step)
    if _features_of[0] is not caps:
        _features_of = (caps, frozenset(ours for theirs, ours in _TORCH_FEATURES.items() if caps.get(theirs)))
    return _features_of[1]


def unavailable_reason(level: str) -> str | None:
    """Why the kernels of ISA level `level` cannot run here (None: they can, if they build)."""
    if os.environ.get("SERVELAB_NATIVE", "1") == "0":
        return "disabled by SERVELAB_NATIVE=0"
    if level not in _LEVELS:
        return f"unknown ISA level {level!r} (known: {', '.join(_LEVELS)})"
    missing = _LEVELS[level].needs - cpu_features()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def best_level() -> str:
    """The ISA level the kernels run at by default: the highest this CPU has, or $SERVELAB_ISA
    where that is lower. InvalidArgument for a SERVELAB_ISA that names no level."""
    features = cpu_features()
    best = [level.name for level in ISA_LEVELS if level.needs <= features][-1]
    wanted = os.environ.get(_ENV, "").strip().lower()
    if not wanted:
        return best
    if wanted not in _LEVELS:
        raise InvalidArgument(
            f"{_ENV}={wanted!r} is not an ISA level (known, lowest first: {', '.join(_LEVELS)})", param=_ENV
        )
    names = list(_LEVELS)
    return names[min(names.index(wanted), names.index(best))]  # lowers, never raises past the CPU


def level_choice() -> str:
    """One line on the default level and why, for the load log."""
    level, wanted = best_level(), os.environ.get(_ENV, "").strip().lower()
    features = " ".join(sorted(cpu_features())) or "none past the baseline"
    if wanted and wanted != level:
        return f"native kernels: ISA level {level} ({_ENV}={wanted}, but this CPU has only: {features})"
    if wanted:
        return f"native kernels: ISA level {level} (set by {_ENV}; CPU features: {features})"
    return f"native kernels: ISA level {level} (the highest this CPU has; CPU features: {features})"


def _cache_dir() -> Path:
    if os.environ.get("SERVELAB_CACHE_DIR"):
        return Path(os.environ["SERVELAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servelab"


def _flags(level: IsaLevel) -> list[str]:
    # No -ffast-math: it may set flush-to-zero for the whole process when the library loads, and
    # the kernels are written to vectorize without reassociation. FMA contraction is allowed.
    return ["-O3", "-std=gnu99", "-shared", "-fPIC", "-ffp-contract=fast", *level.cflags]


@dataclass(frozen=True, slots=True)
class NativeKernels:
    """The C entry points (ctypes functions with argtypes set), built for ISA level `level`."""

    level: str
    decode_attention: Callable[..., None]
    prefill_attention: Callable[..., None]
    prefill_attention_chunks: Callable[..., None]
    paged_attention: Callable[..., None]
    add_rms_norm: Callable[..., None]
    silu_mul: Callable[..., None]
    rope_store_kv: Callable[..., None]
    block_quant_linear: Callable[..., None]
    block_quant_gemm: Callable[..., None]
    block_quant_gemm_kmajor: Callable[..., None]
    block_dequant: Callable[..., None]
    argmax_rows: Callable[..., None]
    nonfinite_rows: Callable[..., int]
    int8_linear: Callable[..., int]
    paged_attention_scratch: Callable[..., int]
    decode_stack: Callable[..., int]
    decode_stack_arena: Callable[..., int]
    half_linear: Callable[..., int]
    bf16_linear: Callable[..., int]
    q8_act_bytes: Callable[..., int]
    q8_quantize: Callable[..., None]
    q8_block_linear: Callable[..., None]


def _build(level: IsaLevel, csrc: Path | None = None, cdll: type[ctypes.CDLL] = ctypes.CDLL) -> NativeKernels:
    src: Traversable = csrc or resources.files("servelab.runtime").joinpath("csrc")
    sources = {name: src.joinpath(name).read_bytes() for name in _SOURCES + _HEADERS}
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = _flags(level)
    key = hashlib.sha256(b"".join(sources.values()) + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib_path = out_dir / f"servelab_native-{key}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            for name, text in sources.items():
                (Path(tmp) / name).write_bytes(text)
            paths = [str(Path(tmp) / name) for name in _SOURCES]
            tmp_lib = Path(tmp) / lib_path.name
            proc = subprocess.run(
                [cc, *flags, *paths, "-o", str(tmp_lib), "-lm", "-lpthread"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders each install a whole file
    lib = cdll(str(lib_path))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

    # ctypes converts an integer restype's result to a Python int and returns None for no restype
    @overload
    def fn(name: str, *argtypes: type[ctypes._SimpleCData]) -> Callable[..., None]: ...
    @overload
    def fn(
        name: str, *argtypes: type[ctypes._SimpleCData], restype: type[ctypes._SimpleCData[int]]
    ) -> Callable[..., int]: ...
    def fn(
        name: str, *argtypes: type[ctypes._SimpleCData], restype: type[ctypes._SimpleCData[int]] | None = None
    ) -> Callable[..., int | None]:
        f = getattr(lib, name)
        f.argtypes, f.restype = list(argtypes), restype
        return f

    return NativeKernels(
        level=level.name,
        decode_attention=fn(
            "servelab_decode_attention",
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            i64,
            i64,
            f32,
            ptr,
            i64,
            ptr,
            i64,
        ),
        prefill_attention=fn(
            "servelab_prefill_attention_f32", ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, i64
        ),
        prefill_attention_chunks=fn(
            "servelab_prefill_attention_chunks_f32",
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            i64,
            i64,
            f32,
            ptr,
            i64,
            ptr,
            i64,
        ),
        paged_attention=fn(
            "servelab_paged_attention_f32",
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            f32,
            ptr,
            ptr,
            i64,
            i64,
        ),
        add_rms_norm=fn("servelab_add_rms_norm_f32", ptr, ptr, ptr, ptr, i64, i64, f32),
        silu_mul=fn("servelab_silu_mul_f32", ptr, ptr, i64, i64),
        rope_store_kv=fn(
            "servelab_rope_store_kv", ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64
        ),
        block_quant_linear=fn(
            "servelab_block_quant_linear_f32", i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64
        ),
        block_quant_gemm=fn(
            "servelab_block_quant_gemm_f32", i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64
        ),
        block_quant_gemm_kmajor=fn(
            "servelab_block_quant_gemm_kmajor_f32", i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64
        ),
        block_dequant=fn("servelab_block_dequant_f32", i64, ptr, i64, i64, i64, i64, ptr),
        argmax_rows=fn("servelab_argmax_rows_f32", ptr, i64, i64, ptr, i64),
        nonfinite_rows=fn("servelab_nonfinite_rows_f32", ptr, i64, i64, ptr, restype=i64),
        int8_linear=fn(
            "servelab_int8_linear_f32", ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i64, restype=ctypes.c_int
        ),
        paged_attention_scratch=fn("servelab_paged_attention_scratch_floats", i64, i64, restype=i64),
        decode_stack=fn("servelab_decode_stack", ptr, ptr, ptr, ptr, ptr, restype=ctypes.c_int),
        decode_stack_arena=fn("servelab_decode_stack_arena_floats", ptr, i64, i64, i64, restype=i64),
        half_linear=fn(
            "servelab_half_linear_f32", i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, restype=ctypes.c_int
        ),
        bf16_linear=fn("servelab_bf16_linear_f32", ptr, i64, i64, ptr, i64, ptr, ptr, i64, restype=ctypes.c_int),
        q8_act_bytes=fn("servelab_q8_act_bytes", i64, i64, restype=i64),
        q8_quantize=fn("servelab_q8_quantize_f32", ptr, i64, i64, i64, ptr, i64),
        q8_block_linear=fn("servelab_q8_block_linear_f32", i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64),
    )


def build(
    level: str, extra_cflags: Sequence[str] = (), csrc: Path | None = None, cdll: type[ctypes.CDLL] = ctypes.CDLL
) -> NativeKernels:
    """The kernels at ISA level `level` built apart from the ones native_kernels() hands out: with
    `extra_cflags` after the level's flags (a knob such as -DSL_SPIN_NS=0), from the sources in
    the directory `csrc` (default: the package's), loaded by `cdll` (a subclass may stand in for
    entry points that older sources lack). Compiled once per machine, as every build is; the CPU's
    features are not checked. RuntimeError (or OSError) where it does not build or load."""
    if level not in _LEVELS:
        raise ValueError(f"unknown ISA level {level!r} (known: {', '.join(_LEVELS)})")
    base = _LEVELS[level]
    return _build(IsaLevel(base.name, (*base.cflags, *extra_cflags), base.needs), csrc, cdll)


def native_kernels(level: str | None = None) -> NativeKernels | None:
    """The C kernels built for ISA level `level` (default: the best this CPU has), or None when
    they cannot be used here; then `kernels_unavailable(level)` says why (and `load_error`, for
    the default level)."""
    global load_error
    name = level or best_level()
    found = _builds.get(name)  # without the lock: the sampler asks every step
    if found is None:
        with _lock:
            if name not in _builds:
                reason = unavailable_reason(name)
                if reason is None:
                    try:
                        _builds[name] = _build(_LEVELS[name])
                    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                        reason = str(exc)
                if reason is not None:
                    _builds[name] = reason
            found = _builds[name]
    if level is None:
        load_error = found if isinstance(found, str) else None
        if name not in _logged:  # once a level, at the model's first load
            _logged.add(name)
            logger.info("%s%s", level_choice(), f"; unavailable: {found}" if isinstance(found, str) else "")
    return None if isinstance(found, str) else found


def kernels_unavailable(level: str | None = None) -> str | None:
    """Why native_kernels(level) is None (None when it is not)."""
    native_kernels(level)
    found = _builds.get(level or best_level())
    return found if isinstance(found, str) else None


def decode_attention(
    kernels: NativeKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_ctx: int,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """out[b] = attention of q[b] over the first ctx_lens[b] positions of sequence b's blocks.

    q: [B, H, D] fp32 with unit stride in its last two dims (any row stride); k, v: one layer of
    the pool, [kv_heads, slots, D] contiguous, in a KV_FORMATS dtype; block_table [B, max_blocks]
    int64 with unit column stride and ctx_lens [B] int64 contiguous; out: [B, H * D] contiguous.
    Nothing is checked: the caller (the model) builds all of these itself.
    """
    B, H, D = q.shape
    kv_heads = k.shape[0]
    threads = torch.get_num_threads()  # the (sequence, KV head) pairs are split over as many
    per_part = (H // kv_heads) * max_ctx
    scratch = torch.empty(threads * per_part, dtype=torch.float32)
    kernels.decode_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.shape[1],
        KV_FORMATS[k.dtype],
        block_table.data_ptr(),
        block_table.stride(0),
        block_size,
        ctx_lens.data_ptr(),
        B,
        kv_heads,
        H // kv_heads,
        D,
        scale,
        scratch.data_ptr(),
        per_part,
        out.data_ptr(),
        threads,
    )


# the C kernel's block sizes (csrc/prefill_attention.c), for its scratch
_PREFILL_QB, _PREFILL_KB, _PREFILL_KP = 32, 64, 16


def _prefill_scratch_floats(chunks: list[tuple[int, int]], kv_heads: int, dim: int, threads: int) -> int:
    """The scratch csrc/prefill_attention.c wants for chunks of (rows, start position): a header
    (two int64 a chunk), K^T of each chunk's context, a work area per thread."""
    header = (4 * len(chunks) + 2 + 15) // 16 * 16
    kt = sum(-(-(start + n) // _PREFILL_KP) * _PREFILL_KP for n, start in chunks) * kv_heads * dim
    per_part = _PREFILL_QB * _PREFILL_KB + _PREFILL_QB * dim + 3 * _PREFILL_QB + dim
    return header + kt + threads * per_part


def prefill_attention(
    kernels: NativeKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float
) -> torch.Tensor:
    """Causal attention of a prefill chunk as [n, H * D]: q [n, H, D] at positions start_pos ..
    start_pos + n - 1 over k, v [start_pos + n, KV, D] (any strides with unit stride in D, and
    for q also between heads). All fp32."""
    n, H, D = q.shape
    ctx, KV, _ = k.shape
    if not (
        q.dtype == k.dtype == v.dtype == torch.float32 and H % KV == 0 and ctx >= start_pos + n
        and k.shape == v.shape and k.shape[2] == D and k.stride() == v.stride()
        and q.stride(2) == 1 and q.stride(1) == D and k.stride(2) == 1
    ):  # fmt: skip
        raise ValueError(
            f"prefill_attention: q {tuple(q.shape)} {q.dtype} at {start_pos}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
            "want fp32 q [n, H, D] and k, v [>= start_pos + n, KV, D] with the same strides, H a multiple of KV"
        )
    threads = torch.get_num_threads()
    scratch = torch.empty(_prefill_scratch_floats([(n, start_pos)], KV, D, threads), dtype=torch.float32)
    out = torch.empty(n, H * D, dtype=torch.float32)
    kernels.prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        k.stride(1),
        n,
        start_pos,
        H,
        KV,
        D,
        scale,
        out.data_ptr(),
        scratch.data_ptr(),
        threads,
    )
    return out


def prefill_attention_chunks(
    kernels: NativeKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[tuple[int, int]],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of several whole-prompt prefill chunks in one call (one thread-pool job a
    layer, not one a prompt): chunk (offset, n) is rows offset .. offset + n - 1 of q [T, H, D]
    at positions 0 .. n - 1 over the same rows of k, v [T, KV, D], written to those rows of out
    [T, H * D]. Each row has the bits prefill_attention gives its chunk alone. Strides as
    prefill_attention wants them; nothing else is checked (the model builds all of these)."""
    T, H, D = q.shape
    KV = k.shape[1]
    threads = torch.get_num_threads()
    table = torch.tensor([(offset, n, 0, offset) for offset, n in chunks], dtype=torch.int64)
    scratch = torch.empty(_prefill_scratch_floats([(n, 0) for _, n in chunks], KV, D, threads), dtype=torch.float32)
    kernels.prefill_attention_chunks(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        k.stride(1),
        table.data_ptr(),
        len(chunks),
        H,
        KV,
        D,
        scale,
        out.data_ptr(),
        out.stride(0),
        scratch.data_ptr(),
        threads,
    )


def paged_attention(
    kernels: NativeKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_ctx: int,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """decode_attention's contract, computed in prefill_attention's order: out[b] has exactly the
    bits prefill_attention gives a query at position ctx_lens[b] - 1 over the same keys and
    values. Deterministic mode's decode attention (slower: it packs each context first)."""
    B, H, D = q.shape
    kv_heads = k.shape[0]
    threads = torch.get_num_threads()
    per_part = kernels.paged_attention_scratch(max_ctx, D)
    scratch = torch.empty(threads * per_part, dtype=torch.float32)
    kernels.paged_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.shape[1],
        KV_FORMATS[k.dtype],
        block_table.data_ptr(),
        block_table.stride(0),
        block_size,
        ctx_lens.data_ptr(),
        B,
        kv_heads,
        H // kv_heads,
        D,
        max_ctx,
        scale,
        out.data_ptr(),
        scratch.data_ptr(),
        per_part,
        threads,
    )


def add_rms_norm(
    kernels: NativeKernels, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += delta (in place, when given), then RMSNorm(x) * weight as a new tensor. All fp32
    contiguous [rows, hidden] (weight [hidden])."""
    out = torch.empty_like(x)
    kernels.add_rms_norm(
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
    )
    return out


def silu_mul(kernels: NativeKernels, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous fp32 [rows, 2 * inter] gate/up output, as [rows, inter]."""
    rows, two_inter = gate_up.shape
    out = torch.empty(rows, two_inter // 2, dtype=gate_up.dtype, device=gate_up.device)
    kernels.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, two_inter // 2)
    return out


def rope_store_kv(
    kernels: NativeKernels,
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """RoPE in place on the Q and K heads of a contiguous fp32 qkv [T, (H + 2 KV) * D], then each
    token's K and V into its slot of one layer of the pool ([KV, slots, D], a KV_FORMATS dtype:
    rounded to nearest even as torch's casts round). cos/sin: contiguous [max_pos, D] tables
    covering every position; positions and slots: [T] int64."""
    kernels.rope_store_kv(
        qkv.data_ptr(),
        qkv.shape[0],
        qkv.shape[1],
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        k.shape[1],
        KV_FORMATS[k.dtype],
    )


def nonfinite_rows(kernels: NativeKernels, x: torch.Tensor) -> list[int]:
    """The rows of a contiguous fp32 [rows, n] that hold a NaN or an infinity, in order."""
    rows, n = x.shape
    bad = (ctypes.c_uint8 * rows)()  # ctypes, not torch: no torch op in a clean step's sampling
    if kernels.nonfinite_rows(x.data_ptr(), rows, n, bad) == 0:
        return []
    return [i for i in range(rows) if bad[i]]


def argmax_rows(kernels: NativeKernels, x: torch.Tensor) -> list[int]:
    """x.argmax(dim=-1).tolist() of a contiguous, NaN-free fp32 [rows, n] (the first index of
    each row's largest value, as torch gives it)."""
    rows, n = x.shape
    out = (ctypes.c_int64 * rows)()
    kernels.argmax_rows(x.data_ptr(), rows, n, out, torch.get_num_threads())
    return list(out)
