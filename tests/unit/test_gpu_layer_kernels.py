"""gpu/kernels/layer_cpu.c (through gpu.models.llama.CpuLayerOps) against the torch ops it replaces
(gpu.models.llama.TorchLayerOps), at decode and prefill token counts and odd shapes."""

import pytest
import torch

from gpu import kernels
from gpu.models.llama import CpuLayerOps, TorchLayerOps

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")

TOKENS = (1, 3, 33, 512)
P, HALF = 700, 32  # rope table positions, head_dim / 2


def ops(seed: int = 0) -> tuple[CpuLayerOps, TorchLayerOps]:
    g = torch.Generator().manual_seed(seed)
    freqs = torch.arange(P, dtype=torch.float32)[:, None] * torch.rand(HALF, generator=g)[None, :]
    return CpuLayerOps(freqs.cos(), freqs.sin()), TorchLayerOps(freqs.cos(), freqs.sin())


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    scale = want.abs().clamp_min(1e-3)  # values near zero: absolute 1e-3 * rel
    err = float(((got - want).abs() / scale).max())
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H", (576, 7))
def test_rms_norm(T: int, H: int) -> None:
    c, t = ops()
    x, w = torch.randn(T, H) * 3, torch.randn(H)
    got_x, got = c.add_rms_norm(x.clone(), None, w, 1e-5)
    want_x, want = t.add_rms_norm(x.clone(), None, w, 1e-5)
    assert torch.equal(got_x, want_x)
    assert_close(got, want, 1e-6)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H", (576, 13))
def test_add_rms_norm_adds_the_residual_in_place(T: int, H: int) -> None:
    c, t = ops()
    x, r, w = torch.randn(T, H), torch.randn(T, H), torch.randn(H)
    got_x, got = c.add_rms_norm(x.clone(), r, w, 1e-6)
    want_x, want = t.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(got_x, want_x)  # the sum is exactly the torch sum
    assert_close(got, want, 1e-6)


@pytest.mark.parametrize("T", TOKENS)
def test_norm_heads_in_place_on_the_fused_qkv_rows(T: int) -> None:
    """Gemma's q/k norms: each head of q and of k (views of the fused qkv's wider rows) normed
    alone, in place; v and the other heads untouched."""
    c, t = ops()
    Hq, Hkv, D = 4, 1, 256
    qkv, wq, wk = torch.randn(T, (Hq + 2 * Hkv) * D) * 3, torch.randn(D), torch.randn(D)
    before, want = qkv.clone(), qkv.clone()
    for o, heads in ((t, want), (c, qkv)):
        qk = heads[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D)
        o.norm_heads(qk[:, :Hq], wq, 1e-6)
        o.norm_heads(qk[:, Hq:], wk, 1e-6)
    assert_close(qkv, want, 1e-6)
    v = (Hq + Hkv) * D
    assert torch.equal(qkv[:, v:], want[:, v:])
    assert torch.equal(want[:, :D], t.rms_norm(before[:, :D], wq, 1e-6))  # the first q head, normed alone


def test_rms_norm_of_zeros_is_zero() -> None:
    c, _ = ops()
    _, out = c.add_rms_norm(torch.zeros(2, 64), None, torch.ones(64), 1e-5)
    assert torch.equal(out, torch.zeros(2, 64))


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hq, Hkv", ((9, 3), (5, 1)))
def test_rope_in_place_on_the_fused_qkv_rows(T: int, Hq: int, Hkv: int) -> None:
    c, t = ops(1)
    D = 2 * HALF
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D) * 4
    positions = torch.randint(0, P, (T,))
    want = t.rope_at(positions)(qkv[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D))
    got_qkv = qkv.clone()
    got = c.rope_at(positions)(got_qkv[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D))
    assert got.data_ptr() == got_qkv.data_ptr()  # in place: q and k stay views of the qkv rows
    assert_close(got, want, 1e-6)
    assert torch.equal(got_qkv[:, (Hq + Hkv) * D :], qkv[:, (Hq + Hkv) * D :])  # v untouched


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("I", (1536, 13))
def test_silu_mul(T: int, I: int) -> None:
    c, t = ops()
    gate_up = torch.randn(T, 2 * I) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])  # e^-g over- and underflowing, zeros
    assert_close(c.silu_mul(gate_up), t.silu_mul(gate_up), 1e-6)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("I", (1536, 13))
def test_gelu_tanh_mul(T: int, I: int) -> None:
    """Against the op in float64: torch's fp32 0.5 g (1 + tanh(z)) loses the tail where tanh(z)
    nears -1 (g below about -3) to cancellation, which the kernel's g / (1 + e^-2z) does not."""
    c, t = ops()
    gate_up = torch.randn(T, 2 * I) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])  # e^-2z over- and underflowing, zeros
    want = t.gelu_tanh_mul(gate_up.double()).float()
    assert_close(c.gelu_tanh_mul(gate_up), want, 2e-6)  # a few fp32 roundings more than silu's
    torch.testing.assert_close(c.gelu_tanh_mul(gate_up), t.gelu_tanh_mul(gate_up), rtol=1e-5, atol=1e-5)
