"""The peer-test plugin's one-case-at-a-time run of DeepGEMM-style tests (``tests/peer/shims/peer_cases.py``),
on a stand-in module whose test loops over the cases its sampler returns."""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "peer" / "shims"))
import peer_cases  # noqa: E402


def _module(failing: set[int]):
    """A module like DeepGEMM's test file: ``sample_mqa_cases`` picks the cases, ``test`` loops over them and
    stops at the first failing one; ``ran`` records every case the loop reached."""
    module = types.SimpleNamespace(ran=[])
    module.sample_mqa_cases = lambda name, cases: cases

    def test():
        for case in module.sample_mqa_cases("paged", list(range(10, 17))):
            module.ran.append(case)
            assert case not in failing, f"case {case} is off"

    return module, test


@pytest.mark.parametrize("shard, expected", [((0, 1), list(range(10, 17))), ((1, 3), [11, 14]), ((2, 3), [12, 15])])
def test_each_case_runs_once_past_failures_and_lists_them(shard, expected):
    module, test = _module(failing={11, 15})
    failures = peer_cases.run_each_case(test, module, shard)
    assert module.ran == expected  # each case of the shard once, on past the failing ones
    assert [(position, case) for position, case, _ in failures] == [(c - 10, c) for c in expected if c in {11, 15}]
    assert all("AssertionError: case" in message for _, _, message in failures)
    assert module.sample_mqa_cases("x", [1, 2]) == [1, 2]  # the sampler is restored


def test_a_test_without_cases_passes_untouched():
    module = types.SimpleNamespace(sample_mqa_cases=lambda name, cases: cases)
    assert peer_cases.run_each_case(lambda: None, module, (0, 1)) == []


@pytest.mark.parametrize("text", ["1", "a/b", "2/2", "-1/3", "1/0", "0/1/2"])
def test_bad_shards_are_refused(text):
    with pytest.raises(ValueError, match="PEER_DG_EACH"):
        peer_cases.parse_shard(text)


def test_good_shards_parse():
    assert peer_cases.parse_shard("0/1") == (0, 1)
    assert peer_cases.parse_shard("3/4") == (3, 4)
