"""SparseAttnIndexer end to end over multi-step mixed batches, against a dense per-request oracle.

The oracle never touches the paged cache: it keeps each request's raw keys, quantises them with
``formats``, scores every row densely with the reference ``mqa_logits`` over the request's whole visible
context and applies the §6 top-k (and the §9 candidate rules). The layer goes through everything the
oracle skips: slot mapping, paged insert, chunk planning, gather, ragged/paged logits, padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsa_indexer import (
    IndexerKCache,
    SparseAttnIndexer,
    StageTimer,
    apply_candidate_mask,
    build_metadata,
    mqa_logits,
    quantize_fp8,
    quantize_mxfp4,
    rope_quant_q,
    select_candidate_blocks,
    topk,
)

HEADS, DIM, BLOCK, TOPK, POISON = 4, 128, 16, 24, -7

# Each step lists (request, new tokens). Request 3 is idle (0 tokens) in the first step; request 2's
# context stays shorter than TOPK for a while; step 2 has a 1-token decode beside 2-token ones.
MIXED_STEPS = [
    [(0, 40), (1, 30), (2, 5), (3, 0)],
    [(1, 2), (2, 2), (0, 60), (3, 20)],
    [(1, 1), (2, 2), (0, 2), (3, 10)],
    [(0, 2), (1, 2), (2, 2), (3, 2)],
]
SINGLE_TOKEN_DECODE_STEPS = [
    [(0, 33), (1, 17)],
    [(0, 1), (1, 1), (2, 50)],
    [(0, 1), (1, 1), (2, 1)],
]


@dataclass
class Run:
    buffers: list[torch.Tensor]
    expected: list[torch.Tensor]
    candidates: list[torch.Tensor]
    expected_candidates: list[torch.Tensor]


def quantize_keys(keys: torch.Tensor, fmt: str):
    if fmt == "fp8":
        values, scales = quantize_fp8(keys, block_size=DIM)
        return values, scales.squeeze(-1)
    return quantize_mxfp4(keys)


def run_steps(
    steps,
    *,
    fmt="fp8",
    ratio=1,
    num_spec_tokens=1,
    candidate_mode=None,
    max_logits_bytes=1 << 20,
    workspace_tokens=4096,
    decode_layout="native",
    consumer_logits="auto",
    seed=0,
    logits_dtype=torch.float32,
    scale_fmt=None,
) -> Run:
    gen = torch.Generator().manual_seed(seed)
    num_requests = 1 + max(r for step in steps for r, _ in step)
    pages = 12
    cache = IndexerKCache(num_requests * pages, block_size=BLOCK, head_dim=DIM, fmt=fmt, scale_fmt=scale_fmt)
    cache.buffer.fill_(0xA5)
    block_table = torch.randperm(num_requests * pages, generator=gen).to(torch.int32).view(num_requests, pages)
    max_tokens = 128
    buffer = torch.empty(max_tokens, TOPK, dtype=torch.int32)
    num_candidate_blocks = 3
    candidate_buffer = None
    if candidate_mode is not None:
        candidate_buffer = torch.full((max_tokens, num_candidate_blocks), -1, dtype=torch.int32)
    layer = SparseAttnIndexer(
        cache, TOPK, buffer, workspace_tokens=workspace_tokens, compress_ratio=ratio,
        candidate_blocks=candidate_buffer, candidate_block_size=4, candidate_write=candidate_mode == "write",
        consumer_logits=consumer_logits, timer=StageTimer(), logits_dtype=logits_dtype,
    )
    cos_sin = torch.randn(512, 64, generator=gen)
    lengths = [0] * num_requests
    history = [[] for _ in range(num_requests)]
    run = Run([], [], [], [])
    for step in steps:
        requests = [r for r, _ in step]
        plan = [q for _, q in step]
        seq_lens = [lengths[r] + q for r, q in step]
        metadata = build_metadata(
            seq_lens, plan, block_table[requests], block_size=BLOCK, num_spec_tokens=num_spec_tokens,
            compress_ratio=ratio, workspace_tokens=workspace_tokens, max_logits_bytes=max_logits_bytes,
            decode_layout=decode_layout, num_cache_blocks=cache.num_blocks,
        )
        num_tokens = sum(plan)
        positions = torch.cat([torch.arange(lengths[r], lengths[r] + q) for r, q in step])
        q = torch.randn(num_tokens, HEADS, DIM, generator=gen).bfloat16()
        k = torch.randn(num_tokens, DIM, generator=gen).bfloat16()
        w = torch.randn(num_tokens, HEADS, generator=gen)
        q_quant, q_scale, weights = rope_quant_q(q, positions, cos_sin, w, DIM**-0.5, HEADS**-0.5, fmt=fmt)
        if candidate_mode == "mask":
            drawn = torch.randint(-1, 12, (num_tokens, num_candidate_blocks), generator=gen)
            if consumer_logits != "dense":  # the sparse path takes rows ascending, then -1 (repeats are padding)
                drawn = torch.where(drawn < 0, 99, drawn).sort(dim=1).values
                drawn = torch.where(drawn == 99, -1, drawn).to(torch.int32)
            candidate_buffer[:num_tokens] = drawn
        given_candidates = None if candidate_buffer is None else candidate_buffer[:num_tokens].clone()
        buffer.fill_(POISON)
        layer(q_quant, q_scale, k, weights, metadata)

        row = 0
        expected = torch.full((num_tokens, TOPK), -1, dtype=torch.int32)
        expected_candidates = torch.full((num_tokens, num_candidate_blocks), -1, dtype=torch.int32)
        for r, count in step:
            for offset in range(count):
                position = lengths[r] + offset
                if (position + 1) % ratio == 0:
                    history[r].append(k[row + offset])
            visible = ((positions[row : row + count] + 1) // ratio).to(torch.int32)
            rows = slice(row, row + count)
            row += count
            if count == 0 or not history[r]:
                continue
            values, scales = quantize_keys(torch.stack(history[r]).float(), fmt)
            starts = torch.zeros_like(visible)
            logits = mqa_logits(
                q_quant[rows], None if q_scale is None else q_scale[rows], values, scales, weights[rows],
                starts, visible, logits_dtype=logits_dtype, backend="reference",
            )
            if candidate_mode == "write":
                expected_candidates[rows] = select_candidate_blocks(logits, starts, visible, num_candidate_blocks, 4)
            elif candidate_mode == "mask":
                apply_candidate_mask(logits, starts, visible, given_candidates[rows], 4)
            expected[rows] = topk(logits, TOPK, starts=starts, ends=visible, backend="reference")
        for r, count in step:
            lengths[r] += count
        run.buffers.append(buffer.clone())
        run.expected.append(expected)
        if candidate_buffer is not None:
            run.candidates.append(candidate_buffer[:num_tokens].clone())
            run.expected_candidates.append(expected_candidates)
    return run


def assert_matches_oracle(run: Run, steps) -> None:
    for index, (buffer, expected) in enumerate(zip(run.buffers, run.expected)):
        num_tokens = sum(q for _, q in steps[index])
        assert torch.equal(buffer[:num_tokens], expected), f"step {index}: indices differ from the dense oracle"
        assert (buffer[num_tokens:] == POISON).all(), f"step {index}: rows beyond the batch were written"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_mixed_steps_equal_dense_oracle(fmt, ratio):
    run = run_steps(MIXED_STEPS, fmt=fmt, ratio=ratio)
    assert_matches_oracle(run, MIXED_STEPS)


def test_bf16_logits_and_mxfp8_cache_equal_dense_oracle():
    """The oracle scores the fp32-scale keys (mxfp8 words decode to the same scales) and picks from bf16 logits."""
    run = run_steps(MIXED_STEPS, logits_dtype=torch.bfloat16, scale_fmt="mxfp8")
    assert_matches_oracle(run, MIXED_STEPS)


def test_bf16_logits_refused_with_candidate_blocks():
    cache = IndexerKCache(2, block_size=BLOCK, head_dim=DIM)
    with pytest.raises(ValueError, match="logits_dtype must be torch.float32 with candidate_blocks"):
        SparseAttnIndexer(cache, TOPK, torch.empty(4, TOPK, dtype=torch.int32), workspace_tokens=64,
                          candidate_blocks=torch.empty(4, 3, dtype=torch.int32), candidate_block_size=4,
                          logits_dtype=torch.bfloat16)


def test_single_token_decodes_equal_dense_oracle():
    run = run_steps(SINGLE_TOKEN_DECODE_STEPS, num_spec_tokens=0)
    assert_matches_oracle(run, SINGLE_TOKEN_DECODE_STEPS)


def test_flattened_decode_layout_equals_dense_oracle():
    run = run_steps(MIXED_STEPS, decode_layout="flattened")
    assert_matches_oracle(run, MIXED_STEPS)


@pytest.mark.parametrize("ratio", [1, 2])
def test_candidate_source_publishes_oracle_blocks_and_indices(ratio):
    run = run_steps(MIXED_STEPS, ratio=ratio, candidate_mode="write")
    assert_matches_oracle(run, MIXED_STEPS)
    for got, expected in zip(run.candidates, run.expected_candidates):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(("consumer_logits", "fmt"), [("sparse", "fp8"), ("sparse", "mxfp4"), ("dense", "fp8")])
def test_candidate_consumer_masks_with_given_blocks(consumer_logits, fmt):
    run = run_steps(MIXED_STEPS, fmt=fmt, candidate_mode="mask", consumer_logits=consumer_logits)
    assert_matches_oracle(run, MIXED_STEPS)


def test_auto_consumer_equals_dense_oracle():
    # 3 blocks of 4 = 12 columns: the first chunk (10 keys) and the decodes up to 12 positions stay dense,
    # the 30-token prefill and the later decodes go sparse
    steps = [[(0, 10)], [(0, 1)], [(0, 1), (1, 30)], [(0, 2), (1, 2)]]
    run = run_steps(steps, candidate_mode="mask", consumer_logits="auto")
    assert_matches_oracle(run, steps)


def test_sparse_consumer_under_tight_chunking_and_flattened_decode_equals_dense_oracle():
    tight = run_steps(MIXED_STEPS, candidate_mode="mask", consumer_logits="sparse", ratio=2,
                      max_logits_bytes=4 * 3 * 64, workspace_tokens=64, decode_layout="flattened")
    assert_matches_oracle(tight, MIXED_STEPS)


def test_chunking_is_invisible():
    roomy = run_steps(MIXED_STEPS, fmt="mxfp4", ratio=2)
    tight = run_steps(MIXED_STEPS, fmt="mxfp4", ratio=2, max_logits_bytes=4 * 3 * 64, workspace_tokens=64)
    for a, b in zip(roomy.buffers, tight.buffers):
        assert torch.equal(a, b)
    assert_matches_oracle(tight, MIXED_STEPS)


def make_layer(fmt="fp8", *, workspace_tokens=256, **kwargs):
    cache = IndexerKCache(8, block_size=BLOCK, head_dim=DIM, fmt=fmt)
    buffer = torch.full((128, TOPK), POISON, dtype=torch.int32)
    return SparseAttnIndexer(cache, TOPK, buffer, workspace_tokens=workspace_tokens, **kwargs), cache, buffer


def fp8_inputs(num_tokens):
    q = torch.randn(num_tokens, HEADS, DIM).to(torch.float8_e4m3fn)
    return q, None, torch.randn(num_tokens, DIM), torch.rand(num_tokens, HEADS)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(compress_ratio=2), "compress_ratio"),
        (dict(dcp_world_size=2), "planned for DCP rank 0 of 2"),
        (dict(workspace_tokens=10_000, seq_lens=[120], layer_workspace=64), "workspace_tokens"),
        (dict(q_rows=3), "q_quant and weights"),
        (dict(k_rows=3), "k needs"),
        (dict(q_scale=True), "q_scale"),
    ],
)
def test_bad_calls_raise_before_anything_is_written(change, match):
    layer, cache, buffer = make_layer(workspace_tokens=change.get("layer_workspace", 256))
    seq_lens = change.get("seq_lens", [20])
    meta = build_metadata(
        seq_lens, seq_lens, torch.arange(8, dtype=torch.int32).view(1, 8), block_size=BLOCK,
        compress_ratio=change.get("compress_ratio", 1), workspace_tokens=change.get("workspace_tokens"),
        dcp_world_size=change.get("dcp_world_size", 1),
    )
    q, q_scale, k, w = fp8_inputs(seq_lens[0])
    if "q_rows" in change:
        q, w = q[: change["q_rows"]], w[: change["q_rows"]]
    if "k_rows" in change:
        k = k[: change["k_rows"]]
    if change.get("q_scale"):
        q_scale = torch.zeros(seq_lens[0], HEADS, DIM // 32, dtype=torch.uint8)
    cache_before, buffer_before = cache.buffer.clone(), buffer.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        layer(q, q_scale, k, w, meta)
    assert torch.equal(cache.buffer, cache_before) and torch.equal(buffer, buffer_before)


def mxfp4_inputs(num_tokens):
    q = torch.randint(0, 256, (num_tokens, HEADS, DIM // 2), dtype=torch.uint8)
    q_scale = torch.full((num_tokens, HEADS, DIM // 32), 127, dtype=torch.uint8)
    return q, q_scale, torch.randn(num_tokens, DIM), torch.rand(num_tokens, HEADS)


def _with(index, value):
    """A change of the (q_quant, q_scale, k, weights) tuple: entry ``index`` becomes ``value(old entry)``."""
    return lambda args: tuple(value(a) if i == index else a for i, a in enumerate(args))


@pytest.mark.parametrize(
    "fmt, change, match",
    [
        ("fp8", _with(0, lambda q: q.to(torch.bfloat16)), "q_quant must have dtype float8_e4m3fn"),
        ("fp8", _with(0, lambda q: q.view(torch.uint8)), "q_quant must have dtype float8_e4m3fn"),
        ("fp8", _with(0, lambda q: q[..., : DIM // 2]), "q_quant must have shape"),
        ("fp8", _with(0, lambda q: q[:, 0]), "q_quant must have 3 dimensions"),
        ("fp8", _with(1, lambda _: torch.zeros(21, HEADS, DIM // 32, dtype=torch.uint8)), "q_scale must be None"),
        ("fp8", _with(2, lambda k: k[:, : DIM - 1]), "k must have shape"),
        ("fp8", _with(2, lambda k: k.to(torch.float8_e4m3fn)), "k must have dtype"),
        ("fp8", _with(3, lambda w: torch.cat([w, w[:, :1]], dim=1)), "weights must have 4 columns"),
        ("fp8", _with(3, lambda w: w[:, :-1]), "weights must have 4 columns"),
        ("fp8", _with(3, lambda w: w.to(torch.bfloat16)), "weights must have dtype float32"),
        ("mxfp4", _with(0, lambda q: torch.zeros(21, HEADS, DIM, dtype=torch.float8_e4m3fn)), "q_quant must have dtype uint8"),
        ("mxfp4", _with(0, lambda q: torch.cat([q, q], dim=2)), "q_quant must have shape"),
        ("mxfp4", _with(1, lambda _: None), "q_scale must be given"),
        ("mxfp4", _with(1, lambda s: s[:, :, :2]), "q_scale must have shape"),
        ("mxfp4", _with(1, lambda s: s[:, :-1]), "q_scale must have shape"),
        ("mxfp4", _with(1, lambda s: s[:5]), "q_scale needs >= 21 rows"),
        ("mxfp4", _with(1, lambda s: s.float()), "q_scale must have dtype uint8"),
        ("mxfp4", _with(3, lambda w: torch.cat([w, w[:, :1]], dim=1)), "weights must have 4 columns"),
    ],
)
def test_bad_tensors_raise_naming_them_before_the_insert_and_the_clear(fmt, change, match):
    """A mixed step (one decode, one prefill): every wrong tensor is named, and neither the cache
    (the insert comes first) nor the top-k buffer (cleared next) changes."""
    layer, cache, buffer = make_layer(fmt)
    meta = build_metadata([9, 20], [1, 20], torch.arange(8, dtype=torch.int32).view(2, 4), block_size=BLOCK)
    args = change((fp8_inputs if fmt == "fp8" else mxfp4_inputs)(21))
    layer(*(fp8_inputs if fmt == "fp8" else mxfp4_inputs)(21), meta)  # a valid step first: non-zero cache bytes
    buffer.fill_(POISON)
    cache_before, buffer_before = cache.buffer.clone(), buffer.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        layer(*args, meta)
    assert torch.equal(cache.buffer, cache_before) and torch.equal(buffer, buffer_before)


@pytest.mark.parametrize("request_index", [0, 1])
def test_block_table_entries_outside_the_cache_raise_before_anything_is_written(request_index):
    """Metadata planned without num_cache_blocks: the first page of the decode (request 0) or of the prefill
    (request 1), read but not written this step (the new keys go to later pages, so the insert's slot check
    passes), is past the layer's 8-page cache; the step is refused before the insert and the clear."""
    layer, cache, buffer = make_layer()
    block_table = torch.arange(8, dtype=torch.int32).view(2, 4)
    block_table[request_index, 0] = 8
    meta = build_metadata([20, 40], [1, 20], block_table, block_size=BLOCK)
    cache_before, buffer_before = cache.buffer.clone(), buffer.clone()
    part = "decode" if request_index == 0 else "prefill_chunks\\[0\\]"
    with pytest.raises(ValueError, match=f"metadata.{part}.block_table entries read must be in \\[0, 8\\)"):
        layer(*fp8_inputs(21), meta)
    assert torch.equal(cache.buffer, cache_before) and torch.equal(buffer, buffer_before)


def test_dense_prefill_bypass_inserts_keys_and_leaves_the_buffer():
    layer, cache, buffer = make_layer(dense_prefill_bypass=True)
    meta = build_metadata([20], [20], torch.arange(8, dtype=torch.int32).view(1, 8), block_size=BLOCK,
                          dense_prefill_max_len=32)
    assert meta.use_dense_prefill
    q, q_scale, k, w = fp8_inputs(20)
    layer(q, q_scale, k, w, meta)
    assert (buffer == POISON).all()
    assert cache.buffer.any()


def test_skip_insert_leaves_the_cache_alone():
    layer, cache, buffer = make_layer(skip_k_cache_insert=True)
    meta = build_metadata([5], [5], torch.arange(8, dtype=torch.int32).view(1, 8), block_size=BLOCK)
    q, q_scale, _, w = fp8_inputs(5)
    layer(q, q_scale, None, w, meta)
    assert not cache.buffer.any()
    assert buffer[4, :6].tolist() == [0, 1, 2, 3, 4, -1]


@pytest.mark.parametrize("skip_clear", [False, True])
def test_buffer_clear_covers_rows_that_see_no_keys(skip_clear):
    layer, _, buffer = make_layer(compress_ratio=4, skip_topk_buffer_clear=skip_clear)
    meta = build_metadata([3], [3], torch.arange(8, dtype=torch.int32).view(1, 8), block_size=BLOCK, compress_ratio=4)
    assert meta.num_prefill_tokens == 3 and meta.prefill_chunks[0].num_keys == 0
    q, q_scale, k, w = fp8_inputs(3)
    layer(q, q_scale, k, w, meta)
    assert (buffer[:3] == (POISON if skip_clear else -1)).all()
    assert (buffer[3:] == POISON).all()


def test_timer_records_stages_and_reserve_reports_peak_bytes():
    timer = StageTimer()
    layer, _, _ = make_layer(timer=timer)
    meta = build_metadata([30, 40], [1, 40], torch.arange(8, dtype=torch.int32).view(2, 4), block_size=BLOCK)
    q, q_scale, k, w = fp8_inputs(41)
    layer(q, q_scale, k, w, meta)
    assert {"insert", "gather", "prefill_logits", "prefill_topk", "decode_logits", "decode_topk"} <= set(timer.seconds)
    peak = layer.reserve_workspace(max_decode_rows=8, max_context_len=1000, max_logits_bytes=1 << 20)
    assert peak >= 256 * (DIM + 4) + (1 << 20)


def test_warmup_runs_a_step_without_touching_the_cache():
    layer, cache, buffer = make_layer()
    meta = build_metadata([30, 40], [1, 40], torch.arange(8, dtype=torch.int32).view(2, 4), block_size=BLOCK)
    q, q_scale, k, w = fp8_inputs(41)
    layer.warmup(q, q_scale, k, w, meta)
    assert not cache.buffer.any()
    assert (buffer[:41, 0] >= -1).all() and (buffer[41:] == POISON).all()


def _compiled_step_equals_eager(device):
    torch.manual_seed(0)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    meta = build_metadata([20, 12], [1, 12], table, block_size=BLOCK)
    q, q_scale, k, w = (None if t is None else t.to(device) for t in fp8_inputs(13))
    results = []
    for compile_forward in (False, True):
        cache = IndexerKCache(8, block_size=BLOCK, head_dim=DIM, device=device)
        buffer = torch.full((128, TOPK), POISON, dtype=torch.int32, device=device)
        layer = SparseAttnIndexer(cache, TOPK, buffer, workspace_tokens=256)
        forward = torch.compile(layer.forward, backend="aot_eager") if compile_forward else layer.forward
        forward(q, q_scale, k, w, meta)
        results.append((buffer.cpu(), cache.buffer.cpu()))
    (eager_buffer, eager_cache), (compiled_buffer, compiled_cache) = results
    assert torch.equal(compiled_buffer, eager_buffer)
    assert torch.equal(compiled_cache, eager_cache)


def test_compiled_forward_equals_eager():
    _compiled_step_equals_eager("cpu")


@pytest.mark.gpu
def test_compiled_forward_equals_eager_on_cuda():
    _compiled_step_equals_eager("cuda")
