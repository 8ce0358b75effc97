"""Float32 compute from 16-bit storage (core/upcast.py): the results of a float32 copy, the stored
weights untouched (the very tensors, not copies), and nothing left wide after a forward that raised."""

import copy

import pytest
import torch

from quantbench.core.upcast import float32_compute


def model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).to(dtype)


def test_a_bfloat16_model_computes_as_its_float32_copy_and_keeps_its_tensors():
    m = model()
    wide = copy.deepcopy(m).float()
    x = torch.randn(5, 64)
    pointers = {n: p.data_ptr() for n, p in m.named_parameters()}
    with torch.no_grad(), float32_compute(m):
        inside = {n: p.dtype for n, p in m.named_parameters()}
        out = m(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, wide(x).detach())
    assert set(inside.values()) == {torch.bfloat16}  # between modules' passes: stored, not wide
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == pointers
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    with torch.no_grad():  # outside the block it computes in bfloat16 again
        assert m(x.bfloat16()).dtype == torch.bfloat16


def test_a_forward_that_raises_leaves_nothing_wide():
    m = model()
    pointers = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(RuntimeError), torch.no_grad(), float32_compute(m):
        m(torch.randn(5, 63))  # wrong width: the first Linear raises after it was widened
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert [p.data_ptr() for p in m.parameters()] == pointers


def test_a_float32_model_is_left_as_it_is():
    m = model(torch.float32)
    with float32_compute(m) as same:
        assert same is m and not any(mod._forward_pre_hooks for mod in m.modules())


def test_the_float32_pass_costs_what_this_cpu_makes_it():
    """Measured, so no CPU's figure is written here: where bfloat16 matmuls are native the float32
    pass is the slower one; where they are emulated (AVX2-only) it is the faster one."""
    from quantbench.core import hardware
    from quantbench.core.upcast import slowdown

    assert slowdown("float32", 1024, 64) == 1.0
    ratio = slowdown("bfloat16", 2048, 256, repeats=5)
    assert ratio > 1 if hardware.native("bfloat16") else ratio < 1, (ratio, hardware.device_line())
