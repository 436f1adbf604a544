"""pytest plugin over DeepGEMM's attention tests, whose functions loop over their case lists inside one test
(the first failing case stops the rest):

- ``PEER_DG_CASE=i``: run only case ``i`` of the cases a test would run (all of a list, or the
  ``DG_MQA_NUM_CASES`` sample DeepGEMM draws with its own seeds), and print it.
- ``PEER_DG_EACH=I/N``: run every case ``i`` with ``i % N == I`` (``0/1``: all of them) one at a time in the
  test's process, on past a failing one; print a line per case and fail the test with the list of failing
  cases. ``N`` shards split a long list (DeepGEMM's SM100 paged list has 1,200 cases) over several runs.

Without either variable nothing is changed.
"""

import gc
import inspect
import os
import time

CASE_ENV = "PEER_DG_CASE"
EACH_ENV = "PEER_DG_EACH"


class _Listed(Exception):
    """Raised by the capturing sampler: carries the case list a test would run."""


def _one_case(sample, index: int):
    def only(name, cases):
        selected = sample(name, cases)
        chosen = selected[index:index + 1]
        print(f" > {name}: case {index} of {len(selected)}: {chosen[0] if chosen else 'none'}", flush=True)
        return chosen

    return only


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"{EACH_ENV} must be I/N (e.g. 0/1, 2/4), got {text!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"{EACH_ENV} must be I/N with 0 <= I < N, got {text!r}")
    return index, count


def run_each_case(test, module, shard: tuple[int, int]) -> list[tuple[int, object, str]]:
    """Run ``test`` (a function that draws its cases from ``module.sample_mqa_cases``) once per case of its
    list in ``shard``; return the failing ones as ``(index, case, message)``."""
    sample = module.sample_mqa_cases

    def capture(name, cases):
        raise _Listed(name, sample(name, cases))

    module.sample_mqa_cases = capture
    try:
        test()
        return []  # the test draws no cases
    except _Listed as listed:
        name, cases = listed.args
    finally:
        module.sample_mqa_cases = sample
    failures = []
    index, count = shard
    chosen = range(index, len(cases), count)
    print(f" > {name}: {len(chosen)} of {len(cases)} cases (shard {index}/{count})", flush=True)
    for position in chosen:
        case = cases[position]
        module.sample_mqa_cases = lambda _name, _cases, case=case: [case]
        start = time.perf_counter()
        try:
            test()
            outcome = "PASS"
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the next case runs
            outcome = "FAIL"
            failures.append((position, case, f"{type(error).__name__}: {str(error)[:300]}"))
        finally:
            module.sample_mqa_cases = sample
        gc.collect()  # a failed case's traceback held its tensors
        print(f" > {name} case {position}: {outcome} ({time.perf_counter() - start:.1f} s) {case}", flush=True)
    return failures


def pytest_collection_modifyitems(session, config, items):
    index = os.environ.get(CASE_ENV)
    if index is None or os.environ.get(EACH_ENV):
        return
    for module in {item.module for item in items if hasattr(item, "module")}:
        sample = getattr(module, "sample_mqa_cases", None)
        if sample is not None and not getattr(sample, "peer_one_case", False):
            only = _one_case(sample, int(index))
            only.peer_one_case = True
            module.sample_mqa_cases = only


def pytest_pyfunc_call(pyfuncitem):
    shard = os.environ.get(EACH_ENV)
    module = getattr(pyfuncitem, "module", None)
    if not shard or getattr(module, "sample_mqa_cases", None) is None or inspect.signature(pyfuncitem.obj).parameters:
        return None
    failures = run_each_case(pyfuncitem.obj, module, parse_shard(shard))
    if failures:
        lines = "\n".join(f"  case {position}: {case}: {message}" for position, case, message in failures)
        raise AssertionError(f"{len(failures)} failing case(s):\n{lines}")
    return True
