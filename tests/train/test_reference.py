"""The indexer KL loss reference and its autograd op against an independent dense oracle."""

from __future__ import annotations

import pytest
import torch
from kl_oracle import make_case, naive_kl, relative_error

from dsa_indexer.train import indexer_kl_loss
from dsa_indexer.train.reference import indexer_kl_reference

CASES = {
    "dense": dict(),
    "sparse": dict(topk=5),
    "varlen": dict(lengths=(7, 0, 1, 9)),
    "varlen_sparse_gqa": dict(lengths=(6, 11), topk=4, heads=4, kv_heads=2),
    "ratio3_varlen": dict(lengths=(10, 2, 8), ratio=3),
    "ratio2_sparse_l1": dict(lengths=(9, 6), ratio=2, topk=3, target_norm="l1", lse_over_visible=False),
    "l1_dense_sum": dict(target_norm="l1", reduction="sum", coeff=0.25),
    "heads_sum_gqa": dict(heads=6, kv_heads=3, reduction="sum", coeff=1e-3),
}


def grads_of_oracle(case):
    leaves = [t.detach().double().requires_grad_(True) for t in (case.q, case.k, case.weights)]
    loss = naive_kl(*leaves, case.attn_q, case.attn_k, case.attn_lse, **case.kwargs)
    return loss, torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("name", CASES)
def test_reference_equals_the_dense_autograd_oracle(name):
    case = make_case(**CASES[name])
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    expected_loss, expected = grads_of_oracle(case)
    assert loss.dtype == torch.float64 and loss.shape == ()
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for got, want in zip((dq, dk, dw), expected):
        assert got.dtype == torch.float64
        assert relative_error(got, want) < 1e-12


def test_chunking_does_not_change_the_result():
    case = make_case(lengths=(9, 14), topk=6, ratio=2, target_norm="l1", lse_over_visible=False)
    one = indexer_kl_reference(*case.args(), **case.kwargs, chunk_rows=1)
    many = indexer_kl_reference(*case.args(), **case.kwargs, chunk_rows=5)
    whole = indexer_kl_reference(*case.args(), **case.kwargs)
    assert one[0].item() == pytest.approx(whole[0].item(), rel=1e-7)
    for a, b, c in zip(one[1:], many[1:], whole[1:]):
        assert relative_error(a, c) < 1e-13 and relative_error(b, c) < 1e-13


def test_gradcheck_of_the_autograd_op():
    case = make_case(lengths=(4, 5), topk=3, ratio=1, heads=2, index_heads=2, index_dim=3, attn_dim=4)
    attn = (case.attn_q, case.attn_k, case.attn_lse)

    def loss_of(q, k, w):
        return indexer_kl_loss(q, k, w, *attn, **case.kwargs)

    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.weights))
    assert torch.autograd.gradcheck(loss_of, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_backward_scales_by_the_upstream_gradient_and_leaves_the_attention_alone():
    case = make_case(topk=4)
    leaves = [t.clone().requires_grad_(True) for t in (case.q, case.k, case.weights)]
    attn_q = case.attn_q.clone().requires_grad_(True)
    loss = indexer_kl_loss(leaves[0], leaves[1], leaves[2], attn_q, case.attn_k, case.attn_lse, **case.kwargs)
    (-2.5 * loss).backward()
    _, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    for leaf, grad in zip(leaves, (dq, dk, dw)):
        assert torch.equal(leaf.grad, -2.5 * grad)
    assert attn_q.grad is None


def test_reruns_are_bitwise_equal():
    case = make_case(lengths=(8, 12), topk=5, ratio=2)
    first = indexer_kl_reference(*case.args(), **case.kwargs)
    second = indexer_kl_reference(*case.args(), **case.kwargs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bfloat16_inputs_give_bfloat16_gradients_close_to_float64():
    case = make_case(lengths=(10, 6), topk=4, dtype=torch.bfloat16)
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    upcast = [t.double() for t in case.args()]
    loss64, dq64, dk64, dw64 = indexer_kl_reference(*upcast, **case.kwargs)
    assert (dq.dtype, dk.dtype, dw.dtype, loss.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    # Same (bf16-valued) inputs, float64 arithmetic in both: only the final rounding differs.
    assert loss.item() == loss64.float().item()
    for got, want in zip((dq, dk, dw), (dq64, dk64, dw64)):
        assert torch.equal(got, want.to(torch.bfloat16))


# Adversarial inputs: each against the oracle.


def test_relu_boundary_a_equal_zero():
    case = make_case(lengths=(9,), topk=None)
    case.q[2, 1] = 0.0            # a = 0 for every key of row 2, head 1
    case.k[3] = 0.0               # a = 0 for key 3 with every query
    case.q[5, 0, :] = torch.tensor([1.0, -1.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    case.k[1, :2] = 1.0           # q[5,0]·k[1] = 0 exactly with other entries generic
    case.k[1, 2:] = 0.0
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    expected_loss, expected = grads_of_oracle(case)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    assert torch.all(dq[2, 1] == 0)
    for got, want in zip((dq, dk, dw), expected):
        assert relative_error(got, want) < 1e-12


def test_empty_rows_are_not_counted():
    case = make_case(lengths=(6, 5), ratio=2, topk=3)
    case.kwargs["topk_indices"][1] = -1            # row 1 sees key 0 but selects nothing
    case.kwargs["topk_indices"][4] = torch.tensor([4, 4, -1], dtype=torch.int32)  # only an invisible id
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    expected_loss, expected = grads_of_oracle(case)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for row in (0, 1, 4, 6):                        # rows 0, 6: position 0 with ratio 2 sees no key
        assert torch.all(dq[row] == 0) and torch.all(dw[row] == 0)
    for got, want in zip((dq, dk, dw), expected):
        assert relative_error(got, want) < 1e-12


def test_no_valid_row_gives_zero_loss_and_gradients():
    case = make_case(lengths=(3, 2), ratio=4)       # every position p < 3 sees (p + 1) // 4 = 0 keys
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    assert case.k.shape[0] == 0 and loss.item() == 0.0
    assert not dq.any() and not dw.any() and dk.shape == (0, case.k.shape[1])
    empty = make_case(lengths=(5,), topk=2)
    empty.kwargs["topk_indices"].fill_(-1)
    loss, dq, dk, dw = indexer_kl_reference(*empty.args(), **empty.kwargs)
    assert loss.item() == 0.0 and not dq.any() and not dk.any() and not dw.any()


def test_huge_logits_stay_finite_and_exact():
    case = make_case(lengths=(12,), topk=5)
    case.weights *= 1e4                              # indexer logits ~1e5: exp overflows without the LSE shift
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    expected_loss, expected = grads_of_oracle(case)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for got, want in zip((dq, dk, dw), expected):
        assert torch.isfinite(got).all() and relative_error(got, want) < 1e-12


@pytest.mark.parametrize("target_norm", ["heads", "l1"])
def test_zero_target_entries_and_zero_mass_rows(target_norm):
    case = make_case(lengths=(10,), softmax_scale=40.0, target_norm=target_norm, lse_over_visible=False)
    if target_norm == "l1":
        case.attn_lse[7] = 1e4                       # the target of row 7 underflows to 0 everywhere: not valid
    mass = torch.exp(40.0 * torch.einsum("thd,sd->ths", case.attn_q, case.attn_k) - case.attn_lse.double()[..., None])
    assert (mass.sum(1).tril() == 0).any()           # some p = 0 entries inside V_t
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    expected_loss, expected = grads_of_oracle(case)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    if target_norm == "l1":
        assert torch.all(dq[7] == 0) and torch.all(dw[7] == 0)
    for got, want in zip((dq, dk, dw), expected):
        assert relative_error(got, want) < 1e-12


# Argument checks: each names the argument and raises before computing.


def _bad_calls():
    case = make_case(lengths=(5, 4), topk=2, dtype=torch.float32)
    q, k, w, aq, ak, lse = case.args()
    kw = dict(case.kwargs)
    cu = kw["cu_seqlens"]
    yield "q dtype", (q.half(), k, w, aq, ak, lse), kw, TypeError, "q must have dtype"
    yield "q rank", (q[0], k, w, aq, ak, lse), kw, ValueError, "q must have 3"
    yield "k dtype", (q, k.double(), w, aq, ak, lse), kw, TypeError, "k must have dtype"
    yield "k dim", (q, k[:, :3], w, aq, ak, lse), kw, ValueError, "k must have shape"
    yield "weights", (q, k, w[:, :1], aq, ak, lse), kw, ValueError, "weights must have shape"
    yield "attn_q rows", (q, k, w, aq[1:], ak, lse), kw, ValueError, "attn_q must have shape"
    yield "attn_k dtype", (q, k, w, aq, ak.double(), lse), kw, TypeError, "attn_k must have dtype"
    yield "attn_k rows", (q, k, w, aq, ak[1:], lse), kw, ValueError, "attn_k must have shape"
    yield "attn_k heads", (q, k, w, aq, ak[:, None].expand(-1, 3, -1), lse), kw, ValueError, "H_kv"
    yield "attn_lse dtype", (q, k, w, aq, ak, lse.bfloat16()), kw, TypeError, "attn_lse must have dtype"
    yield "attn_lse shape", (q, k, w, aq, ak, lse[:, :1]), kw, ValueError, "attn_lse must have shape"
    yield "softmax_scale", case.args(), {**kw, "softmax_scale": float("nan")}, ValueError, "softmax_scale"
    yield "softmax_scale type", case.args(), {**kw, "softmax_scale": "0.1"}, TypeError, "softmax_scale"
    yield "coeff", case.args(), {**kw, "coeff": True}, TypeError, "coeff"
    yield "compress_ratio", case.args(), {**kw, "compress_ratio": 0}, ValueError, "compress_ratio"
    yield "target_norm", case.args(), {**kw, "target_norm": "L1"}, ValueError, "target_norm"
    yield "reduction", case.args(), {**kw, "reduction": "none"}, ValueError, "reduction"
    yield "backend", case.args(), {**kw, "backend": "cuda"}, ValueError, "backend"
    yield "cu dtype", case.args(), {**kw, "cu_seqlens": cu.float()}, TypeError, "cu_seqlens"
    yield "cu short", case.args(), {**kw, "cu_seqlens": cu[:1]}, ValueError, "cu_seqlens"
    yield "cu start", case.args(), {**kw, "cu_seqlens": cu + 1}, ValueError, "cu_seqlens[0]"
    yield "cu end", case.args(), {**kw, "cu_seqlens": torch.tensor([0, 4, 8], dtype=torch.int32)}, ValueError, \
        "cu_seqlens[-1]"
    yield "cu order", case.args(), {**kw, "cu_seqlens": torch.tensor([0, 6, 5, 9], dtype=torch.int32)}, \
        ValueError, "non-decreasing"
    yield "key count", (q, k[:-1], w, aq, ak[:-1], lse), kw, ValueError, "k must have"
    yield "topk rows", case.args(), {**kw, "topk_indices": kw["topk_indices"][1:]}, ValueError, "topk_indices"
    yield "topk dtype", case.args(), {**kw, "topk_indices": kw["topk_indices"].float()}, TypeError, "topk_indices"
    too_big = kw["topk_indices"].clone()
    too_big[6, 1] = 4                                   # sequence 1 has 4 keys: ids 0..3
    yield "topk range", case.args(), {**kw, "topk_indices": too_big}, ValueError, "topk_indices[6, 1] = 4"
    negative = kw["topk_indices"].clone()
    negative[0, 0] = -2
    yield "topk negative", case.args(), {**kw, "topk_indices": negative}, ValueError, "topk_indices[0, 0] = -2"
    yield "device", (q, k, w, aq, ak, lse.to("meta")), kw, ValueError, "attn_lse is on meta"


@pytest.mark.parametrize("name, args, kwargs, error, words", list(_bad_calls()), ids=[c[0] for c in _bad_calls()])
def test_bad_arguments_raise_naming_the_argument(name, args, kwargs, error, words):
    with pytest.raises(error, match=None) as info:
        indexer_kl_loss(*args, **kwargs)
    assert words in str(info.value)


def test_triton_backend_on_cpu_tensors_is_refused(without_interpreter):
    case = make_case(dtype=torch.float32)
    with pytest.raises(ValueError, match="backend='triton'"):
        indexer_kl_loss(*case.args(), **case.kwargs, backend="triton")


def test_auto_on_cpu_is_the_reference(monkeypatch):
    case = make_case(lengths=(6, 7), topk=3, dtype=torch.float32)
    expected = indexer_kl_reference(*case.args(), **case.kwargs)[0]
    assert torch.equal(indexer_kl_loss(*case.args(), **case.kwargs), expected)
    assert torch.equal(indexer_kl_loss(*case.args(), **case.kwargs, backend="reference"), expected)
    monkeypatch.setenv("DSA_INDEXER_BACKEND", "reference")  # what auto means; an explicit backend still wins
    assert torch.equal(indexer_kl_loss(*case.args(), **case.kwargs), expected)


@pytest.mark.gpu
def test_reference_on_cuda_equals_cpu():
    case = make_case(lengths=(40, 1, 25), topk=8, ratio=2, heads=4, kv_heads=2, dtype=torch.float32)
    expected = indexer_kl_reference(*case.args(), **case.kwargs)
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
    leaves = [t.cuda().requires_grad_(True) for t in (case.q, case.k, case.weights)]
    loss = indexer_kl_loss(*leaves, *(t.cuda() for t in case.args()[3:]), **kwargs, backend="reference")
    loss.backward()
    assert loss.device.type == "cuda" and loss.item() == pytest.approx(expected[0].item(), rel=1e-6)
    for leaf, want in zip(leaves, expected[1:]):
        assert relative_error(leaf.grad.cpu(), want) < 1e-6


def test_l1_row_without_target_mass_and_huge_logits_has_finite_zero_gradients():
    case = make_case(lengths=(8,), target_norm="l1", lse_over_visible=False)
    case.attn_lse[5] = 1e4                           # row 5: no target mass, so not valid
    case.weights[5] = case.weights[5].abs() * 1e5     # and an indexer logit far beyond exp's range:
    case.q[5] = case.k[0]                            # I[5, 0] = Σ_j w·|k_0|² ~ 1e5
    loss, dq, dk, dw = indexer_kl_reference(*case.args(), **case.kwargs)
    expected_loss, expected = grads_of_oracle(case)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    assert torch.all(dq[5] == 0) and torch.all(dw[5] == 0)
    for got, want in zip((dq, dk, dw), expected):
        assert torch.isfinite(got).all() and relative_error(got, want) < 1e-12


def test_triton_backend_dispatches_to_the_kernel_module(monkeypatch):
    """With ``dsa_indexer.train.triton`` importable, ``backend="triton"`` (interpreter: CPU tensors) calls its
    ``indexer_kl_triton`` with the validated arguments; float64 inputs never go there."""
    import importlib.machinery
    import types

    from dsa_indexer import backend

    if not backend.triton_available():
        pytest.skip("needs Triton installed")
    calls = []

    def fake_kernel(*args, **kwargs):
        calls.append(kwargs)
        return indexer_kl_reference(*args, **kwargs)

    module = types.ModuleType("dsa_indexer.train.triton")
    module.__spec__ = importlib.machinery.ModuleSpec("dsa_indexer.train.triton", None)
    module.indexer_kl_triton = fake_kernel
    monkeypatch.setitem(__import__("sys").modules, "dsa_indexer.train.triton", module)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(lengths=(5, 6), topk=3, dtype=torch.float32)
    loss = indexer_kl_loss(*case.args(), **case.kwargs, backend="triton")
    assert len(calls) == 1 and calls[0]["topk_indices"] is case.kwargs["topk_indices"]
    assert torch.equal(loss, indexer_kl_reference(*case.args(), **case.kwargs)[0])
    double = make_case(lengths=(5, 6), topk=3)
    indexer_kl_loss(*double.args(), **double.kwargs)
    with pytest.raises(ValueError, match="backend='triton'"):
        indexer_kl_loss(*double.args(), **double.kwargs, backend="triton")
    assert len(calls) == 1
