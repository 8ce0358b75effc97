"""The CPU's class and what it computes natively, and the compute dtype chosen from them: asked of
every class, whatever this machine is, and of this machine as it is."""

import json
import os

import pytest

from quantbench.core import hardware

AVX2 = hardware.CPU(frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
AVX512 = hardware.CPU(AVX2.flags | {"avx512f", "avx512_vnni"})
AVX512_BF16 = hardware.CPU(AVX512.flags | {"avx512_bf16"})
AMX = hardware.CPU(AVX512_BF16.flags | {"amx_tile", "amx_bf16"})


@pytest.mark.parametrize("cpu, klass, bf16", [
    (hardware.CPU(frozenset({"sse2"})), "baseline", False),
    (AVX2, "AVX2", False),
    (AVX512, "AVX-512", False),
    (AVX512_BF16, "AVX512-BF16", True),
    (AMX, "AMX", True),
])
def test_cpu_classes(cpu, klass, bf16):
    assert cpu.klass == klass and cpu.native("bfloat16") is bf16 and cpu.native("float32")
    assert not cpu.native("float16")
    assert cpu.describe().startswith(klass + " (")
    assert ("bfloat16 emulated" in cpu.describe()) is not bf16


@pytest.mark.parametrize("cpu, saved, auto", [
    (AVX2, "bfloat16", "float32"),  # emulated bf16: ~7x slower than fp32 on an AVX2-only EPYC
    (AVX512, "bfloat16", "float32"),
    (AVX512_BF16, "bfloat16", "bfloat16"),
    (AMX, "bfloat16", "bfloat16"),
    (AMX, "float16", "float32"),  # no AMX-FP16 in these flags
    (AMX.__class__(AMX.flags | {"amx_fp16"}), "float16", "float16"),
    (AVX2, "float32", "float32"),
    (AMX, "float32", "float32"),  # never less precision than saved
])
def test_auto_compute_dtype(cpu, saved, auto):
    assert hardware.compute_dtype("auto", saved, on_cuda=False, on=cpu) == auto
    assert hardware.compute_dtype("bfloat16", saved, on_cuda=False, on=cpu) == "bfloat16"  # asked: kept


def test_this_machine(tmp_path):
    here = hardware.cpu()
    flags = open("/proc/cpuinfo").read()
    assert ("avx2" in here.flags) == (" avx2 " in flags or " avx2\n" in flags)
    expected = "bfloat16" if here.native("bfloat16") or hardware.cuda() else "float32"
    assert hardware.compute_dtype("auto", "bfloat16") == expected
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert hardware.compute_dtype_of(tmp_path) == expected
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert hardware.compute_dtype_of(tmp_path) == "float32"
    assert here.klass in hardware.device_line() or hardware.cuda()
    # kernels with a dtype of their own: as saved, whatever this CPU is
    for method in ("gptq", "awq", "bitsandbytes"):
        (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": {"quant_method": method}}))
        assert hardware.compute_dtype_of(tmp_path) == "bfloat16" == hardware.compute_dtype_of(tmp_path, "float32")
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": {"quant_method": "compressed-tensors"}}))
    assert hardware.compute_dtype_of(tmp_path) == expected and hardware.compute_dtype_of(tmp_path, "float32") == "float32"


def test_an_isa_cap_is_what_torch_runs(monkeypatch):
    """ONEDNN_MAX_CPU_ISA holds torch's matmuls below the CPU: bfloat16 is then emulated, and the
    class and compute dtype say so (how an AVX2-only CPU is reproduced on a bigger one)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the CPU as it is, even when the suite runs capped
    hardware.cpu.cache_clear()
    here = hardware.cpu()
    try:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
        hardware.cpu.cache_clear()
        capped = hardware.cpu()
        assert capped.flags == here.flags - hardware.ISA_CAPS["AVX2"] and not capped.native("bfloat16")
        assert capped.klass in ("AVX2", "baseline") and "capped by ONEDNN_MAX_CPU_ISA=AVX2" in capped.describe()
        assert hardware.compute_dtype("auto", "bfloat16", on_cuda=False) == "float32"
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        hardware.cpu.cache_clear()
        assert hardware.cpu().flags == here.flags - {"avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"}
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "DEFAULT")
        hardware.cpu.cache_clear()
        assert hardware.cpu() == here
    finally:
        monkeypatch.undo()  # the environment as the suite had it
        hardware.cpu.cache_clear()


def test_the_gpu_is_read_from_the_driver(tmp_path, monkeypatch):
    """Compute capability and memory come from `nvidia-smi --query-gpu` (the job's torch is a CPU
    build). Here a stand-in driver on PATH answers as an H100's does; without one, None."""
    driver = tmp_path / "nvidia-smi"
    driver.write_text(
        "#!/bin/sh\ncase \"$1\" in\n  --query-gpu=compute_cap) echo 9.0; echo 9.0 ;;\n"
        "  --query-gpu=memory.total) echo 81559; echo 81559 ;;\n  *) exit 9 ;;\nesac\n"
    )
    driver.chmod(0o755)
    for read in (hardware.cuda_capability, hardware.cuda_memory):
        read.cache_clear()
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    try:
        assert hardware.cuda_capability() == (9, 0)
        assert hardware.cuda_memory() == 81559 * 2**20  # MiB, the first GPU's
        for read in (hardware.cuda_capability, hardware.cuda_memory):
            read.cache_clear()
        monkeypatch.setenv("PATH", str(tmp_path / "none"))
        assert hardware.cuda_capability() is None and hardware.cuda_memory() is None
    finally:
        for read in (hardware.cuda_capability, hardware.cuda_memory):
            read.cache_clear()
