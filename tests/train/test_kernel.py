"""The Triton KL-loss kernels (``dsa_indexer.train.triton``) against an independent float64 oracle.

The oracle below follows the math of issue 27 literally, query chunk by query chunk, materialising the
``[chunk, T_k]`` scores (the whole ``T x T_k`` matrix at the interpreter's tiny shapes): visibility mask,
indexer logits, the head-summed target, KL per row, and the gradients through ``G = (c/N)(pi - p)``.
The oracle's own gradients are checked once against torch autograd of its loss. Interpreter cases are
tiny (T <= 32); realistic shapes, the 20-rerun determinism of ``dk`` and the memory bound run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsa_indexer.testing import calc_diff

triton_kernels = pytest.importorskip("dsa_indexer.train.triton")
indexer_kl_triton = triton_kernels.indexer_kl_triton


def _layout(t: int, cu_seqlens, ratio: int):
    """Per token: (first key row of its sequence, visible key count (p + 1) // ratio)."""
    cu = [0, t] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    base, limit, key_start = [], [], 0
    for b in range(len(cu) - 1):
        length = cu[b + 1] - cu[b]
        for p in range(length):
            base.append(key_start)
            limit.append((p + 1) // ratio)
        key_start += length // ratio
    return torch.tensor(base, dtype=torch.int64), torch.tensor(limit, dtype=torch.int64)


def _visible(rows, t_k, base, limit, topk):
    """Bool [len(rows), T_k]: key s in V_t."""
    s = torch.arange(t_k, device=base.device)
    mask = (s[None, :] >= base[rows, None]) & (s[None, :] < (base + limit)[rows, None])
    if topk is None:
        return mask
    ids = topk[rows].to(torch.int64)
    ok = (ids >= 0) & (ids < limit[rows, None])
    hits = torch.zeros(mask.shape, dtype=torch.int64, device=base.device)
    hits.scatter_add_(1, torch.where(ok, base[rows, None] + ids, 0), ok.to(torch.int64))
    return mask & (hits > 0)


def oracle(q, k, w, attn_q, attn_k, attn_lse, *, softmax_scale, cu_seqlens=None, topk_indices=None, compress_ratio=1,
           target_norm="heads", reduction="mean", coeff=1.0, chunk=4096):
    """(loss, dq, dk, dw) in float64 on the inputs' device."""
    q, k, w, attn_q, attn_k, attn_lse = (x.double() for x in (q, k, w, attn_q, attn_k, attn_lse))
    t, h = attn_q.shape[:2]
    t_k = k.shape[0]
    kv = attn_k if attn_k.dim() == 3 else attn_k[:, None, :]
    kv_of_head = torch.arange(h, device=q.device) // (h // kv.shape[1])
    base, limit = (x.to(q.device) for x in _layout(t, cu_seqlens, compress_ratio))
    topk = None if topk_indices is None else topk_indices.to(q.device)

    def chunk_terms(rows):
        vis = _visible(rows, t_k, base, limit, topk)
        a = torch.einsum("thd,sd->ths", q[rows], k)
        logits = torch.einsum("th,ths->ts", w[rows], a.clamp(min=0))
        z = torch.einsum("thd,shd->ths", attn_q[rows], kv[:, kv_of_head])
        target = torch.exp(softmax_scale * z - attn_lse[rows, :, None]).sum(1)
        return vis, a, logits, target

    lse_i = torch.empty(t, dtype=torch.float64, device=q.device)
    denom = torch.full((t,), float(h), dtype=torch.float64, device=q.device)
    for c0 in range(0, t, chunk):
        rows = torch.arange(c0, min(t, c0 + chunk), device=q.device)
        vis, _, logits, target = chunk_terms(rows)
        lse_i[rows] = torch.logsumexp(logits.masked_fill(~vis, -math.inf), 1)
        if target_norm == "l1":
            denom[rows] = (target * vis).sum(1)
    valid = lse_i > -math.inf
    count = int(valid.sum())
    g_scale = coeff / max(count, 1) if reduction == "mean" else coeff
    kl = torch.zeros(t, dtype=torch.float64, device=q.device)
    dq, dk, dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
    for c0 in range(0, t, chunk):
        rows = torch.arange(c0, min(t, c0 + chunk), device=q.device)
        vis, a, logits, target = chunk_terms(rows)
        p = torch.where(vis, target / denom[rows, None], 0.0)
        pi = torch.where(vis, torch.exp(logits - lse_i[rows, None]), 0.0)
        plogp = torch.where(vis & (p > 0), p * torch.log(torch.where(p > 0, p, 1.0)), 0.0)
        row_kl = plogp.sum(1) - (p * torch.where(vis, logits, 0.0)).sum(1) + torch.where(valid[rows], lse_i[rows], 0.0)
        kl[rows] = torch.where(valid[rows], row_kl, 0.0)
        grad = g_scale * (pi - p)
        gate = (a > 0).double()
        dw[rows] = torch.einsum("ts,ths->th", grad, a.clamp(min=0))
        dq[rows] = w[rows, :, None] * torch.einsum("ts,ths,sd->thd", grad, gate, k)
        dk += torch.einsum("ts,th,ths,thd->sd", grad, w[rows], gate, q[rows])
    total = kl.sum()
    loss = coeff * (total / max(count, 1) if reduction == "mean" else total)
    return loss, dq, dk, dw


def _inputs(t, h_i, d_i, h, d_a, *, t_k=None, h_kv=0, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    t_k = t if t_k is None else t_k
    q = torch.randn(t, h_i, d_i, generator=gen)
    k = torch.randn(t_k, d_i, generator=gen)
    w = torch.randn(t, h_i, generator=gen) / math.sqrt(h_i * d_i)
    attn_q = torch.randn(t, h, d_a, generator=gen)
    attn_k = torch.randn(t_k, h_kv, d_a, generator=gen) if h_kv else torch.randn(t_k, d_a, generator=gen)
    attn_lse = torch.randn(t, h, generator=gen) + 3.0
    return [x.to(device=device, dtype=dtype) for x in (q, k, w, attn_q, attn_k)] + [attn_lse.to(device)]


def _causal_lse(attn_q, attn_k, softmax_scale, cu_seqlens, ratio, topk=None):
    """The attention's own per-head LSE over V_t (rows with an empty V_t: 0), float32."""
    t, h = attn_q.shape[:2]
    kv = attn_k if attn_k.dim() == 3 else attn_k[:, None, :]
    kv_of_head = torch.arange(h, device=attn_q.device) // (h // kv.shape[1])
    base, limit = (x.to(attn_q.device) for x in _layout(t, cu_seqlens, ratio))
    rows = torch.arange(t, device=attn_q.device)
    vis = _visible(rows, attn_k.shape[0], base, limit, topk)
    z = softmax_scale * torch.einsum("thd,shd->ths", attn_q.double(), kv[:, kv_of_head].double())
    lse = torch.logsumexp(z.masked_fill(~vis[:, None, :], -math.inf), 2)
    return torch.where(torch.isfinite(lse), lse, 0.0).float()


def _assert_close(got, want, *, dtype, label=""):
    loss, dq, dk, dw = got
    ref_loss, ref_dq, ref_dk, ref_dw = want
    grad_tol = 1e-9 if dtype == torch.float32 else 5e-6
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * (1 + abs(float(ref_loss))), (label, float(loss), float(ref_loss))
    for name, x, y in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dw", dw, ref_dw)):
        assert torch.isfinite(x).all(), (label, name)
        assert calc_diff(x, y) < grad_tol, (label, name, calc_diff(x, y))


def test_oracle_gradients_equal_autograd_of_its_loss():
    """The oracle's G-based gradients are the derivative of its loss (float64 autograd, varlen, ratio 2, sparse)."""
    q, k, w, attn_q, attn_k, attn_lse = (x.double() for x in _inputs(10, 2, 4, 3, 5, t_k=5))
    cu = torch.tensor([0, 6, 10])
    topk = torch.tensor([[0, 1, 2, -1]] * 10, dtype=torch.int32)
    for sel in (None, topk):
        kwargs = dict(softmax_scale=0.3, cu_seqlens=cu, topk_indices=sel, compress_ratio=2, target_norm="l1", coeff=0.7)
        _, dq, dk, dw = oracle(q, k, w, attn_q, attn_k, attn_lse, **kwargs)
        leaves = [x.clone().requires_grad_() for x in (q, k, w)]
        loss, *_ = oracle(*leaves, attn_q, attn_k, attn_lse, **kwargs)
        loss.backward()
        for leaf, grad in zip(leaves, (dq, dk, dw)):
            assert torch.allclose(leaf.grad, grad, rtol=1e-10, atol=1e-12)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case",
    [
        dict(t=23, h_i=3, d_i=16, h=4, d_a=24, dtype=torch.float32),
        dict(t=17, h_i=4, d_i=32, h=4, d_a=16, dtype=torch.bfloat16, target_norm="l1"),
        dict(t=21, h_i=2, d_i=16, h=4, d_a=20, h_kv=2, cu=[0, 1, 12, 12, 21], ratio=2, target_norm="l1",
             config=dict(dk_min_split_rows=4, fused_dk=False, target_chunk_rows=4)),
        dict(t=20, h_i=4, d_i=16, h=2, d_a=16, cu=[0, 7, 20], ratio=3, reduction="sum", coeff=0.25),
        dict(t=40, h_i=8, d_i=16, h=2, d_a=16, cu=[0, 3, 40], target_norm="l1", config=dict(fused_dk=True)),
        dict(t=40, h_i=8, d_i=16, h=2, d_a=16, cu=[0, 3, 40], config=dict(fused_dk=True, target_chunk_rows=7)),
        dict(t=19, h_i=2, d_i=16, h=4, d_a=40, config=dict(tile_rows=16, block_keys=16, block_d_a=16, num_warps=4)),
        dict(t=45, h_i=2, d_i=16, h=40, d_a=40, h_kv=2, cu=[0, 5, 45], target_norm="l1",
             config=dict(target_head_rows=16, target_block_keys=16, block_d_a=16, target_group_rows=3,
                         target_chunk_rows=11)),
    ],
    ids=["dense-fp32-causal", "dense-bf16-l1", "dense-varlen-ratio2-gqa-l1-split-dk-chunks",
         "dense-varlen-ratio3-sum", "dense-varlen-fused-dk", "dense-varlen-fused-dk-chunks", "dense-small-tiles",
         "dense-target-tiles"],
)
def test_dense_matches_oracle(kernel_device, case, monkeypatch):
    # dk_min_split_rows: dk summed from several parts of the query sweep; fused_dk: dk added in the gradient pass
    # behind per-tile tickets (the second sequence: three blocks of 16 tokens adding, in turn, to two tiles of
    # 32 keys), and the separate dk kernel must not run; target_chunk_rows: the target mass in chunks of 4 or 7
    # query rows, whose edges cut query blocks, sequences and dk runs; dense-target-tiles: the target kernel over
    # up to three 16-key tiles, two chunks of 16 heads per kv group of 20 (the second one part masked), D_a 40 in
    # steps of 16 (the last one part masked) and row groups of 3 (each chunk's last group short, its rows seeing
    # 6, 17, 28 and 39 keys)
    config = triton_kernels.KlLossConfig(**case.get("config", {}))
    if config.fused_dk:
        monkeypatch.setattr(triton_kernels, "_dk_dense_kernel", None)
    ratio = case.get("ratio", 1)
    cu = None if "cu" not in case else torch.tensor(case["cu"], dtype=torch.int32)
    t = case["t"]
    t_k = t // ratio if cu is None else sum((b - a) // ratio for a, b in zip(case["cu"], case["cu"][1:]))
    dtype = case.get("dtype", torch.float32)
    q, k, w, attn_q, attn_k, attn_lse = _inputs(t, case["h_i"], case["d_i"], case["h"], case["d_a"], t_k=t_k,
                                                h_kv=case.get("h_kv", 0), dtype=dtype, device=kernel_device)
    if case.get("target_norm", "heads") == "heads":
        attn_lse = _causal_lse(attn_q, attn_k, 0.3, cu, ratio)
    kwargs = dict(softmax_scale=0.3, cu_seqlens=None if cu is None else cu.to(kernel_device), compress_ratio=ratio,
                  target_norm=case.get("target_norm", "heads"), reduction=case.get("reduction", "mean"),
                  coeff=case.get("coeff", 1.0))
    got = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, **kwargs, config=config)
    assert [x.dtype for x in got[1:]] == [dtype] * 3
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, attn_lse, **kwargs), dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("target_norm", ["heads", "l1"])
def test_sparse_matches_oracle(kernel_device, target_norm):
    """Selections with -1 padding, duplicates, ids past the visible range and rows with nothing visible."""
    t, cu = 10, torch.tensor([0, 3, 10], dtype=torch.int64)
    q, k, w, attn_q, attn_k, attn_lse = _inputs(t, 3, 16, 3, 16, device=kernel_device, seed=1)
    gen = torch.Generator().manual_seed(2)
    topk = torch.randint(-1, 8, (t, 5), generator=gen, dtype=torch.int32)
    topk[4, :] = torch.tensor([1, 1, 0, 0, 1], dtype=torch.int32)  # duplicates count once
    topk[5, :] = -1  # empty row
    topk[6, :] = torch.tensor([4, 5, 6, 7, 4], dtype=torch.int32)  # local position 3: nothing visible
    topk = topk.to(kernel_device)
    if target_norm == "heads":
        attn_lse = _causal_lse(attn_q, attn_k, 0.3, cu, 1, topk)
    kwargs = dict(softmax_scale=0.3, cu_seqlens=cu.to(kernel_device), topk_indices=topk, target_norm=target_norm)
    got = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, **kwargs)
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, attn_lse, **kwargs), dtype=torch.float32)
    assert torch.equal(got[1][5:7].float(), torch.zeros_like(got[1][5:7]).float())


def _distinct_selection(t, slots, cu, *, seed):
    """int32 [T, slots]: each row a random number of distinct ids below its visible count, in random slots,
    -1 in the others (row 0 of each sequence: as many as it sees)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for a, b in zip(cu[:-1], cu[1:]):
        for p in range(b - a):
            count = int(torch.randint(0, min(slots, p + 1) + 1, (1,), generator=gen))
            ids = torch.full((slots,), -1, dtype=torch.int32)
            ids[torch.randperm(slots, generator=gen)[:count]] = torch.randperm(p + 1, generator=gen)[:count].to(torch.int32)
            rows.append(ids)
    return torch.stack(rows)


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk", [3, 1, 64])
def test_sparse_chunked_dk_matches_oracle(kernel_device, chunk):
    """The sparse dk in query chunks of C tokens (C = 3 over T = 10 splits unevenly; C = 1; C >= T one chunk):
    distinct selections of varying length with -1 slots, two slot tiles per token, two buffer rows a step of the
    by-key sum; the target mass in chunks of C + 1 rows, two tiles of 16 slots a row; within the oracle's tier
    (C = 3: and a rerun bitwise equal)."""
    t, cu = 10, [0, 4, 10]
    q, k, w, attn_q, attn_k, attn_lse = _inputs(t, 3, 16, 2, 16, device=kernel_device, seed=11)
    topk = _distinct_selection(t, 20, cu, seed=12).to(kernel_device)
    config = triton_kernels.KlLossConfig(sparse_dk_chunk_tokens=chunk, sparse_dk_block_slots=16, sparse_dk_sum_entries=2,
                                         target_chunk_rows=chunk + 1, target_block_keys=16)
    kwargs = dict(softmax_scale=0.3, cu_seqlens=torch.tensor(cu, device=kernel_device), topk_indices=topk,
                  target_norm="l1")
    got = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, **kwargs, config=config)
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, attn_lse, **kwargs), dtype=torch.float32, label=chunk)
    if chunk == 3:
        again = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, **kwargs, config=config)
        assert all(torch.equal(x, y) for x, y in zip(got, again))


@pytest.mark.interpreter
def test_sparse_chunked_dk_on_key_shards(kernel_device):
    """Context-parallel pieces: two key shards (the cut inside the second sequence), each shard's dk in chunks of
    3 tokens; the shards' dk side by side within the oracle's tier of the whole dk (bf16 inputs)."""
    t, cu = 11, [0, 5, 11]
    q, k, w, attn_q, attn_k, attn_lse = _inputs(t, 2, 16, 2, 16, dtype=torch.bfloat16, device=kernel_device, seed=13)
    topk = _distinct_selection(t, 6, cu, seed=14).to(kernel_device)
    kwargs = dict(softmax_scale=0.3, cu_seqlens=torch.tensor(cu, device=kernel_device), topk_indices=topk)
    config = triton_kernels.KlLossConfig(sparse_dk_chunk_tokens=3)
    shards = [(0, 7), (7, t - 7)]
    problems = [triton_kernels.prepare(q, k[o:o + n], w, attn_q, attn_k[o:o + n], attn_lse, **kwargs, config=config,
                                       key_shard=triton_kernels.KeyShard(o, n)) for o, n in shards]
    lse_i, denom = triton_kernels.merge_key_statistics([triton_kernels.row_statistics(x) for x in problems])
    parts = [triton_kernels.row_gradients(x, lse_i, denom, partial=True) for x in problems]
    dk = torch.cat([part[2] for part in parts])
    dq = parts[0][1] + parts[1][1]
    dw = parts[0][3] + parts[1][3]
    loss = triton_kernels.finish_loss(problems[0], lse_i, parts[0][0] + parts[1][0])
    want = oracle(q, k, w, attn_q, attn_k, attn_lse, **kwargs)
    _assert_close((loss, dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)), want, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_empty_and_single_token(kernel_device):
    """T = 1 with ratio 2 sees no key, nor does a sparse stage with k = 0: loss and gradients 0; T = 0 returns empty
    gradients."""
    q, k, w, attn_q, attn_k, attn_lse = _inputs(1, 2, 16, 2, 16, t_k=0, device=kernel_device)
    loss, dq, dk, dw = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, softmax_scale=0.2, compress_ratio=2)
    assert float(loss) == 0.0 and not dq.any() and dk.shape == (0, 16) and not dw.any()
    q, k, w, attn_q, attn_k, attn_lse = _inputs(3, 2, 16, 2, 16, device=kernel_device)
    nothing = torch.empty(3, 0, dtype=torch.int32, device=kernel_device)  # k = 0: every V_t is empty
    loss, dq, dk, dw = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, softmax_scale=0.2, topk_indices=nothing)
    assert float(loss) == 0.0 and not dq.any() and not dk.any() and not dw.any()
    empty = _inputs(0, 2, 16, 2, 16, device=kernel_device)
    loss, dq, dk, dw = indexer_kl_triton(*empty, softmax_scale=0.2)
    assert float(loss) == 0.0 and dq.shape == (0, 2, 16) and dk.shape == (0, 16) and dw.shape == (0, 2)


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(k=torch.zeros(8, 8)), ValueError),
        (dict(k=torch.zeros(8, 16, dtype=torch.float64)), TypeError),
        (dict(weights=torch.zeros(8, 3)), ValueError),
        (dict(attn_k=torch.zeros(8, 3, 16)), ValueError),
        (dict(attn_lse=torch.zeros(8, 4, dtype=torch.bfloat16)), TypeError),
        (dict(target_norm="l2"), ValueError),
        (dict(reduction="none"), ValueError),
        (dict(compress_ratio=0), ValueError),
        (dict(compress_ratio=2), ValueError),
        (dict(topk_indices=torch.zeros(8, 2, dtype=torch.int64)), TypeError),
        (dict(topk_indices=torch.zeros(7, 2, dtype=torch.int32)), ValueError),
        (dict(cu_seqlens=torch.tensor([0, 5, 9])), ValueError),
        (dict(cu_seqlens=torch.tensor([0, 6, 4, 8])), ValueError),
        (dict(config={"fused_dk": True}), TypeError),
    ],
)
def test_bad_input_is_rejected(change, error):
    q, k, w, attn_q, attn_k, attn_lse = _inputs(8, 2, 16, 4, 16)
    args = dict(q=q, k=k, weights=w, attn_q=attn_q, attn_k=attn_k, attn_lse=attn_lse, softmax_scale=0.2)
    args.update(change)
    with pytest.raises(error):
        indexer_kl_triton(args.pop("q"), args.pop("k"), args.pop("weights"), args.pop("attn_q"), args.pop("attn_k"),
                          args.pop("attn_lse"), **args)


V32 = dict(h=128, d_a=576, h_i=64, d_i=128, softmax_scale=0.1352)


def _gpu_case(t, *, h=V32["h"], seed=0):
    q, k, w, attn_q, attn_k, _ = _inputs(t, V32["h_i"], V32["d_i"], h, V32["d_a"], dtype=torch.bfloat16, device="cuda",
                                         seed=seed)
    attn_q = attn_q / 4  # attention logits of a few units, as in a trained model
    return q, k, w, attn_q, attn_k


@pytest.mark.gpu
@pytest.mark.parametrize("fused_dk", [False, True])
@pytest.mark.parametrize("t, target_norm, h", [(1024, "heads", 128), (2048, "l1", 128), (4096, "heads", 16)])
def test_gpu_dense_matches_oracle(t, target_norm, h, fused_dk):
    """T = 2048: the target mass in chunks of 600 query rows (cutting query blocks and dk runs)."""
    q, k, w, attn_q, attn_k = _gpu_case(t, h=h)
    scale = V32["softmax_scale"]
    lse = _gpu_lse(attn_q, attn_k, scale, None) if target_norm == "heads" else torch.randn(t, h, device="cuda") + 8.0
    kwargs = dict(softmax_scale=scale, target_norm=target_norm)
    chunks = {"target_chunk_rows": 600} if t == 2048 else {}
    config = triton_kernels.KlLossConfig(fused_dk=fused_dk, **chunks)
    got = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, **kwargs, config=config)
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, lse, chunk=128, **kwargs), dtype=torch.bfloat16, label=t)


@pytest.mark.gpu
def test_gpu_varlen_ratio_gqa_matches_oracle():
    """Packed sequences (one of a single token), compress_ratio 4, GQA attention keys (8 kv heads), "l1"."""
    cu = torch.tensor([0, 1, 700, 2000], device="cuda")
    t_k = sum((b - a) // 4 for a, b in zip(cu.tolist(), cu.tolist()[1:]))
    q, k, w, attn_q, attn_k, lse = _inputs(2000, V32["h_i"], V32["d_i"], 64, 192, t_k=t_k, h_kv=8, dtype=torch.bfloat16,
                                           device="cuda", seed=7)
    kwargs = dict(softmax_scale=0.1, cu_seqlens=cu, compress_ratio=4, target_norm="l1")
    got = indexer_kl_triton(q, k, w, attn_q / 4, attn_k, lse + 5.0, **kwargs)
    _assert_close(got, oracle(q, k, w, attn_q / 4, attn_k, lse + 5.0, chunk=128, **kwargs), dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_call_replays_in_a_cuda_graph():
    """Captured with the value checks skipped (as under any capture), replayed: the eager result's bits."""
    t = 1024
    q, k, w, attn_q, attn_k = _gpu_case(t, h=16)
    lse = torch.randn(t, 16, device="cuda") + 8.0
    topk = torch.randint(-1, t, (t, 256), generator=torch.Generator(device="cuda").manual_seed(8), device="cuda",
                         dtype=torch.int32)
    cu = torch.tensor([0, 300, t], device="cuda")
    for sel in (None, topk):
        def call(sel=sel):
            return indexer_kl_triton(q, k, w, attn_q, attn_k, lse, softmax_scale=0.1352, cu_seqlens=cu, topk_indices=sel)

        eager = call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(eager, captured):
            assert torch.equal(x, y)


@pytest.mark.gpu
def test_gpu_sparse_varlen_matches_oracle():
    t, cu = 3000, torch.tensor([0, 1000, 1001, 3000], device="cuda")
    q, k, w, attn_q, attn_k = _gpu_case(t)
    gen = torch.Generator(device="cuda").manual_seed(5)
    topk = torch.randint(-1, 2000, (t, 512), generator=gen, device="cuda", dtype=torch.int32)
    scale = V32["softmax_scale"]
    lse = _gpu_lse(attn_q, attn_k, scale, cu, topk)
    kwargs = dict(softmax_scale=scale, cu_seqlens=cu, topk_indices=topk)
    got = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, **kwargs)
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, lse, chunk=128, **kwargs), dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_sparse_chunked_dk_tier_reruns_and_memory():
    """T = 4K, k = 512, H_I = 64, D_I = 128, bf16, over 16 query chunks of 256 tokens: within the oracle's tier,
    20 reruns bitwise equal, and peak memory above the inputs and outputs within a bound linear in T (the
    selection's work arrays, a few words a row) plus the chunk buffer [C, K, D_I] fp32."""
    t, slots = 4096, 512
    q, k, w, attn_q, attn_k = _gpu_case(t)
    gen = torch.Generator(device="cuda").manual_seed(9)
    topk = torch.randint(-1, t, (t, slots), generator=gen, device="cuda", dtype=torch.int32)
    scale = V32["softmax_scale"]
    lse = _gpu_lse(attn_q, attn_k, scale, None, topk)
    kwargs = dict(softmax_scale=scale, topk_indices=topk)
    config = triton_kernels.KlLossConfig()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, **kwargs, config=config)
    torch.cuda.synchronize()
    outputs = sum(x.numel() * x.element_size() for x in got)
    peak = torch.cuda.max_memory_allocated() - before - outputs
    chunk_buffer = triton_kernels.sparse_dk_chunk(config, t, slots, V32["d_i"]) * slots * V32["d_i"] * 4
    assert peak < chunk_buffer + t * (48 * slots + 8 * V32["d_i"] * 4 + 4096)
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, lse, chunk=128, **kwargs), dtype=torch.bfloat16)
    for _ in range(20):
        again = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, **kwargs, config=config)
        assert all(torch.equal(x, y) for x, y in zip(got, again))


def _gpu_lse(attn_q, attn_k, scale, cu, topk=None, chunk=128):
    t = attn_q.shape[0]
    out = torch.empty(t, attn_q.shape[1], device="cuda")
    base, limit = (x.cuda() for x in _layout(t, cu, 1))
    for c0 in range(0, t, chunk):
        rows = torch.arange(c0, min(t, c0 + chunk), device="cuda")
        vis = _visible(rows, attn_k.shape[0], base, limit, topk)
        z = scale * torch.einsum("thd,sd->ths", attn_q[rows].float(), attn_k.float())
        lse = torch.logsumexp(z.masked_fill(~vis[:, None, :], -math.inf), 2)
        out[rows] = torch.where(torch.isfinite(lse), lse, 0.0)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("sparse, fused_dk", [(False, False), (False, True), (True, False)])
def test_gpu_dk_is_bitwise_deterministic(sparse, fused_dk):
    config = triton_kernels.KlLossConfig(fused_dk=fused_dk, target_chunk_rows=700)  # 3 chunks of the target mass
    t = 2048
    q, k, w, attn_q, attn_k = _gpu_case(t)
    lse = torch.randn(t, V32["h"], device="cuda") + 8.0
    topk = None
    if sparse:
        topk = torch.randint(0, t, (t, 1024), generator=torch.Generator(device="cuda").manual_seed(6), device="cuda",
                             dtype=torch.int32)
    kwargs = dict(softmax_scale=V32["softmax_scale"], topk_indices=topk, config=config)
    first = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, **kwargs)
    for _ in range(20):
        again = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, **kwargs)
        for x, y in zip(first, again):
            assert torch.equal(x, y)


@pytest.mark.gpu
def test_gpu_extra_memory_is_linear_in_t():
    """Peak memory above the inputs and outputs grows like T: T = 8K stays under a bound no T x T tensor fits."""
    peaks = {}
    for t in (4096, 8192):
        q, k, w, attn_q, attn_k = _gpu_case(t, h=16)
        lse = torch.randn(t, 16, device="cuda") + 8.0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = indexer_kl_triton(q, k, w, attn_q, attn_k, lse, softmax_scale=0.1352)
        torch.cuda.synchronize()
        outputs = sum(x.numel() * x.element_size() for x in result)
        peaks[t] = torch.cuda.max_memory_allocated() - before - outputs
        del result
    # At most 16 fp32 [T, D_I] parts of dk, the [C, T] fp32 target mass buffer (C = 4096) and a few words per token;
    # one fp32 T x T matrix at 8K is 256 MiB.
    chunk = triton_kernels.target_chunk(triton_kernels.KlLossConfig(), 8192)
    assert peaks[8192] < 16 * 8192 * V32["d_i"] * 4 + chunk * 8192 * 4 + 256 * 8192 < 8192 * 8192 * 4
    assert peaks[8192] <= 2 * peaks[4096] + (1 << 20)


class _Launches:
    """Stands in for a Triton kernel: records the arguments of each launch, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.args = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.args.append(args)
            return self.kernel[grid](*args, **kwargs)

        return launch


def _rows_by_program(writes, tensor, row_bytes) -> dict[int, set]:
    """{row of ``tensor`` (``row_bytes`` apart): the programs (first grid index) that wrote into it}."""
    start = tensor.untyped_storage().data_ptr()
    rows = {}
    for (_, address), programs in writes.items():
        if start <= address < start + tensor.untyped_storage().nbytes():
            rows.setdefault((address - start) // row_bytes, set()).update(program[0] for program in programs)
    return rows


@pytest.mark.interpreter
@pytest.mark.parametrize("stage", ["dense", "dense-split-dk", "sparse"])
def test_every_written_value_has_one_owner(kernel_device, stage, monkeypatch):
    """No float atomics, one owner per sum: no two programs write the same address in any buffer (the
    interpreter's stores recorded per program; a GPU would race there). fused_dk=True is the one mode that does
    (query blocks add to a key tile in ticket order), which shows the recording sees it. Sparse, in query chunks of
    16 tokens: row r of the chunk buffer is written only by program r of the parts kernel, the fp32 dk row of
    key s only by program s of the sum kernel, and every selected key's row is written."""
    if kernel_device != "cpu":
        pytest.skip("records the CPU interpreter's stores: the GPU runs these kernels compiled")
    from program_writes import conflicting_writes, recorded_program_writes

    t = 40
    q, k, w, attn_q, attn_k, attn_lse = _inputs(t, 8, 16, 2, 16, device=kernel_device, seed=3)
    kwargs = dict(softmax_scale=0.3, cu_seqlens=torch.tensor([0, 3, 40], dtype=torch.int32), target_norm="l1")
    if stage == "sparse":
        kwargs["topk_indices"] = torch.randint(-1, 30, (t, 6), generator=torch.Generator().manual_seed(4),
                                               dtype=torch.int32)
    config = triton_kernels.KlLossConfig(dk_min_split_rows=4 if stage == "dense-split-dk" else 256,
                                         sparse_dk_chunk_tokens=16, fused_dk=False, target_chunk_rows=13)
    parts = _Launches(triton_kernels._dk_sparse_parts_kernel)
    sums = _Launches(triton_kernels._dk_sparse_sum_kernel)
    monkeypatch.setattr(triton_kernels, "_dk_sparse_parts_kernel", parts)
    monkeypatch.setattr(triton_kernels, "_dk_sparse_sum_kernel", sums)
    with recorded_program_writes() as writes:
        got = indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, **kwargs, config=config)
    assert not conflicting_writes(writes)
    _assert_close(got, oracle(q, k, w, attn_q, attn_k, attn_lse, **kwargs), dtype=torch.float32)
    if stage == "sparse":
        assert len(parts.args) == len(sums.args) == 3  # chunks of 16, 16 and 8 tokens
        slots, d_i = kwargs["topk_indices"].shape[1], q.shape[2]
        buf, dk = parts.args[0][8], sums.args[0][3]
        buf_rows = _rows_by_program(writes, buf, slots * d_i * 4)
        assert sorted(buf_rows) == list(range(16)) and all(programs == {row} for row, programs in buf_rows.items())
        dk_rows = _rows_by_program(writes, dk, d_i * 4)
        assert all(programs == {row} for row, programs in dk_rows.items())
        base, limit = _layout(t, kwargs["cu_seqlens"], 1)
        selected = _visible(torch.arange(t), k.shape[0], base, limit, kwargs["topk_indices"]).any(0)
        assert sorted(dk_rows) == torch.nonzero(selected).flatten().tolist()
    if stage == "dense":
        with recorded_program_writes() as writes:
            indexer_kl_triton(q, k, w, attn_q, attn_k, attn_lse, **kwargs,
                              config=triton_kernels.KlLossConfig(fused_dk=True, target_chunk_rows=13))
        assert conflicting_writes(writes)


@given(tokens=st.integers(1, 10**6), slots=st.integers(1, 8192), dim=st.sampled_from([16, 64, 128]),
       budget=st.integers(1, 1 << 31))
def test_sparse_dk_chunk_is_as_many_tokens_as_fit_the_buffer(tokens, slots, dim, budget):
    config = triton_kernels.KlLossConfig(sparse_dk_buffer_bytes=budget)
    chunk = triton_kernels.sparse_dk_chunk(config, tokens, slots, dim)
    row = slots * dim * 4
    assert 1 <= chunk <= tokens
    assert chunk == 1 or chunk * row <= budget
    assert chunk == tokens or (chunk + 1) * row > budget
    given_chunk = triton_kernels.KlLossConfig(sparse_dk_chunk_tokens=3, sparse_dk_buffer_bytes=budget)
    assert triton_kernels.sparse_dk_chunk(given_chunk, tokens, slots, dim) == min(3, tokens)
