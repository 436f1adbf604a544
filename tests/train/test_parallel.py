"""Context- and tensor-parallel indexer KL loss on gloo process groups: bitwise equal to one process.

Each world size spawns once; the workers run every case and return their outputs, which the parent
compares bit for bit with the single-process definitions over the same partition (same backend) and with
the unpartitioned reference: within float64 rounding for the reference pieces, within the kernel tier for
the Triton pieces (interpreter, tiny shapes; the GPU cases simulate two ranks in one process).
"""

from __future__ import annotations

import math

import pytest
import torch
from kl_oracle import kernel_tier_failures, make_case, relative_error, visibility

from dsa_indexer.testing import run_distributed
from dsa_indexer.train.parallel import (
    balanced_row_blocks,
    context_parallel_indexer_kl,
    context_parallel_loss,
    context_parallel_single_process,
    tensor_parallel_indexer_kl,
    tensor_parallel_single_process,
)
from dsa_indexer.train.reference import Layout, indexer_kl_reference

pytestmark = pytest.mark.distributed

CP_CASES = [
    dict(lengths=(9, 1, 12), ratio=2, topk=4, target_norm="l1", lse_over_visible=False, dtype=torch.float32),
    dict(lengths=(14,), heads=4, kv_heads=2, reduction="sum", coeff=0.5),
]
TP_CASES = [
    dict(lengths=(7, 10), topk=5, heads=4, kv_heads=4, dtype=torch.bfloat16),
    dict(lengths=(11,), ratio=2, heads=8, target_norm="l1", lse_over_visible=False),
]


def key_splits(num_keys: int, world: int) -> list[int]:
    """Uneven contiguous shards in rank order; with 3+ ranks the second one is empty."""
    first = num_keys // 3
    if world == 2:
        return [first, num_keys - first]
    rest = num_keys - first
    middle = [rest // (world - 2)] * (world - 3)
    return [first, 0, *middle, rest - sum(middle)]


def cp_rank_args(case, rank: int, world: int) -> tuple:
    """``case``'s arguments as rank ``rank`` of ``world`` holds them: its shard of ``k`` and ``attn_k``."""
    splits = key_splits(case.k.shape[0], world)
    lo = sum(splits[:rank])
    q, k, w, aq, ak, lse = case.args()
    return q, k[lo:lo + splits[rank]], w, aq, ak[lo:lo + splits[rank]], lse


def tp_rank_args(case, rank: int, world: int) -> tuple:
    """``case``'s arguments as rank ``rank`` of ``world`` holds them: its heads of ``attn_q``, ``attn_lse`` (and
    of a GQA ``attn_k``)."""
    q, k, w, aq, ak, lse = case.args()
    per = aq.shape[1] // world
    heads = slice(rank * per, (rank + 1) * per)
    kv = ak if ak.dim() == 2 else ak[:, rank * ak.shape[1] // world:(rank + 1) * ak.shape[1] // world]
    return q, k, w, aq[:, heads].contiguous(), kv.contiguous(), lse[:, heads].contiguous()


def assert_cp_ranks_equal(results: list, expected, splits: list[int]) -> None:
    """Every rank's ``(loss, dq, dk, dw)`` equals the one-process run bit for bit (``dk``: its shard's rows)."""
    offsets = [sum(splits[:r]) for r in range(len(splits) + 1)]
    for rank, (loss, dq, dk, dw) in enumerate(results):
        assert bitwise((loss, dq, dw), (expected[0], expected[1], expected[3]))
        assert torch.equal(dk, expected[2][offsets[rank]:offsets[rank + 1]])


def workers(rank: int, world: int):
    torch.set_num_threads(1)
    results = {"cp": [], "tp": [], "tp_cross": []}
    for spec in CP_CASES:
        case = make_case(**spec)
        results["cp"].append(context_parallel_indexer_kl(*cp_rank_args(case, rank, world), **case.kwargs))
    for spec in TP_CASES:
        case = make_case(**spec)
        args = tp_rank_args(case, rank, world)
        results["tp"].append(tensor_parallel_indexer_kl(*args, **case.kwargs))
        results["tp_cross"].append(tensor_parallel_indexer_kl(*args, **case.kwargs, exact_loss=False))
    # The autograd wrapper: gradients land on q, this rank's k shard and weights.
    case = make_case(**CP_CASES[0])
    q, k, w, aq, ak, lse = cp_rank_args(case, rank, world)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, w)]
    loss = context_parallel_loss(*leaves, aq, ak, lse, **case.kwargs)
    loss.backward()
    results["autograd"] = (loss.detach(), *(leaf.grad for leaf in leaves))
    results["errors"] = mismatch_errors(rank, world)
    return results


def mismatch_errors(rank: int, world: int) -> list[str]:
    """Inconsistent shards raise the same error on every rank (no hang)."""
    case = make_case(lengths=(8,), heads=4)
    q, k, w, aq, ak, lse = case.args()
    messages = []
    short = k.shape[0] // world - (rank == 0)     # the shards miss a key
    lo = rank * (k.shape[0] // world)
    try:
        context_parallel_indexer_kl(q, k[lo:lo + short], w, aq, ak[lo:lo + short], lse, **case.kwargs)
    except ValueError as error:
        messages.append(str(error))
    heads = 2 if rank == 0 else 1                 # rank 0 holds more heads than the others
    try:
        tensor_parallel_indexer_kl(q, k, w, aq[:, :heads], ak, lse[:, :heads], **case.kwargs)
    except ValueError as error:
        messages.append(str(error))
    return messages


def bitwise(got, expected):
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_paths_equal_one_process_bitwise(world):
    ranks = run_distributed(workers, world)
    for index, spec in enumerate(CP_CASES):
        case = make_case(**spec)
        splits = key_splits(case.k.shape[0], world)
        assert len(splits) == world and sum(splits) == case.k.shape[0]
        expected = context_parallel_single_process(*case.args(), key_splits=splits, **case.kwargs)
        assert_cp_ranks_equal([result["cp"][index] for result in ranks], expected, splits)
        whole = indexer_kl_reference(*case.args(), **case.kwargs)
        assert expected[0].item() == pytest.approx(whole[0].item(), rel=1e-6)
        for got, want in zip(expected[1:], whole[1:]):
            assert relative_error(got, want) < (1e-6 if got.dtype == torch.float32 else 1e-12)
    for index, spec in enumerate(TP_CASES):
        case = make_case(**spec)
        expected = tensor_parallel_single_process(*case.args(), world_size=world, **case.kwargs)
        cross = tensor_parallel_single_process(*case.args(), world_size=world, exact_loss=False, **case.kwargs)
        for result in ranks:
            assert bitwise(result["tp"][index], expected)
            assert bitwise(result["tp_cross"][index], cross)
        whole = indexer_kl_reference(*case.args(), **case.kwargs)
        assert expected[0].item() == pytest.approx(whole[0].item(), rel=1e-6)
        for got, want in zip(expected[1:], whole[1:]):
            tolerance = 1e-2 if got.dtype == torch.bfloat16 else 1e-12
            assert relative_error(got, want) < tolerance
        # Without the entropy pass the loss is the cross-entropy; the gradients are those of the KL.
        assert bitwise(cross[1:], expected[1:])
        assert cross[0].item() == pytest.approx(expected[0].item() - target_entropy(case), rel=1e-5, abs=1e-6)
    case = make_case(**CP_CASES[0])
    splits = key_splits(case.k.shape[0], world)
    expected = context_parallel_single_process(*case.args(), key_splits=splits, **case.kwargs)
    for rank, result in enumerate(ranks):
        lo = sum(splits[:rank])
        assert bitwise(result["autograd"], (expected[0], expected[1], expected[2][lo:lo + splits[rank]], expected[3]))
        short, heads = result["errors"]
        assert "must add up to T_k = Σ_b len_b // compress_ratio = 8" in short
        assert f"the ranks disagree on heads per rank: {[2] + [1] * (world - 1)}" in heads


def target_entropy(case) -> float:
    """``c · mean_t Σ_s p log p`` over valid rows, computed densely."""
    kw = case.kwargs
    mask = visibility(case.q.shape[0], case.k.shape[0], kw["cu_seqlens"], kw["compress_ratio"], kw["topk_indices"])
    heads = case.attn_q.shape[1]
    kv = case.attn_k.double()
    kv = kv[:, None].expand(-1, heads, -1) if kv.dim() == 2 else kv.repeat_interleave(heads // kv.shape[1], 1)
    scores = torch.einsum("thd,shd->ths", case.attn_q.double(), kv) * kw["softmax_scale"]
    lse = torch.where(mask.any(1, keepdim=True), case.attn_lse.double(), 0.0)
    target = torch.exp(scores - lse[:, :, None]).sum(1).masked_fill(~mask, 0.0)
    denom = target.sum(1, keepdim=True) if kw["target_norm"] == "l1" else torch.full_like(target[:, :1], heads)
    valid = mask.any(1) & (denom[:, 0] > 0)
    p = target / torch.where(denom > 0, denom, 1.0)
    entropy = torch.special.xlogy(p, p).sum(1)[valid]
    total = entropy.sum().item() * kw["coeff"]
    return total / len(entropy) if kw["reduction"] == "mean" else total


def test_balanced_row_blocks_tile_the_rows_with_even_causal_work():
    layout = Layout.of(300, torch.tensor([0, 100, 101, 300]), 1)
    blocks = balanced_row_blocks(layout, 4)
    assert blocks[0][0] == 0 and blocks[-1][1] == 300
    assert all(a[1] == b[0] for a, b in zip(blocks[:-1], blocks[1:]))
    counts = layout.visible_counts()
    work = [sum(counts[r0:r1]) for r0, r1 in blocks]
    assert max(work) - min(work) <= max(counts)
    assert balanced_row_blocks(Layout.of(3, None, 5), 2) == [(0, 0), (0, 3)]


# The kernel pieces (backend="triton") under the interpreter: float32/bfloat16 inputs, H_I <= 2, D_I <= 16.
KERNEL_CP_CASES = [
    dict(lengths=(9, 1, 12), ratio=2, target_norm="l1", lse_over_visible=False, dtype=torch.float32),
    dict(lengths=(4, 7), topk=4, kv_heads=2, dtype=torch.bfloat16, reduction="sum", coeff=0.5),
]
KERNEL_SMALL = dict(index_heads=2, index_dim=16)


def kernel_tp_cases(world: int) -> list[dict]:
    """Dense MQA "heads" (both exact_loss settings) and sparse GQA "l1" with one key head per rank."""
    heads = max(4, world)
    return [
        dict(lengths=(11, 6), heads=heads, dtype=torch.float32),
        dict(lengths=(9,), topk=4, heads=2 * world, kv_heads=world, target_norm="l1", lse_over_visible=False,
             dtype=torch.bfloat16),
    ]


def kernel_workers(rank: int, world: int):
    torch.set_num_threads(1)
    results = {"cp": [], "tp": []}
    for spec in KERNEL_CP_CASES:
        case = make_case(**spec, **KERNEL_SMALL)
        results["cp"].append(context_parallel_indexer_kl(*cp_rank_args(case, rank, world), backend="triton",
                                                         **case.kwargs))
    for index, spec in enumerate(kernel_tp_cases(world)):
        case = make_case(**spec, **KERNEL_SMALL)
        args = tp_rank_args(case, rank, world)
        for exact in (True, False) if index == 0 else (True,):
            results["tp"].append(tensor_parallel_indexer_kl(*args, backend="triton", exact_loss=exact, **case.kwargs))
    return results


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_kernel_parallel_paths_equal_one_process_bitwise(kernel_device, world):
    if kernel_device != "cpu":
        pytest.skip("gloo ranks on CPU tensors run the kernels under the interpreter; the GPU cases are below")
    ranks = run_distributed(kernel_workers, world)
    for index, spec in enumerate(KERNEL_CP_CASES):
        case = make_case(**spec, **KERNEL_SMALL)
        splits = key_splits(case.k.shape[0], world)
        expected = context_parallel_single_process(*case.args(), key_splits=splits, backend="triton", **case.kwargs)
        assert_cp_ranks_equal([result["cp"][index] for result in ranks], expected, splits)
        whole = indexer_kl_reference(*case.args(), **case.kwargs)
        assert not kernel_tier_failures(expected, whole, spec["dtype"])
    runs = iter(range(len(ranks[0]["tp"])))
    for index, spec in enumerate(kernel_tp_cases(world)):
        case = make_case(**spec, **KERNEL_SMALL)
        whole = indexer_kl_reference(*case.args(), **case.kwargs)
        for exact in (True, False) if index == 0 else (True,):
            run = next(runs)
            expected = tensor_parallel_single_process(*case.args(), world_size=world, exact_loss=exact,
                                                      backend="triton", **case.kwargs)
            for result in ranks:
                assert bitwise(result["tp"][run], expected)
            # Without the entropy the loss is the cross-entropy; the gradients are those of the KL.
            want = whole if exact else (whole[0] - target_entropy(case), *whole[1:])
            assert not kernel_tier_failures(expected, want, spec["dtype"])


def test_backend_choice(without_interpreter):
    """"auto" runs the reference pieces on CPU tensors (also float32); "triton" on CPU tensors without the
    interpreter is refused before anything runs."""
    case = make_case(**KERNEL_CP_CASES[0], **KERNEL_SMALL)
    splits = key_splits(case.k.shape[0], 2)
    auto = context_parallel_single_process(*case.args(), key_splits=splits, **case.kwargs)
    reference = context_parallel_single_process(*case.args(), key_splits=splits, backend="reference", **case.kwargs)
    assert bitwise(auto, reference)
    with pytest.raises(ValueError, match="backend='triton' needs"):
        tensor_parallel_single_process(*case.args(), world_size=2, backend="triton", **case.kwargs)


# GPU: two ranks simulated in one process at a realistic shape, against the single-process kernels.

GPU_SHAPE = dict(t=2048, heads=16, attn_dim=576, index_heads=8, index_dim=128, softmax_scale=0.1352)


def gpu_case(t: int, seed: int = 0):
    """bf16 CUDA inputs, causal, the attention LSE over the visible keys (``"heads"``)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = GPU_SHAPE

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q = randn(t, shape["index_heads"], shape["index_dim"])
    k = randn(t, shape["index_dim"])
    w = randn(t, shape["index_heads"], scale=1 / math.sqrt(shape["index_heads"] * shape["index_dim"]))
    attn_q = randn(t, shape["heads"], shape["attn_dim"], scale=0.25)
    attn_k = randn(t, shape["attn_dim"])
    lse = torch.empty(t, shape["heads"], device="cuda")
    keys = torch.arange(t, device="cuda")
    for r0 in range(0, t, 256):
        rows = torch.arange(r0, min(t, r0 + 256), device="cuda")
        z = shape["softmax_scale"] * torch.einsum("thd,sd->ths", attn_q[rows].float(), attn_k.float())
        lse[rows] = z.masked_fill(keys[None, None, :] > rows[:, None, None], -math.inf).logsumexp(-1)
    return q, k, w, attn_q, attn_k, lse


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["context", "tensor"])
def test_gpu_two_ranks_in_one_process_match_the_single_process_kernels(path):
    """CP (uneven key shards) and TP (8 heads a rank, exact loss) over 2 shards: within the kernel tier of
    ``indexer_kl_triton``, and 20 reruns bitwise equal."""
    from dsa_indexer.train.triton import indexer_kl_triton

    args = gpu_case(GPU_SHAPE["t"])
    kwargs = dict(softmax_scale=GPU_SHAPE["softmax_scale"], backend="triton")
    if path == "context":
        t_k = args[1].shape[0]
        def call():
            return context_parallel_single_process(*args, key_splits=[t_k // 3, t_k - t_k // 3], **kwargs)
    else:
        def call():
            return tensor_parallel_single_process(*args, world_size=2, **kwargs)
    first = call()
    single = indexer_kl_triton(*args, softmax_scale=GPU_SHAPE["softmax_scale"])
    assert not kernel_tier_failures(first, single, torch.bfloat16)
    for _ in range(20):
        assert bitwise(call(), first)


@pytest.mark.gpu
def test_gpu_context_parallel_memory_is_linear_in_t():
    """Peak memory of the two-shard context-parallel definition above its inputs and outputs, at T = 8K: within
    a bound linear in T (the shards' key copies, three fp32 dq-sized partials and sums, at most 16 fp32 dk parts,
    a few words a row) that one fp32 T x T matrix (256 MiB) exceeds."""
    t = 8192
    args = gpu_case(t)
    t_k = args[1].shape[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = context_parallel_single_process(*args, key_splits=[t_k // 2, t_k - t_k // 2], backend="triton",
                                             softmax_scale=GPU_SHAPE["softmax_scale"])
    torch.cuda.synchronize()
    outputs = sum(x.numel() * x.element_size() for x in result)
    peak = torch.cuda.max_memory_allocated() - before - outputs
    d_i, rows = GPU_SHAPE["index_dim"], GPU_SHAPE["index_heads"] * GPU_SHAPE["index_dim"]
    bound = t * (3 * rows * 4 + 16 * d_i * 4 + 2 * (d_i + GPU_SHAPE["attn_dim"]) + 512)
    assert peak < bound < 4 * t * t
