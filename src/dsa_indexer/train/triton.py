"""Triton kernels of the indexer's KL loss: the loss and its gradients in one call.

``indexer_kl_triton`` returns ``(loss, dq, dk, dweights)`` for the math of ``docs/contract.md`` (the training
section) with memory linear in T: no ``T x T_k`` tensor is formed; scores are recomputed tile by tile. Pass 1
(``_query_kernel`` with ``STATS``) keeps each query row's online ``LSE_I`` (and the ``"l1"`` target
denominator); pass 2 recomputes the indexer scores and the target, forms ``G = (coeff/N)(pi - p)`` and
accumulates ``dq``, ``dw`` and the KL terms; pass 3 forms ``dk`` without float atomics (dense: fp32 parts over
at most 16 runs of the queries, summed in a fixed order; sparse: query-outer in chunks of tokens, each selected
pair's ``M^T q`` on the tensor cores into a chunk buffer, then summed per key in a fixed order). Every sum has a
fixed order, so reruns are bitwise equal. The call is a composition of per-shard pieces (``prepare``,
``row_statistics``, ``merge_key_statistics``/``merge_head_statistics``, ``row_gradients``, ``finish_loss``) that
the parallel paths run on key or head shards. Rows of a tile are ``(token, head)`` pairs; varlen batches
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
from .reference import ordered_sum

_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class KlLossConfig:
    """Launch of the KL-loss kernels; the class defaults are what ships (``_tile_plan`` and ``_dk_splits`` turn
    them into one call's tiles).

    tile_rows: ``(token, head)`` rows of one indexer tile, the M dimension of its tensor-core products (a power
        of two).
    block_keys: most keys per indexer tile.
    target_head_rows: most attention heads (of one kv group) per target product, its M dimension.
    target_block_keys: most keys (slots) per target product, its N dimension.
    block_d_a: ``D_a`` columns per step of the target product (D_a = 576 = 9 x 64).
    target_group_rows: query rows that sweep the key tiles side by side in the target kernel (L2 reuse).
    target_stages: software-pipeline depth of the target product's loads.
    target_warps: warps of the target kernel.
    target_chunk_rows: query rows ``C`` of the fp32 ``[C, W]`` target mass buffer (``W``: held keys dense, ``K``
        sparse): ``4 C`` bytes a key, linear in T (16 KB a token at 4096; ``attn_q`` is 147 KB a token at V3.2).
    sparse_dk_buffer_bytes: the most bytes of the sparse ``dk`` pass's fp32 ``[C, K, D_I]`` chunk buffer: ``C``
        is as many query tokens as fit (``sparse_dk_chunk``; 256 tokens at K = 2048, D_I = 128, 1024 at K = 512).
    sparse_dk_chunk_tokens: ``C`` itself (None: from ``sparse_dk_buffer_bytes``); capped by T.
    sparse_dk_block_slots: most selected slots (keys) a tile in the sparse ``dk`` products, the M dimension of
        ``M^T q``.
    sparse_dk_token_programs: most programs per query token in the sparse ``dk`` products, each over a
        contiguous run of its slot tiles (more programs in flight; each loads ``q[t]`` once).
    sparse_dk_sum_entries: by-key entries (``buf`` rows) added a step in the sparse ``dk`` sum.
    sparse_dk_warps: warps of the two sparse ``dk`` kernels (4: the products fit 140 registers, three programs an
        SM on sm_90; with 8 they take 214, one program an SM).
    num_warps: warps of the other kernels.
    fused_dk: dense ``dk`` inside the gradient pass, added to each key tile in a fixed order behind a per-tile
        ticket (removes the ``dk`` pass and its recompute of ``I``; within 2 % of the ``dk`` pass at T 4K-32K on an
        H100 since neither recomputes the target, ``train/README.md``). It relies on programs starting in launch
        order, as NVIDIA GPUs do. Applies to one-process dense calls; a key shard (context parallel) and the sparse
        stage take the ``dk`` pass.
    dk_programs, dk_max_splits, dk_min_split_rows: the dense ``dk`` pass splits the query sweep until about
        ``dk_programs`` programs, in at most ``dk_max_splits`` parts of at least ``dk_min_split_rows`` query
        rows on average.
    """

    tile_rows: int = 128
    block_keys: int = 32
    target_head_rows: int = 128
    target_block_keys: int = 128
    block_d_a: int = 64
    target_group_rows: int = 8
    target_stages: int = 3
    target_warps: int = 8
    target_chunk_rows: int = 4096
    sparse_dk_buffer_bytes: int = 256 << 20
    sparse_dk_chunk_tokens: int | None = None
    sparse_dk_block_slots: int = 64
    sparse_dk_token_programs: int = 4
    sparse_dk_sum_entries: int = 4
    sparse_dk_warps: int = 4
    num_warps: int = 8
    fused_dk: bool = True
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


_RUNTIME_INTS = ["num_seqs", "H_I", "D_I", "H", "ratio", "width"]


@triton.jit
def _held_keys(key_lo_ptr, key_start_ptr, b):
    """(sequence-local id of the first key of sequence ``b`` held here, its row in ``k``, the end of the held
    ids): the held keys of a sequence are its ids ``[lo, hi)`` at rows ``start + id - lo``."""
    lo = tl.load(key_lo_ptr + b).to(tl.int64)
    start = tl.load(key_start_ptr + b).to(tl.int64)
    hi = lo + tl.load(key_start_ptr + b + 1).to(tl.int64) - start
    return lo, start, hi


@triton.jit(do_not_specialize=["H_KV", "GROUP", "K", "ratio", "row_lo", "rows", "tiles", "width"])
def _target_mass_kernel(
    aq_ptr, ak_ptr, alse_ptr, sel_ptr, sequence_ptr, cu_ptr, key_lo_ptr, key_start_ptr, mass_ptr,
    saq_t, saq_h, sak_s, sak_h, slse_t, H_KV, GROUP, K, ratio, qk_scale_log2, row_lo, rows, tiles, width,
    D_A: tl.constexpr, HC: tl.constexpr, BN: tl.constexpr, BDA: tl.constexpr, GM: tl.constexpr,
    STAGES: tl.constexpr, SPARSE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """The target mass ``sum_h exp(tau z_h - lse_h)`` of one query row ``t`` of ``[row_lo, row_lo + rows)``
    against one tile of its keys (``BN`` held key offsets ``o`` dense, ``BN`` slots of ``sel[t]`` sparse) into
    ``mass[t - row_lo, o]`` (fp32, row stride ``width``); entries the row does not see are not written.

    The ``rows x tiles`` programs go in groups of ``GM`` rows, each group sweeping the key tiles with its rows side
    by side, so that a group's ``attn_q`` rows and each key tile are read from L2. One product is
    ``[HC, BDA] x [BDA, BN]``: ``HC`` heads of a kv group (heads ``g * GROUP ..`` read kv head g) against the key
    tile, ``D_A`` in ``BDA`` chunks, software-pipelined over ``STAGES`` loads."""
    pid = tl.program_id(0)
    group = pid // (GM * tiles)
    in_group = tl.minimum(GM, rows - group * GM)
    rest = pid - group * GM * tiles
    t = row_lo + (group * GM + rest % in_group).to(tl.int64)
    o0 = (rest // in_group) * BN
    b = tl.load(sequence_ptr + t)
    key_lo, key_start, key_hi = _held_keys(key_lo_ptr, key_start_ptr, b)
    offsets = o0 + tl.arange(0, BN)
    if SPARSE:
        idx = tl.load(sel_ptr + t * K + offsets, mask=offsets < K, other=-1)
        key_ok = idx >= 0
        key_rows = key_start + tl.maximum(idx - key_lo, 0).to(tl.int64)
        seen = K
    else:
        seen = tl.minimum((t - tl.load(cu_ptr + b) + 1) // ratio, key_hi) - key_lo
        key_ok = offsets < seen
        key_rows = key_start + offsets.to(tl.int64)
    if o0 < seen:
        hh = tl.arange(0, HC)
        d = tl.arange(0, BDA)
        mass = tl.zeros([BN], dtype=tl.float32)
        g = H_KV * 0
        while g < H_KV:
            c0 = GROUP * 0
            while c0 < GROUP:
                head = g * GROUP + c0 + hh
                ok = c0 + hh < GROUP
                lse = tl.load(alse_ptr + t * slse_t + head, mask=ok, other=float("inf")) * 1.4426950408889634
                z = tl.zeros([HC, BN], dtype=tl.float32)
                for d0 in tl.range(0, D_A, BDA, num_stages=STAGES):
                    dd = d0 + d
                    aq = tl.load(aq_ptr + t * saq_t + head[:, None] * saq_h + dd[None, :],
                                 mask=ok[:, None] & (dd < D_A)[None, :], other=0.0)
                    ak = tl.load(ak_ptr + key_rows[:, None] * sak_s + g * sak_h + dd[None, :],
                                 mask=key_ok[:, None] & (dd < D_A)[None, :], other=0.0)
                    z += _mma(aq, tl.trans(ak), IEEE, UPCAST)
                mass += tl.sum(tl.exp2(z * qk_scale_log2 - lse[:, None]), axis=0)
                c0 += HC
            g += 1
        tl.store(mass_ptr + (t - row_lo) * width + offsets, mass, mask=key_ok)


@triton.jit
def _chunk_target(mass_ptr, tok, row_lo, width, offsets, seen):
    """[BT, BS] target mass of tokens ``tok`` [BT] at key offsets (slots) ``offsets`` [BS] from the chunk buffer
    whose first row is query row ``row_lo``; 0 where ``seen`` [BT, BS] is false."""
    return tl.load(mass_ptr + (tok - row_lo)[:, None] * width + offsets[None, :], mask=seen, other=0.0)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["K", "row_lo", "row_hi"])
def _query_kernel(
    q_ptr, w_ptr, k_ptr, mass_ptr, sel_ptr,
    cu_ptr, block_seq_ptr, block_start_ptr, key_lo_ptr, key_start_ptr,
    lse_i_ptr, denom_ptr, scale_ptr,
    kl_ptr, dq_ptr, dw_ptr, gbuf_ptr,
    dk_sum_ptr, tickets_ptr, tile_start_ptr,
    sq_t, sq_h, sw_t, sk_s, sdq_t, sdq_h, sdw_t,
    num_seqs, H_I, D_I, H, K, ratio, width, pi_weight, row_lo, row_hi,
    BT: tl.constexpr, HIP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
    SPARSE: tl.constexpr, STATS: tl.constexpr, L1: tl.constexpr, IEEE_I: tl.constexpr, UPCAST: tl.constexpr,
    FUSED_DK: tl.constexpr, ENTROPY: tl.constexpr, GRADS: tl.constexpr,
):
    """One block of ``BT`` query tokens against the keys held here: with ``STATS`` the row statistics over
    those keys (``lse_i`` [T], -inf where none is visible; ``denom`` [T], the target mass, for L1), else the
    row loss parts ``kl`` [T], ``dq``, ``dw`` and (``SPARSE``) ``G`` of each slot.

    Keys: sequence ``b`` holds its ids ``[key_lo[b], key_lo[b] + key_start[b+1] - key_start[b])`` at rows
    ``key_start[b] + id - key_lo[b]`` of ``k`` (one process: all its keys; a context-parallel rank: a shard);
    visibility uses the id. The target mass comes from the chunk buffer ``mass`` (``_target_mass_kernel``'s rows
    ``row_lo ..``, stride ``width``; unread by ``STATS`` without ``L1``). ``H`` is the head count of the
    ``"heads"`` denominator (all heads, also when the target holds a shard of them). The gradient pass takes the
    merged ``lse_i``, ``denom`` and ``scale`` and forms ``G = scale (pi_weight pi - p)``;
    ``kl[t] = sum_s p (log p - log pi) - LSE_I sum_s p`` (without ``ENTROPY``: ``- sum_s p log pi - LSE_I sum_s
    p``), the caller adds ``LSE_I`` once per valid row. Only tokens in ``[row_lo, row_hi)`` are computed;
    ``GRADS=False`` skips the gradients (loss parts only).

    ``FUSED_DK`` (dense, one process): also adds the block's ``M^T q`` of each key tile into ``dk_sum`` (fp32
    [T_k, D_I]), in a fixed order: the blocks of a sequence add to a tile from the last one down, each waiting
    until the tile's ticket (int32, one per key tile, ``tile_start[b]`` the first tile of sequence b, zero at the
    launch) counts the blocks above it that hold rows of ``[row_lo, row_hi)``. Programs start in that same order
    (heaviest first), so a program only waits for earlier ones."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the last blocks of a sequence (most keys) start first
    b, seq_start, seq_len, p0 = _sequence_block(pid, block_seq_ptr, block_start_ptr, cu_ptr, num_seqs, BT)
    n_tok = tl.maximum(tl.minimum(seq_len - p0, BT), 0)
    t0 = seq_start + p0
    key_lo, key_start, key_hi = _held_keys(key_lo_ptr, key_start_ptr, b)
    in_lo = tl.maximum(row_lo - t0, 0)  # the block's tokens [in_lo, in_hi) are in the row range
    in_hi = tl.minimum(row_hi - t0, n_tok)
    tt = tl.arange(0, BT)
    tok_ok = (tt >= in_lo) & (tt < in_hi)
    tok = t0 + tt.to(tl.int64)
    # Dense: the loop runs over held offsets o (id key_lo + o, row key_start + o); o < limit is visible.
    limit = tl.where(tok_ok, tl.minimum((p0 + tt + 1) // ratio, key_hi) - key_lo, 0)
    if SPARSE:
        span = tl.where(in_hi > in_lo, K, 0)
    else:
        span = tl.where(in_hi > in_lo, tl.minimum((p0 + in_hi) // ratio, key_hi) - key_lo, 0)
    s0 = span * 0
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
        if GRADS:
            dq_acc = tl.zeros([BT * HIP, BD], dtype=tl.float32)
            dw_acc = tl.zeros([BT * HIP], dtype=tl.float32)
    while s0 < span:
        cols = s0 + tl.arange(0, BS)
        if SPARSE:
            idx = tl.load(sel_ptr + t0 * K + cols, mask=(cols < K) & (n_tok > 0), other=-1)
            key_ok = idx >= 0
            key_rows = key_start + tl.maximum(idx - key_lo, 0).to(tl.int64)
            vis = tl.broadcast_to(key_ok[None, :], (BT, BS))
        else:
            key_ok = cols < span
            key_rows = key_start + cols.to(tl.int64)
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
                den += tl.sum(_chunk_target(mass_ptr, tok, row_lo, width, cols, vis & tok_ok[:, None]), axis=1)
        else:
            target = _chunk_target(mass_ptr, tok, row_lo, width, cols, vis & tok_ok[:, None])
            p = target / den[:, None]
            log_pi = scores - lse_i[:, None]
            if ENTROPY:
                positive = vis & (p > 0.0)
                kl_a += tl.sum(tl.where(positive, p * (tl.log(tl.where(positive, p, 1.0)) - log_pi), 0.0), axis=1)
            else:
                kl_a -= tl.sum(tl.where(vis, p * log_pi, 0.0), axis=1)
            p_sum += tl.sum(tl.where(vis, p, 0.0), axis=1)
            if GRADS:
                pi = tl.exp2(log_pi * 1.4426950408889634)
                grad = tl.where(vis, scale * (pi_weight * pi - p), 0.0)  # [BT, BS]
                grad_rows = tl.reshape(tl.broadcast_to(grad[:, None, :], (BT, HIP, BS)), (BT * HIP, BS))
                dw_acc += tl.sum(grad_rows * tl.maximum(a, 0.0), axis=1)
                gated = tl.where(a > 0.0, grad_rows, 0.0)
                dq_acc += _mma_split(gated, kt, IEEE_I, UPCAST)
                if FUSED_DK:
                    part = _mma_split(tl.trans(tl.where(a > 0.0, grad_rows * w[:, None], 0.0)), q, IEEE_I, UPCAST)
                    ticket = tickets_ptr + tl.load(tile_start_ptr + b) + s0 // BS
                    # this sequence's blocks after this one that hold rows of [row_lo, row_hi)
                    above = (tl.minimum(seq_len, row_hi - seq_start) - 1) // BT - p0 // BT
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
        # sum_s p (log p - I) = sum_s p (log p - log pi) - LSE_I sum_s p; 0 on rows without a visible key.
        valid = lse_i != float("-inf")
        kl_row = tl.where(valid, kl_a - tl.where(valid, lse_i, 0.0) * p_sum, 0.0)
        tl.store(kl_ptr + tok, kl_row, mask=tok_ok)
        if GRADS:
            r = tl.arange(0, BT * HIP)
            rt = r // HIP
            rj = r % HIP
            row_ok = (rt >= in_lo) & (rt < in_hi) & (rj < H_I)  # this launch's rows only
            rtok = t0 + rt.to(tl.int64)
            d = tl.arange(0, BD)
            w = tl.load(w_ptr + rtok * sw_t + rj, mask=row_ok, other=0.0).to(tl.float32)
            dq = w[:, None] * dq_acc
            tl.store(dq_ptr + rtok[:, None] * sdq_t + rj[:, None] * sdq_h + d[None, :], _as_output(dq, dq_ptr, UPCAST),
                     mask=row_ok[:, None] & (d < D_I)[None, :])
            tl.store(dw_ptr + rtok * sdw_t + rj, _as_output(dw_acc, dw_ptr, UPCAST), mask=row_ok)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["splits", "row_lo", "row_hi"])
def _dk_dense_kernel(
    q_ptr, w_ptr, k_ptr, mass_ptr,
    cu_ptr, block_seq_ptr, block_start_ptr, key_lo_ptr, key_start_ptr,
    lse_i_ptr, denom_ptr, scale_ptr, part_ptr,
    sq_t, sq_h, sw_t, sk_s, spart_split, spart_s,
    num_seqs, H_I, D_I, H, ratio, width, splits, pi_weight, row_lo, row_hi,
    BT: tl.constexpr, HIP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
    L1: tl.constexpr, IEEE_I: tl.constexpr, UPCAST: tl.constexpr,
):
    """Part ``program_id(1)`` of ``dk`` of one block of ``BS`` held keys of one sequence (dense stage; keys as
    in ``_query_kernel``, the blocks mapped over ``key_start``): the queries that see its first key, cut in
    ``splits`` equal runs, this program's run (its rows in the chunk ``[row_lo, row_hi)`` whose target mass
    ``mass`` holds) swept in token order, adding ``M^T q`` with ``M = G w 1[a > 0]``,
    ``G = scale (pi_weight pi - p)``, to ``part[split]`` (fp32; chunks in row order)."""
    pid = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    b, key_start, key_len, s0 = _sequence_block(pid, block_seq_ptr, block_start_ptr, key_start_ptr, num_seqs, BS)
    key_lo = tl.load(key_lo_ptr + b).to(tl.int64)
    seq_start = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = tl.where(key_len > 0, tl.load(cu_ptr + b + 1).to(tl.int64) - seq_start, 0)
    offsets = s0 + tl.arange(0, BS)
    key_ok = offsets < key_len
    key_rows = key_start + offsets.to(tl.int64)
    cols = key_lo + offsets  # sequence-local key ids
    scale = tl.load(scale_ptr)
    dk_acc = tl.zeros([BS, BD], dtype=tl.float32)
    tt = tl.arange(0, BT)
    p_first = (key_lo + s0 + 1) * ratio - 1  # the first query that sees the block's first key
    run = tl.cdiv(tl.cdiv(tl.maximum(seq_len - p_first, 0), splits), BT) * BT
    p0 = p_first + split * run
    p_end = tl.minimum(tl.minimum(seq_len, p0 + run), row_hi - seq_start)
    p0 = tl.maximum(p0, row_lo - seq_start)
    worked = p0 < p_end
    while p0 < p_end:
        n_tok = tl.minimum(p_end - p0, BT)
        t0 = seq_start + p0
        tok_ok = tt < n_tok
        tok = t0 + tt.to(tl.int64)
        limit = tl.where(tok_ok, (p0 + tt + 1) // ratio, 0)
        vis = (cols[None, :] < limit[:, None]) & key_ok[None, :]
        a, w, scores, q, kt = _indexer_tile(q_ptr, w_ptr, k_ptr, t0, n_tok, key_rows, key_ok, sq_t, sq_h, sw_t, sk_s,
                                            H_I, D_I, BT, HIP, BS, BD, IEEE_I, UPCAST)
        target = _chunk_target(mass_ptr, tok, row_lo, width, offsets, vis)
        lse_i = tl.load(lse_i_ptr + tok, mask=tok_ok, other=0.0)
        if L1:
            den = tl.load(denom_ptr + tok, mask=tok_ok, other=1.0)
        else:
            den = tl.zeros([BT], dtype=tl.float32) + H
        pi = tl.exp2((scores - lse_i[:, None]) * 1.4426950408889634)
        grad = tl.where(vis, scale * (pi_weight * pi - target / den[:, None]), 0.0)
        grad_rows = tl.reshape(tl.broadcast_to(grad[:, None, :], (BT, HIP, BS)), (BT * HIP, BS))
        gated = tl.where(a > 0.0, grad_rows * w[:, None], 0.0)  # [BT*HIP, BS]
        dk_acc += _mma_split(tl.trans(gated), q, IEEE_I, UPCAST)
        p0 += BT
    if worked:
        d = tl.arange(0, BD)
        where = part_ptr + split * spart_split + key_rows[:, None] * spart_s + d[None, :]
        inside = key_ok[:, None] & (d < D_I)[None, :]
        tl.store(where, tl.load(where, mask=inside, other=0.0) + dk_acc, mask=inside)


@triton.jit(do_not_specialize=["H_I", "D_I", "K", "chunk_start", "run"])
def _dk_sparse_parts_kernel(
    q_ptr, w_ptr, k_ptr, sel_ptr, sequence_ptr, key_lo_ptr, key_start_ptr, gbuf_ptr, buf_ptr,
    sq_t, sq_h, sw_t, sk_s, H_I, D_I, K, chunk_start, run,
    HIP: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Sparse ``dk`` contributions of query token ``t = chunk_start + program_id(0)``: for each of its slots
    ``program_id(1) * run .. + run - 1`` (below ``K``), ``M^T q[t]`` with
    ``M = G[t, slot] w[t, j] 1[q[t, j] . k[s] > 0]`` [H_I] into ``buf[program_id(0), slot]`` (fp32 [C, K, D_I];
    0 for a -1 slot). ``q[t]`` and ``w[t]`` are loaded once; the key rows of ``BS`` slots at a time are gathered
    (sequence-local id ``sel[t, slot]`` at row ``key_start[b] + id - key_lo[b]``)."""
    r = tl.program_id(0).to(tl.int64)
    s0 = tl.program_id(1) * run
    s_end = tl.minimum(s0 + run, K)
    t = chunk_start + r
    b = tl.load(sequence_ptr + t)
    key_lo = tl.load(key_lo_ptr + b).to(tl.int64)
    key_start = tl.load(key_start_ptr + b).to(tl.int64)
    j = tl.arange(0, HIP)
    d = tl.arange(0, BD)
    d_ok = d < D_I
    q = tl.load(q_ptr + t * sq_t + j[:, None] * sq_h + d[None, :], mask=(j < H_I)[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t * sw_t + j, mask=j < H_I, other=0.0).to(tl.float32)
    while s0 < s_end:
        cols = s0 + tl.arange(0, BS)
        col_ok = cols < s_end
        idx = tl.load(sel_ptr + t * K + cols, mask=col_ok, other=-1)
        key_ok = idx >= 0
        key_rows = key_start + tl.maximum(idx - key_lo, 0).to(tl.int64)
        kt = tl.load(k_ptr + key_rows[:, None] * sk_s + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        a = _mma(q, tl.trans(kt), IEEE, UPCAST)  # [HIP, BS]
        g = tl.load(gbuf_ptr + t * K + cols, mask=col_ok, other=0.0)
        gated = tl.where(a > 0.0, w[:, None] * g[None, :], 0.0)
        part = _mma_split(tl.trans(gated), q, IEEE, UPCAST)  # [BS, BD]
        tl.store(buf_ptr + (r * K + cols)[:, None] * D_I + d[None, :], part, mask=col_ok[:, None] & d_ok[None, :])
        s0 += BS


@triton.jit(do_not_specialize=["D_I"])
def _dk_sparse_sum_kernel(buf_ptr, ptr_ptr, entries_ptr, dk_ptr, D_I, BD: tl.constexpr, BE: tl.constexpr):
    """Adds to ``dk[s]`` (fp32 [held keys, D_I]), ``s = program_id``, the sum of the ``buf`` rows (flat
    ``r * K + slot`` ids of one chunk) ``entries[ptr[s]] .. entries[ptr[s + 1] - 1]``, taken ``BE`` at a time in
    entry order (the chunk's pairs selecting key ``s``, ascending)."""
    s = tl.program_id(0).to(tl.int64)
    e0 = tl.load(ptr_ptr + s)
    e1 = tl.load(ptr_ptr + s + 1)
    if e1 > e0:
        d = tl.arange(0, BD)
        d_ok = d < D_I
        i = tl.arange(0, BE)
        acc = tl.zeros([BD], dtype=tl.float32)
        e = e0
        while e < e1:
            ok = e + i < e1
            flat = tl.load(entries_ptr + e + i, mask=ok, other=0).to(tl.int64)
            rows = tl.load(buf_ptr + flat[:, None] * D_I + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(rows, axis=0)
            e += BE
        where = dk_ptr + s * D_I + d
        tl.store(where, tl.load(where, mask=d_ok, other=0.0) + acc, mask=d_ok)


def _check_inputs(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio,
                  target_norm, reduction, coeff, whole_keys):
    """Types, dtypes, shapes and devices (no host reads); the key count only when ``k`` holds every key
    (``whole_keys``). Returns (H_kv, group)."""
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
    elif whole_keys and t_k != t // compress_ratio:
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


def _tile_plan(config: KlLossConfig, h_i: int, d_i: int, keys: int, sparse: bool) -> dict:
    """Indexer tile sizes (the kernels' constexprs): ``(token, head)`` rows near ``config.tile_rows`` and every
    dimension at least 16 (the tensor-core minimum); key tiles no wider than ``keys`` (the most a row sweeps).
    ``BT`` tokens (1 when sparse) of ``HIP`` padded heads, ``BD`` padded ``D_I``, ``BS`` keys a tile."""
    hip = next_pow2(h_i)
    bt = 1 if sparse else max(1, config.tile_rows // hip)
    hip = max(hip, 16 // bt)
    return {"BT": bt, "HIP": hip, "BD": next_pow2(d_i, minimum=16),
            "BS": min(config.block_keys, next_pow2(keys, minimum=16))}


def _target_plan(config: KlLossConfig, group: int, d_a: int, width: int) -> dict:
    """Target kernel constexprs: ``HC`` heads a product (at least 16), ``BN`` keys a product (no wider than the
    ``width`` keys a row can see), ``BDA`` ``D_a`` columns a step."""
    return {"HC": max(16, min(next_pow2(group), config.target_head_rows)),
            "BN": min(config.target_block_keys, next_pow2(width, minimum=16)),
            "BDA": min(config.block_d_a, next_pow2(d_a, minimum=16)),
            "GM": config.target_group_rows, "STAGES": config.target_stages}


def target_chunk(config: KlLossConfig, rows: int) -> int:
    """Query rows per chunk of the target mass buffer: ``config.target_chunk_rows``, at least 1, at most ``rows``."""
    return max(1, min(config.target_chunk_rows, rows))


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


@dataclasses.dataclass(frozen=True)
class KeyShard:
    """The packed key rows ``[offset, offset + size)`` of the batch's ``T_k`` keys that ``k`` and ``attn_k`` hold
    (a context-parallel rank's shard)."""

    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call's inputs and device layout, shared by its passes (``prepare`` builds it).

    Tensors are contiguous (``attn_k`` as ``[T_k, H_kv, D_a]``). Sequence ``b`` owns query rows
    ``[cu[b], cu[b+1])`` and holds its sequence-local key ids ``[key_lo[b], key_lo[b] + n_b)`` at rows
    ``key_start[b] + id - key_lo[b]`` of ``k``, ``n_b = key_start[b+1] - key_start[b]`` (one process:
    ``key_lo = 0``, ``key_start`` the packed key offsets). ``selection`` (sparse) is ``[T, K]`` int32: each
    row's distinct visible held ids, sorted, -1 elsewhere. ``valid_rows`` and ``count`` (``N``) and ``scale``
    (``c/N`` or ``c``, fp32 ``[1]``) are over every key, held or not. ``num_heads`` is the ``"heads"``
    denominator ``H`` (all heads, also when ``attn_q`` holds a shard of them).
    """

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    attn_q: torch.Tensor
    attn_k: torch.Tensor
    attn_lse: torch.Tensor
    softmax_scale: float
    num_heads: int
    compress_ratio: int
    l1: bool
    reduction: str
    coeff: float
    config: KlLossConfig
    cu: torch.Tensor
    key_lo: torch.Tensor
    key_start: torch.Tensor
    sequence: torch.Tensor
    selection: torch.Tensor | None
    valid_rows: torch.Tensor
    count: torch.Tensor
    scale: torch.Tensor
    tiles: dict
    block_seq: torch.Tensor
    block_start: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.q.shape[0] == 0 or self.q.shape[1] == 0

    @property
    def num_seqs(self) -> int:
        return self.cu.shape[0] - 1

    @property
    def held_keys(self) -> int:
        return self.k.shape[0]

    def layout_args(self) -> dict:
        """The kernels' layout and shape arguments shared by the query and dense ``dk`` passes."""
        return dict(
            q_ptr=self.q, w_ptr=self.weights, k_ptr=self.k, cu_ptr=self.cu, key_lo_ptr=self.key_lo,
            key_start_ptr=self.key_start, sq_t=self.q.stride(0), sq_h=self.q.stride(1), sw_t=self.weights.stride(0),
            sk_s=self.k.stride(0), num_seqs=self.num_seqs, H_I=self.q.shape[1], D_I=self.q.shape[2], H=self.num_heads,
            ratio=self.compress_ratio, L1=self.l1, IEEE_I=self.q.dtype == torch.float32, UPCAST=interpreting(),
            num_warps=self.config.num_warps,
        )

    @property
    def target_width(self) -> int:
        """Columns of a target mass buffer row: the held keys (dense; a row's held offsets), ``K`` (sparse)."""
        return max(1, self.held_keys if self.selection is None else self.selection.shape[1])

    def target_chunks(self, rows: tuple[int, int]):
        """Yields ``(r0, r1, mass)`` over the chunks of query rows ``[r0, r1)`` of ``rows``, in row order, after
        writing each chunk's target mass (``_target_mass_kernel``) into ``mass`` (fp32 ``[C, target_width]``,
        one buffer reused by every chunk: a chunk's consumers run before the next chunk is written)."""
        width = self.target_width
        chunk = target_chunk(self.config, rows[1] - rows[0])
        mass = torch.empty((chunk, width), dtype=torch.float32, device=self.q.device)
        plan = _target_plan(self.config, self.attn_q.shape[1] // self.attn_k.shape[1], self.attn_q.shape[2], width)
        tiles = triton.cdiv(width, plan["BN"])
        sparse = self.selection is not None
        for r0 in range(rows[0], rows[1], chunk):
            r1 = min(rows[1], r0 + chunk)
            _target_mass_kernel[((r1 - r0) * tiles,)](
                self.attn_q, self.attn_k, self.attn_lse, self.selection if sparse else self.cu, self.sequence, self.cu,
                self.key_lo, self.key_start, mass, self.attn_q.stride(0), self.attn_q.stride(1),
                self.attn_k.stride(0), self.attn_k.stride(1), self.attn_lse.stride(0), self.attn_k.shape[1],
                self.attn_q.shape[1] // self.attn_k.shape[1], self.selection.shape[1] if sparse else 0,
                self.compress_ratio, self.softmax_scale * _LOG2E, r0, r1 - r0, tiles, width,
                **plan, D_A=self.attn_q.shape[2], SPARSE=sparse, IEEE=self.attn_q.dtype == torch.float32,
                UPCAST=interpreting(), num_warps=self.config.target_warps)
            yield r0, r1, mass


def prepare(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None, topk_indices=None,
            compress_ratio=1, target_norm="heads", reduction="mean", coeff=1.0, config: KlLossConfig | None = None,
            key_shard: KeyShard | None = None, num_heads: int | None = None) -> Problem:
    """Check the arguments (those of ``indexer_kl_triton``) and lay the call out on the device (no host read
    besides the ``cu_seqlens`` value check, skipped for a key shard: its caller checks the whole batch).
    ``key_shard``: ``k``/``attn_k`` hold only those packed key rows; ``num_heads``: the ``"heads"``
    denominator when ``attn_q`` holds a shard of the heads (default: its own count)."""
    if config is None:
        config = KlLossConfig()
    elif not isinstance(config, KlLossConfig):
        raise TypeError(f"config must be a KlLossConfig, got {type(config).__name__}")
    _check_inputs(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio,
                  target_norm, reduction, coeff, key_shard is None)
    t, h_i, d_i = q.shape
    t_k, h = k.shape[0], attn_q.shape[1]
    device = q.device
    if key_shard is None:
        if cu_seqlens is not None and value_checks_enabled():
            _check_cu_seqlens(cu_seqlens, t, t_k, compress_ratio)
    elif key_shard.size != t_k:
        raise ValueError(f"k must hold the key shard's {key_shard.size} rows, got {t_k}")
    else:
        config = dataclasses.replace(config, fused_dk=False)  # the tickets order one process's blocks only
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
    if key_shard is None:
        key_lo, key_start = torch.zeros(num_seqs, dtype=torch.int64, device=device), cu_k
    else:
        held = cu_k.clamp(key_shard.offset, key_shard.offset + key_shard.size)
        key_lo, key_start = held[:-1] - cu_k[:-1], held - key_shard.offset
    sparse = topk_indices is not None
    tiles = _tile_plan(config, h_i, d_i, topk_indices.shape[1] if sparse else t_k, sparse)
    rows = torch.arange(t, dtype=torch.int64, device=device)
    sequence = torch.searchsorted(cu[1:], rows, right=True)
    position = rows - cu[sequence]
    selection = None
    if sparse:
        selection = _clean_selection(topk_indices, position, compress_ratio)
        valid_rows = (selection >= 0).any(dim=1)
        if key_shard is not None:
            lo = key_lo[sequence][:, None]
            hi = lo + (key_start[1:] - key_start[:-1])[sequence][:, None]
            selection = torch.where((selection >= lo) & (selection < hi), selection, -1).contiguous()
    else:
        valid_rows = position + 1 >= compress_ratio
    count = valid_rows.sum()
    if reduction == "mean":
        scale = (float(coeff) / count.clamp(min=1).to(torch.float64)).to(torch.float32).reshape(1)
    else:
        scale = torch.full((1,), float(coeff), dtype=torch.float32, device=device)
    block_seq, block_start = _block_map(cu, tiles["BT"], t // tiles["BT"] + num_seqs)
    return Problem(q, k, weights, attn_q, attn_k, attn_lse, float(softmax_scale), h if num_heads is None else num_heads,
                   compress_ratio, target_norm == "l1", reduction, float(coeff), config, cu, key_lo, key_start,
                   sequence, selection, valid_rows, count, scale, tiles, block_seq, block_start)


def _query_args(problem: Problem, lse_i, denom, kl, dq, dw, gbuf) -> dict:
    device = problem.q.device
    unused = torch.empty(1, dtype=torch.int32, device=device)
    sparse = problem.selection is not None
    return dict(
        problem.layout_args(), **problem.tiles,
        sel_ptr=problem.selection if sparse else unused, block_seq_ptr=problem.block_seq,
        block_start_ptr=problem.block_start, lse_i_ptr=lse_i, denom_ptr=denom, scale_ptr=problem.scale,
        kl_ptr=kl, dq_ptr=dq, dw_ptr=dw, gbuf_ptr=gbuf, dk_sum_ptr=gbuf, tickets_ptr=unused,
        tile_start_ptr=problem.key_start, sdq_t=dq.stride(0), sdq_h=dq.stride(1), sdw_t=dw.stride(0),
        K=problem.selection.shape[1] if sparse else 1, SPARSE=sparse, FUSED_DK=False,
    )


def row_statistics(problem: Problem) -> torch.Tensor:
    """Pass 1 over the held keys and heads: fp32 ``[2, T]``, each row's ``log Σ exp I`` (-inf when it sees
    no held key) and, for ``"l1"``, its target mass ``Σ_s Σ_h P_h`` (0 for ``"heads"``)."""
    t = problem.q.shape[0]
    stats = torch.zeros((2, t), dtype=torch.float32, device=problem.q.device)
    if problem.empty:
        stats[0] = float("-inf")
    elif problem.l1:
        for r0, r1, mass in problem.target_chunks((0, t)):
            _chunk_statistics(problem, stats, r0, r1, mass)
    else:
        _chunk_statistics(problem, stats, 0, t, stats[1])
    return stats


def _chunk_statistics(problem: Problem, stats: torch.Tensor, r0: int, r1: int, mass: torch.Tensor) -> None:
    """Pass 1 on query rows ``[r0, r1)`` into ``stats`` (fp32 ``[2, T]``), the target mass of ``"l1"`` from the
    chunk buffer ``mass`` (its first row ``r0``)."""
    args = _query_args(problem, stats[0], stats[1], stats[0], problem.q, problem.weights, stats[0])
    _query_kernel[(problem.block_seq.shape[0],)](**args, mass_ptr=mass, width=mass.shape[-1], pi_weight=1.0, row_lo=r0,
                                                  row_hi=r1, STATS=True, ENTROPY=True, GRADS=True)


def merge_key_statistics(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LSE_I, D_t)`` fp32 ``[T]`` from the ``row_statistics`` of disjoint key sets, merged in list order in
    float64 (one part: its own values, exactly)."""
    stacked = torch.stack(list(parts)).to(torch.float64)
    top = stacked[:, 0].max(0).values
    seen = top != float("-inf")
    shift = torch.where(seen, top, 0.0)
    total = ordered_sum([torch.exp(part[0] - shift) for part in stacked])
    lse = torch.where(seen, shift + torch.log(torch.where(seen, total, 1.0)), float("-inf"))
    return lse.to(torch.float32), ordered_sum([part[1] for part in stacked]).to(torch.float32)


def merge_head_statistics(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LSE_I, D_t)`` from the ``row_statistics`` of disjoint head sets over the same keys: the first part's
    ``LSE_I`` (every part has the same), the masses summed in list order in float64."""
    return parts[0][0], ordered_sum([part[1].to(torch.float64) for part in parts]).to(torch.float32)


def row_gradients(problem: Problem, lse_i: torch.Tensor, denom: torch.Tensor, *, pi_weight: float = 1.0,
                  entropy: bool = True, rows: tuple[int, int] | None = None, gradients: bool = True,
                  partial: bool = False, statistics: torch.Tensor | None = None):
    """Pass 2 (and 3) over the held keys and heads, given the merged ``LSE_I`` and ``D_t`` (fp32 ``[T]``):
    ``(kl [T] fp32, dq, dk [held keys, D_I], dw)`` of ``G = scale (pi_weight π - p)``.

    ``kl[t] = Σ_s p (entropy · log p - log π) - LSE_I Σ_s p`` over the held keys (0 on rows without a visible
    key); ``finish_loss`` adds ``LSE_I`` once. The gradients are in the dtypes of ``q``, ``k``, ``weights``, or
    fp32 with ``partial`` (parts to be summed before one rounding). ``rows``: only query rows ``[r0, r1)``
    (the others' ``kl`` is 0); ``gradients=False``: the loss parts alone (the gradients are ``None``).
    ``statistics`` (one process, every key held: ``lse_i`` and ``denom`` are its rows): each chunk's pass 1 runs
    first into it, from the same target mass, so the target is computed once for ``"l1"`` too.
    """
    t = problem.q.shape[0]
    device = problem.q.device
    if rows is None:
        rows = (0, t)
    dtypes = [torch.float32 if partial else x.dtype for x in (problem.q, problem.k, problem.weights)]
    if problem.empty:
        zeros = [torch.zeros(x.shape, dtype=d, device=device) for x, d in zip((problem.q, problem.k, problem.weights),
                                                                              dtypes)]
        return (torch.zeros(t, dtype=torch.float32, device=device), *(zeros if gradients else [None] * 3))
    kl = (torch.empty if rows == (0, t) else torch.zeros)(t, dtype=torch.float32, device=device)
    sparse = problem.selection is not None
    if gradients:
        # Every row of dq and dw in `rows` is written by exactly one program, once.
        alloc = torch.empty if rows == (0, t) else torch.zeros
        dq = alloc(problem.q.shape, dtype=dtypes[0], device=device)
        dw = alloc(problem.weights.shape, dtype=dtypes[2], device=device)
        gbuf = torch.zeros(problem.selection.numel() if sparse else 1, dtype=torch.float32, device=device)
    else:
        dq, dw, gbuf = problem.q, problem.weights, kl
    fused = gradients and problem.config.fused_dk and not sparse and problem.held_keys > 0
    dense_dk = gradients and not fused and not sparse
    args = _query_args(problem, lse_i, denom if problem.l1 else lse_i, kl, dq, dw, gbuf)
    tickets = None
    if fused:
        d_i, bs = problem.q.shape[2], problem.tiles["BS"]
        tiles = (problem.key_start[1:] - problem.key_start[:-1] + bs - 1) // bs
        tile_start = torch.zeros_like(problem.key_start)
        tile_start[1:] = torch.cumsum(tiles, 0)
        dk = torch.zeros((problem.held_keys, d_i), dtype=torch.float32, device=device)
        tickets = torch.empty(problem.held_keys // bs + problem.num_seqs, dtype=torch.int32, device=device)
        args.update(dk_sum_ptr=dk, tile_start_ptr=tile_start, tickets_ptr=tickets, FUSED_DK=True)
    elif dense_dk:
        dk_launch, dk_args, dk = _dense_key_gradients(problem, lse_i, denom, pi_weight)
    for r0, r1, mass in problem.target_chunks(rows):
        if statistics is not None:
            _chunk_statistics(problem, statistics, r0, r1, mass)
        if tickets is not None:
            tickets.zero_()
        _query_kernel[(problem.block_seq.shape[0],)](**args, mass_ptr=mass, width=mass.shape[1],
                                                      pi_weight=float(pi_weight), row_lo=r0, row_hi=r1, STATS=False,
                                                      ENTROPY=entropy, GRADS=gradients)
        if dense_dk and dk_launch is not None:
            dk_launch(**dk_args, mass_ptr=mass, width=mass.shape[1], row_lo=r0, row_hi=r1)
    if not gradients:
        return kl, None, None, None
    if sparse:
        return kl, dq, _sparse_key_gradients(problem, gbuf, dtypes[1]), dw
    if dense_dk:
        dk = dk.sum(0)
    return kl, dq, dk.to(dtypes[1]), dw


def _dense_key_gradients(problem: Problem, lse_i, denom, pi_weight: float):
    """Pass 3 of the dense stage, set up for the chunks of ``row_gradients``: (the ``_dk_dense_kernel`` launch or
    None without held keys, its arguments but the chunk's, the fp32 parts ``[splits, held keys, D_I]`` it adds to,
    summed in split order by the caller: deterministic)."""
    t, h_i, d_i = problem.q.shape
    held = problem.held_keys
    config = problem.config
    if not held:
        return None, {}, torch.zeros((1, 0, d_i), dtype=torch.float32, device=problem.q.device)
    dense = _tile_plan(config, h_i, d_i, held, False)
    key_programs = held // dense["BS"] + problem.num_seqs
    key_seq, key_block_start = _block_map(problem.key_start, dense["BS"], key_programs)
    splits = _dk_splits(config, key_programs, t)
    parts = torch.zeros((splits, held, d_i), dtype=torch.float32, device=problem.q.device)
    args = dict(**problem.layout_args(), **dense, block_seq_ptr=key_seq, block_start_ptr=key_block_start,
                lse_i_ptr=lse_i, denom_ptr=denom if problem.l1 else lse_i, scale_ptr=problem.scale, part_ptr=parts,
                spart_split=parts.stride(0), spart_s=parts.stride(1), splits=splits, pi_weight=float(pi_weight))
    return _dk_dense_kernel[(key_programs, splits)], args, parts


def sparse_dk_chunk(config: KlLossConfig, tokens: int, slots: int, index_dim: int) -> int:
    """Query tokens ``C`` per chunk of the sparse ``dk`` pass (host integers): ``config.sparse_dk_chunk_tokens``
    when set, else as many as fit ``config.sparse_dk_buffer_bytes`` of fp32 ``[C, slots, index_dim]``; at least
    1, at most ``tokens``."""
    chunk = config.sparse_dk_chunk_tokens
    if chunk is None:
        chunk = config.sparse_dk_buffer_bytes // max(1, slots * index_dim * 4)
    return max(1, min(chunk, tokens))


def _sparse_key_gradients(problem: Problem, gbuf, dtype) -> torch.Tensor:
    """Sparse pass 3, query-outer in chunks of ``C`` tokens. Per chunk, ``_dk_sparse_parts_kernel`` (per token, up
    to ``sparse_dk_token_programs`` programs over runs of its slots) writes each (token, slot)'s ``M^T q`` into
    ``buf`` [C, K, D_I] fp32, then ``_dk_sparse_sum_kernel`` adds, per held key, its entries of the chunk (sorted
    by key with a stable sort: ascending token, then slot) to an fp32 ``dk``. Returns ``dk`` [held keys, D_I] in
    ``dtype``."""
    device = problem.q.device
    t, h_i, d_i = problem.q.shape
    held = problem.held_keys
    sel = problem.selection
    slots = sel.shape[1]
    config = problem.config
    dk = torch.zeros((held, d_i), dtype=torch.float32, device=device)
    if not held or not slots:
        return dk.to(dtype)
    chunk = sparse_dk_chunk(config, t, slots, d_i)
    buf = torch.empty((chunk, slots, d_i), dtype=torch.float32, device=device)
    # key row of a selected id: id + key_start[b] - key_lo[b]; the -1 slots sort last, past every held key
    offset = (problem.key_start[:-1] - problem.key_lo)[problem.sequence].to(torch.int32)
    targets = torch.arange(held + 1, dtype=torch.int32, device=device)
    tiles = problem.tiles
    block_slots = min(config.sparse_dk_block_slots, next_pow2(slots, minimum=16))
    tiles_per_token = triton.cdiv(slots, block_slots)
    run = triton.cdiv(tiles_per_token, min(config.sparse_dk_token_programs, tiles_per_token)) * block_slots
    for c0 in range(0, t, chunk):
        n = min(chunk, t - c0)
        ids = sel[c0:c0 + n]
        keys = torch.where(ids >= 0, ids + offset[c0:c0 + n, None], held)
        sorted_keys, entries = torch.sort(keys.reshape(-1), stable=True)
        ptr = torch.searchsorted(sorted_keys, targets)
        _dk_sparse_parts_kernel[(n, triton.cdiv(slots, run))](
            problem.q, problem.weights, problem.k, sel, problem.sequence, problem.key_lo, problem.key_start, gbuf, buf,
            problem.q.stride(0), problem.q.stride(1), problem.weights.stride(0), problem.k.stride(0), h_i, d_i, slots,
            c0, run, HIP=tiles["HIP"], BD=tiles["BD"], BS=block_slots, IEEE=problem.q.dtype == torch.float32,
            UPCAST=interpreting(), num_warps=config.sparse_dk_warps)
        _dk_sparse_sum_kernel[(held,)](buf, ptr, entries, dk, d_i, BD=tiles["BD"], BE=config.sparse_dk_sum_entries,
                                       num_warps=config.sparse_dk_warps)
    return dk.to(dtype)


def finish_loss(problem: Problem, lse_i: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """The fp32 loss from the merged ``LSE_I`` and the summed ``row_gradients`` parts: ``KL_t = kl[t] + LSE_I[t]``
    on rows that see a key (0 elsewhere), summed in float64, ``c/N``- or ``c``-scaled."""
    valid = lse_i != float("-inf")
    total = torch.where(valid, kl.to(torch.float64) + lse_i.to(torch.float64), 0.0).sum()
    if problem.reduction == "mean":
        total = total / problem.count.clamp(min=1).to(torch.float64)
    return (problem.coeff * total).to(torch.float32)


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
    holds ``[T, K]`` int32 / fp32 work arrays (the selection sorted, G per slot), an fp32 ``dk`` and an fp32
    ``[C, K, D_I]`` chunk buffer (at most ``config.sparse_dk_buffer_bytes``: ``sparse_dk_chunk``).
    ``config``: the launch (``None``: ``KlLossConfig()``, what ships); every config gives the same loss and
    gradients up to the order of the fp32 sums. The call is the composition of the pieces the parallel
    paths run per shard: ``prepare``, ``row_statistics``, ``merge_key_statistics``, ``row_gradients``,
    ``finish_loss``.
    """
    problem = prepare(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                      topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm,
                      reduction=reduction, coeff=coeff, config=config)
    if problem.empty:
        zeros = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, weights))
        return (torch.zeros((), dtype=torch.float32, device=q.device), *zeros)
    # One part's merge is its own values: each chunk's statistics are final once computed.
    statistics = torch.zeros((2, problem.q.shape[0]), dtype=torch.float32, device=q.device)
    kl, dq, dk, dw = row_gradients(problem, statistics[0], statistics[1], statistics=statistics)
    return finish_loss(problem, statistics[0], kl), dq, dk, dw
