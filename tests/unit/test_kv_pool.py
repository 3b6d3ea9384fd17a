"""KVPool: per-layer page-major buffers whose pages are contiguous byte ranges."""

import pytest
import torch

from disagg_worker.mem.kv_pool import KVPool

SHAPE = dict(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8)


def _pool(dtype=torch.float32):
    return KVPool(**SHAPE, dtype=dtype)


def test_buffers_have_page_major_shape_and_start_zeroed():
    pool = _pool()
    for layer in range(3):
        for buf in (pool.k_buffer(layer), pool.v_buffer(layer)):
            assert buf.shape == (5, 4, 2, 8) and buf.dtype == torch.float32
            assert buf.is_contiguous() and not buf.any()
    assert pool.buffers() == [*(pool.k_buffer(i) for i in range(3)), *(pool.v_buffer(i) for i in range(3))]
    assert len({b.data_ptr() for b in pool.buffers()}) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sizes(dtype):
    pool = _pool(dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert pool.page_nbytes == 4 * 2 * 8 * itemsize
    assert pool.nbytes == sum(b.nbytes for b in pool.buffers()) == 2 * 3 * 5 * pool.page_nbytes


def test_writing_a_page_touches_only_that_pages_bytes():
    pool = _pool()
    pool.v_buffer(1)[2] = 1.0
    raw = pool.v_buffer(1).view(torch.uint8).flatten()
    lo, hi = 2 * pool.page_nbytes, 3 * pool.page_nbytes
    assert raw[lo:hi].any() and not raw[:lo].any() and not raw[hi:].any()
    assert not any(b.any() for b in pool.buffers() if b is not pool.v_buffer(1))


def test_page_bytes_identify_page_contents():
    a, b = _pool(torch.bfloat16), _pool(torch.bfloat16)
    for layer in range(3):
        a.k_buffer(layer)[3] = layer + 1
        b.k_buffer(layer)[1] = layer + 1
    assert a.page_bytes([3]) == b.page_bytes([1])
    assert a.page_bytes([3]) != a.page_bytes([1])
    assert len(a.page_bytes([0, 3])) == 2 * 6 * a.page_nbytes


def test_pages_for_memory_fits_the_budget():
    per_page = 2 * 3 * (4 * 2 * 8 * 2)  # K and V, 3 layers, bf16
    args = (3, 4, 2, 8, torch.bfloat16)
    assert KVPool.pages_for_memory(10 * per_page, *args) == 10
    assert KVPool.pages_for_memory(11 * per_page - 1, *args) == 10
    assert KVPool.pages_for_memory(per_page - 1, *args) == 0
    n = KVPool.pages_for_memory(7 * per_page + 5, *args)
    assert KVPool(3, n, 4, 2, 8, torch.bfloat16).nbytes <= 7 * per_page + 5
