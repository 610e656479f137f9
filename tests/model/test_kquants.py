"""GGUF K-quants and Q5_0/Q5_1 kept as small integers: every type decodes to exactly what
gguf-py's numpy dequantizer gives for the same bytes, read back from a file gguf-py wrote."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from dynaspec.models.quant import GGUF_BLOCKS, QuantizedTensor, cat_rows, from_gguf_blocks

# (kind, group) each GGUF type must become; the contract with the CPU linear kernels.
EXPECTED_FORM = {"Q4_0": ("q4", 32), "Q4_1": ("q4", 32), "Q8_0": ("q8", 32), "Q5_0": ("q8", 32),
                 "Q5_1": ("q8", 32), "Q4_K": ("q4", 32), "Q5_K": ("q8", 32), "Q6_K": ("q8", 16)}
# Byte offsets of each K-quant block's fp16 fields (d, dmin): random bytes there could be inf/nan.
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid blocks: gguf-py's quantizer where it has one, else
    random bytes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    qtype = getattr(T, type_name)
    if type_name not in _F16_FIELDS:
        w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
        return quants.quantize(w, qtype)
    nbytes, per_block = GGUF_BLOCKS[type_name]
    raw = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[type_name]:
        scales = (rng.uniform(1e-4, 0.05, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]))
        raw[..., off:off + 2] = scales.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _write_and_read(tmp_path, tensors: dict[str, tuple[str, np.ndarray]]) -> dict:
    path = str(tmp_path / "types.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for name, (type_name, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=getattr(T, type_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("type_name", sorted(EXPECTED_FORM))
def test_every_type_decodes_like_gguf_py(type_name, tmp_path):
    rows, cols = 6, 512
    read = _write_and_read(
        tmp_path, {"w": (type_name, random_blocks(type_name, rows, cols, seed=len(type_name)))}
    )
    tensor = read["w"]
    ref = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(rows, cols)
    got = from_gguf_blocks(np.asarray(tensor.data), type_name, (rows, cols))
    kind, group = EXPECTED_FORM[type_name]
    assert (got.kind, got.group_size) == (kind, group)
    assert got.q.dtype == (torch.uint8 if kind == "q4" else torch.int8)
    assert got.scale.shape == (rows, cols // group) and got.scale.dtype == torch.float32
    if kind == "q4":
        assert int(got.q.max()) <= 15
    # float32 all the way: only the order of the final multiply-add may differ from gguf-py.
    np.testing.assert_allclose(
        got.dequantize().numpy(), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max()
    )
    assert np.abs(ref).max() > 0  # the blocks were not all zero


def test_q6_k_and_q5_0_need_no_zero_and_q5_k_keeps_its_minimum():
    q6 = from_gguf_blocks(random_blocks("Q6_K", 2, 256, 1), "Q6_K", (2, 256))
    q50 = from_gguf_blocks(random_blocks("Q5_0", 2, 256, 1), "Q5_0", (2, 256))
    q5k = from_gguf_blocks(random_blocks("Q5_K", 2, 256, 1), "Q5_K", (2, 256))
    assert q6.zero is None and int(q6.q.min()) >= -32 and int(q6.q.max()) <= 31
    assert q50.zero is None and int(q50.q.min()) >= -16 and int(q50.q.max()) <= 15
    assert q5k.zero is not None and int(q5k.q.min()) >= 0 and int(q5k.q.max()) <= 31


def test_mixed_gguf_types_fuse_as_exact_q8():
    # A Q4_K_M layer: q|k in Q4_K, v in Q6_K (group 16): one fused q8 matrix, same values.
    parts = [from_gguf_blocks(random_blocks("Q4_K", 4, 256, 3), "Q4_K", (4, 256)),
             from_gguf_blocks(random_blocks("Q6_K", 2, 256, 4), "Q6_K", (2, 256)),
             from_gguf_blocks(random_blocks("Q8_0", 2, 256, 5), "Q8_0", (2, 256))]
    fused = cat_rows(parts)
    assert isinstance(fused, QuantizedTensor) and (fused.kind, fused.group_size) == ("q8", 16)
    ref = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(fused.dequantize(), ref, rtol=1e-6, atol=1e-6)
