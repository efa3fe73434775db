"""gpu/quant/gguf_quantize.py: for every block type the kernels take, gguf-py's dequantize of
the blocks written is within that type's round-off of the input, and odd inputs (zeros, a
constant row, huge and tiny magnitudes) come back finite.

The bound of each type, derived from how the quantizer picks its scales: a value's error is at
most alpha * a + beta * A, a the largest magnitude of its scale group (the values sharing one
scale), A that of its block (K-quants and IQ4_XS: the 256-value super-block whose scales are
themselves quantized against one d; elsewhere the group is the block and beta is 0).
- Q4_0 / Q5_0 (gguf-py: d = max / -8, -16): the largest magnitude maps to the level with a
  spare one beside it; a value of the opposite sign as large lands one step short: d = a/8, a/16.
- Q4_1 / Q5_1: d = (max - min) / 15, 31 <= 2a / 15, 2a / 31; half a step: a/15, a/31.
- Q8_0: d = a / 127, half a step.
- Q2_K / Q4_K / Q5_K (value = d sc q - dmin m, q in 0..n): the step d sc is within d/2 of the
  group's (max - min) / n <= 2a / n, so half a step <= a/n + d/4; rounding sc down clips the top
  by up to n d / 2, m's rounding shifts by dmin / 2; d <= 2A / (n * scale levels), dmin <= A / levels:
  Q2_K a/3 + A/10, Q4_K a/15 + A/40, Q5_K a/31 + A/40.
- Q3_K (q in -4..3, scale s = max / -4, 6-bit scales, d = A / 128): the step is within d of s
  (rounding, and 31 where 32 was due), so a/4 for the spare level plus 4d: a/4 + A/32.
- Q6_K (scale a / 31, q in -32..31, 8-bit scales, d = A / (31 * 127)): a/62 + A/200.
- IQ4_NL (d = max / -127 on the values -127 .. 113): the widest gap is the top one, 113 to 127:
  14 a / 127. IQ4_XS: the same per 32-value sub-block, whose scale is within d = A / (127 * 32)
  of its own, which may cost up to 127 d: 14 a / 127 + A / 32.
All scales are fp16: 5% more, and 2^-10 A for a scale rounded after its values were."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from gpu.quant import gguf_quantize
from gpu.quant.gguf_quantize import TYPES, block_elements, quantize
from gpu.quant.gguf_types import BLOCK_TYPES

# type: (values per scale group, alpha, beta), as derived in the module's docstring
BOUNDS: dict[str, tuple[int, float, float]] = {
    "Q4_0": (32, 1 / 8, 0),
    "Q4_1": (32, 1 / 15, 0),
    "Q5_0": (32, 1 / 16, 0),
    "Q5_1": (32, 1 / 31, 0),
    "Q8_0": (32, 1 / 254, 0),
    "Q2_K": (16, 1 / 3, 1 / 10),
    "Q3_K": (16, 1 / 4, 1 / 32),
    "Q4_K": (32, 1 / 15, 1 / 40),
    "Q5_K": (32, 1 / 31, 1 / 40),
    "Q6_K": (16, 1 / 62, 1 / 200),
    "IQ4_NL": (32, 14 / 127, 0),
    "IQ4_XS": (32, 14 / 127, 1 / 32),
}
K = 512


def roundtrip(x: np.ndarray, name: str) -> np.ndarray:
    blocks = quantize(x, name)
    qtype = gguf.GGMLQuantizationType[name]
    size, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert blocks.dtype == np.uint8 and blocks.shape == (x.shape[0], x.shape[1] // size * type_bytes)
    return gguf.quants.dequantize(blocks, qtype).reshape(x.shape)


def bound(x: np.ndarray, name: str) -> np.ndarray:
    """Each value's largest error under the type's derived bound."""
    group, alpha, beta = BOUNDS[name]
    block = block_elements(name)
    N = x.shape[0]
    a = np.repeat(np.abs(x).reshape(N, -1, group).max(-1), group, axis=1)
    A = np.repeat(np.abs(x).reshape(N, -1, block).max(-1), block, axis=1)
    return 1.05 * (alpha * a + beta * A) + 2**-10 * A


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(28)
    normal = rng.standard_normal((8, K)).astype(np.float32)
    # groups of very different sizes inside one super-block: the scales' own quantization shows
    uneven = normal * np.repeat(10.0 ** rng.uniform(-3, 0, (8, K // 16)), 16, axis=1).astype(np.float32)
    return {
        "normal": normal * rng.uniform(0.01, 3, (8, 1)).astype(np.float32),
        "heavy tails": rng.standard_t(2, (8, K)).astype(np.float32),
        "all positive": np.abs(normal) + 0.5,
        "all negative": -np.abs(normal) - 0.5,
        "uneven groups": uneven,
        "one outlier a block": np.where(np.arange(K) % 32 == 5, 50.0, normal).astype(np.float32),
    }


def test_every_kernel_type_has_a_quantizer() -> None:
    assert set(TYPES) == set(BLOCK_TYPES) == set(BOUNDS)


@pytest.mark.parametrize("name", TYPES)
def test_dequantized_blocks_within_the_types_round_off(name: str) -> None:
    for label, x in inputs().items():
        err = np.abs(roundtrip(x, name) - x)
        excess = err / bound(x, name)
        worst = np.unravel_index(excess.argmax(), x.shape)
        assert excess.max() <= 1, (
            f"{name} {label}: |error| {err[worst]} at {worst} over the bound {bound(x, name)[worst]}"
        )


@pytest.mark.parametrize("name", TYPES)
def test_round_off_is_typical_not_only_bounded(name: str) -> None:
    """A quantizer that spends half its levels would still meet a loose bound: the rms error
    of normal values must be near a uniform round-off of the type's bits (step^2 / 12)."""
    x = inputs()["normal"]
    rel = np.sqrt(np.mean((roundtrip(x, name) - x) ** 2) / np.mean(x**2))
    bits = {"Q2_K": 2, "Q3_K": 3, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}.get(name, 4)
    # a Gaussian group's range is ~5 standard deviations: step 5 / 2^bits, rms step / sqrt(12)
    assert rel < 1.5 * 5 / 2**bits / np.sqrt(12), f"{name}: relative rms error {rel}"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "label, value",
    [("zeros", 0.0), ("constant", 0.37), ("negative constant", -2.5), ("huge", 1e9), ("tiny", 1e-30)],
)
def test_edge_rows_come_back_finite(name: str, label: str, value: float) -> None:
    x = np.full((2, K), value, np.float32)
    x[1, ::7] = -value  # a second row with both signs
    y = roundtrip(x, name)
    assert np.isfinite(y).all(), f"{name} {label}: {y[~np.isfinite(y)][:4]}"
    if label == "zeros":
        assert not y.any()
    elif label in ("constant", "negative constant"):
        assert (np.abs(y - x) <= bound(x, name)).all()


@pytest.mark.parametrize("name", TYPES)
def test_large_magnitudes_keep_their_precision(name: str) -> None:
    """Values up to ~2e4 (fp16's range is 65504): no scale overflows, the bound holds."""
    x = inputs()["normal"] * np.float32(2e3)
    assert np.abs(x).max() < 65504
    assert (np.abs(roundtrip(x, name) - x) <= bound(x, name)).all()


def test_matrix_of_many_blocks_is_quantized_in_chunks() -> None:
    """A matrix above one chunk of blocks gives the same blocks as its rows one at a time."""
    rows = gguf_quantize._CHUNK_BLOCKS // (K // 256) + 3
    x = np.random.default_rng(1).standard_normal((rows, K)).astype(np.float32)
    whole = quantize(x, "Q4_K")
    assert np.array_equal(whole[-3:], quantize(x[-3:], "Q4_K"))
