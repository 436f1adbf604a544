"""Mutation check (session 10, not kept): the split select discarding the *previous* row's scratch lines instead of its
own must make the discard GPU test's property fail; prints MUTANT CAUGHT or MUTANT SURVIVED."""
import torch, triton, triton.language as tl
from dsa_indexer.ops.candidates import select_candidate_blocks
from dsa_indexer.ops.candidates import triton as ct


@triton.jit
def _previous_rows_lines(first, LINES: tl.constexpr):
    tl.debug_barrier()
    lines = tl.arange(0, LINES)
    tl.inline_asm_elementwise(ct._DISCARD_L2_ASM, "=r,l", [first - LINES * 32 + lines * 32], dtype=tl.int32,
                              is_pure=False, pack=1)


ct._discard_lines = _previous_rows_lines
caught = 0
generator = torch.Generator().manual_seed(6)
for blocks_per_row in (32, 64):
    num_rows, width = 1536, 8 * blocks_per_row - 3
    logits = torch.randn(num_rows, width, generator=generator).cuda()
    starts = torch.randint(0, 16, (num_rows,), generator=generator, dtype=torch.int32).cuda()
    ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
    for num_blocks_k in (1, 7, blocks_per_row // 2):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 8, backend="reference")
        for _ in range(5):
            garbage = torch.full((64 << 20,), -7, dtype=torch.int32, device="cuda")
            del garbage
            got = ct.select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 8, 1, fused_pieces=4,
                                                     fused_piece_discard=True)
            caught += int(not torch.equal(got, expected))
print("MUTANT CAUGHT" if caught else "MUTANT SURVIVED", caught, "of 30 runs differ")
