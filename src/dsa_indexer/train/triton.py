"""Triton kernels of the indexer's KL loss: the loss and its gradients in one call.

``indexer_kl_triton`` returns ``(loss, dq, dk, dweights)`` for the math of ``docs/contract.md`` (the training
section) with memory linear in T: no ``T x T_k`` tensor is formed; scores are recomputed tile by tile. Pass 1
(``_query_kernel`` with ``STATS``) keeps each query row's online ``LSE_I`` (and the ``"l1"`` target
denominator); pass 2 recomputes the indexer scores and the target, forms ``G = (coeff/N)(pi - p)`` and
accumulates ``dq``, ``dw`` and the KL terms; pass 3 forms ``dk`` without float atomics (dense: fp32 parts over
at most 16 runs of the queries, summed in a fixed order; sparse: a by-key CSR of the selected pairs). Every
sum has a fixed order, so reruns are bitwise equal. Rows of a tile are ``(token, head)`` pairs; varlen batches
map programs to (sequence, block) on the device, so nothing is read back to the host. Loops with a run-time
trip count are ``while`` loops (the CPU interpreter cannot ``range`` over one). Details: ``README.md``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._validation import (
    check_choice,
    check_floating,
    check_index_tensor,
    check_positive_int,
    check_same_device,
    check_tensor,
    first_true,
    value_checks_enabled,
)
from ..ops.common.codecs import round_to_bf16
from ..ops.common.runtime import interpreting, next_pow2

_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class KlLossConfig:
    """Launch of the KL-loss kernels; the class defaults are what ships (``_tile_plan`` and ``_dk_splits`` turn
    them into one call's tiles).

    tile_rows: ``(token, head)`` rows of one tile, the M dimension of the tensor-core products (a power of two).
    block_keys: most keys per tile (64 spills registers in the gradient pass at H_I = 64, D_I = 128 on sm_90).
    block_d_a: most ``D_a`` columns per chunk of the attention product (D_a = 576 = 9 x 64).
    block_entries: CSR entries per step of the sparse ``dk`` kernel.
    num_warps: warps of every kernel.
    fused_dk: dense ``dk`` inside the gradient pass, added to each key tile in a fixed order behind a per-tile
        ticket (removes the ``dk`` pass and its recompute of the target). Off until measured on the GPU: it
        relies on programs starting in launch order, as NVIDIA GPUs do.
    dk_programs, dk_max_splits, dk_min_split_rows: the dense ``dk`` pass splits the query sweep until about
        ``dk_programs`` programs, in at most ``dk_max_splits`` parts of at least ``dk_min_split_rows`` query
        rows on average.
    """

    tile_rows: int = 128
    block_keys: int = 32
    block_d_a: int = 64
    block_entries: int = 2
    num_warps: int = 8
    fused_dk: bool = False
    dk_programs: int = 1024
    dk_max_splits: int = 16
    dk_min_split_rows: int = 256


@triton.jit
def _mma(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32: fp32 operands exactly (``IEEE``), bf16 ones on the tensor cores.
    ``UPCAST`` (the CPU interpreter, whose bf16 ``tl.dot`` returns garbage) multiplies the same values in fp32."""
    if UPCAST:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _mma_split(x, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``x @ b`` for an fp32 ``x`` against a bf16 ``b``: ``x`` goes in as a bf16 head and a bf16 remainder (16
    significant bits; ``G`` sums to 0 over a row, so one bf16 rounding of it would show in ``dq``/``dk``)."""
    if IEEE:
        product = _mma(x, b, IEEE, UPCAST)
    else:
        head = x.to(b.dtype)
        tail = (x - head.to(tl.float32)).to(b.dtype)
        product = _mma(head, b, IEEE, UPCAST) + _mma(tail, b, IEEE, UPCAST)
    return product


@triton.jit
def _as_output(x, ptr, UPCAST: tl.constexpr):
    """fp32 ``x`` converted to ``ptr``'s element type (bf16: to nearest, ties to even, also in the interpreter,
    whose own conversion truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = round_to_bf16(x, UPCAST)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _indexer_tile(q_ptr, w_ptr, k_ptr, t0, n_tok, key_rows, key_ok, sq_t, sq_h, sw_t, sk_s, H_I, D_I,
                  BT: tl.constexpr, HIP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Indexer scores of tokens ``t0 .. t0 + n_tok - 1`` against the keys ``key_rows`` [BS].

    Rows ``r = t * HIP + j`` (token t of the block, head j). Returns ``a = q.k`` [BT*HIP, BS] fp32,
    ``w`` [BT*HIP] fp32 (0 on padded rows), ``I`` [BT, BS] fp32, the q rows [BT*HIP, BD] and the key
    tile [BS, BD] (input dtype; zero where masked)."""
    r = tl.arange(0, BT * HIP)
    t = r // HIP
    j = r % HIP
    row_ok = (t < n_tok) & (j < H_I)
    tok = t0 + t.to(tl.int64)
    d = tl.arange(0, BD)
    d_ok = d < D_I
    q = tl.load(q_ptr + tok[:, None] * sq_t + j[:, None] * sq_h + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kt = tl.load(k_ptr + key_rows[:, None] * sk_s + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    a = _mma(q, tl.trans(kt), IEEE, UPCAST)
    w = tl.load(w_ptr + tok * sw_t + j, mask=row_ok, other=0.0).to(tl.float32)
    scores = tl.sum(tl.reshape(w[:, None] * tl.maximum(a, 0.0), (BT, HIP, BS)), axis=1)
    return a, w, scores, q, kt


@triton.jit
def _target_tile(aq_ptr, ak_ptr, lse_ptr, t0, n_tok, key_rows, key_ok, saq_t, saq_h, sak_s, sak_h, slse_t,
                 H_KV, GROUP, D_A, qk_scale_log2,
                 BT: tl.constexpr, HC: tl.constexpr, BS: tl.constexpr, BDA: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    """``sum_h exp(tau z_h - lse_h)`` [BT, BS] fp32 for tokens ``t0 ..`` and keys ``key_rows`` (rows
    ``t * HC + head in chunk``; heads ``g * GROUP .. (g + 1) * GROUP - 1`` read kv head g)."""
    r = tl.arange(0, BT * HC)
    t = r // HC
    hh = r % HC
    tok = t0 + t.to(tl.int64)
    tok_ok = t < n_tok
    d = tl.arange(0, BDA)
    total = tl.zeros([BT, BS], dtype=tl.float32)
    g = H_KV * 0
    while g < H_KV:
        c0 = GROUP * 0
        while c0 < GROUP:
            head = g * GROUP + c0 + hh
            ok = tok_ok & (c0 + hh < GROUP)
            lse = tl.load(lse_ptr + tok * slse_t + head, mask=ok, other=float("inf")) * 1.4426950408889634
            z = tl.zeros([BT * HC, BS], dtype=tl.float32)
            d0 = D_A * 0
            while d0 < D_A:
                dd = d0 + d
                aq = tl.load(aq_ptr + tok[:, None] * saq_t + head[:, None] * saq_h + dd[None, :],
                             mask=ok[:, None] & (dd < D_A)[None, :], other=0.0)
                ak = tl.load(ak_ptr + key_rows[:, None] * sak_s + g * sak_h + dd[None, :],
                             mask=key_ok[:, None] & (dd < D_A)[None, :], other=0.0)
                z += _mma(aq, tl.trans(ak), IEEE, UPCAST)
                d0 += BDA
            probs = tl.exp2(z * qk_scale_log2 - lse[:, None])
            total += tl.sum(tl.reshape(probs, (BT, HC, BS)), axis=1)
            c0 += HC
        g += 1
    return total


@triton.jit
def _sequence_block(pid, block_seq_ptr, block_start_ptr, cu_ptr, num_seqs, BT: tl.constexpr):
    """(sequence, its first row, its length, first local position of this program's block) of program
    ``pid``; programs past the last block get a sequence of length 0."""
    b = tl.load(block_seq_ptr + pid)
    real = b < num_seqs
    b = tl.minimum(b, num_seqs - 1)
    start = tl.load(cu_ptr + b).to(tl.int64)
    length = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    length = tl.where(real, length, 0)
    p0 = (pid - tl.load(block_start_ptr + b)).to(tl.int64) * BT
    return b, start, length, p0


_RUNTIME_INTS = ["num_seqs", "H_I", "D_I", "H", "H_KV", "GROUP", "D_A", "ratio"]


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["K"])
def _query_kernel(
    q_ptr, w_ptr, k_ptr, aq_ptr, ak_ptr, alse_ptr, cu_ptr, cu_k_ptr, block_seq_ptr, block_start_ptr, sel_ptr,
    lse_i_ptr, denom_ptr, scale_ptr, kl_ptr, dq_ptr, dw_ptr, gbuf_ptr, dk_sum_ptr, tickets_ptr, tile_start_ptr,
    sq_t, sq_h, sw_t, sk_s, saq_t, saq_h, sak_s, sak_h, slse_t, sdq_t, sdq_h, sdw_t,
    num_seqs, H_I, D_I, H, H_KV, GROUP, D_A, K, ratio, qk_scale_log2,
    BT: tl.constexpr, HIP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, HC: tl.constexpr, BDA: tl.constexpr,
    SPARSE: tl.constexpr, STATS: tl.constexpr, L1: tl.constexpr, IEEE_I: tl.constexpr, IEEE_A: tl.constexpr, UPCAST: tl.constexpr,
    FUSED_DK: tl.constexpr,
):
    """One block of ``BT`` query tokens: with ``STATS`` the row statistics (``lse_i`` [T], ``denom`` [T]
    for L1), else the row KL terms ``kl`` [T], ``dq``, ``dw`` and (``SPARSE``) ``G`` of each slot.

    ``FUSED_DK`` (dense): also adds the block's ``M^T q`` of each key tile into ``dk_sum`` (fp32 [T_k, D_I]),
    in a fixed order: the blocks of a sequence add to a tile from the last one down, each waiting until the
    tile's ticket (int32, one per key tile, ``tile_start[b]`` the first tile of sequence b) counts the blocks
    above it. Programs start in that same order (heaviest first), so a program only waits for earlier ones."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the last blocks of a sequence (most keys) start first
    b, seq_start, seq_len, p0 = _sequence_block(pid, block_seq_ptr, block_start_ptr, cu_ptr, num_seqs, BT)
    n_tok = tl.maximum(tl.minimum(seq_len - p0, BT), 0)
    t0 = seq_start + p0
    key_base = tl.load(cu_k_ptr + b).to(tl.int64)
    tt = tl.arange(0, BT)
    tok_ok = tt < n_tok
    tok = t0 + tt.to(tl.int64)
    limit = tl.where(tok_ok, (p0 + tt + 1) // ratio, 0)  # local keys j < limit are visible (dense stage)
    if SPARSE:
        span = tl.where(n_tok > 0, K, 0)
    else:
        span = (p0 + n_tok) // ratio
    if STATS:
        m_i = tl.full([BT], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BT], dtype=tl.float32)
        den = tl.zeros([BT], dtype=tl.float32)
    else:
        lse_i = tl.load(lse_i_ptr + tok, mask=tok_ok, other=float("-inf"))
        if L1:
            den = tl.load(denom_ptr + tok, mask=tok_ok, other=1.0)
        else:
            den = tl.zeros([BT], dtype=tl.float32) + H
        scale = tl.load(scale_ptr)
        kl_a = tl.zeros([BT], dtype=tl.float32)
        p_sum = tl.zeros([BT], dtype=tl.float32)
        dq_acc = tl.zeros([BT * HIP, BD], dtype=tl.float32)
        dw_acc = tl.zeros([BT * HIP], dtype=tl.float32)
    s0 = span * 0
    while s0 < span:
        cols = s0 + tl.arange(0, BS)
        if SPARSE:
            idx = tl.load(sel_ptr + t0 * K + cols, mask=(cols < K) & (n_tok > 0), other=-1)
            key_ok = idx >= 0
            key_rows = key_base + tl.maximum(idx, 0).to(tl.int64)
            vis = tl.broadcast_to(key_ok[None, :], (BT, BS))
        else:
            key_ok = cols < span
            key_rows = key_base + cols.to(tl.int64)
            vis = cols[None, :] < limit[:, None]
        a, w, scores, q, kt = _indexer_tile(q_ptr, w_ptr, k_ptr, t0, n_tok, key_rows, key_ok, sq_t, sq_h, sw_t, sk_s,
                                            H_I, D_I, BT, HIP, BS, BD, IEEE_I, UPCAST)
        if STATS:
            m_new = tl.maximum(m_i, tl.max(tl.where(vis, scores, float("-inf")), axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2((m_i - m_safe) * 1.4426950408889634) + tl.sum(
                tl.where(vis, tl.exp2((scores - m_safe[:, None]) * 1.4426950408889634), 0.0), axis=1)
            m_i = m_new
            if L1:
                target = _target_tile(aq_ptr, ak_ptr, alse_ptr, t0, n_tok, key_rows, key_ok, saq_t, saq_h, sak_s, sak_h,
                                      slse_t, H_KV, GROUP, D_A, qk_scale_log2, BT, HC, BS, BDA, IEEE_A, UPCAST)
                den += tl.sum(tl.where(vis, target, 0.0), axis=1)
        else:
            target = _target_tile(aq_ptr, ak_ptr, alse_ptr, t0, n_tok, key_rows, key_ok, saq_t, saq_h, sak_s, sak_h,
                                  slse_t, H_KV, GROUP, D_A, qk_scale_log2, BT, HC, BS, BDA, IEEE_A, UPCAST)
            p = target / den[:, None]
            log_pi = scores - lse_i[:, None]
            pi = tl.exp2(log_pi * 1.4426950408889634)
            grad = tl.where(vis, scale * (pi - p), 0.0)  # [BT, BS]
            positive = vis & (p > 0.0)
            kl_a += tl.sum(tl.where(positive, p * (tl.log(tl.where(positive, p, 1.0)) - log_pi), 0.0), axis=1)
            p_sum += tl.sum(tl.where(vis, p, 0.0), axis=1)
            grad_rows = tl.reshape(tl.broadcast_to(grad[:, None, :], (BT, HIP, BS)), (BT * HIP, BS))
            dw_acc += tl.sum(grad_rows * tl.maximum(a, 0.0), axis=1)
            gated = tl.where(a > 0.0, grad_rows, 0.0)
            dq_acc += _mma_split(gated, kt, IEEE_I, UPCAST)
            if FUSED_DK:
                part = _mma_split(tl.trans(tl.where(a > 0.0, grad_rows * w[:, None], 0.0)), q, IEEE_I, UPCAST)
                ticket = tickets_ptr + tl.load(tile_start_ptr + b) + s0 // BS
                above = tl.cdiv(seq_len, BT) - 1 - p0 // BT  # blocks of this sequence after this one
                while tl.atomic_add(ticket, 0, sem="acquire") != above:
                    pass
                d = tl.arange(0, BD)
                where = dk_sum_ptr + key_rows[:, None] * D_I + d[None, :]
                inside = key_ok[:, None] & (d < D_I)[None, :]
                total = tl.load(where, mask=inside, other=0.0, cache_modifier=".cg")  # L2: the predecessor's bytes
                tl.store(where, total + part, mask=inside)
                tl.debug_barrier()  # every thread's store issued before the ticket moves on
                tl.atomic_add(ticket, 1, sem="release")
            if SPARSE:
                tl.store(gbuf_ptr + t0 * K + cols, tl.sum(grad, axis=0), mask=(cols < K) & (n_tok > 0))
        s0 += BS
    if STATS:
        lse_row = tl.where(l_i > 0.0, m_i + tl.log(l_i), float("-inf"))
        tl.store(lse_i_ptr + tok, lse_row, mask=tok_ok)
        if L1:
            tl.store(denom_ptr + tok, den, mask=tok_ok)
    else:
        # KL_t = sum p (log p - I) + LSE_I = sum p (log p - log pi) + LSE_I (1 - sum p); 0 on empty rows.
        valid = lse_i != float("-inf")
        kl_row = tl.where(valid, kl_a + tl.where(valid, lse_i, 0.0) * (1.0 - p_sum), 0.0)
        tl.store(kl_ptr + tok, kl_row, mask=tok_ok)
        r = tl.arange(0, BT * HIP)
        rt = r // HIP
        rj = r % HIP
        row_ok = (rt < n_tok) & (rj < H_I)
        rtok = t0 + rt.to(tl.int64)
        d = tl.arange(0, BD)
        w = tl.load(w_ptr + rtok * sw_t + rj, mask=row_ok, other=0.0).to(tl.float32)
        dq = w[:, None] * dq_acc
        tl.store(dq_ptr + rtok[:, None] * sdq_t + rj[:, None] * sdq_h + d[None, :], _as_output(dq, dq_ptr, UPCAST),
                 mask=row_ok[:, None] & (d < D_I)[None, :])
        tl.store(dw_ptr + rtok * sdw_t + rj, _as_output(dw_acc, dw_ptr, UPCAST), mask=row_ok)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["splits"])
def _dk_dense_kernel(
    q_ptr, w_ptr, k_ptr, aq_ptr, ak_ptr, alse_ptr, cu_ptr, cu_k_ptr, block_seq_ptr, block_start_ptr,
    lse_i_ptr, denom_ptr, scale_ptr, part_ptr,
    sq_t, sq_h, sw_t, sk_s, saq_t, saq_h, sak_s, sak_h, slse_t, spart_split, spart_s,
    num_seqs, H_I, D_I, H, H_KV, GROUP, D_A, ratio, splits, qk_scale_log2,
    BT: tl.constexpr, HIP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, HC: tl.constexpr, BDA: tl.constexpr,
    L1: tl.constexpr, IEEE_I: tl.constexpr, IEEE_A: tl.constexpr, UPCAST: tl.constexpr,
):
    """Part ``program_id(1)`` of ``dk`` of one block of ``BS`` keys of one sequence (dense stage): the
    queries that see its first key, cut in ``splits`` equal runs, this program's run swept in token order,
    summing ``M^T q`` with ``M = G w 1[a > 0]`` into ``part[split]`` (fp32)."""
    pid = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    b, key_start, key_len, s0 = _sequence_block(pid, block_seq_ptr, block_start_ptr, cu_k_ptr, num_seqs, BS)
    seq_start = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = tl.where(key_len > 0, tl.load(cu_ptr + b + 1).to(tl.int64) - seq_start, 0)
    cols = s0 + tl.arange(0, BS)
    key_ok = cols < key_len
    key_rows = key_start + cols.to(tl.int64)
    scale = tl.load(scale_ptr)
    dk_acc = tl.zeros([BS, BD], dtype=tl.float32)
    tt = tl.arange(0, BT)
    p_first = (s0 + 1) * ratio - 1  # the first query that sees key s0
    run = tl.cdiv(tl.cdiv(tl.maximum(seq_len - p_first, 0), splits), BT) * BT
    p0 = p_first + split * run
    p_end = tl.minimum(seq_len, p0 + run)
    while p0 < p_end:
        n_tok = tl.minimum(p_end - p0, BT)
        t0 = seq_start + p0
        tok_ok = tt < n_tok
        tok = t0 + tt.to(tl.int64)
        limit = tl.where(tok_ok, (p0 + tt + 1) // ratio, 0)
        vis = (cols[None, :] < limit[:, None]) & key_ok[None, :]
        a, w, scores, q, kt = _indexer_tile(q_ptr, w_ptr, k_ptr, t0, n_tok, key_rows, key_ok, sq_t, sq_h, sw_t, sk_s,
                                            H_I, D_I, BT, HIP, BS, BD, IEEE_I, UPCAST)
        target = _target_tile(aq_ptr, ak_ptr, alse_ptr, t0, n_tok, key_rows, key_ok, saq_t, saq_h, sak_s, sak_h,
                              slse_t, H_KV, GROUP, D_A, qk_scale_log2, BT, HC, BS, BDA, IEEE_A, UPCAST)
        lse_i = tl.load(lse_i_ptr + tok, mask=tok_ok, other=0.0)
        if L1:
            den = tl.load(denom_ptr + tok, mask=tok_ok, other=1.0)
        else:
            den = tl.zeros([BT], dtype=tl.float32) + H
        pi = tl.exp2((scores - lse_i[:, None]) * 1.4426950408889634)
        grad = tl.where(vis, scale * (pi - target / den[:, None]), 0.0)
        grad_rows = tl.reshape(tl.broadcast_to(grad[:, None, :], (BT, HIP, BS)), (BT * HIP, BS))
        gated = tl.where(a > 0.0, grad_rows * w[:, None], 0.0)  # [BT*HIP, BS]
        dk_acc += _mma_split(tl.trans(gated), q, IEEE_I, UPCAST)
        p0 += BT
    d = tl.arange(0, BD)
    tl.store(part_ptr + split * spart_split + key_rows[:, None] * spart_s + d[None, :], dk_acc,
             mask=key_ok[:, None] & (d < D_I)[None, :])


@triton.jit(do_not_specialize=["H_I", "D_I", "K"])
def _dk_sparse_kernel(
    q_ptr, w_ptr, k_ptr, ptr_ptr, entries_ptr, gbuf_ptr, dk_ptr,
    sq_t, sq_h, sw_t, sk_s, sdk_s, H_I, D_I, K,
    HIP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, UPCAST: tl.constexpr,
):
    """``dk`` of key row ``program_id`` (sparse stage) from the CSR entries ``ptr[s] .. ptr[s + 1] - 1``
    (flat ``t * K + slot`` ids of the pairs selecting it, ascending), each weighted by its stored ``G``."""
    s = tl.program_id(0).to(tl.int64)
    e0 = tl.load(ptr_ptr + s)
    e1 = tl.load(ptr_ptr + s + 1)
    d = tl.arange(0, BD)
    d_ok = d < D_I
    kvec = tl.load(k_ptr + s * sk_s + d, mask=d_ok, other=0.0).to(tl.float32)
    r = tl.arange(0, BE * HIP)
    j = r % HIP
    acc = tl.zeros([BD], dtype=tl.float32)
    e = e0
    while e < e1:
        er = e + r // HIP
        ok = (er < e1) & (j < H_I)
        flat = tl.load(entries_ptr + er, mask=ok, other=0).to(tl.int64)
        tok = flat // K
        g = tl.load(gbuf_ptr + flat, mask=ok, other=0.0)
        w = tl.load(w_ptr + tok * sw_t + j, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + tok[:, None] * sq_t + j[:, None] * sq_h + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        a = tl.sum(q * kvec[None, :], axis=1)
        acc += tl.sum(tl.where(a > 0.0, g * w, 0.0)[:, None] * q, axis=0)
        e += BE
    tl.store(dk_ptr + s * sdk_s + d, _as_output(acc, dk_ptr, UPCAST), mask=d_ok)


def _check_inputs(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio,
                  target_norm, reduction, coeff):
    """Types, dtypes, shapes and devices (no host reads); returns (H_kv, group)."""
    check_tensor("q", q, ndim=3)
    check_floating("q", q)
    t, h_i, d_i = q.shape
    check_tensor("k", k, dtype=(torch.bfloat16, torch.float32, torch.float16), ndim=2)
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k.shape[1] != d_i:
        raise ValueError(f"k must have shape [T_k, {d_i}] (q's head dim), got {list(k.shape)}")
    t_k = k.shape[0]
    check_tensor("weights", weights, shape=(t, h_i))
    check_floating("weights", weights)
    check_tensor("attn_q", attn_q, ndim=3)
    check_floating("attn_q", attn_q)
    h, d_a = attn_q.shape[1], attn_q.shape[2]
    if attn_q.shape[0] != t:
        raise ValueError(f"attn_q must have shape [{t}, H, D_a] (T = q's tokens), got {list(attn_q.shape)}")
    check_tensor("attn_k", attn_k, ndim=(2, 3))
    if attn_k.dtype != attn_q.dtype:
        raise TypeError(f"attn_k must have attn_q's dtype {attn_q.dtype}, got {attn_k.dtype}")
    h_kv = 1 if attn_k.dim() == 2 else attn_k.shape[1]
    if attn_k.shape[0] != t_k or attn_k.shape[-1] != d_a or h_kv < 1 or h % h_kv:
        raise ValueError(
            f"attn_k must have shape [{t_k}, {d_a}] or [{t_k}, H_kv, {d_a}] with H_kv dividing H = {h}, got {list(attn_k.shape)}")
    check_tensor("attn_lse", attn_lse, dtype=torch.float32, shape=(t, h))
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    check_positive_int("compress_ratio", compress_ratio)
    check_choice("target_norm", target_norm, ("heads", "l1"))
    check_choice("reduction", reduction, ("mean", "sum"))
    if not isinstance(coeff, (int, float)) or isinstance(coeff, bool):
        raise TypeError(f"coeff must be a float, got {type(coeff).__name__}")
    if cu_seqlens is not None:
        check_index_tensor("cu_seqlens", cu_seqlens, ndim=1)
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have at least 2 entries [B + 1], got {list(cu_seqlens.shape)}")
    elif t_k != t // compress_ratio:
        raise ValueError(f"k must have T // compress_ratio = {t // compress_ratio} rows, got {t_k}")
    if topk_indices is not None:
        check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
        if topk_indices.shape[0] != t:
            raise ValueError(f"topk_indices must have shape [{t}, K], got {list(topk_indices.shape)}")
    check_same_device(q=q, k=k, weights=weights, attn_q=attn_q, attn_k=attn_k, attn_lse=attn_lse, cu_seqlens=cu_seqlens,
                      topk_indices=topk_indices)
    return h_kv, h // h_kv


def _check_cu_seqlens(cu: torch.Tensor, t: int, t_k: int, ratio: int) -> None:
    """Values of ``cu_seqlens`` (one host read): starts at 0, nondecreasing, ends at T, keys add up to T_k."""
    lengths = cu[1:] - cu[:-1]
    first, last, keys = torch.stack((cu[0], cu[-1], (lengths // ratio).sum())).tolist()
    if first != 0 or last != t:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {t}, got {first} and {last}")
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must be nondecreasing, decreases after entry {first_true(lengths < 0)}")
    if keys != t_k:
        raise ValueError(f"k must have sum(len_b // compress_ratio) = {keys} rows for these cu_seqlens, got {t_k}")


def _block_map(cu: torch.Tensor, block: int, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each program [programs] (B past the last block), first program of each sequence [B + 1])."""
    blocks = (cu[1:] - cu[:-1] + block - 1) // block
    block_start = torch.zeros(cu.shape[0], dtype=torch.int64, device=cu.device)
    block_start[1:] = torch.cumsum(blocks, 0)
    ids = torch.arange(programs, dtype=torch.int64, device=cu.device)
    block_seq = torch.searchsorted(block_start[1:], ids, right=True)
    return block_seq.to(torch.int32), block_start


def _tile_plan(config: KlLossConfig, h_i: int, d_i: int, group: int, d_a: int, keys: int, sparse: bool) -> dict:
    """Tile sizes (the kernels' constexprs): ``(token, head)`` rows near ``config.tile_rows`` and every dimension
    at least 16 (the tensor-core minimum); key tiles and ``D_a`` chunks no wider than ``keys`` (the most a row
    sweeps) and ``D_a`` need. ``BT`` tokens (1 when sparse) of ``HIP`` padded heads, ``HC`` attention heads a
    step, ``BD`` padded ``D_I``, ``BS`` keys a tile, ``BDA`` ``D_a`` columns a chunk."""
    hip = next_pow2(h_i)
    bt = 1 if sparse else max(1, config.tile_rows // hip)
    hip = max(hip, 16 // bt)
    hc = max(16 // bt, min(next_pow2(group), max(1, config.tile_rows // bt)))
    return {"BT": bt, "HIP": hip, "BD": next_pow2(d_i, minimum=16), "HC": hc,
            "BS": min(config.block_keys, next_pow2(keys, minimum=16)),
            "BDA": min(config.block_d_a, next_pow2(d_a, minimum=16))}


def _dk_splits(config: KlLossConfig, key_programs: int, t: int) -> int:
    """Runs of the query sweep per key block in the dense ``dk`` pass (>= 1): more programs than the
    ``key_programs`` key blocks alone, whose causal work is uneven, over ``t`` query rows."""
    return max(1, min(config.dk_max_splits, triton.cdiv(config.dk_programs, key_programs),
                      triton.cdiv(t, config.dk_min_split_rows)))


def _clean_selection(topk_indices: torch.Tensor, position: torch.Tensor, ratio: int) -> torch.Tensor:
    """``topk_indices`` [T, K] sorted per row with duplicates, -1 and invisible ids (``j >= (p+1)//r``)
    replaced by -1: each entry >= 0 is one distinct key of V_t."""
    ids = torch.sort(topk_indices, dim=1).values
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[:, 1:] = ids[:, 1:] == ids[:, :-1]
    visible = (ids >= 0) & (ids.to(torch.int64) < ((position + 1) // ratio)[:, None]) & ~repeated
    return torch.where(visible, ids, torch.full_like(ids, -1)).contiguous()


def indexer_kl_triton(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None, topk_indices=None,
                      compress_ratio=1, target_norm="heads", reduction="mean", coeff=1.0,
                      config: KlLossConfig | None = None):
    """KL loss between the main attention's target and the indexer's softmax, and its gradients (Triton).

    Shapes and math as ``docs/contract.md`` (training): ``q [T, H_I, D_I]``, ``k [T_k, D_I]``,
    ``weights [T, H_I]``, ``attn_q [T, H, D_a]``, ``attn_k [T_k, D_a]`` or ``[T_k, H_kv, D_a]``,
    ``attn_lse [T, H]`` fp32 (natural log), ``cu_seqlens`` int32/int64 ``[B + 1]``, ``topk_indices``
    int32 ``[T, K]`` sequence-local key ids (-1 padded; duplicates count once; ids outside the visible
    set ``j < (p+1)//compress_ratio`` are not in V_t). Returns ``(loss, dq, dk, dweights)``: ``loss``
    an fp32 scalar, the gradients shaped and typed like ``q``, ``k``, ``weights``. Rows with an empty
    V_t add 0 and are not counted; with no valid row the loss and gradients are 0.

    Extra memory: O(T (H_I D_I)) for the outputs plus O(T) fp32 row statistics; the sparse stage also
    holds ``[T, K]`` int32 / fp32 work arrays (the selection sorted, G per slot, the by-key CSR).
    ``config``: the launch (``None``: ``KlLossConfig()``, what ships); every config gives the same loss and
    gradients up to the order of the fp32 sums.
    """
    if config is None:
        config = KlLossConfig()
    elif not isinstance(config, KlLossConfig):
        raise TypeError(f"config must be a KlLossConfig, got {type(config).__name__}")
    h_kv, group = _check_inputs(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices,
                                compress_ratio, target_norm, reduction, coeff)
    t, h_i, d_i = q.shape
    t_k, h, d_a = k.shape[0], attn_q.shape[1], attn_q.shape[2]
    device = q.device
    if cu_seqlens is not None and value_checks_enabled():
        _check_cu_seqlens(cu_seqlens, t, t_k, compress_ratio)
    if t == 0 or h_i == 0:
        zeros = (torch.zeros(x.shape, dtype=x.dtype, device=device) for x in (q, k, weights))
        return (torch.zeros((), dtype=torch.float32, device=device), *zeros)
    # Every row of the gradients is written by exactly one program.
    dq, dk, dw = (torch.empty(x.shape, dtype=x.dtype, device=device) for x in (q, k, weights))
    q, k, weights, attn_q, attn_k, attn_lse = (x.contiguous() for x in (q, k, weights, attn_q, attn_k, attn_lse))
    if attn_k.dim() == 2:
        attn_k = attn_k.unsqueeze(1)
    if cu_seqlens is None:
        cu = torch.arange(2, dtype=torch.int64, device=device) * t  # [0, T] without a host copy (graph capture)
    else:
        cu = cu_seqlens.to(torch.int64)
    num_seqs = cu.shape[0] - 1
    cu_k = torch.zeros_like(cu)
    cu_k[1:] = torch.cumsum((cu[1:] - cu[:-1]) // compress_ratio, 0)
    sparse = topk_indices is not None
    cfg = _tile_plan(config, h_i, d_i, group, d_a, topk_indices.shape[1] if sparse else t_k, sparse)
    rows = torch.arange(t, dtype=torch.int64, device=device)
    position = rows - cu[torch.searchsorted(cu[1:], rows, right=True)]
    if sparse:
        big_k = topk_indices.shape[1]
        sel = _clean_selection(topk_indices, position, compress_ratio)
        valid_rows = (sel >= 0).any(dim=1)
        gbuf = torch.zeros(t * big_k, dtype=torch.float32, device=device)
    else:
        big_k = 1
        sel = torch.empty(1, dtype=torch.int32, device=device)
        valid_rows = position + 1 >= compress_ratio
        gbuf = torch.empty(1, dtype=torch.float32, device=device)
    count = valid_rows.sum()
    if reduction == "mean":
        scale = (float(coeff) / count.clamp(min=1).to(torch.float64)).to(torch.float32).reshape(1)
    else:
        scale = torch.full((1,), float(coeff), dtype=torch.float32, device=device)
    programs = t // cfg["BT"] + num_seqs
    block_seq, block_start = _block_map(cu, cfg["BT"], programs)
    lse_i = torch.empty(t, dtype=torch.float32, device=device)
    denom = torch.empty(t, dtype=torch.float32, device=device) if target_norm == "l1" else lse_i
    kl = torch.empty(t, dtype=torch.float32, device=device)
    l1 = target_norm == "l1"
    fused = config.fused_dk and not sparse and t_k > 0
    if fused:
        tiles = (cu_k[1:] - cu_k[:-1] + cfg["BS"] - 1) // cfg["BS"]
        tile_start = torch.zeros_like(cu_k)
        tile_start[1:] = torch.cumsum(tiles, 0)
        tickets = torch.zeros(t_k // cfg["BS"] + num_seqs, dtype=torch.int32, device=device)
        dk_sum = torch.zeros((t_k, d_i), dtype=torch.float32, device=device)
    else:
        tile_start, tickets, dk_sum = cu_k, torch.empty(1, dtype=torch.int32, device=device), gbuf
    ieee_i = q.dtype == torch.float32
    ieee_a = attn_q.dtype == torch.float32
    upcast = interpreting()
    common = (q, weights, k, attn_q, attn_k, attn_lse, cu, cu_k, block_seq, block_start, sel,
              lse_i, denom, scale, kl, dq, dw, gbuf, dk_sum, tickets, tile_start,
              q.stride(0), q.stride(1), weights.stride(0), k.stride(0), attn_q.stride(0), attn_q.stride(1),
              attn_k.stride(0), attn_k.stride(1), attn_lse.stride(0), dq.stride(0), dq.stride(1), dw.stride(0),
              num_seqs, h_i, d_i, h, h_kv, group, d_a, big_k, compress_ratio, float(softmax_scale) * _LOG2E)
    for stats in (True, False):
        _query_kernel[(programs,)](*common, SPARSE=sparse, STATS=stats, L1=l1, IEEE_I=ieee_i, IEEE_A=ieee_a,
                                     UPCAST=upcast, FUSED_DK=fused and not stats, num_warps=config.num_warps, **cfg)
    if fused:
        dk.copy_(dk_sum)
    elif sparse:
        keys = torch.where(sel >= 0, cu_k[torch.searchsorted(cu[1:], rows, right=True)][:, None] + sel,
                           torch.full_like(sel, t_k, dtype=torch.int64))
        sorted_keys, order = torch.sort(keys.reshape(-1), stable=True)
        ptr = torch.searchsorted(sorted_keys, torch.arange(t_k + 1, dtype=torch.int64, device=device))
        entries = order.to(torch.int32) if t * big_k < 2**31 else order
        if t_k:
            _dk_sparse_kernel[(t_k,)](q, weights, k, ptr, entries, gbuf, dk, q.stride(0), q.stride(1), weights.stride(0),
                                      k.stride(0), dk.stride(0), h_i, d_i, big_k,
                                      HIP=cfg["HIP"], BD=cfg["BD"], BE=config.block_entries, UPCAST=upcast,
                                      num_warps=config.num_warps)
    elif t_k:
        dense = _tile_plan(config, h_i, d_i, group, d_a, t_k, False)
        key_programs = t_k // dense["BS"] + num_seqs
        key_seq, key_start = _block_map(cu_k, dense["BS"], key_programs)
        # The fp32 parts of the `splits` runs are summed in split order by one torch reduction: deterministic.
        splits = _dk_splits(config, key_programs, t)
        parts = torch.empty((splits, t_k, d_i), dtype=torch.float32, device=device)
        _dk_dense_kernel[(key_programs, splits)](
            q, weights, k, attn_q, attn_k, attn_lse, cu, cu_k, key_seq, key_start, lse_i, denom, scale, parts,
            q.stride(0), q.stride(1), weights.stride(0), k.stride(0), attn_q.stride(0), attn_q.stride(1),
            attn_k.stride(0), attn_k.stride(1), attn_lse.stride(0), parts.stride(0), parts.stride(1),
            num_seqs, h_i, d_i, h, h_kv, group, d_a, compress_ratio, splits, float(softmax_scale) * _LOG2E,
            L1=l1, IEEE_I=ieee_i, IEEE_A=ieee_a, UPCAST=upcast, num_warps=config.num_warps, **dense)
        dk.copy_(parts.sum(0))
    total = kl.to(torch.float64).sum()
    if reduction == "mean":
        total = total / count.clamp(min=1).to(torch.float64)
    loss = (float(coeff) * total).to(torch.float32)
    return loss, dq, dk, dw
