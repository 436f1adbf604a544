"""The oracles themselves: calc_diff, the exact top-k checker, and the adversarial generators."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsa_indexer.testing import (
    ADVERSARIAL_GENERATORS,
    all_equal_rows,
    assert_topk_exact,
    calc_diff,
    count_topk_errors,
    few_distinct_rows,
    nonfinite_rows,
    one_bin_rows,
    relu_sum_rows,
    signed_zero_rows,
    sorted_rows,
    tiny_difference_rows,
    with_garbage_past_ends,
)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_calc_diff_is_zero_for_identical_and_two_for_negated_inputs():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert abs(calc_diff(x, x)) < 1e-15
    assert calc_diff(x, -x) == pytest.approx(2.0, abs=1e-15)


def test_calc_diff_matches_the_formula_written_with_numpy():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(300).astype(np.float32)
    y = (x + 0.01 * rng.standard_normal(300)).astype(np.float32)
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    expected = 1 - 2 * np.dot(xd, yd) / (np.dot(xd, xd) + np.dot(yd, yd))
    assert calc_diff(torch.from_numpy(x), torch.from_numpy(y)) == pytest.approx(expected, rel=1e-12)


def test_calc_diff_of_orthogonal_vectors_is_one():
    assert calc_diff(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])) == pytest.approx(1.0)


def test_calc_diff_of_all_zero_inputs_is_zero():
    assert calc_diff(torch.zeros(4, 4), torch.zeros(4, 4)) == 0.0
    assert calc_diff(torch.empty(0), torch.empty(0)) == 0.0


def test_calc_diff_skips_shared_minus_inf_and_nonfinite_entries():
    x = torch.tensor([1.0, -math.inf, 2.0, math.nan, 5.0])
    y = torch.tensor([1.0, -math.inf, 2.5, 7.0, math.inf])
    assert calc_diff(x, y) == pytest.approx(calc_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])))


def test_calc_diff_rejects_different_minus_inf_masks():
    with pytest.raises(AssertionError, match=r"-inf masks differ, first at \(1, 0\)"):
        calc_diff(torch.tensor([[0.0], [-math.inf]]), torch.tensor([[0.0], [1.0]]))


def test_calc_diff_rejects_different_shapes():
    with pytest.raises(AssertionError, match="shapes differ"):
        calc_diff(torch.zeros(3), torch.zeros(4))


def test_checker_accepts_the_exact_answer_with_padding():
    logits = torch.tensor([[3.0, math.nan, 5.0, -math.inf, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert count_topk_errors(logits, int32([[0, 2, 4, -1], [0, 1, 2, 3]]), 4) == 0
    assert_topk_exact(logits, int32([[0, 2, 4, -1], [0, 1, 2, 3]]), 4)


def test_checker_catches_a_pick_one_millionth_too_small():
    logits = torch.tensor([[1.0, 1.000001, 0.5, 1.000002]])
    assert count_topk_errors(logits, int32([[1, 3]]), 2) == 0
    assert count_topk_errors(logits, int32([[0, 3]]), 2) == 1


def test_checker_catches_a_tie_broken_toward_the_higher_column():
    logits = torch.tensor([[2.0, 7.0, 2.0, 2.0]])
    assert count_topk_errors(logits, int32([[0, 1]]), 2) == 0
    assert count_topk_errors(logits, int32([[1, 2]]), 2) == 1


def test_checker_treats_signed_zeros_as_equal():
    logits = torch.tensor([[-0.0, 0.0, -1.0]])
    assert count_topk_errors(logits, int32([[0]]), 1) == 0
    assert count_topk_errors(logits, int32([[1]]), 1) == 1


@pytest.mark.parametrize(
    "row, what",
    [
        ([1, 2, 2], "duplicate"),
        ([2, 1, -1], "descending"),
        ([1, -1, 2], "after a -1"),
        ([1, -1, -1], "missing"),
        ([1, 2, 5], "unexpected"),
        ([0, 1, 2], "unexpected"),
    ],
    ids=["duplicate", "not_ascending", "padding_not_suffix", "missing_pick", "out_of_range", "unselectable_pick"],
)
def test_checker_counts_each_structural_violation_once(row, what):
    logits = torch.tensor([[-math.inf, 4.0, 3.0, math.nan, math.nan]])
    assert count_topk_errors(logits, int32([[1, 2, -1]]), 3) == 0
    assert count_topk_errors(logits, int32([row]), 3) == 1
    with pytest.raises(AssertionError, match=f"row 0: .*{what}"):
        assert_topk_exact(logits, int32([row]), 3)


def test_checker_rejects_indices_of_the_wrong_shape():
    with pytest.raises(AssertionError, match="shape"):
        count_topk_errors(torch.zeros(1, 5), int32([[1, 2, 3, 4]]), 3)


def test_checker_rejects_selecting_nan_or_minus_inf_to_fill_k():
    logits = torch.tensor([[math.nan, 1.0, -math.inf]])
    assert count_topk_errors(logits, int32([[1, -1, -1]]), 3) == 0
    assert count_topk_errors(logits, int32([[0, 1, -1]]), 3) == 1
    assert count_topk_errors(logits, int32([[0, 1, 2]]), 3) == 2


def test_checker_reads_only_the_window_and_expects_relative_columns():
    logits = torch.tensor([[9.0, 1.0, 3.0, 2.0, 9.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
    starts, ends = int32([1, 2]), int32([4, 2])
    assert count_topk_errors(logits, int32([[1, 2], [-1, -1]]), 2, starts=starts, ends=ends) == 0
    assert count_topk_errors(logits, int32([[2, 3], [-1, -1]]), 2, starts=starts, ends=ends) == 1
    assert count_topk_errors(logits, int32([[1, 2], [0, -1]]), 2, starts=starts, ends=ends) == 1


def test_assert_topk_exact_names_the_first_bad_row_and_counts_rows():
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]])
    with pytest.raises(AssertionError, match=r"2 error\(s\) in 2 row\(s\); first bad row 1: missing \[1\]"):
        assert_topk_exact(logits, int32([[1], [0], [1]]), 1)


GENERATOR_FUNCTIONS = [
    one_bin_rows,
    all_equal_rows,
    few_distinct_rows,
    sorted_rows,
    tiny_difference_rows,
    signed_zero_rows,
    nonfinite_rows,
    relu_sum_rows,
]


def test_registry_lists_every_generator():
    assert set(ADVERSARIAL_GENERATORS.values()) == set(GENERATOR_FUNCTIONS)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_generators_are_seeded_fp32_of_the_requested_shape(name):
    generate = ADVERSARIAL_GENERATORS[name]
    first = generate((3, 257), 42)
    assert first.dtype == torch.float32 and first.shape == (3, 257) and first.device.type == "cpu"
    again = generate((3, 257), torch.Generator().manual_seed(42))
    assert torch.equal(first.view(torch.int32), again.view(torch.int32))
    assert not torch.equal(first.view(torch.int32), generate((3, 257), 43).view(torch.int32))
    assert generate((0, 5), 0).shape == (0, 5)
    assert generate((2, 0), 0).shape == (2, 0)


def test_one_bin_rows_share_the_top_22_bits():
    bits = one_bin_rows((4, 5000), 0).view(torch.int32)
    assert bool((bits >> 10 == bits[0, 0] >> 10).all())
    assert len(torch.unique(bits)) > 900


def test_all_equal_rows_are_constant_per_row():
    values = all_equal_rows((3, 100), 0)
    assert torch.equal(values, values[:, :1].expand(3, 100))
    assert len(torch.unique(values[:, 0])) == 3


def test_few_distinct_rows_hold_ten_values():
    assert len(torch.unique(few_distinct_rows((8, 1000), 0))) == 10


def test_sorted_rows_alternate_ascending_and_descending():
    values = sorted_rows((4, 50), 0)
    steps = values.diff(dim=1)
    assert bool((steps[0::2] >= 0).all()) and bool((steps[1::2] <= 0).all())


def test_tiny_difference_rows_are_distinct_and_one_millionth_apart():
    values = tiny_difference_rows((3, 2000), 0).double()
    gaps = values.sort(dim=1).values.diff(dim=1)
    assert bool((gaps > 0.8e-6).all()) and bool((gaps < 1.2e-6).all())


def test_signed_zero_rows_mix_both_zeros_and_negatives_only():
    values = signed_zero_rows((4, 1000), 0)
    zeros = values == 0
    negative_sign = values.view(torch.int32) < 0
    assert int((zeros & ~negative_sign).sum()) > 1000
    assert int((zeros & negative_sign).sum()) > 1000
    assert int((values < 0).sum()) > 100
    assert not bool((values > 0).any())


def test_nonfinite_rows_mix_nan_both_infinities_and_finite_values():
    values = nonfinite_rows((4, 1000), 0)
    assert int(values.isnan().sum()) > 200
    assert int((values == math.inf).sum()) > 100
    assert int((values == -math.inf).sum()) > 200
    assert int(values.isfinite().sum()) > 2000


def test_relu_sum_rows_hold_many_exact_zeros():
    values = relu_sum_rows((4, 1000), 0)
    assert int((values == 0).sum()) > 1200
    assert int((values != 0).sum()) > 1200


def test_with_garbage_past_ends_poisons_only_outside_the_bounds():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    ends = int32([7, 4, 0])
    starts = int32([2, 1, 0])
    dirty = with_garbage_past_ends(logits, ends, (math.nan, 1e30), starts=starts)
    assert torch.equal(logits, original)
    inside = torch.zeros(3, 7, dtype=torch.bool)
    inside[0, 2:7] = True
    inside[1, 1:4] = True
    assert torch.equal(dirty[inside], logits[inside])
    cycle = torch.tensor([math.nan, 1e30] * 4)[:7].expand(3, 7)
    assert torch.equal(dirty[~inside].isnan(), cycle[~inside].isnan())
    assert bool((dirty[~inside].nan_to_num(0.0) == cycle[~inside].nan_to_num(0.0)).all())


def test_with_garbage_past_ends_defaults_to_nan_huge_and_minus_inf():
    dirty = with_garbage_past_ends(torch.zeros(1, 4), int32([1]))
    assert dirty[0, 0] == 0 and math.isnan(dirty[0, 3]) and dirty[0, 1] == 1e30 and dirty[0, 2] == -math.inf
