"""Host-side planning of one indexer step: decode/prefill split, prefill chunks, decode rows.

Everything that reads lengths on the host (``.tolist()``, Python loops over requests) lives here, so
that the ops stay capturable in CUDA graphs. A step's batch is described per request, in batch order:

- ``seq_lens[r]``: the request's context length in tokens *after* this step (cached + new tokens);
- ``query_lens[r]``: the tokens it brings this step (its rows in the batch, consecutive);
- ``block_table[r]``: the pages of its (compressed, and under DCP rank-local) key positions.

Requests with ``query_len <= 1 + num_spec_tokens`` are decodes and must come first, as engines order
them. Key positions are compressed: with ``compress_ratio = c`` token position ``p`` completes key
``(p + 1) // c - 1`` when ``(p + 1) % c == 0``, and a query at position ``p`` sees ``(p + 1) // c`` keys.
Under decode context parallelism (``dcp_world_size = W``, interleave ``I``) global key ``g`` lives on
rank ``(g // I) % W`` at local index ``(g // (I * W)) * I + g % I``; lengths are localised per row,
after the expansion to rows.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ._validation import check_choice, check_index_tensor, check_positive_int, index_as_int32
from .distributed import global_to_local, local_lengths

DEFAULT_MAX_LOGITS_BYTES = 512 * 1024 * 1024
LOGIT_BYTES = 4


@dataclass
class PrefillChunk:
    """One prefill chunk: a run of query rows whose keys are gathered into one ragged buffer.

    Rows ``[token_start, token_end)`` of the batch; ``ks/ke [rows] int32`` index the gathered keys of
    the chunk's requests (request ``j`` fills ``[cu_seq_lens[j], cu_seq_lens[j+1])``), so
    ``column - ks`` is the request-local key position. ``skip_gather`` reuses the previous chunk's
    gathered keys (a request split along its query rows).
    """

    token_start: int
    token_end: int
    block_table: torch.Tensor
    cu_seq_lens: torch.Tensor
    num_keys: int
    ks: torch.Tensor
    ke: torch.Tensor
    skip_gather: bool
    global_visible: torch.Tensor
    max_global_visible: int

    @property
    def num_rows(self) -> int:
        return self.token_end - self.token_start


@dataclass
class DecodeRows:
    """The decode part of a step as ``[B, next_n]`` rows.

    ``context_lens [B, next_n] int32`` gives each row the number of (local, compressed) keys it sees;
    ``global_context_lens`` the same before DCP localisation. With ``requires_padding`` the decode
    tokens are not ``B * next_n`` consecutive rows: ``decode_lens [B]`` tokens of each request are
    packed into the grid with ``pack_seq`` and the indices unpacked with ``unpack_seq``.
    """

    block_table: torch.Tensor
    context_lens: torch.Tensor
    global_context_lens: torch.Tensor
    decode_lens: torch.Tensor
    next_n: int
    requires_padding: bool
    max_context_len: int
    max_global_context_len: int
    row_to_request: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class IndexerMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor
    decode: DecodeRows | None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    use_dense_prefill: bool = False
    compress_ratio: int = 1
    dcp_rank: int = 0
    dcp_world_size: int = 1
    dcp_interleave: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


class MetadataBuilder:
    """Plans steps into fixed-shape, reused device buffers (what a CUDA graph replays).

    The decode tensors of every step are views of buffers allocated once here, at
    ``[max_decode_requests, max_next_n]`` and ``[max_decode_requests, max_blocks_per_request]``: a
    graph captured for a batch size keeps reading the same addresses while lengths change.
    """

    def __init__(
        self,
        *,
        max_decode_requests: int,
        max_next_n: int,
        max_blocks_per_request: int,
        block_size: int,
        device: torch.device | str | None = None,
        num_spec_tokens: int = 0,
        compress_ratio: int = 1,
        workspace_tokens: int | None = None,
        max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
        decode_layout: str = "native",
        dcp_rank: int = 0,
        dcp_world_size: int = 1,
        dcp_interleave: int = 1,
        dense_prefill_max_len: int = 0,
        num_cache_blocks: int | None = None,
    ):
        check_positive_int("max_decode_requests", max_decode_requests, minimum=0)
        check_positive_int("max_next_n", max_next_n)
        check_positive_int("max_blocks_per_request", max_blocks_per_request)
        check_positive_int("block_size", block_size)
        check_positive_int("num_spec_tokens", num_spec_tokens, minimum=0)
        check_positive_int("compress_ratio", compress_ratio)
        check_positive_int("max_logits_bytes", max_logits_bytes)
        check_choice("decode_layout", decode_layout, ("native", "flattened"))
        check_positive_int("dcp_world_size", dcp_world_size)
        check_positive_int("dcp_interleave", dcp_interleave)
        check_positive_int("dcp_rank", dcp_rank, minimum=0)
        if dcp_rank >= dcp_world_size:
            raise ValueError(f"dcp_rank must be < dcp_world_size ({dcp_world_size}), got {dcp_rank}")
        if workspace_tokens is not None:
            check_positive_int("workspace_tokens", workspace_tokens)
        check_positive_int("dense_prefill_max_len", dense_prefill_max_len, minimum=0)
        if num_cache_blocks is not None:
            check_positive_int("num_cache_blocks", num_cache_blocks, minimum=0)
        if max_next_n < 1 + num_spec_tokens and decode_layout == "native":
            raise ValueError(f"max_next_n must be >= 1 + num_spec_tokens ({1 + num_spec_tokens}), got {max_next_n}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        self.compress_ratio = compress_ratio
        self.workspace_tokens = workspace_tokens
        self.max_logits_bytes = max_logits_bytes
        self.decode_layout = decode_layout
        self.dcp_rank = dcp_rank
        self.dcp_world_size = dcp_world_size
        self.dcp_interleave = dcp_interleave
        self.dense_prefill_max_len = dense_prefill_max_len
        self.num_cache_blocks = num_cache_blocks
        self.max_blocks_per_request = max_blocks_per_request
        rows = max_decode_requests * (max_next_n if decode_layout == "flattened" else 1)
        cols = 1 if decode_layout == "flattened" else max_next_n
        self._decode_rows_capacity = rows
        self._context_lens = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self._global_context_lens = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self._decode_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self._row_to_request = torch.zeros(rows * cols, dtype=torch.int32, device=self.device)
        self._block_table = torch.zeros(rows, max_blocks_per_request, dtype=torch.int32, device=self.device)
        self._slots = torch.full((max_decode_requests * max_next_n,), -1, dtype=torch.int64, device=self.device)

    def build(self, seq_lens: Sequence[int], query_lens: Sequence[int], block_table: torch.Tensor) -> IndexerMetadata:
        """Plan one step. ``seq_lens``, ``query_lens``: per request, integers (Python or numpy ints, or
        a 1-D integer tensor). ``block_table [num_requests, >= blocks needed]`` int32 or int64 (any
        device; entries within the int32 range), copied as int32 into the plan."""
        seq_lens = _as_int_list("seq_lens", seq_lens)
        query_lens = _as_int_list("query_lens", query_lens)
        num_requests = len(seq_lens)
        if len(query_lens) != num_requests:
            raise ValueError(f"query_lens must have {num_requests} entries like seq_lens, got {len(query_lens)}")
        check_index_tensor("block_table", block_table, ndim=2)
        if block_table.shape[0] != num_requests:
            raise ValueError(f"block_table must have {num_requests} rows (one per request), got {block_table.shape[0]}")
        block_table = index_as_int32("block_table", block_table)
        for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
            if seq_len < 0 or query_len < 0:
                raise ValueError(f"seq_lens and query_lens must be >= 0, got {seq_len} and {query_len} for request {r}")
            if query_len > seq_len:
                raise ValueError(f"query_lens[{r}] = {query_len} exceeds seq_lens[{r}] = {seq_len}")
        decode_threshold = 1 + self.num_spec_tokens
        decodes = [r for r, q in enumerate(query_lens) if 0 < q <= decode_threshold]
        prefills = [r for r, q in enumerate(query_lens) if q > decode_threshold]
        if decodes and prefills and max(decodes) > min(prefills):
            raise ValueError(
                f"query_lens must list the decode requests (query_len <= {decode_threshold}) before the prefills; "
                f"request {max(decodes)} follows prefill request {min(prefills)}"
            )
        host_table = block_table.cpu()
        local_keys = self._local([s // self.compress_ratio for s in seq_lens])
        self._check_block_table(host_table, local_keys)
        self._check_decode_capacity(decodes, query_lens, local_keys)
        slot_mapping = self._persistent_slots(self._slot_mapping(seq_lens, query_lens, host_table))
        num_decode_tokens = sum(query_lens[r] for r in decodes)
        decode_index = torch.tensor(decodes, dtype=torch.int64, device=block_table.device)
        decode = self._decode_rows(
            [seq_lens[r] for r in decodes], [query_lens[r] for r in decodes], block_table.index_select(0, decode_index)
        )
        chunks = self._prefill_chunks(seq_lens, query_lens, block_table, prefills, num_decode_tokens, local_keys)
        use_dense = (
            not decodes
            and bool(prefills)
            and self.dense_prefill_max_len > 0
            and max(seq_lens[r] for r in prefills) <= self.dense_prefill_max_len
        )
        return IndexerMetadata(
            num_decodes=len(decodes),
            num_decode_tokens=num_decode_tokens,
            num_prefills=len(prefills),
            num_prefill_tokens=sum(query_lens[r] for r in prefills),
            slot_mapping=slot_mapping,
            decode=decode,
            prefill_chunks=chunks,
            use_dense_prefill=use_dense,
            compress_ratio=self.compress_ratio,
            dcp_rank=self.dcp_rank,
            dcp_world_size=self.dcp_world_size,
            dcp_interleave=self.dcp_interleave,
        )

    def _local(self, global_counts: list[int]) -> list[int]:
        """This rank's share of each global key count (all of it without DCP)."""
        counts = torch.tensor(global_counts, dtype=torch.int64)
        return local_lengths(counts, self.dcp_rank, self.dcp_world_size, self.dcp_interleave).tolist()

    def _check_block_table(self, host_table: torch.Tensor, local_keys: list[int]) -> None:
        for r, keys in enumerate(local_keys):
            pages = -(-keys // self.block_size)
            if pages > host_table.shape[1]:
                raise ValueError(
                    f"block_table row {r} has {host_table.shape[1]} pages but the request needs {pages} "
                    f"({keys} keys of block_size {self.block_size})"
                )
            used = host_table[r, :pages]
            if pages and (used.min() < 0 or (self.num_cache_blocks is not None and used.max() >= self.num_cache_blocks)):
                raise ValueError(
                    f"block_table row {r} has page ids outside [0, {self.num_cache_blocks}) among its first {pages} pages: "
                    f"{used.tolist()}"
                )

    def _check_decode_capacity(self, decodes: list[int], query_lens: list[int], local_keys: list[int]) -> None:
        """The decode part fits the builder's buffers: rows, next_n and pages per request (a longer
        request would otherwise have its block table cut to ``max_blocks_per_request`` columns)."""
        if not decodes:
            return
        decode_queries = [query_lens[r] for r in decodes]
        if self.decode_layout == "flattened":
            rows, next_n = sum(decode_queries), 1
        else:
            rows, next_n = len(decodes), max(decode_queries)
        if rows > self._decode_rows_capacity or next_n > self._context_lens.shape[1]:
            raise ValueError(
                f"decode batch of {rows} rows x next_n {next_n} exceeds the builder's capacity "
                f"{self._decode_rows_capacity} x {self._context_lens.shape[1]} (max_decode_requests, max_next_n)"
            )
        for r in decodes:
            pages = -(-local_keys[r] // self.block_size)
            if pages > self.max_blocks_per_request:
                raise ValueError(
                    f"decode request {r} needs {pages} pages ({local_keys[r]} keys of block_size {self.block_size}), "
                    f"more than the builder's max_blocks_per_request ({self.max_blocks_per_request})"
                )

    def _persistent_slots(self, slots: list[int]) -> torch.Tensor:
        """Slots of a step that fits the decode capacity live in the builder's buffer (graph replays
        read the same address); larger (prefill) steps get a fresh tensor."""
        values = torch.tensor(slots, dtype=torch.int64)
        if len(slots) > self._slots.shape[0]:
            return values.to(self.device)
        target = self._slots[: len(slots)]
        target.copy_(values)
        return target

    def _slot_mapping(self, seq_lens, query_lens, host_table) -> list[int]:
        """Per new token: the slot of the key it completes on this rank, else -1."""
        ratio = self.compress_ratio
        slots: list[int] = []
        for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
            positions = torch.arange(seq_len - query_len, seq_len, dtype=torch.int64)
            completes = (positions + 1) % ratio == 0
            owner, local = global_to_local((positions + 1) // ratio - 1, self.dcp_world_size, self.dcp_interleave)
            mine = completes & (owner == self.dcp_rank)
            if not bool(mine.any()):
                slots += [-1] * query_len
                continue
            page = host_table[r].to(torch.int64)[torch.where(mine, local // self.block_size, 0)]
            slots += torch.where(mine, page * self.block_size + local % self.block_size, -1).tolist()
        return slots

    def _decode_rows(self, seq_lens, query_lens, block_table) -> DecodeRows | None:
        if not seq_lens:
            return None
        ratio = self.compress_ratio
        if self.decode_layout == "flattened":
            global_rows = [[(s - q + t + 1) // ratio] for s, q in zip(seq_lens, query_lens) for t in range(q)]
            request_of_row = [r for r, q in enumerate(query_lens) for _ in range(q)]
            next_n, decode_lens, padding = 1, [1] * len(global_rows), False
        else:
            next_n = max(query_lens)
            global_rows = [
                [(s - q + t + 1) // ratio if t < q else 0 for t in range(next_n)] for s, q in zip(seq_lens, query_lens)
            ]
            request_of_row = list(range(len(seq_lens)))
            decode_lens, padding = list(query_lens), min(query_lens) != next_n
        rows = len(global_rows)
        local_rows = [self._local(row) for row in global_rows]
        self._global_context_lens[:rows, :next_n].copy_(torch.tensor(global_rows, dtype=torch.int32))
        self._context_lens[:rows, :next_n].copy_(torch.tensor(local_rows, dtype=torch.int32))
        self._decode_lens[:rows].copy_(torch.tensor(decode_lens, dtype=torch.int32))
        index = torch.tensor(request_of_row, dtype=torch.int64, device=block_table.device)
        width = min(block_table.shape[1], self.max_blocks_per_request)
        table = self._block_table[:rows]
        table.fill_(0)
        table[:, :width].copy_(block_table.index_select(0, index)[:, :width])
        row_requests = torch.tensor(request_of_row, dtype=torch.int32).repeat_interleave(next_n)
        self._row_to_request[: rows * next_n].copy_(row_requests)
        return DecodeRows(
            block_table=table,
            context_lens=self._context_lens[:rows, :next_n],
            global_context_lens=self._global_context_lens[:rows, :next_n],
            decode_lens=self._decode_lens[:rows],
            next_n=next_n,
            requires_padding=padding,
            max_context_len=max(max(row) for row in local_rows),
            max_global_context_len=max(max(row) for row in global_rows),
            row_to_request=self._row_to_request[: rows * next_n],
        )

    def _prefill_chunks(self, seq_lens, query_lens, block_table, prefills, token_offset, local_keys) -> list[PrefillChunk]:
        ratio = self.compress_ratio
        workspace = self.workspace_tokens
        budget_rows = self.max_logits_bytes // LOGIT_BYTES
        pieces: list[tuple[list[int], int, int, bool]] = []
        current: list[int] = []
        current_rows = current_keys = 0
        for r in prefills:
            # Budgets count the global keys so that every DCP rank plans the same chunks (the merge and
            # the candidate reduction are collectives over each chunk); without DCP they are equal.
            rows, keys = query_lens[r], seq_lens[r] // ratio
            if workspace is not None and keys > workspace:
                raise ValueError(f"request {r} has {keys} keys, more than workspace_tokens ({workspace})")
            fits = (workspace is None or current_keys + keys <= workspace) and (
                (current_rows + rows) * (current_keys + keys) <= budget_rows
            )
            if current and not fits:
                pieces.append((current, 0, current_rows, False))
                current, current_rows, current_keys = [], 0, 0
            if rows * keys > budget_rows:
                rows_per_piece = max(1, budget_rows // max(keys, 1))
                for start in range(0, rows, rows_per_piece):
                    pieces.append(([r], start, min(rows, start + rows_per_piece), start > 0))
                continue
            current.append(r)
            current_rows += rows
            current_keys += keys
        if current:
            pieces.append((current, 0, current_rows, False))

        token_start_of = {}
        position = token_offset
        for r in prefills:
            token_start_of[r] = position
            position += query_lens[r]
        return [self._chunk(requests, lo, hi, skip, seq_lens, query_lens, block_table, token_start_of, local_keys, ratio)
                for requests, lo, hi, skip in pieces]

    def _chunk(self, requests, row_lo, row_hi, skip_gather, seq_lens, query_lens, block_table, token_start_of,
               local_keys, ratio) -> PrefillChunk:
        cu = [0]
        ks: list[int] = []
        ke: list[int] = []
        global_visible: list[int] = []
        for r in requests:
            start_pos = seq_lens[r] - query_lens[r]
            lo, hi = (row_lo, row_hi) if len(requests) == 1 else (0, query_lens[r])
            visible = [(start_pos + 1 + offset) // ratio for offset in range(lo, hi)]
            global_visible += visible
            ks += [cu[-1]] * len(visible)
            ke += [cu[-1] + local for local in self._local(visible)]
            cu.append(cu[-1] + local_keys[r])
        first_token = token_start_of[requests[0]] + (row_lo if len(requests) == 1 else 0)
        num_rows = len(ks)
        index = torch.tensor(requests, dtype=torch.int64, device=block_table.device)
        to_device = lambda values: torch.tensor(values, dtype=torch.int32).to(self.device)  # noqa: E731
        return PrefillChunk(
            token_start=first_token,
            token_end=first_token + num_rows,
            block_table=block_table.index_select(0, index).to(self.device),
            cu_seq_lens=to_device(cu),
            num_keys=cu[-1],
            ks=to_device(ks),
            ke=to_device(ke),
            skip_gather=skip_gather,
            global_visible=to_device(global_visible),
            max_global_visible=max(global_visible, default=0),
        )


def build_metadata(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_spec_tokens: int = 0,
    compress_ratio: int = 1,
    workspace_tokens: int | None = None,
    max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
    decode_layout: str = "native",
    dcp_rank: int = 0,
    dcp_world_size: int = 1,
    dcp_interleave: int = 1,
    dense_prefill_max_len: int = 0,
    num_cache_blocks: int | None = None,
    device: torch.device | str | None = None,
) -> IndexerMetadata:
    """Plan one step with buffers sized for exactly this batch (see ``MetadataBuilder``).

    Args:
        seq_lens: per request, context length in tokens after this step (integers: Python or numpy
            ints, or a 1-D integer tensor; ``100.9`` or ``100.0`` is refused).
        query_lens: per request, new tokens this step (consecutive rows of the batch, decodes first).
        block_table: ``[num_requests, max_blocks]`` int32 or int64 pages of each request's keys.
        block_size: tokens per cache page.
        num_spec_tokens: speculative tokens per decode; ``query_len <= 1 + num_spec_tokens`` is a decode.
        compress_ratio: tokens per indexer key.
        workspace_tokens: most keys one prefill chunk may gather (``None``: unbounded).
        max_logits_bytes: most bytes of one prefill chunk's ``[rows, keys]`` fp32 logits.
        decode_layout: ``"native"`` (``[B, next_n]`` rows, padded when decode lengths differ) or
            ``"flattened"`` (one row per decode token, ``next_n = 1``).
        dcp_rank, dcp_world_size, dcp_interleave: decode context parallelism of the cache.
        dense_prefill_max_len: when every request is a prefill no longer than this, the step is marked
            ``use_dense_prefill`` (the attention runs dense and needs no indices).
        num_cache_blocks: pages in the cache, to check block-table entries (``None``: only ``>= 0``).
        device: where the planned tensors go.
    """
    seq_list = _as_int_list("seq_lens", seq_lens)
    query_list = _as_int_list("query_lens", query_lens)
    threshold = 1 + num_spec_tokens
    decode_queries = [q for q in query_list if 0 < q <= threshold]
    builder = MetadataBuilder(
        max_decode_requests=len(decode_queries),
        max_next_n=max(max(decode_queries, default=1), threshold),
        max_blocks_per_request=max(1, block_table.shape[1]) if isinstance(block_table, torch.Tensor) else 1,
        block_size=block_size,
        device=device if device is not None else getattr(block_table, "device", None),
        num_spec_tokens=num_spec_tokens,
        compress_ratio=compress_ratio,
        workspace_tokens=workspace_tokens,
        max_logits_bytes=max_logits_bytes,
        decode_layout=decode_layout,
        dcp_rank=dcp_rank,
        dcp_world_size=dcp_world_size,
        dcp_interleave=dcp_interleave,
        dense_prefill_max_len=dense_prefill_max_len,
        num_cache_blocks=num_cache_blocks,
    )
    return builder.build(seq_list, query_list, block_table)


def _as_int_list(name: str, values) -> list[int]:
    """``values`` as Python ints: a sequence of integers (``numbers.Integral``: Python or numpy ints,
    not bool) or a 1-D integer tensor. Floats are refused, not truncated."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    items = list(values)
    for position, value in enumerate(items):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must hold integers, got {value!r} ({type(value).__name__}) at position {position}")
    return [int(value) for value in items]
