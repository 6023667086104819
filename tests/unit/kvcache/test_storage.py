from __future__ import annotations

import torch
from glm5.kvcache.storage import KVLayout, PagedKVStorage, quantize_rows


def test_int8_rows_dequantise_within_half_a_step() -> None:
    x = torch.randn(64, 96) * torch.logspace(-2, 2, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    err = (q.float() * scale.float() - x).abs()
    assert (err <= scale.float() * 0.5 + 1e-6).all()


def test_gather_reads_both_tiers_and_layout_bytes() -> None:
    layout = KVLayout(2, 32, 8, 16, (0, -1), 4, 3, 2, torch.bfloat16, torch.device("cpu"))
    st = PagedKVStorage(layout)
    rows = torch.randn(12, 40)
    for layer in range(2):
        st.write_kv(layer, torch.arange(12), rows * (layer + 1))
    st.write_index(0, torch.arange(12), rows[:, :16])
    st.demote(torch.tensor([2]), torch.tensor([1]))  # L1 block 2 -> L2 block 1 (unified 4: slots 16..19)
    got = st.gather_kv(1, torch.tensor([0, 17, 18]), torch.float32)
    want = (rows * 2)[[0, 9, 10]].bfloat16().float()
    assert torch.allclose(got, want, atol=0.05, rtol=0.02)
    assert not torch.equal(got[1:], want[1:])  # quantised, not a copy
    assert torch.allclose(st.gather_index(0, torch.tensor([17]), torch.float32), rows[9:10, :16], atol=0.05)
    # bf16: (2 * 40 + 16) * 2 bytes; int8: 96 + float16 scales for 2 latents, 2 rope keys, 1 indexer key
    assert layout.fp_bytes_per_token() == 192 and layout.q_bytes_per_token() == 106


_RECYCLED = """
import torch
from glm5.allocator import retain_freed_memory
from glm5.kvcache.storage import KVLayout, PagedKVStorage
retain_freed_memory()  # as the worker runs: freed heap memory is handed out again, garbage and all
layout = KVLayout(4, 64, 16, 32, (0, 1, -1, 2), 16, 64, 64, torch.float32, torch.device("cpu"))
for _ in range(3):
    junk = [torch.full((n,), float("nan")) for n in (4 * 1024 * 80, 3 * 1024 * 32, 1 << 20)]
    del junk
    storage = PagedKVStorage(layout)
    pools = (storage.fp_kv, storage.fp_index, storage.q_kv, storage.q_kv_scale, storage.q_index, storage.q_index_scale)
    assert all(bool((p == 0).all()) for p in pools), "a pool holds recycled garbage"
print("ok")
"""


def test_pools_start_zeroed_even_over_recycled_memory() -> None:
    """Masked-out slots are still read (0 x NaN = NaN in the value product): a pool must never start with garbage,
    which a heap that recycles freed memory would otherwise hand it (a NaN once ended a request's generation)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RECYCLED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
