"""The main job: a simulated serving run of the indexer, checked step by step.

A handful of requests arrive with prompts of different lengths. Each step the scheduler builds a mixed
batch — decodes first (``next_n`` tokens each: one real token plus speculative ones), then prefill
chunks that continue each request's cached context — plans it with ``build_metadata``, and runs the
indexer layer through the paged cache. One step has a decode that brings fewer tokens than ``next_n``
(a rejected draft), which forces the padded decode path.

Every step the indices are compared with an exact dense oracle: for each request, all of its keys are
gathered, scored densely from the same quantised inputs (reference ``mqa_logits``) and selected with the
§6 rule. Separately the picks are compared with an unquantised fp32 indexer (recall: how much FP8/MXFP4
quantisation costs). With the V4.1 configuration a second, consumer layer shares the cache and masks
its logits with the candidate blocks the first layer publishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import IndexerKCache
from .indexer import Indexer, IndexerConfig
from .layer import SparseAttnIndexer, StageTimer
from .metadata import build_metadata
from .ops.candidates import apply_candidate_mask, select_candidate_blocks
from .ops.logits import mqa_logits
from .ops.topk import topk


@dataclass
class DemoOptions:
    config: str = "v32"
    fmt: str | None = None
    device: str = "cpu"
    requests: int = 4
    prompt_len: int = 1024
    decode_steps: int = 6
    next_n: int = 2
    topk: int = 128
    prefill_chunk: int | None = None
    block_size: int = 16
    seed: int = 0
    max_logits_bytes: int = 256 * 1024
    dcp: int = 1


@dataclass
class StepRecord:
    step: int
    decode_tokens: int
    prefill_tokens: int
    rows_checked: int
    rows_equal: int
    rows_near_tie: int
    recall: float
    padded: bool


@dataclass
class DemoResult:
    options: DemoOptions
    steps: list[StepRecord] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    indexer_seconds: float = 0.0
    tokens: int = 0
    step_indices: list[torch.Tensor] = field(default_factory=list)
    dcp_rows_equal: int | None = None
    dcp_rows: int | None = None

    @property
    def agreement(self) -> float:
        checked = sum(s.rows_checked for s in self.steps)
        return sum(s.rows_equal for s in self.steps) / checked if checked else 1.0

    @property
    def agreement_within_ties(self) -> float:
        """Rows equal to the oracle or differing only where its logits tie within kernel rounding."""
        checked = sum(s.rows_checked for s in self.steps)
        agreed = sum(s.rows_equal + s.rows_near_tie for s in self.steps)
        return agreed / checked if checked else 1.0

    @property
    def recall_vs_fp32(self) -> float:
        weighted = [(s.recall, s.rows_checked) for s in self.steps if s.rows_checked]
        total = sum(n for _, n in weighted)
        return sum(r * n for r, n in weighted) / total if total else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.indexer_seconds if self.indexer_seconds else 0.0

    @property
    def fmt(self) -> str:
        """The cache format the run used: ``options.fmt``, or the config's own when that is None."""
        return _config(self.options).fmt

    def to_json(self) -> dict:
        return {
            "config": self.options.config,
            "fmt": self.fmt,
            "device": self.options.device,
            "agreement": self.agreement,
            "agreement_within_ties": self.agreement_within_ties,
            "recall_vs_fp32": self.recall_vs_fp32,
            "tokens_per_s": self.tokens_per_s,
            "tokens": self.tokens,
            "dcp": self.options.dcp,
            "dcp_agreement": None if not self.dcp_rows else self.dcp_rows_equal / self.dcp_rows,
            "stage_seconds": self.stage_seconds,
            "steps": [vars(s) for s in self.steps],
        }


class _Request:
    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.length = 0
        self.keys_fp32: list[torch.Tensor] = []

    @property
    def prefilling(self) -> bool:
        return self.length < self.prompt_len


def _config(options: DemoOptions) -> IndexerConfig:
    base = IndexerConfig.deepseek_v32 if options.config == "v32" else IndexerConfig.deepseek_v41
    overrides = {"topk": options.topk}
    if options.fmt is not None:
        overrides["fmt"] = options.fmt
    if options.config == "v41":
        overrides.update(candidate_topk_blocks=4, candidate_block_size=8)
    return base(**overrides).small()


def _prefill_chunk(options: DemoOptions) -> int:
    """Prompt tokens a request brings per step: a quarter of the longest prompt unless set, so prompts
    of different lengths finish in different steps and some steps mix decodes with prefill chunks."""
    return options.prefill_chunk or max(16, options.prompt_len // 4)


def _schedule(requests: list[_Request], step: int, options: DemoOptions, short_decode_step: int) -> list[int]:
    """Tokens each request brings this step: decodes (``next_n``, or 1 on the short step), then prefill chunks."""
    plan = []
    for index, request in enumerate(requests):
        if request.prefilling:
            plan.append(min(_prefill_chunk(options), request.prompt_len - request.length))
        elif step == short_decode_step and index == 0:
            plan.append(1)
        else:
            plan.append(options.next_n)
    return plan


def run_demo(options: DemoOptions, progress=None, *, dcp_rank: int = 0, dcp_group=None) -> DemoResult:
    """Run the simulated serving loop; ``progress(step, total)`` is called after each step.

    With ``dcp_group`` (world ``options.dcp``) this process holds rank ``dcp_rank``'s shard of every
    request's keys and the indices are merged across ranks; the dense oracle and the fp32 recall need
    the whole cache, so they are skipped there (``run_demo_dcp`` compares with a single-process run).
    """
    device = torch.device(options.device)
    world = options.dcp if dcp_group is not None else 1
    config = _config(options)
    fmt = config.fmt
    generator = torch.Generator().manual_seed(options.seed)
    source = Indexer(config, seed=options.seed, device=device)
    consumer = Indexer(config, seed=options.seed + 1, device=device) if config.candidate_topk_blocks else None
    ratio = config.compress_ratio

    prompt_lens = [max(1, options.prompt_len - (options.prompt_len // 7) * i) for i in range(options.requests)]
    requests = [_Request(n) for n in prompt_lens]
    max_len = max(prompt_lens) + options.decode_steps * options.next_n + 1
    pages_per_request = -(-(max_len // ratio + 1) // options.block_size)
    cache = IndexerKCache(
        options.requests * pages_per_request, block_size=options.block_size, head_dim=config.head_dim, fmt=fmt, device=device
    )
    page_order = torch.randperm(cache.num_blocks, generator=generator).to(torch.int32)
    block_table = page_order.view(options.requests, pages_per_request).to(device)

    max_tokens = sum(prompt_lens) + options.requests * options.next_n
    buffer = torch.full((max_tokens, config.topk), -1, dtype=torch.int32, device=device)
    workspace_tokens = options.requests * (max_len // ratio + 1)
    timer = StageTimer()
    candidate_buffer = None
    if consumer is not None:
        candidate_buffer = torch.full((max_tokens, config.candidate_topk_blocks), -1, dtype=torch.int32, device=device)
    common = dict(workspace_tokens=workspace_tokens, compress_ratio=ratio, timer=timer, dcp_group=dcp_group)
    layer = SparseAttnIndexer(
        cache, config.topk, buffer, candidate_blocks=candidate_buffer,
        candidate_block_size=config.candidate_block_size, candidate_write=consumer is not None, **common,
    )
    consumer_buffer = torch.full_like(buffer, -1) if consumer is not None else None
    consumer_layer = None
    if consumer is not None:
        consumer_layer = SparseAttnIndexer(
            cache, config.topk, consumer_buffer, candidate_blocks=candidate_buffer,
            candidate_block_size=config.candidate_block_size, skip_k_cache_insert=True, **common,
        )

    prefill_steps = -(-max(prompt_lens) // _prefill_chunk(options))
    total_steps = prefill_steps + options.decode_steps
    short_decode_step = prefill_steps + min(1, options.decode_steps - 1)
    result = DemoResult(options)
    hidden_size, latent_size = config.hidden_size, config.q_lora_rank
    for step in range(total_steps):
        full_plan = _schedule(requests, step, options, short_decode_step)
        # Engines order a batch decodes first; a short last prefill chunk counts as a decode.
        order = sorted(range(len(requests)), key=lambda i: not 0 < full_plan[i] <= options.next_n)
        active = [requests[i] for i in order]
        plan = [full_plan[i] for i in order]
        step_table = block_table[torch.tensor(order, device=device)]
        seq_lens = [r.length + q for r, q in zip(active, plan)]
        num_tokens = sum(plan)
        positions = torch.cat([torch.arange(r.length, r.length + q) for r, q in zip(active, plan)]).to(device)
        hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(device, torch.bfloat16)
        latent = torch.randn(num_tokens, latent_size, generator=generator).to(device, torch.bfloat16)
        k_input = torch.randn(num_tokens, config.k_input_size, generator=generator).to(device, torch.bfloat16)

        metadata = build_metadata(
            seq_lens, plan, step_table, block_size=options.block_size, num_spec_tokens=options.next_n - 1,
            compress_ratio=ratio, workspace_tokens=workspace_tokens, max_logits_bytes=options.max_logits_bytes,
            num_cache_blocks=cache.num_blocks, dcp_rank=dcp_rank, dcp_world_size=world,
        )
        q, k_rotated, w = source.project(hidden, latent, positions, k_input=k_input)
        start = time.perf_counter()
        q_quant, q_scale, k_for_cache, weights = source.quantize(q, k_rotated, w, positions)
        if ratio > 1:
            k_for_cache = _pooled_keys(k_rotated, active, plan, ratio)
        indices = layer(q_quant, q_scale, k_for_cache, weights, metadata)
        consumer_inputs = None
        consumer_indices = None
        if consumer is not None:
            q_c, k_c, w_c = consumer.project(hidden, latent, positions, k_input=k_input)
            consumer_inputs = consumer.quantize(q_c, k_c, w_c, positions)
            consumer_indices = consumer_layer(consumer_inputs[0], consumer_inputs[1], None, consumer_inputs[3], metadata)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.indexer_seconds += time.perf_counter() - start
        result.tokens += num_tokens

        for request, chunk in zip(active, k_rotated.float().split(plan)):
            request.keys_fp32.append(chunk)
        for request, q in zip(active, plan):
            request.length += q
        result.step_indices.append(_in_request_order(indices, order, plan))
        if world == 1:
            record = _check_step(
                step, source, consumer, cache, step_table, active, plan, positions, hidden, latent, k_input,
                (q_quant, q_scale, weights), consumer_inputs, indices, consumer_indices, candidate_buffer, config,
            )
        else:
            record = StepRecord(step, 0, 0, 0, 0, 0, float("nan"), False)
        record.padded = metadata.decode is not None and metadata.decode.requires_padding
        record.decode_tokens, record.prefill_tokens = metadata.num_decode_tokens, metadata.num_prefill_tokens
        result.steps.append(record)
        if progress is not None:
            progress(step + 1, total_steps)
    result.stage_seconds = dict(timer.seconds)
    return result


def _in_request_order(indices: torch.Tensor, order: list[int], plan: list[int]) -> torch.Tensor:
    """The step's index rows regrouped by request id (the batch order changes from step to step)."""
    rows = indices.split(plan)
    by_request = sorted(zip(order, rows), key=lambda pair: pair[0])
    return torch.cat([r for _, r in by_request]).cpu()


def _dcp_worker(rank: int, world: int, options: DemoOptions) -> list[torch.Tensor]:
    import torch.distributed as dist

    if options.device == "cuda":
        torch.cuda.set_device(rank)
    return run_demo(options, dcp_rank=rank, dcp_group=dist.group.WORLD).step_indices


def run_demo_dcp(options: DemoOptions, progress=None) -> DemoResult:
    """The demo on ``options.dcp`` processes (gloo on CPU, NCCL with one GPU each on CUDA), checked
    against the single-process run: every merged index row must equal it bit for bit."""
    from .testing import run_distributed

    single = run_demo(options, progress)
    per_rank = run_distributed(_dcp_worker, options.dcp, options, backend="nccl" if options.device == "cuda" else "gloo")
    equal = rows = 0
    for rank_steps in per_rank:
        for got, want in zip(rank_steps, single.step_indices):
            equal += int((got == want).all(1).sum())
            rows += want.shape[0]
    single.dcp_rows_equal, single.dcp_rows = equal, rows
    return single


def _pooled_keys(rotated: torch.Tensor, requests: list[_Request], plan: list[int], ratio: int) -> torch.Tensor:
    """Keys for the cache when ``compress_ratio > 1``: a token that completes a group carries the mean of
    the group's rotated keys (a stand-in for the model's compressor); other rows are never inserted."""
    pooled = torch.zeros_like(rotated)
    row = 0
    for request, q in zip(requests, plan):
        history = torch.cat(request.keys_fp32 + [rotated[row : row + q].float()])
        for offset in range(q):
            position = request.length + offset
            if (position + 1) % ratio == 0:
                pooled[row + offset] = history[position + 1 - ratio : position + 1].mean(0).to(pooled.dtype)
        row += q
    return pooled


def _request_keys_fp32(request: _Request, ratio: int) -> torch.Tensor:
    keys = torch.cat(request.keys_fp32)
    if ratio == 1:
        return keys
    groups = keys.shape[0] // ratio
    pooled = keys[: groups * ratio].view(groups, ratio, -1).mean(1)
    return pooled.bfloat16().float()


# The oracle scores with the reference; on GPU the Triton kernels sum in another order and Hopper's FP8
# tensor cores accumulate each dot with reduced internal precision (about 1e-4 relative, inside the
# DESIGN §11 tier), so a pick may flip between keys whose logits differ by less than this fraction of
# the row's largest magnitude. On CPU both sides are the reference and agreement is exact.
NEAR_TIE_RELATIVE = 1e-3


def _near_tie_rows(logits: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """bool [R]: rows that differ from the oracle only by swapping keys tied (within kernel rounding)
    with the oracle's k-th pick."""
    result = torch.zeros(got.shape[0], dtype=torch.bool)
    for r in range(got.shape[0]):
        want = set(expected[r][expected[r] >= 0].tolist())
        have = set(got[r][got[r] >= 0].tolist())
        if want == have or len(want) != len(have) or not want:
            continue
        values = logits[r].double()
        kth = min(values[c].item() for c in want)
        scale = values[torch.isfinite(values)].abs().max().item()
        swapped = want ^ have
        result[r] = all(abs(values[c].item() - kth) <= NEAR_TIE_RELATIVE * scale for c in swapped)
    return result


def _check_step(step, source, consumer, cache, block_table, requests, plan, positions, hidden, latent, k_input,
                source_inputs, consumer_inputs, indices, consumer_indices, candidate_buffer, config) -> StepRecord:
    ratio = config.compress_ratio
    rows_checked = rows_equal = rows_near_tie = 0
    hits = total = 0
    row = 0
    q, _, w_fp32 = source.project(hidden, latent, positions, k_input=k_input)
    q_rot = source.apply_rope(q, positions)
    for index, (request, q) in enumerate(zip(requests, plan)):
        if q == 0:
            continue
        rows = slice(row, row + q)
        row += q
        num_keys = request.length // ratio
        visible = ((positions[rows] + 1) // ratio).to(torch.int32)
        starts = torch.zeros_like(visible)
        table = block_table[index : index + 1]
        cu = torch.tensor([0, num_keys], dtype=torch.int32, device=cache.device)
        values, scales = cache.gather(table, cu, backend="reference")
        q_quant, q_scale, weights = source_inputs
        logits = mqa_logits(
            q_quant[rows], None if q_scale is None else q_scale[rows], values, scales, weights[rows], starts, visible,
            backend="reference",
        )
        expected = topk(logits, config.topk, starts=starts, ends=visible, backend="reference")
        got = indices[rows]
        if consumer is not None:
            expected_blocks = select_candidate_blocks(
                logits, starts, visible, config.candidate_topk_blocks, config.candidate_block_size, backend="reference"
            )
            blocks_equal = torch.equal(candidate_buffer[rows], expected_blocks)
            cq, cs, _, cw = consumer_inputs
            consumer_logits = mqa_logits(
                cq[rows], None if cs is None else cs[rows], values, scales, cw[rows], starts, visible, backend="reference"
            )
            apply_candidate_mask(consumer_logits, starts, visible, expected_blocks, config.candidate_block_size,
                                 backend="reference")
            consumer_expected = topk(consumer_logits, config.topk, starts=starts, ends=visible, backend="reference")
            consumer_got = consumer_indices[rows]
            equal_rows = (got == expected).all(1) & (consumer_got == consumer_expected).all(1) & blocks_equal
            near_tie = (
                ((got == expected).all(1).cpu() | _near_tie_rows(logits.cpu(), got.cpu(), expected.cpu()))
                & ((consumer_got == consumer_expected).all(1).cpu()
                   | _near_tie_rows(consumer_logits.cpu(), consumer_got.cpu(), consumer_expected.cpu()))
                & blocks_equal
            ) & ~equal_rows.cpu()
        else:
            equal_rows = (got == expected).all(1)
            near_tie = _near_tie_rows(logits.cpu(), got.cpu(), expected.cpu())
        rows_checked += q
        rows_equal += int(equal_rows.sum())
        rows_near_tie += int(near_tie.sum())

        keys_fp32 = _request_keys_fp32(request, ratio).to(cache.device)
        scores = source.scores_fp32(q_rot[rows].float(), keys_fp32[:num_keys], w_fp32[rows])
        reference_picks = topk(scores, config.topk, starts=starts, ends=visible, backend="reference")
        for picked, truth in zip(got, reference_picks):
            truth_set = set(truth[truth >= 0].tolist())
            hits += len(truth_set & set(picked[picked >= 0].tolist()))
            total += len(truth_set)
    recall = hits / total if total else 1.0
    return StepRecord(step, 0, 0, rows_checked, rows_equal, rows_near_tie, recall, False)
