"""The indexer's KL loss, forward and backward, at DeepSeek-V3.2 shapes.

Main attention: H = 128 heads over the MLA latent (D_a = 576, MQA), softmax scale 0.1352; indexer
H_I = 64 heads of D_I = 128; bf16; causal, one sequence of T tokens. Dense stage for T in {4K, 8K, 32K};
sparse stage with k = 2048 selected keys per row (every visible key while fewer than k, else a stratified
random draw of k distinct visible keys). Dense shapes run twice: with ``dk`` fused into the gradient
pass (the default) and in its own pass (``KlLossConfig(fused_dk=False)``, what a key shard runs). The
target's per-head LSE is the exact one over V_t (computed before timing, chunked). Time: median of a few
event-timed calls of ``indexer_kl_triton`` (loss and the three gradients in one call, as the autograd op's
forward does), after one untimed call; a second call is first checked bitwise equal to the first
(determinism). Peak memory: the allocator's peak above the inputs.

FLOP accounting (``train/README.md``): 213K per visible pair (target 2 H D_a = 147,456; indexer forward
and backward 4 x 2 H_I D_I = 65,536), TFLOP/s against the measured bf16 matmul ceiling of the same run
(the floor). megatron-core's ``FusedDSAIndexerLoss`` (materialises fp32 [H, T, T]) is timed beside us at
T = 4K only, dense, when ``megatron.core`` is importable; otherwise its baseline is left out. cuDNN FE's DSA
indexer loss (``cudnn_dsa``: score recomputes, fp32 [T, T] dense or [T, K] sparse, and the indexer backward;
no loss value) is timed at every (T, k) when it imports on an SM90/SM100 GPU (else left out silently), after a
check against ours with ``target_norm="l1"`` (its target): its loss (from its score tensors) and gradients,
as relative differences in parts per million; a note flags the loss beyond 1e-3 or a gradient beyond 2e-2.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator

import torch

from . import cudnn_dsa, harness

HEADS, LATENT, SCALE, INDEX_HEADS, INDEX_DIM = 128, 576, 0.1352, 64, 128
FLOP_PER_PAIR = 2 * HEADS * LATENT + 4 * 2 * INDEX_HEADS * INDEX_DIM
SHAPES = [(4096, None), (8192, None), (32768, None), (4096, 2048), (8192, 2048), (32768, 2048)]  # (T, k; None: dense)
MEGATRON_T = 4096
CUDNN_LOSS_TOLERANCE, CUDNN_GRAD_TOLERANCE = 1e-3, 2e-2  # relative, against ours with target_norm="l1"
_BUDGET_S = 6.0  # timed calls per case stop after about this long


def _inputs(t: int, gen: torch.Generator):
    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).to(torch.bfloat16)

    q = randn(t, INDEX_HEADS, INDEX_DIM)
    k = randn(t, INDEX_DIM)
    weights = randn(t, INDEX_HEADS, std=1 / math.sqrt(INDEX_HEADS * INDEX_DIM))
    attn_q = randn(t, HEADS, LATENT, std=0.25)
    attn_k = randn(t, LATENT)
    return q, k, weights, attn_q, attn_k


def _selection(t: int, top: int, gen: torch.Generator) -> torch.Tensor:
    """[T, top] int32: row p holds 0..p then -1 while p < top, else top distinct ids, one drawn uniformly
    from each of the disjoint ranges [i (p+1) // top, (i+1) (p+1) // top), i < top."""
    pos = torch.arange(t, device="cuda")[:, None]
    slot = torch.arange(top, device="cuda")[None, :]
    low = slot * (pos + 1) // top
    high = (slot + 1) * (pos + 1) // top
    drawn = low + (torch.rand(t, top, generator=gen, device="cuda") * (high - low)).long()
    early = torch.where(slot <= pos, slot, -1)
    return torch.where(pos + 1 > top, drawn, early).to(torch.int32)


def _attention_lse(attn_q, attn_k, topk, chunk: int = 256) -> torch.Tensor:
    """fp32 [T, H]: the per-head natural-log LSE of softmax_scale * attn_q . attn_k over V_t."""
    t = attn_q.shape[0]
    out = torch.empty(t, HEADS, device="cuda")
    keys = torch.arange(t, device="cuda")
    for c0 in range(0, t, chunk):
        rows = torch.arange(c0, min(t, c0 + chunk), device="cuda")
        visible = keys[None, :] <= rows[:, None]
        if topk is not None:
            ids = topk[rows].long()
            hits = torch.zeros(visible.shape, dtype=torch.int32, device="cuda")
            hits.scatter_add_(1, ids.clamp(min=0), (ids >= 0).to(torch.int32))
            visible &= hits > 0
        z = SCALE * torch.einsum("thd,sd->ths", attn_q[rows], attn_k[: c0 + rows.shape[0]]).float()
        z = z.masked_fill(~visible[:, None, : z.shape[2]], -math.inf)
        out[rows] = torch.logsumexp(z, 2)
    return out


def _events_us(fn, budget_s: float = _BUDGET_S, max_reps: int = 10) -> float:
    """Median µs of event-timed calls of ``fn`` (one untimed first), as many as fit ``budget_s``."""
    fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < max_reps and sum(times) / 1e3 < budget_s:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] * 1e3


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def _megatron(q, k, weights, attn_q, attn_k) -> dict[str, float]:
    """megatron-core's dense loss, forward and backward, on the same inputs: µs and peak bytes."""
    from megatron.core.transformer.experimental_attention_variant.dsa import FusedDSAIndexerLoss

    t = q.shape[0]
    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    mask = torch.triu(torch.full((t, t), float("-inf"), device="cuda"), diagonal=1)
    query = attn_q[:, None]
    key = attn_k[:, None, None, :].expand(t, 1, HEADS, LATENT)

    def step():
        leaves = [x[:, None].detach().requires_grad_() for x in (q, weights, k)]
        _, loss = FusedDSAIndexerLoss.apply(leaves[0], leaves[1], leaves[2], query, key, SCALE, 2048, 1.0, mask, False, pg)
        loss.backward()
        return loss

    return {"megatron_us": _events_us(step, budget_s=20.0, max_reps=3), "megatron_peak_mem_bytes": float(_peak_bytes(step))}


def _relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """``‖ours − theirs‖ / ‖ours‖`` in fp32 (fp64 for a scalar)."""
    dtype = torch.float64 if ours.dim() == 0 else torch.float32
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    return float((ours - theirs).norm() / ours.norm())


def _cudnn(inputs, ours) -> dict[str, float]:
    """cuDNN FE's DSA indexer loss on the same inputs: µs and peak bytes of its step (the gradients), and its loss
    (from its score tensors) and gradients against ``ours`` (loss, dq, dk, dw with its target, ``"l1"``), in ppm."""
    q, k, weights, attn_q, attn_k, topk, lse = inputs
    x = cudnn_dsa.arguments(q, k, weights, attn_q, attn_k, lse, topk, softmax_scale=SCALE)
    score_tensors = cudnn_dsa.scores(x)
    theirs = (cudnn_dsa.loss(x, score_tensors), *cudnn_dsa.backward(x, score_tensors))
    diffs = {f"cudnn_{name}_diff_ppm": 1e6 * _relative_difference(a, b)
             for name, a, b in zip(("loss", "dq", "dk", "dw"), ours, theirs)}
    del theirs, score_tensors
    torch.cuda.empty_cache()
    step = lambda: cudnn_dsa.step(x)
    return {"cudnn_us": _events_us(step), "cudnn_peak_mem_bytes": float(_peak_bytes(step)), **diffs}


def _cudnn_disagreement(baselines: dict[str, float]) -> str | None:
    """What of cuDNN FE's check lies beyond its tolerance, or None."""
    over = [f"{name} {baselines[f'cudnn_{name}_diff_ppm']:.0f} ppm" for name, tolerance in
            (("loss", CUDNN_LOSS_TOLERANCE), ("dq", CUDNN_GRAD_TOLERANCE), ("dk", CUDNN_GRAD_TOLERANCE),
             ("dw", CUDNN_GRAD_TOLERANCE)) if baselines[f"cudnn_{name}_diff_ppm"] > 1e6 * tolerance]
    return f"differs from ours beyond tolerance: {', '.join(over)}" if over else None


def _megatron_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def _measure(kernels, inputs, t: int, top: int | None, fused: bool, ceilings: dict[str, float]) -> dict:
    """One record: the call checked (deterministic, finite loss), timed and its peak memory measured."""
    q, k, weights, attn_q, attn_k, topk, lse = inputs
    config = kernels.KlLossConfig(fused_dk=fused)

    def call():
        return kernels.indexer_kl_triton(q, k, weights, attn_q, attn_k, lse, softmax_scale=SCALE, topk_indices=topk,
                                         config=config)

    first, second = call(), call()
    if not all(torch.equal(x, y) for x, y in zip(first, second)):
        raise AssertionError(f"train loss T={t} k={top}: two calls differ (the kernels must be deterministic)")
    if not torch.isfinite(first[0]):
        raise AssertionError(f"train loss T={t} k={top}: loss {float(first[0])} is not finite")
    del first, second
    us = _events_us(call)
    peak = _peak_bytes(call)
    pairs = t * (t + 1) // 2 if top is None else sum(min(top, p + 1) for p in range(t))
    flops = FLOP_PER_PAIR * pairs
    baselines, note = {}, {}
    if top is None and t == MEGATRON_T and fused:
        if _megatron_available():
            try:
                baselines.update(_megatron(q, k, weights, attn_q, attn_k))
            except (RuntimeError, TypeError, ValueError, ImportError) as error:  # OOM or an API other than 0.19.2's
                note["megatron"] = f"not run: {type(error).__name__}: {str(error)[:120]}"
        else:
            note["megatron"] = "not importable"
    if (fused or top is not None) and cudnn_dsa.available():
        ours = kernels.indexer_kl_triton(q, k, weights, attn_q, attn_k, lse, softmax_scale=SCALE, topk_indices=topk,
                                         target_norm="l1", config=config)
        try:
            cudnn = _cudnn(inputs, ours)
        except Exception as error:  # the CuTe DSL compiler's errors derive from Exception only
            note["cudnn"] = f"not run: {type(error).__name__}: {str(error)[:120]}"
        else:
            baselines.update(cudnn)
            if (disagreement := _cudnn_disagreement(cudnn)) is not None:
                note["cudnn"] = disagreement
        del ours
    torch.cuda.empty_cache()
    shape = {"T": t, "k": top or "dense", "dk": "fused" if fused else "own pass", "H": HEADS, "D_a": LATENT,
             "H_I": INDEX_HEADS, "D_I": INDEX_DIM}
    return harness.record("indexer_kl_fwd_bwd", shape, us, flops / (ceilings["bf16_tflops"] * 1e6), tflops=flops / us / 1e6,
                          baselines=baselines, peak_mem_bytes=peak, **note)


def run(ceilings: dict[str, float]) -> Iterator[dict]:
    from ..train import triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    for t, top in SHAPES:
        q, k, weights, attn_q, attn_k = _inputs(t, gen)
        topk = None if top is None else _selection(t, top, gen)
        inputs = (q, k, weights, attn_q, attn_k, topk, _attention_lse(attn_q, attn_k, topk))
        for fused in (True, False) if top is None else (False,):
            yield _measure(kernels, inputs, t, top, fused, ceilings)
        del q, k, weights, attn_q, attn_k, topk, inputs
        torch.cuda.empty_cache()
