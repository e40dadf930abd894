"""The torch implementations (CPU serving path and kernel references) against dense, unpaged math."""

import pytest
import torch

from kernels import ops
from tests.kernels.paged_case import dense_decode_attention, make_case


@pytest.mark.parametrize("num_q_heads", [2, 4, 8])  # GQA ratio 1, 2, 4 over 2 KV heads
@pytest.mark.parametrize("seq_lens", [[1, 13, 8], [4, 5, 16, 3], [7]])
def test_decode_attention_matches_dense(num_q_heads, seq_lens):
    case = make_case(seq_lens, num_q_heads=num_q_heads, seed=len(seq_lens) + num_q_heads)
    scale = 16 ** -0.5
    for layer in range(2):
        out = ops.paged_decode_attention(case.q, case.buffer, layer, case.page_table, case.seq_lens, scale)
        want = dense_decode_attention(case.q, case.dense_k[layer], case.dense_v[layer], scale)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_attention_ignores_garbage_page_table_entries():
    # Entries past each sequence's last page hold ids far outside the pool: never dereferenced.
    case = make_case([5, 9], filler=10_000)
    out = ops.paged_decode_attention(case.q, case.buffer, 1, case.page_table, case.seq_lens, 0.25)
    want = dense_decode_attention(case.q, case.dense_k[1], case.dense_v[1], 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_attention_bf16_computes_softmax_in_fp32():
    case = make_case([3, 11, 6], num_q_heads=4, dtype=torch.bfloat16)
    out = ops.paged_decode_attention(case.q, case.buffer, 0, case.page_table, case.seq_lens, 0.25)
    assert out.dtype == torch.bfloat16
    want = dense_decode_attention(case.q, case.dense_k[0], case.dense_v[0], 0.25)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_decode_attention_zero_length_sequence_gives_zeros():
    case = make_case([4, 6])
    lens = torch.tensor([0, 6], dtype=torch.int32)
    out = ops.paged_decode_attention(case.q, case.buffer, 0, case.page_table, lens, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    want = dense_decode_attention(case.q[1:], case.dense_k[0][1:], case.dense_v[0][1:], 0.25)
    torch.testing.assert_close(out[1:].double(), want, rtol=1e-5, atol=1e-5)


def test_store_kv_then_gather_kv_round_trip():
    case = make_case([6, 10], page_size=4)
    page_ids = torch.tensor(case.page_ids[1])
    # overwrite tokens 3..9 of sequence 1 in layer 1 with new values through store_kv
    slots = page_ids[torch.arange(3, 10) // 4] * 4 + torch.arange(3, 10) % 4
    new_k, new_v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    before = case.buffer.clone()
    ops.store_kv(case.buffer, 1, slots, new_k, new_v)
    k, v = ops.gather_kv(case.buffer, 1, page_ids, 10)
    assert k.is_contiguous() and v.is_contiguous() and k.shape == (10, 2, 16)
    assert torch.equal(k[:3], case.dense_k[1][1][:3]) and torch.equal(k[3:], new_k)
    assert torch.equal(v[:3], case.dense_v[1][1][:3]) and torch.equal(v[3:], new_v)
    # nothing else in the pool changed: layer 0 and the other sequence's pages are untouched
    changed = (case.buffer != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= set(case.page_ids[1])
    assert torch.equal(case.buffer[:, 0], before[:, 0])


def test_gather_kv_partial_page_and_extra_page_ids():
    case = make_case([9])
    k, v = ops.gather_kv(case.buffer, 0, torch.tensor(case.page_ids[0] + [0, 0]), 6)
    assert torch.equal(k, case.dense_k[0][0][:6]) and torch.equal(v, case.dense_v[0][0][:6])
    with pytest.raises(ValueError):
        ops.gather_kv(case.buffer, 0, torch.tensor(case.page_ids[0][:2]), 9)


def test_gather_scatter_pages_round_trip_is_exact():
    case = make_case([5, 12, 3], dtype=torch.bfloat16)
    ids = [case.page_ids[1][2], case.page_ids[0][0], case.page_ids[1][0]]
    staged = ops.gather_pages(case.buffer, ids)
    assert staged.is_contiguous() and staged.shape == (3, *case.buffer.shape[1:])
    for i, page in enumerate(ids):
        assert torch.equal(staged[i], case.buffer[page])
    target = torch.zeros_like(case.buffer)
    dst = [7, 2, 4]
    ops.scatter_pages(target, torch.tensor(dst), staged)
    for i, page in enumerate(dst):
        assert torch.equal(target[page], staged[i])
    untouched = [p for p in range(target.shape[0]) if p not in dst]
    assert not target[untouched].any()


def test_scatter_pages_rejects_wrong_shape():
    case = make_case([4])
    with pytest.raises(ValueError):
        ops.scatter_pages(case.buffer, [0, 1], torch.zeros(2, 1, 2, 4, 2, 16))


def test_decode_attention_accepts_strided_q_from_a_fused_projection():
    case = make_case([3, 10], num_q_heads=4)
    fused = torch.zeros(2, 4 + 2 + 2, 16)
    q = fused[:, :4]
    q.copy_(case.q)
    assert not q.is_contiguous()
    out = ops.paged_decode_attention(q, case.buffer, 0, case.page_table, case.seq_lens, 0.25)
    want = dense_decode_attention(case.q, case.dense_k[0], case.dense_v[0], 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_decode_attention_model_sized_heads_and_pages():
    # 12 query / 4 KV heads, head_dim 64, 16-token pages, as in the 100M benchmark model
    case = make_case([1, 16, 17, 95], num_layers=1, page_size=16, num_kv_heads=4, num_q_heads=12,
                     head_dim=64, seed=11)
    out = ops.paged_decode_attention(case.q, case.buffer, 0, case.page_table, case.seq_lens, 0.125)
    want = dense_decode_attention(case.q, case.dense_k[0], case.dense_v[0], 0.125)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
