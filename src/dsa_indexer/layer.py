"""``SparseAttnIndexer``: one indexer forward over a mixed batch, from quantised Q to top-k indices.

The order of work is the production engine's: insert K into the paged cache, clear the caller's index
buffer, then per prefill chunk gather → logits → [candidates] → top-k, then decode logits →
[candidates] → top-k → unpad. Planning (lengths on the host) happened before, in ``metadata.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from ._validation import check_choice, check_positive_int, check_tensor, checked_by_caller, value_checks_enabled
from .cache import IndexerKCache
from .distributed import (
    DcpMergeWorkspace,
    gather_prefill_k,
    merge_scored_topk_global,
    merge_topk_global,
    select_candidate_blocks_dcp,
)
from .formats import FP8_DTYPE
from .metadata import IndexerMetadata
from .ops.candidates import apply_candidate_mask, select_candidate_blocks
from .ops.k_cache import K_DTYPES, insert_k
from .ops.logits import mqa_logits, paged_mqa_logits
from .ops.seq_pack import pack_seq, unpack_seq
from .ops.sparse_logits import columns_to_positions, sparse_mqa_logits, sparse_paged_mqa_logits
from .ops.topk import topk, topk_decode


class StageTimer:
    """Wall time per stage, accumulated over calls (synchronises the device at stage edges)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def stage(self, name: str, device: torch.device):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


# How consumer layers score their candidates (see ``SparseAttnIndexer``).
CONSUMER_LOGITS = ("auto", "sparse", "dense")


class SparseAttnIndexer(nn.Module):
    """The indexer layer: writes each token's top-k key positions into ``topk_indices_buffer``.

    Args:
        cache: the paged K cache of this layer.
        topk_tokens: k (2048 for DeepSeek-V3.2, 512 for V4.1).
        topk_indices_buffer: caller-owned ``int32 [max_tokens, >= topk_tokens]``; rows of this step's
            tokens receive request-local key positions (ascending, ``-1``-padded).
        workspace_tokens: keys one prefill chunk may gather (sizes the gather workspace).
        compress_ratio: tokens per indexer key (must match the metadata's).
        skip_k_cache_insert: K is already in the cache (written by a fused producer).
        skip_topk_buffer_clear: the buffer's rows were already filled with ``-1``.
        candidate_blocks: V4.1 two-level selection buffer ``int32 [max_tokens, num_blocks_k]``;
            with ``candidate_write`` this layer selects blocks into it, otherwise it masks its logits with it.
        candidate_block_size: positions per candidate block (8 for V4.1).
        consumer_logits: how a consumer layer (``candidate_blocks`` given, ``candidate_write`` False) scores:
            ``"sparse"`` computes the logits of the candidate blocks only (``ops.sparse_logits``) and
            selects among them; ``"dense"`` computes every visible key's logit, masks it with
            ``apply_candidate_mask`` and selects; ``"auto"`` (default) is sparse wherever the candidate
            columns (``num_blocks_k * candidate_block_size``) are fewer than the dense logits width of the
            call (a prefill chunk's gathered keys, the decode logits width; global positions under DCP), a
            choice from host integers. Both give the same indices wherever their logits agree. The sparse path
            needs candidate rows ascending then ``-1``-padded (what a source layer writes); forced, it may
            allocate ``rows x num_blocks_k * candidate_block_size`` fp32 logits beyond ``max_logits_bytes``.
        dense_prefill_bypass: leave the buffer untouched when the metadata marks the step dense.
        decode_logits_width: a fixed width for the decode logits (e.g. the model's longest compressed
            context). With it, the decode path's shapes do not depend on the step's lengths, so a CUDA
            graph captured once replays for any lengths up to it. None: the step's longest row.
        dcp_group: decode-context-parallel process group: this rank's cache holds its shard of every
            request (interleave ``dcp_interleave``); indices are merged to global positions. Metadata
            must be planned with the same rank, world size and interleave.
        pcp_group: prefill-context-parallel process group: the prefill keys of every rank are gathered
            before the insert, so each rank's (replicated) cache receives the whole prompt.
        timer: a ``StageTimer`` to record per-stage time (None: no timing, no cost).
        logits_dtype: ``torch.float32`` or ``torch.bfloat16``: the dtype of the logits the top-k reads
            (bf16 halves those bytes; the picks are the exact top-k of the bf16-rounded logits). bf16 is not
            combined with candidate blocks or decode context parallelism (their ops take fp32 logits).
        backend: ``"auto" | "reference" | "triton"`` for every op.
    """

    def __init__(
        self,
        cache: IndexerKCache,
        topk_tokens: int,
        topk_indices_buffer: torch.Tensor,
        *,
        workspace_tokens: int,
        compress_ratio: int = 1,
        skip_k_cache_insert: bool = False,
        skip_topk_buffer_clear: bool = False,
        candidate_blocks: torch.Tensor | None = None,
        candidate_block_size: int = 0,
        candidate_write: bool = False,
        consumer_logits: str = "auto",
        dense_prefill_bypass: bool = False,
        decode_logits_width: int | None = None,
        dcp_group=None,
        dcp_interleave: int = 1,
        pcp_group=None,
        timer: StageTimer | None = None,
        logits_dtype: torch.dtype = torch.float32,
        backend: str = "auto",
    ):
        super().__init__()
        if not isinstance(cache, IndexerKCache):
            raise TypeError(f"cache must be an IndexerKCache, got {type(cache).__name__}")
        check_positive_int("topk_tokens", topk_tokens)
        check_tensor("topk_indices_buffer", topk_indices_buffer, dtype=torch.int32, ndim=2, device=cache.device)
        if topk_indices_buffer.shape[1] < topk_tokens:
            raise ValueError(
                f"topk_indices_buffer must have >= topk_tokens ({topk_tokens}) columns, got {topk_indices_buffer.shape[1]}"
            )
        check_positive_int("workspace_tokens", workspace_tokens)
        check_positive_int("compress_ratio", compress_ratio)
        check_choice("backend", backend, ("auto", "reference", "triton"))
        check_choice("logits_dtype", logits_dtype, (torch.float32, torch.bfloat16))
        if logits_dtype != torch.float32 and (candidate_blocks is not None or dcp_group is not None):
            raise ValueError("logits_dtype must be torch.float32 with candidate_blocks or dcp_group (their ops take "
                             f"fp32 logits), got {logits_dtype}")
        check_choice("consumer_logits", consumer_logits, CONSUMER_LOGITS)
        if candidate_blocks is not None:
            check_tensor("candidate_blocks", candidate_blocks, dtype=torch.int32, ndim=2, device=cache.device)
            check_positive_int("candidate_block_size", candidate_block_size)
            if candidate_blocks.shape[0] < topk_indices_buffer.shape[0]:
                raise ValueError(
                    f"candidate_blocks must have >= {topk_indices_buffer.shape[0]} rows (one per token), "
                    f"got {candidate_blocks.shape[0]}"
                )
        self.cache = cache
        self.logits_dtype = logits_dtype
        self.topk_tokens = topk_tokens
        self.topk_indices_buffer = topk_indices_buffer
        self.workspace_tokens = workspace_tokens
        self.compress_ratio = compress_ratio
        self.skip_k_cache_insert = skip_k_cache_insert
        self.skip_topk_buffer_clear = skip_topk_buffer_clear
        self.candidate_blocks = candidate_blocks
        self.candidate_block_size = candidate_block_size
        self.candidate_write = candidate_write
        self.consumer_logits = consumer_logits
        self.dense_prefill_bypass = dense_prefill_bypass
        if decode_logits_width is not None:
            check_positive_int("decode_logits_width", decode_logits_width)
        self.decode_logits_width = decode_logits_width
        check_positive_int("dcp_interleave", dcp_interleave)
        self.dcp_group = dcp_group
        self.dcp_interleave = dcp_interleave
        self.pcp_group = pcp_group
        self.timer = timer
        self.backend = backend
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dcp_merge_workspace: DcpMergeWorkspace | None = None

    def gather_workspace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(values, scales)`` buffers prefill chunks gather keys into (allocated once)."""
        if self._workspace is None:
            n, d, device = self.workspace_tokens, self.cache.head_dim, self.cache.device
            if self.cache.fmt == "fp8":
                values = torch.empty(n, d, dtype=torch.float8_e4m3fn, device=device)
                if self.cache.scale_fmt == "mxfp8":  # gather copies the raw scale words
                    scales = torch.empty(n, 4, dtype=torch.uint8, device=device)
                else:
                    scales = torch.empty(n, dtype=torch.float32, device=device)
            else:
                values = torch.empty(n, d // 2, dtype=torch.uint8, device=device)
                scales = torch.empty(n, self.cache.scale_bytes, dtype=torch.uint8, device=device)
            self._workspace = (values, scales)
        return self._workspace

    def reserve_workspace(self, *, max_decode_rows: int, max_context_len: int, max_logits_bytes: int) -> int:
        """Allocate the gather workspace and return the peak bytes one forward needs beyond its inputs.

        Peak = gather workspace + the larger of one prefill chunk's logits (``max_logits_bytes``) and the
        decode logits ``[max_decode_rows, max_context_len]`` (``logits_dtype``), + candidate scratch when padding.
        """
        values, scales = self.gather_workspace()
        workspace = values.numel() * values.element_size() + scales.numel() * scales.element_size()
        decode_width = max_context_len
        if self.candidate_blocks is not None and not self.candidate_write and self.consumer_logits != "dense":
            decode_width = max(decode_width, self.candidate_blocks.shape[1] * self.candidate_block_size)
        decode_logits = max_decode_rows * decode_width * self.logits_dtype.itemsize
        candidate_scratch = 0
        if self.candidate_blocks is not None:
            candidate_scratch = max_decode_rows * self.candidate_blocks.shape[1] * 4
        return workspace + max(max_logits_bytes, decode_logits) + candidate_scratch + max_decode_rows * self.topk_tokens * 4

    def warmup(
        self,
        q_quant: torch.Tensor,
        q_scale: torch.Tensor | None,
        k: torch.Tensor | None,
        weights: torch.Tensor,
        metadata: IndexerMetadata,
    ) -> None:
        """Compile every kernel variant a step of this shape uses, without touching the cache.

        Run it before capturing a CUDA graph of ``forward`` (Triton compiles on first use, which a
        capture cannot contain): one forward with the same shapes whose insert writes nothing (every
        slot ``-1``). The index buffer rows of the step are overwritten.
        """
        idle = dataclasses.replace(metadata, slot_mapping=torch.full_like(metadata.slot_mapping, -1))
        self.forward(q_quant, q_scale, k, weights, idle)

    def _stage(self, name: str):
        if self.timer is None:
            return nullcontext()
        return self.timer.stage(name, self.cache.device)

    def forward(
        self,
        q_quant: torch.Tensor,
        q_scale: torch.Tensor | None,
        k: torch.Tensor | None,
        weights: torch.Tensor,
        metadata: IndexerMetadata,
    ) -> torch.Tensor:
        """Index one step.

        Args:
            q_quant: ``[T, H, D]`` e4m3 (FP8) or ``[T, H, D/2]`` uint8 (MXFP4), rows in batch order.
            q_scale: None (FP8: folded into ``weights``) or ``uint8 [T, H, S]`` (MXFP4, ``S = cache.scale_bytes``).
            k: ``[T, D]`` keys of this step's tokens (ignored with ``skip_k_cache_insert``).
            weights: ``float32 [T, H]`` head weights (``weights_out`` of ``rope_quant_q``).
            metadata: the step's plan from ``build_metadata``/``MetadataBuilder``.

        Returns:
            ``topk_indices_buffer[:T, :topk_tokens]``.
        """
        self._validate(q_quant, q_scale, k, weights, metadata)
        # The step is checked once here; its ops skip their own value checks (each a host synchronisation).
        with checked_by_caller():
            return self._run(q_quant, q_scale, k, weights, metadata)

    def _run(self, q_quant, q_scale, k, weights, metadata) -> torch.Tensor:
        num_tokens = metadata.num_tokens
        buffer = self.topk_indices_buffer
        if not self.skip_k_cache_insert:
            with self._stage("insert"):
                keys, slots = k[: metadata.slot_mapping.shape[0]], metadata.slot_mapping
                if self.pcp_group is not None:
                    keys, slots = gather_prefill_k(keys, slots, metadata.num_decode_tokens, group=self.pcp_group)
                insert_k(keys, self.cache, slots, backend=self.backend)
        if self.dense_prefill_bypass and metadata.use_dense_prefill:
            return buffer[:num_tokens, : self.topk_tokens]
        if not self.skip_topk_buffer_clear:
            buffer[:num_tokens].fill_(-1)
        for chunk in metadata.prefill_chunks:
            self._prefill_chunk(q_quant, q_scale, weights, chunk)
        if metadata.decode is not None:
            self._decode(q_quant, q_scale, weights, metadata)
        return buffer[:num_tokens, : self.topk_tokens]

    def _validate(self, q_quant, q_scale, k, weights, metadata) -> None:
        if not isinstance(metadata, IndexerMetadata):
            raise TypeError(f"metadata must be an IndexerMetadata, got {type(metadata).__name__}")
        if metadata.compress_ratio != self.compress_ratio:
            raise ValueError(
                f"metadata was planned with compress_ratio {metadata.compress_ratio}, the layer uses {self.compress_ratio}"
            )
        world, rank = 1, 0
        if self.dcp_group is not None:
            import torch.distributed as dist

            world, rank = dist.get_world_size(self.dcp_group), dist.get_rank(self.dcp_group)
        if (metadata.dcp_world_size, metadata.dcp_rank, metadata.dcp_interleave) != (world, rank, self.dcp_interleave):
            raise ValueError(
                f"metadata was planned for DCP rank {metadata.dcp_rank} of {metadata.dcp_world_size} with interleave "
                f"{metadata.dcp_interleave}; the layer is rank {rank} of {world} with interleave {self.dcp_interleave}"
            )
        if self.candidate_blocks is not None and world > 1:
            if self.dcp_interleave != 1 or self.candidate_block_size % world:
                raise ValueError(
                    "candidate blocks under DCP need dcp_interleave 1 and candidate_block_size divisible by the "
                    f"world size; got interleave {self.dcp_interleave}, block {self.candidate_block_size}, world {world}"
                )
        num_tokens = metadata.num_tokens
        if num_tokens > self.topk_indices_buffer.shape[0]:
            raise ValueError(
                f"the step has {num_tokens} tokens but topk_indices_buffer holds {self.topk_indices_buffer.shape[0]} rows"
            )
        self._validate_inputs(q_quant, q_scale, k, weights, metadata)
        decode = metadata.decode
        if decode is not None and self.decode_logits_width is not None and decode.max_context_len > self.decode_logits_width:
            raise ValueError(
                f"a decode row sees {decode.max_context_len} keys, more than decode_logits_width ({self.decode_logits_width})"
            )
        largest_chunk = max((c.num_keys for c in metadata.prefill_chunks), default=0)
        if largest_chunk > self.workspace_tokens:
            raise ValueError(
                f"a prefill chunk gathers {largest_chunk} keys, more than workspace_tokens ({self.workspace_tokens}); "
                "plan the metadata with the same workspace_tokens"
            )
        self._validate_pages(metadata)

    def _validate_inputs(self, q_quant, q_scale, k, weights, metadata) -> None:
        """The step's tensors against the cache and each other: formats, dtypes, head counts, head dims,
        rows and devices (what the ops would reject later, after the insert and the buffer clear)."""
        cache, num_tokens = self.cache, metadata.num_tokens
        fp8 = cache.fmt == "fp8"
        check_tensor("q_quant", q_quant, dtype=FP8_DTYPE if fp8 else torch.uint8, ndim=3, device=cache.device)
        heads = q_quant.shape[1]
        if q_quant.shape[2] != cache.value_bytes:
            width = "D" if fp8 else "D/2"
            raise ValueError(
                f"q_quant must have shape [T, H, {width}] = [*, *, {cache.value_bytes}] for a {cache.fmt} cache with "
                f"head_dim {cache.head_dim}, got {list(q_quant.shape)}"
            )
        check_tensor("weights", weights, dtype=torch.float32, ndim=2, device=cache.device)
        if weights.shape[1] != heads:
            raise ValueError(f"weights must have {heads} columns (q_quant's heads), got shape {list(weights.shape)}")
        if q_quant.shape[0] < num_tokens or weights.shape[0] < num_tokens:
            raise ValueError(
                f"q_quant and weights need >= {num_tokens} rows, got {q_quant.shape[0]} and {weights.shape[0]}"
            )
        if fp8:
            if q_scale is not None:
                raise ValueError("q_scale must be None for an fp8 cache (the Q scale is folded into weights)")
        else:
            if q_scale is None:
                raise ValueError("q_scale must be given for an mxfp4 cache")
            check_tensor("q_scale", q_scale, dtype=torch.uint8, shape=(None, heads, cache.scale_bytes), device=cache.device)
            if q_scale.shape[0] < num_tokens:
                raise ValueError(f"q_scale needs >= {num_tokens} rows, got {q_scale.shape[0]}")
        if not self.skip_k_cache_insert:
            check_tensor("k", k, dtype=K_DTYPES, ndim=2, device=cache.device)
            if k.shape[1] != cache.head_dim:
                raise ValueError(f"k must have shape [T, {cache.head_dim}] (the cache's head_dim), got {list(k.shape)}")
            if k.shape[0] < metadata.slot_mapping.shape[0]:
                raise ValueError(f"k needs >= {metadata.slot_mapping.shape[0]} rows, got {k.shape[0]}")

    def _validate_pages(self, metadata) -> None:
        """The block-table entries the step reads lie in the cache: one host synchronisation, skipped with value
        checks off. Metadata planned without ``num_cache_blocks`` (or for another cache) is refused here, not by
        an op after the insert and the buffer clear."""
        if not value_checks_enabled():
            return
        tables = []  # (name, block table [n, max_blocks], positions read per row [n])
        if metadata.decode is not None:
            tables.append(("metadata.decode.block_table", metadata.decode.block_table,
                           metadata.decode.context_lens.amax(dim=1)))
        tables += [(f"metadata.prefill_chunks[{i}].block_table", chunk.block_table, chunk.cu_seq_lens.diff())
                   for i, chunk in enumerate(metadata.prefill_chunks) if chunk.num_keys and not chunk.skip_gather]
        if not tables:
            return
        block_size, num_blocks = self.cache.block_size, self.cache.num_blocks
        outside = []
        for _, table, positions in tables:
            read = torch.arange(table.shape[1], device=table.device) < -(-positions.long() // block_size)[:, None]
            outside.append(read & ((table < 0) | (table >= num_blocks)))  # [n, max_blocks]
        for (name, table, _), bad, found in zip(tables, outside, torch.stack([o.any() for o in outside]).tolist()):
            if found:
                row, column = (int(i) for i in torch.nonzero(bad)[0])
                raise ValueError(
                    f"{name} entries read must be in [0, {num_blocks}) (the cache's pages), "
                    f"got {name}[{row}, {column}] = {int(table[row, column])}"
                )

    def _prefill_chunk(self, q_quant, q_scale, weights, chunk) -> None:
        rows = slice(chunk.token_start, chunk.token_end)
        out = self.topk_indices_buffer[rows, : self.topk_tokens]
        sharded = self.dcp_group is not None
        if chunk.num_keys == 0 and not sharded:
            return
        values, scales = self.gather_workspace()
        if not chunk.skip_gather and chunk.num_keys:
            with self._stage("gather"):
                self.cache.gather(chunk.block_table, chunk.cu_seq_lens, out=(values, scales), backend=self.backend)
        if self._sparse_consumer(chunk.max_global_visible if sharded else chunk.num_keys):
            with self._stage("prefill_logits"):
                candidates = self.candidate_blocks[rows]
                logits = sparse_mqa_logits(
                    q_quant[rows], None if q_scale is None else q_scale[rows], values[: chunk.num_keys],
                    scales[: chunk.num_keys], weights[rows], chunk.ks, chunk.ke, candidates,
                    self._local_candidate_block_size(), backend=self.backend,
                )
            with self._stage("prefill_topk"):
                self._sparse_topk(logits, candidates, out)
            return
        with self._stage("prefill_logits"):
            logits = mqa_logits(
                q_quant[rows],
                None if q_scale is None else q_scale[rows],
                values[: chunk.num_keys],
                scales[: chunk.num_keys],
                weights[rows],
                chunk.ks,
                chunk.ke,
                clean=False,
                logits_dtype=self.logits_dtype,
                backend=self.backend,
            )
        if self.candidate_blocks is not None:
            with self._stage("candidates"):
                candidates = self.candidate_blocks[rows]
                if self.candidate_write and sharded:
                    select_candidate_blocks_dcp(
                        logits, chunk.ks, chunk.ke, candidates.shape[1], self.candidate_block_size,
                        global_ends=chunk.global_visible,
                        max_global_blocks=-(-chunk.max_global_visible // self.candidate_block_size),
                        group=self.dcp_group, out=candidates, backend=self.backend,
                    )
                elif self.candidate_write:
                    select_candidate_blocks(
                        logits, chunk.ks, chunk.ke, candidates.shape[1], self.candidate_block_size,
                        out=candidates, backend=self.backend,
                    )
                else:
                    apply_candidate_mask(
                        logits, chunk.ks, chunk.ke, candidates, self._local_candidate_block_size(), backend=self.backend
                    )
        with self._stage("prefill_topk"):
            topk(logits, self.topk_tokens, starts=chunk.ks, ends=chunk.ke, out=out, backend=self.backend)
        if sharded:
            with self._stage("dcp_merge"):
                self._dcp_merge(logits, out, chunk.ks)

    def _dcp_merge(self, logits, indices, starts) -> None:
        """The exact DCP merge of ``indices`` in place, through a workspace made at the first merge (a collective,
        so in warmup, before any capture) with room for the topk buffer's rows, grown if a merge has more."""
        rows = indices.shape[0]
        workspace = self._dcp_merge_workspace
        if workspace is None or workspace.max_rows < rows or workspace.send.device != logits.device:
            workspace = DcpMergeWorkspace(
                max(rows, self.topk_indices_buffer.shape[0]), self.topk_tokens, group=self.dcp_group,
                interleave=self.dcp_interleave, device=logits.device,
            )
            self._dcp_merge_workspace = workspace
        merge_topk_global(
            logits, indices, self.topk_tokens, group=self.dcp_group, interleave=self.dcp_interleave, starts=starts,
            workspace=workspace, backend=self.backend,
        )

    def _sparse_consumer(self, dense_width: int) -> bool:
        """Whether this consumer call scores the candidate blocks only (``consumer_logits``; host integers).

        ``dense_width``: the dense logits width of the call, in global positions under DCP so that every rank
        makes the same choice (their merges are collectives)."""
        if self.candidate_blocks is None or self.candidate_write or self.consumer_logits == "dense":
            return False
        if self.consumer_logits == "sparse":
            return True
        return self.candidate_blocks.shape[1] * self.candidate_block_size < dense_width

    def _sparse_topk(self, logits, candidates, out) -> None:
        """§5 top-k over sparse logits into ``out`` as row-relative positions (global under DCP)."""
        local_block = self._local_candidate_block_size()
        columns = topk(logits, self.topk_tokens, backend=self.backend)
        if self.dcp_group is None:
            columns_to_positions(columns, candidates, local_block, out=out, backend=self.backend)
            return
        positions = columns_to_positions(columns, candidates, local_block, backend=self.backend)
        with self._stage("dcp_merge"):
            if logits.shape[1]:
                scores = torch.where(columns >= 0, logits.gather(1, columns.clamp_min(0).long()), float("-inf"))
            else:
                scores = torch.full(columns.shape, float("-inf"), device=logits.device)
            merge_scored_topk_global(
                scores, positions, self.topk_tokens, group=self.dcp_group, interleave=self.dcp_interleave, out=out,
                backend=self.backend,
            )

    def _local_candidate_block_size(self) -> int:
        """Positions of a candidate block held by this rank (the whole block without DCP)."""
        if self.dcp_group is None:
            return self.candidate_block_size
        import torch.distributed as dist

        return self.candidate_block_size // dist.get_world_size(self.dcp_group)

    def _decode(self, q_quant, q_scale, weights, metadata) -> None:
        decode = metadata.decode
        num_decode_tokens = metadata.num_decode_tokens
        batch, next_n = decode.batch_size, decode.next_n
        rows = batch * next_n
        q = q_quant[:num_decode_tokens]
        scale = None if q_scale is None else q_scale[:num_decode_tokens]
        w = weights[:num_decode_tokens]
        if decode.requires_padding:
            pad = dict(max_len=next_n, backend=self.backend)
            q = pack_seq(q, decode.decode_lens, pad_value=0, **pad)
            scale = None if scale is None else pack_seq(scale, decode.decode_lens, pad_value=0, **pad)
            w = pack_seq(w, decode.decode_lens, pad_value=0.0, **pad).reshape(rows, -1)
        else:
            q = q.reshape(batch, next_n, *q.shape[1:])
            scale = None if scale is None else scale.reshape(batch, next_n, *scale.shape[1:])
        if self._sparse_consumer(self._global_decode_width(decode)):
            self._decode_sparse(q, scale, w, metadata)
            return
        with self._stage("decode_logits"):
            logits = paged_mqa_logits(
                q, scale, self.cache, w, decode.context_lens, decode.block_table, self._decode_width(decode),
                clean=False, logits_dtype=self.logits_dtype, backend=self.backend,
            )
        if self.candidate_blocks is not None:
            with self._stage("candidates"):
                self._decode_candidates(logits, decode, num_decode_tokens)
        with self._stage("decode_topk"):
            indices = topk_decode(logits, decode.context_lens, next_n, self.topk_tokens, backend=self.backend)
        if self.dcp_group is not None:
            with self._stage("dcp_merge"):
                self._dcp_merge(logits, indices, None)
        with self._stage("decode_unpad"):
            if decode.requires_padding:
                indices = unpack_seq(
                    indices.view(batch, next_n, -1), decode.decode_lens, total=num_decode_tokens, backend=self.backend
                )
            self.topk_indices_buffer[:num_decode_tokens, : self.topk_tokens].copy_(indices)

    def _decode_sparse(self, q, scale, w, metadata) -> None:
        """Consumer decode over the candidate blocks only: sparse logits, top-k as positions, unpad."""
        decode = metadata.decode
        num_decode_tokens = metadata.num_decode_tokens
        batch, next_n = decode.batch_size, decode.next_n
        candidates = self.candidate_blocks[:num_decode_tokens]
        if decode.requires_padding:
            candidates = pack_seq(candidates, decode.decode_lens, pad_value=-1, max_len=next_n, backend=self.backend)
            candidates = candidates.reshape(batch * next_n, -1)
        with self._stage("decode_logits"):
            logits = sparse_paged_mqa_logits(
                q, scale, self.cache, w, decode.context_lens, decode.block_table, candidates,
                self._local_candidate_block_size(), backend=self.backend,
            )
        indices = torch.empty((batch * next_n, self.topk_tokens), dtype=torch.int32, device=logits.device)
        with self._stage("decode_topk"):
            self._sparse_topk(logits, candidates, indices)
        with self._stage("decode_unpad"):
            if decode.requires_padding:
                indices = unpack_seq(
                    indices.view(batch, next_n, -1), decode.decode_lens, total=num_decode_tokens, backend=self.backend
                )
            self.topk_indices_buffer[:num_decode_tokens, : self.topk_tokens].copy_(indices)

    def _global_decode_width(self, decode) -> int:
        """The decode logits width in global positions (the same on every DCP rank)."""
        if self.dcp_group is None:
            return self._decode_width(decode)
        if self.decode_logits_width is None:
            return max(decode.max_global_context_len, 1)
        import torch.distributed as dist

        return self.decode_logits_width * dist.get_world_size(self.dcp_group)

    def _decode_width(self, decode) -> int:
        return max(decode.max_context_len, 1) if self.decode_logits_width is None else self.decode_logits_width

    def _select_decode_blocks(self, logits, decode, ends, num_blocks_k, out=None) -> torch.Tensor:
        if self.dcp_group is None:
            return select_candidate_blocks(
                logits, None, ends, num_blocks_k, self.candidate_block_size, out=out, backend=self.backend
            )
        return select_candidate_blocks_dcp(
            logits, None, ends, num_blocks_k, self.candidate_block_size,
            global_ends=decode.global_context_lens.reshape(-1),
            max_global_blocks=-(-decode.max_global_context_len // self.candidate_block_size),
            group=self.dcp_group, out=out, backend=self.backend,
        )

    def _decode_candidates(self, logits, decode, num_decode_tokens) -> None:
        ends = decode.context_lens.reshape(-1)
        token_candidates = self.candidate_blocks[:num_decode_tokens]
        local_block = self._local_candidate_block_size()
        if not decode.requires_padding:
            if self.candidate_write:
                self._select_decode_blocks(logits, decode, ends, token_candidates.shape[1], out=token_candidates)
            else:
                apply_candidate_mask(logits, None, ends, token_candidates, local_block, backend=self.backend)
            return
        batch, next_n = decode.batch_size, decode.next_n
        if self.candidate_write:
            grid = self._select_decode_blocks(logits, decode, ends, token_candidates.shape[1])
            token_candidates.copy_(
                unpack_seq(grid.view(batch, next_n, -1), decode.decode_lens, total=num_decode_tokens, backend=self.backend)
            )
        else:
            grid = pack_seq(token_candidates, decode.decode_lens, pad_value=-1, max_len=next_n, backend=self.backend)
            apply_candidate_mask(logits, None, ends, grid.reshape(batch * next_n, -1), local_block, backend=self.backend)
