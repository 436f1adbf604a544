"""The cuDNN FE DSA baseline's host side (``dsa_indexer.bench.cudnn_dsa``) without a GPU.

Its argument builder (our packed ``[T, ...]`` inputs as cuDNN FE's batch of one), the calls a step makes (through
a recording stand-in for ``cudnn.DSA``; their arguments are also bound to the installed wrappers' signatures when
``nvidia-cudnn-frontend`` imports here), and its loss from score tensors written as cuDNN FE documents them, which
equals the float64 reference with ``target_norm="l1"``.
"""

from __future__ import annotations

import inspect
import math
import sys
import types

import pytest
import torch

from dsa_indexer.bench import cudnn_dsa
from dsa_indexer.train.reference import indexer_kl_reference

SCALE = 0.1352


def _inputs(t: int, top: int | None, *, index_heads=64, index_dim=16, heads=4, latent=8, lse_noise=0.0, seed=0):
    """bf16 inputs at the suite's scales, the per-head LSE over V_t (fp32; plus uniform noise in
    ``[0, lse_noise)``, which moves the target mass off H) and, sparse, a selection of the suite's kind: row p lists
    0..p while p < top, else ``top`` distinct ids <= p (int64); and the bool [T, T] V_t."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape, std=1.0: (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)
    q, k = randn(t, index_heads, index_dim), randn(t, index_dim)
    weights = randn(t, index_heads, std=1 / math.sqrt(index_heads * index_dim))
    attn_q, attn_k = randn(t, heads, latent, std=0.25), randn(t, latent)
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    topk = None
    if top is not None:
        rows = []
        for p in range(t):
            ids = torch.arange(p + 1) if p < top else torch.randperm(p + 1, generator=gen)[:top].sort().values
            rows.append(torch.cat([ids, torch.full((top - ids.numel(),), -1)]))
        topk = torch.stack(rows)
        visible = torch.zeros(t, t + 1, dtype=torch.bool).scatter_(1, torch.where(topk >= 0, topk, t), True)[:, :t]
    z = SCALE * torch.einsum("thd,sd->ths", attn_q.double(), attn_k.double())
    lse = torch.logsumexp(z.masked_fill(~visible[:, None, :], -math.inf), 2)
    lse = (lse + lse_noise * torch.rand(lse.shape, generator=gen, dtype=torch.float64)).float()
    return (q, k, weights, attn_q, attn_k, lse, topk), visible


def _documented_scores(x: cudnn_dsa.Arguments, visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 score tensors as cuDNN FE's score recomputes document them (``cudnn/deepseek_sparse_attention/
    score_recompute/api.py``), NaN where its dense kernels may leave memory unwritten (past the causal bound)."""
    q, k, w = x.q[0].double(), x.k[0].double(), x.weights[0].double()
    logits = (torch.einsum("tjd,sd->tjs", q, k).clamp_min(0) * w[:, :, None]).sum(1)
    z = x.softmax_scale * torch.einsum("thd,sd->ths", x.attn_q[0].double(), x.attn_k[0].double())
    mass = torch.exp(z - x.attn_lse[0].double()[:, :, None]).sum(1)
    if x.topk is None:
        l1 = torch.where(visible, mass, 0.0).sum(1)
        lse_i = torch.logsumexp(logits.masked_fill(~visible, -math.inf), 1)
        dense = [torch.where(visible, mass, math.nan), l1, torch.where(visible, logits, math.nan), lse_i]
        return tuple(s.float()[None] for s in dense)
    ids = x.topk[0].long()
    listed = ids >= 0
    slot_mass = torch.where(listed, mass.gather(1, ids.clamp(min=0)), 0.0)
    slot_logits = torch.where(listed, logits.gather(1, ids.clamp(min=0)), -math.inf)
    target = slot_mass / slot_mass.sum(1, keepdim=True)
    return target.float()[None], torch.softmax(slot_logits, 1).float()[None]


@pytest.mark.parametrize("top", [None, 128])
def test_arguments_are_a_batch_of_one(top):
    (q, k, w, attn_q, attn_k, lse, topk), _ = _inputs(130, top)
    x = cudnn_dsa.arguments(q, k, w, attn_q, attn_k, lse, topk, softmax_scale=SCALE, coeff=0.5)
    for theirs, ours in ((x.q, q), (x.k, k), (x.weights, w), (x.attn_q, attn_q), (x.attn_k, attn_k)):
        assert theirs.shape == (1, *ours.shape) and theirs.is_contiguous() and theirs.data_ptr() == ours.data_ptr()
    assert x.attn_lse.shape == (1, *lse.shape) and x.attn_lse.dtype == torch.float32
    if top is None:
        assert x.topk is None
    else:
        assert x.topk.dtype == torch.int32 and x.topk.shape == (1, *topk.shape) and torch.equal(x.topk[0].long(), topk)
    assert (x.softmax_scale, x.coeff) == (SCALE, 0.5)
    assert x.grad_loss.shape == (1,) and x.grad_loss.dtype == torch.float32 and float(x.grad_loss) == 1.0


@pytest.mark.parametrize("case", ["packed keys", "gqa", "fp32", "index heads", "top k"])
def test_arguments_reject_what_its_kernels_do_not_take(case):
    (q, k, w, attn_q, attn_k, lse, topk), _ = _inputs(8, 4 if case == "top k" else None)
    if case == "packed keys":
        k = k[:4]
    elif case == "gqa":
        attn_k = attn_k[:, None, :]
    elif case == "fp32":
        q = q.float()
    elif case == "index heads":
        q, w = q[:, :32], w[:, :32]
    with pytest.raises(ValueError):
        cudnn_dsa.arguments(q, k, w, attn_q, attn_k, lse, topk, softmax_scale=SCALE)


class _RecordingDSA:
    """``cudnn.DSA`` stand-in: records each call and returns outputs shaped as the wrappers document."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name.startswith("dense_") and name.endswith("score_recompute_wrapper"):
                b, s_q, s_k = args[0].shape[0], args[0].shape[1], args[1].shape[1]
                return {"out": torch.zeros(b, s_q, s_k), "denom": torch.ones(b, s_q)}
            if name == "sparse_attn_score_recompute_wrapper":
                return {"target": torch.zeros(args[3].shape)}
            if name == "sparse_indexer_score_recompute_wrapper":
                return {"predict": torch.zeros(args[3].shape)}
            q, w, k = args[:3]
            return {"d_index_q": torch.zeros_like(q), "d_weights": torch.zeros_like(w), "d_index_k": torch.zeros_like(k)}

        return call


def _recorded_step(monkeypatch, top):
    (q, k, w, attn_q, attn_k, lse, topk), _ = _inputs(16, top, heads=128, latent=16)
    x = cudnn_dsa.arguments(q, k, w, attn_q, attn_k, lse, topk, softmax_scale=SCALE, coeff=0.25)
    dsa = _RecordingDSA()
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(DSA=dsa))
    grads = cudnn_dsa.step(x)
    return x, (q, k, w), grads, dsa.calls


@pytest.mark.parametrize("top", [None, 128])
def test_a_step_calls_the_score_recomputes_then_the_backward(monkeypatch, top):
    x, (q, k, w), grads, calls = _recorded_step(monkeypatch, top)
    names = [name for name, _, _ in calls]
    t = q.shape[0]
    if top is None:
        assert names == ["dense_attn_score_recompute_wrapper", "dense_indexer_score_recompute_wrapper",
                         "dense_indexer_backward_wrapper"]
        (_, attn_args, attn_kw), (_, index_args, index_kw), (_, bwd_args, bwd_kw) = calls
        assert attn_args[1].shape == (1, t, 1, 16) and attn_args[2] is x.attn_lse and attn_args[3] == SCALE
        assert attn_kw == {"qhead_per_kv_head": 128}
        assert index_args[1].shape == (1, t, 1, 16) and index_kw == {"qhead_per_kv_head": 64}
        assert len(bwd_args) == 7 and bwd_args[:3] == (x.q, x.weights, x.k)
    else:
        assert names == ["sparse_attn_score_recompute_wrapper", "sparse_indexer_score_recompute_wrapper",
                         "indexer_backward_wrapper"]
        (_, attn_args, attn_kw), (_, index_args, index_kw), (_, bwd_args, bwd_kw) = calls
        assert attn_args[1] is x.attn_k and attn_args[3] is x.topk and attn_args[4] == SCALE
        assert attn_kw == {"qhead_per_kv_head": 128} and index_kw == {"qhead_per_kv_head": 64}
        assert index_args[:4] == (x.q, x.k, x.weights, x.topk)
        assert len(bwd_args) == 6 and bwd_args[:3] == (x.q, x.weights, x.k) and bwd_args[5] is x.topk
    assert bwd_kw == {"grad_loss": x.grad_loss, "loss_coeff": 0.25}
    assert [g.shape for g in grads] == [q.shape, k.shape, w.shape]


@pytest.mark.parametrize("top", [None, 128])
def test_the_calls_bind_to_the_installed_wrappers(monkeypatch, top):
    pytest.importorskip("cudnn.deepseek_sparse_attention",
                        reason="nvidia-cudnn-frontend is not installed here (scripts/cudnn-wheels installs it)")
    from cudnn import DSA

    signatures = {name: inspect.signature(getattr(DSA, name)) for name in (
        "dense_attn_score_recompute_wrapper", "dense_indexer_score_recompute_wrapper", "dense_indexer_backward_wrapper",
        "sparse_attn_score_recompute_wrapper", "sparse_indexer_score_recompute_wrapper", "indexer_backward_wrapper")}
    _, _, _, calls = _recorded_step(monkeypatch, top)
    for name, args, kwargs in calls:
        signatures[name].bind(*args, **kwargs)


@pytest.mark.parametrize("top", [None, 128])
def test_loss_of_its_scores_is_the_l1_target_kl(top):
    """A perturbed LSE (target mass off H) tells the L1 target from ``"heads"``: its loss is ours with ``"l1"``."""
    (q, k, w, attn_q, attn_k, lse, topk), visible = _inputs(160 if top else 48, top, lse_noise=0.5)
    x = cudnn_dsa.arguments(q, k, w, attn_q, attn_k, lse, topk, softmax_scale=SCALE, coeff=0.7)
    ours = {norm: float(indexer_kl_reference(q, k, w, attn_q, attn_k, lse, softmax_scale=SCALE, topk_indices=topk,
                                             target_norm=norm, coeff=0.7)[0]) for norm in ("l1", "heads")}
    theirs = cudnn_dsa.loss(x, _documented_scores(x, visible))
    assert theirs.dtype == torch.float64
    assert float(theirs) == pytest.approx(ours["l1"], rel=1e-5)
    assert float(theirs) != pytest.approx(ours["heads"], rel=1e-2)


def test_dense_loss_reads_in_chunks(monkeypatch):
    (q, k, w, attn_q, attn_k, lse, _), visible = _inputs(40, None)
    x = cudnn_dsa.arguments(q, k, w, attn_q, attn_k, lse, softmax_scale=SCALE)
    scores = _documented_scores(x, visible)
    whole = cudnn_dsa.loss(x, scores)
    monkeypatch.setattr(cudnn_dsa, "_LOSS_CHUNK_ELEMENTS", 3 * 40)
    assert float(cudnn_dsa.loss(x, scores)) == pytest.approx(float(whole), rel=1e-12)
