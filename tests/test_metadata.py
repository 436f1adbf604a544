"""The step planner: decode/prefill split, chunk budgets, ks/ke, decode rows, slots, DCP lengths."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer.metadata import MetadataBuilder, build_metadata


def table(num_requests: int, pages: int, *, offset: int = 0) -> torch.Tensor:
    return (torch.arange(num_requests * pages, dtype=torch.int32) + offset).view(num_requests, pages)


def test_decodes_first_then_prefill_chunks_cover_every_prefill_row_once():
    seq_lens, query_lens = [40, 9, 100, 33], [2, 1, 60, 33]
    meta = build_metadata(seq_lens, query_lens, table(4, 8), block_size=16, num_spec_tokens=1)
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_prefills, meta.num_prefill_tokens) == (2, 3, 2, 93)
    covered = [t for c in meta.prefill_chunks for t in range(c.token_start, c.token_end)]
    assert covered == list(range(3, 96))


def test_ks_ke_are_causal_over_cached_context_with_compression():
    ratio = 2
    seq_lens, query_lens = [50, 21], [20, 21]
    meta = build_metadata(seq_lens, query_lens, table(2, 4), block_size=16, compress_ratio=ratio)
    (chunk,) = meta.prefill_chunks
    assert chunk.cu_seq_lens.tolist() == [0, 25, 35]
    expected_ks, expected_ke = [], []
    for base, (s, q) in zip([0, 25], zip(seq_lens, query_lens)):
        for o in range(q):
            expected_ks.append(base)
            expected_ke.append(base + (s - q + 1 + o) // ratio)
    assert chunk.ks.tolist() == expected_ks and chunk.ke.tolist() == expected_ke


@pytest.mark.parametrize("max_logits_bytes", [4 * 30 * 64, 4 * 7 * 64, 4])
def test_logits_budget_splits_query_rows_and_reuses_the_gather(max_logits_bytes):
    meta = build_metadata([64], [64], table(1, 4), block_size=16, max_logits_bytes=max_logits_bytes)
    chunks = meta.prefill_chunks
    assert sum(c.num_rows for c in chunks) == 64
    assert [c.skip_gather for c in chunks] == [False] + [True] * (len(chunks) - 1)
    for c in chunks:
        assert c.num_rows == 1 or c.num_rows * c.num_keys * 4 <= max_logits_bytes
        assert c.ke.tolist() == [t + 1 for t in range(c.token_start, c.token_end)]


def test_workspace_budget_packs_requests_greedily():
    meta = build_metadata([30, 30, 30], [30, 30, 30], table(3, 2), block_size=16, workspace_tokens=64)
    assert [c.num_keys for c in meta.prefill_chunks] == [60, 30]
    with pytest.raises(ValueError, match="workspace_tokens"):
        build_metadata([100], [100], table(1, 8), block_size=16, workspace_tokens=64)


def test_decode_rows_native_uniform_and_padded():
    meta = build_metadata([10, 3], [2, 2], table(2, 3), block_size=4, num_spec_tokens=1)
    assert meta.decode.context_lens.tolist() == [[9, 10], [2, 3]]
    assert not meta.decode.requires_padding
    meta = build_metadata([10, 3], [1, 2], table(2, 3), block_size=4, num_spec_tokens=1)
    assert meta.decode.requires_padding
    assert meta.decode.context_lens.tolist() == [[10, 0], [2, 3]]
    assert meta.decode.decode_lens.tolist() == [1, 2]


def test_decode_rows_flattened_have_one_row_per_token():
    meta = build_metadata([10, 3], [2, 1], table(2, 3), block_size=4, num_spec_tokens=1, decode_layout="flattened")
    assert meta.decode.next_n == 1
    assert meta.decode.context_lens.tolist() == [[9], [10], [3]]
    assert meta.decode.row_to_request.tolist() == [0, 0, 1]
    assert torch.equal(meta.decode.block_table, table(2, 3)[[0, 0, 1]])


def test_dcp_localises_lengths_after_the_row_expansion():
    meta = build_metadata([10], [3], table(1, 4), block_size=4, num_spec_tokens=2, dcp_rank=1, dcp_world_size=2)
    assert meta.decode.global_context_lens.tolist() == [[8, 9, 10]]
    assert meta.decode.context_lens.tolist() == [[4, 4, 5]]


def test_slot_mapping_follows_block_table_compression_and_dcp_owner():
    tbl = torch.tensor([[7, 3, 5]], dtype=torch.int32)
    meta = build_metadata([12], [12], tbl, block_size=2, compress_ratio=2)
    expected = []
    for p in range(12):
        c = (p + 1) // 2 - 1
        expected.append(-1 if (p + 1) % 2 else int(tbl[0, c // 2]) * 2 + c % 2)
    assert meta.slot_mapping.tolist() == expected
    meta = build_metadata([6], [6], tbl, block_size=2, dcp_rank=1, dcp_world_size=2)
    assert meta.slot_mapping.tolist() == [-1, 14, -1, 15, -1, 6]


def test_dense_prefill_flag_only_for_short_all_prefill_steps():
    assert build_metadata([20, 30], [20, 30], table(2, 2), block_size=16, dense_prefill_max_len=32).use_dense_prefill
    assert not build_metadata([20, 40], [20, 40], table(2, 3), block_size=16, dense_prefill_max_len=32).use_dense_prefill
    assert not build_metadata([20, 30], [1, 30], table(2, 2), block_size=16, dense_prefill_max_len=32).use_dense_prefill


def test_idle_requests_are_allowed_anywhere():
    meta = build_metadata([5, 0, 8, 9], [1, 0, 1, 9], table(4, 1), block_size=16)
    assert meta.num_decodes == 2 and meta.num_prefills == 1
    assert meta.decode.context_lens.tolist() == [[5], [8]]


def test_builder_reuses_its_decode_buffers_across_steps():
    builder = MetadataBuilder(max_decode_requests=4, max_next_n=2, max_blocks_per_request=4, block_size=4, num_spec_tokens=1)
    first = builder.build([5, 6], [2, 2], table(2, 2))
    pointers = first.decode.context_lens.data_ptr(), first.decode.block_table.data_ptr()
    second = builder.build([9, 7], [2, 2], table(2, 3))
    assert (second.decode.context_lens.data_ptr(), second.decode.block_table.data_ptr()) == pointers
    assert second.decode.context_lens.tolist() == [[8, 9], [6, 7]]


def _builder_state(builder: MetadataBuilder) -> list[torch.Tensor]:
    return [t.clone() for t in (builder._context_lens, builder._global_context_lens, builder._decode_lens,
                                builder._row_to_request, builder._block_table, builder._slots)]


@pytest.mark.parametrize(
    "layout, seq_lens, query_lens, match",
    [
        # Request 1 needs ceil(101 / 16) = 7 pages of a 4-page capacity; its table has 8 columns.
        ("native", [5, 101], [1, 1], "decode request 1 needs 7 pages .* max_blocks_per_request \\(4\\)"),
        ("flattened", [5, 101], [1, 2], "decode request 1 needs 7 pages .* max_blocks_per_request \\(4\\)"),
        ("native", [65, 5], [1, 1], "decode request 0 needs 5 pages"),
        ("native", [5, 6, 7], [1, 1, 1], "3 rows x next_n 1 exceeds the builder's capacity 2 x 2"),
        ("flattened", [5, 6], [2, 3], "5 rows x next_n 1 exceeds the builder's capacity 4 x 1"),
    ],
)
def test_builder_capacity_overflow_raises_before_writing_its_buffers(layout, seq_lens, query_lens, match):
    builder = MetadataBuilder(max_decode_requests=2, max_next_n=2, max_blocks_per_request=4, block_size=16,
                              num_spec_tokens=1 if layout == "native" else 2, decode_layout=layout)
    builder.build([20, 30], [1, 1], table(2, 4, offset=3))  # a planned step: the buffers hold non-zero values
    before = _builder_state(builder)
    with pytest.raises(ValueError, match=match):
        builder.build(seq_lens, query_lens, table(len(seq_lens), 8))
    assert all(torch.equal(a, b) for a, b in zip(before, _builder_state(builder)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seq_lens=[5], query_lens=[6]), "query_lens\\[0\\]"),
        (dict(seq_lens=[-1], query_lens=[0]), "must be >= 0"),
        (dict(seq_lens=[5, 5], query_lens=[5]), "query_lens must have 2"),
        (dict(seq_lens=[80], query_lens=[1]), "block_table row 0 has 2 pages"),
        (dict(seq_lens=[20, 5], query_lens=[20, 1]), "query_lens must list the decode requests"),
        (dict(seq_lens=[5], query_lens=[1], block_table=torch.tensor([[-1, 0]], dtype=torch.int32)), "page ids outside"),
        (dict(seq_lens=[5], query_lens=[1], block_table=torch.tensor([[9, 0]], dtype=torch.int32)), "page ids outside"),
        (dict(seq_lens=[5], query_lens=[1], block_table=torch.zeros(1, 2)), "block_table must have dtype"),
        (dict(seq_lens=[5], query_lens=[1], dcp_rank=2, dcp_world_size=2), "dcp_rank"),
        (dict(seq_lens=[5], query_lens=[1], num_cache_blocks="8"), "num_cache_blocks"),
        (dict(seq_lens=[5], query_lens=[1], num_cache_blocks=-1), "num_cache_blocks"),
        (dict(seq_lens=[5], query_lens=[1], dense_prefill_max_len=1.5), "dense_prefill_max_len"),
    ],
)
def test_bad_batches_raise_before_planning(kwargs, match):
    kwargs = dict(kwargs)
    args = dict(block_table=table(len(kwargs["seq_lens"]), 2), block_size=16, num_cache_blocks=8)
    args.update(kwargs)
    seq_lens, query_lens = args.pop("seq_lens"), args.pop("query_lens")
    tbl = args.pop("block_table")
    with pytest.raises((ValueError, TypeError), match=match):
        build_metadata(seq_lens, query_lens, tbl, **args)


@pytest.mark.parametrize(
    "seq_lens, query_lens, error, match",
    [
        ([100.9], [1], TypeError, "seq_lens"),
        ([100.0], [1], TypeError, "seq_lens"),
        ([100], [1.0], TypeError, "query_lens"),
        ([100], [True], TypeError, "query_lens"),
        (torch.tensor([100.5]), [1], TypeError, "seq_lens"),
        ([100], torch.tensor([[1]]), ValueError, "query_lens"),
        ("12", [1], TypeError, "seq_lens"),
        (100, [1], TypeError, "seq_lens"),
    ],
)
def test_non_integer_lengths_are_refused_not_truncated(seq_lens, query_lens, error, match):
    builder = MetadataBuilder(max_decode_requests=1, max_next_n=1, max_blocks_per_request=8, block_size=16)
    before = builder._block_table.clone()
    with pytest.raises(error, match=match):
        build_metadata(seq_lens, query_lens, table(1, 8), block_size=16)
    with pytest.raises(error, match=match):
        builder.build(seq_lens, query_lens, table(1, 8))
    assert torch.equal(builder._block_table, before)


def test_integer_lengths_of_every_kind_plan_alike():
    np = pytest.importorskip("numpy")
    expected = build_metadata([100, 7], [1, 7], table(2, 8), block_size=16)
    for seq_lens, query_lens in [
        (np.array([100, 7]), np.array([1, 7], dtype=np.int32)),
        ([np.int64(100), np.int16(7)], (1, 7)),
        (torch.tensor([100, 7]), torch.tensor([1, 7], dtype=torch.int32)),
    ]:
        meta = build_metadata(seq_lens, query_lens, table(2, 8), block_size=16)
        assert torch.equal(meta.slot_mapping, expected.slot_mapping)
        assert meta.decode.context_lens.tolist() == expected.decode.context_lens.tolist()
        assert [c.ke.tolist() for c in meta.prefill_chunks] == [c.ke.tolist() for c in expected.prefill_chunks]
