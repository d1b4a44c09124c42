"""Every Triton kernel compiled ahead of time for real NVIDIA targets (sm_90, sm_80), without a GPU.

The interpreter tests (TRITON_INTERPRET=1) run a kernel's Python on CPU tensors and never type-check it the way
the GPU compiler does: the grouped int8 expert kernel's `tl.dot(a, w, acc)` ran there but failed to compile on an
H200. Here each kernel goes through Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX, then the wheel's own ptxas
to a cubin) for each target, with every argument dtype and block size its wrapper launches it with. No CUDA
driver is involved: `triton.compile` takes the target instead of asking a device.

An omitted `tl.dot(..., out_dtype=...)` is compiled as float32, the default in Tritons without
triton-lang/triton#10353 (3.6, for one; newer ones take the accumulator's type), so a kernel that compiles here
compiles on those too, and gives the same IR on newer ones.

Compiling runs in one child process per target, in parallel: the kernel modules must be imported with
TRITON_INTERPRET unset (the interpreter tests set it for the whole pytest process, and it also picks the
modules' tile constants), and each child gets its own empty TRITON_CACHE_DIR so nothing comes from a cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TARGETS = {"sm90": 90, "sm80": 80}  # H100 / H200, A100
KERNEL_MODULES = ("agentfold.kernels.triton_ops", "agentfold.kernels.triton_moe")
FLOAT_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # every float dtype the wrappers accept
RMS_NORM_BLOCKS = (128, 1024)  # next_power_of_2(d): a q/k-norm head dim (128), a hidden size (576, 640)
HEAD_DIM_BLOCKS = (64, 128, 256)  # next_power_of_2(head_dim): SmolLM2, Qwen3, Gemma 3
CHILD_TIMEOUT_S = 300


def _unavailable() -> str | None:
    """Why ahead-of-time CUDA compilation cannot run on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"Triton's CUDA compiler (with its ptxas) only ships for Linux, not {sys.platform}"
    for module in ("triton", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    triton_dir = Path(importlib.util.find_spec("triton").origin).parent
    ptxas_dir = triton_dir / "backends" / "nvidia" / "bin"
    if not os.environ.get("TRITON_PTXAS_PATH") and not list(ptxas_dir.glob("ptxas*")):
        return f"this triton wheel has no ptxas in {ptxas_dir} (and TRITON_PTXAS_PATH is unset)"
    return None


# -- child process: compile every kernel for one target --------------------------------------------


def _legacy_dot_default() -> bool:
    """Make an omitted `tl.dot` out_dtype mean float32, as older Tritons do; False when it already does."""
    import inspect

    import triton.language as tl

    parameter = inspect.signature(tl.dot).parameters.get("out_dtype")
    if parameter is None or parameter.default is not None:
        return False  # a Triton whose default is already float32 (a dtype, not None)
    from triton.language.semantic import TritonSemantic

    original = TritonSemantic.dot
    signature = inspect.signature(original)

    def dot(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("out_dtype") is None:
            bound.arguments["out_dtype"] = tl.float32
        return original(*bound.args, **bound.kwargs)

    TritonSemantic.dot = dot
    return True


def _cases() -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    """Case id -> (kernel, non-constexpr argument types, constexprs), as the wrappers launch each kernel.

    Integer arguments are plain i32 (no divisibility or ==1 specialization: the general variant).
    """
    from agentfold.kernels import triton_moe as moe
    from agentfold.kernels import triton_ops as ops

    assert not ops.INTERPRETED, "the kernel modules were imported under TRITON_INTERPRET=1"

    def i32(*names: str) -> dict[str, str]:
        return dict.fromkeys(names, "i32")

    cases: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {}
    bm, bn, bk = ops.LINEAR_TILE
    for dtype, ty in FLOAT_TYPES.items():
        cases[f"linear-{dtype}"] = (
            ops._linear_kernel,
            {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "y_ptr": f"*{ty}",
             **i32("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")},
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IEEE": dtype == "float32", "USE_DOT": not ops.INTERPRETED})
        for block_d in RMS_NORM_BLOCKS:
            cases[f"rms_norm-{dtype}-d{block_d}"] = (
                ops._rms_norm_kernel,
                {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "y_ptr": f"*{ty}", **i32("D", "stride_x", "stride_y"),
                 "eps": "fp32"},
                {"BLOCK_D": block_d})
        for block_d in HEAD_DIM_BLOCKS:
            cases[f"attention_split-{dtype}-d{block_d}"] = (
                ops._attention_split_kernel,
                {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "pos_ptr": "*i64", "acc_ptr": "*fp32",
                 "stat_ptr": "*fp32", **i32("M", "L", "D", "group"), "scale": "fp32",
                 **i32("sq_h", "sq_m", "sk_h", "sk_l", "sv_h", "sv_l", "n_splits")},
                {"SPLIT": ops.ATTENTION_SPLIT, "BLOCK_N": ops.ATTENTION_BLOCK, "BLOCK_D": block_d})
            cases[f"attention_combine-{dtype}-d{block_d}"] = (
                ops._attention_combine_kernel,
                {"acc_ptr": "*fp32", "stat_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": f"*{ty}",
                 **i32("M", "D", "so_h", "so_m", "n_splits")},
                {"SPLIT": ops.ATTENTION_SPLIT, "BLOCK_D": block_d})
    cases["grouped_int8"] = (
        moe._grouped_int8_kernel,
        {"a_ptr": "*i8", "rows_ptr": "*i32", "slot_ptr": "*i32", "w_ptr": "*i8", "out_ptr": "*i32",
         **i32("R", "N", "K", "stride_a", "stride_ws", "stride_wn", "stride_o")},
        {"BLOCK_M": moe.GROUP_BLOCK, "BLOCK_N": moe._TILE_N, "BLOCK_K": moe._TILE_K})
    return cases


def _compile_one(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], target: Any) -> dict[str, Any]:
    """Compile one kernel variant; the sizes of its PTX and cubin."""
    import triton
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    if set(names) != set(types) | set(constexprs) or set(types) & set(constexprs):
        raise ValueError(f"the case's arguments {sorted(set(types) | set(constexprs))} are not the kernel's {names}")
    signature = {name: "constexpr" if name in constexprs else types[name] for name in names}
    # pointers as the allocator gives them (16-byte aligned), except where the kernel opts out of that hint
    attrs = {(i,): [["tt.divisibility", 16]] for i, param in enumerate(kernel.params)
             if signature[param.name].startswith("*") and not getattr(param, "do_not_specialize_on_alignment", False)}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=target)
    ptx, cubin = compiled.asm.get("ptx", ""), compiled.asm.get("cubin", b"")
    if f".entry {kernel.__name__}" not in ptx:
        raise AssertionError(f"no .entry {kernel.__name__} in the PTX ({len(ptx)} characters)")
    if not cubin.startswith(b"\x7fELF"):
        raise AssertionError(f"the cubin is not an ELF file ({len(cubin)} bytes)")
    return {"ptx_chars": len(ptx), "cubin_bytes": len(cubin)}


def _ptxas_problem(arch: int) -> str | None:
    """Why the ptxas Triton would use for `arch` cannot run here, or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None  # a Triton without this helper: the compile itself will tell
    try:
        path = get_ptxas(arch).path
    except Exception as e:  # knobs raise when neither the wheel nor TRITON_PTXAS_PATH has one
        return f"no ptxas for sm_{arch}: {e}"
    try:
        subprocess.run([path, "--version"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"ptxas ({path}) does not run here: {e}"
    return None


def _compile_all(arch: int) -> dict[str, Any]:
    """Every kernel variant for one target; also the module kernels no case compiles."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    report: dict[str, Any] = {"arch": arch, "triton": triton.__version__, "unavailable": _ptxas_problem(arch)}
    if report["unavailable"]:
        return report
    report["legacy_dot_default"] = _legacy_dot_default()
    target = GPUTarget("cuda", arch, 32)
    cases = _cases()
    results: dict[str, dict[str, Any]] = {}
    for case, (kernel, types, constexprs) in cases.items():
        try:
            results[case] = {"ok": True, **_compile_one(kernel, types, constexprs, target)}
        except Exception as e:  # report every failing variant, not just the first
            results[case] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
    report["results"] = results
    covered = {kernel for kernel, _, _ in cases.values()}
    report["uncovered"] = sorted(
        f"{name}.{attr}" for name in KERNEL_MODULES for attr, value in vars(importlib.import_module(name)).items()
        if isinstance(value, JITFunction) and value not in covered)
    return report


# -- tests -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One child per target, run in parallel, each compiling into its own empty Triton cache."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("triton_compile")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH")}
    children = {}
    for name, arch in TARGETS.items():
        out = root / f"{name}.json"
        child_env = {**env, "TRITON_CACHE_DIR": str(root / f"cache-{name}")}
        children[name] = (out, subprocess.Popen([sys.executable, __file__, str(arch), str(out)], env=child_env,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    found = {}
    for name, (out, child) in children.items():
        try:
            log, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            log, _ = child.communicate()
            pytest.fail(f"compiling for {name} took over {CHILD_TIMEOUT_S} s:\n{log[-3000:]}")
        if child.returncode or not out.exists():
            pytest.fail(f"the {name} compile process failed (exit {child.returncode}):\n{log[-3000:]}")
        found[name] = json.loads(out.read_text())
    return found


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_kernel_compiles(reports: dict[str, dict[str, Any]], target: str) -> None:
    report = reports[target]
    if report["unavailable"]:
        pytest.skip(report["unavailable"])
    results = report["results"]
    failed = {case: r["error"] for case, r in results.items() if not r["ok"]}
    assert not failed, f"{len(failed)} of {len(results)} kernel variants do not compile for {target} " \
        f"(triton {report['triton']}):\n" + "\n\n".join(f"{case}: {error}" for case, error in failed.items())
    assert all(r["ptx_chars"] > 0 and r["cubin_bytes"] > 0 for r in results.values())


def test_every_kernel_has_a_case(reports: dict[str, dict[str, Any]]) -> None:
    for target, report in reports.items():
        if not report["unavailable"]:
            assert not report["uncovered"], f"kernels with no compile case ({target}): {report['uncovered']}"


if __name__ == "__main__":  # the child: python test_triton_compile.py ARCH OUT.json
    Path(sys.argv[2]).write_text(json.dumps(_compile_all(int(sys.argv[1]))))
