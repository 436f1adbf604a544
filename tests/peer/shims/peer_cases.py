"""pytest plugin: with ``PEER_DG_CASE=i``, DeepGEMM's attention tests run only case ``i`` of the cases they
would run (all of a list, or the ``DG_MQA_NUM_CASES`` sample DeepGEMM draws with its own seeds), and print it.

DeepGEMM's tests loop over their cases inside one test function, so the first failing case stops the rest;
one run per case names every failing one. Without ``PEER_DG_CASE`` nothing is changed.
"""

import os

CASE_ENV = "PEER_DG_CASE"


def _one_case(sample, index: int):
    def only(name, cases):
        selected = sample(name, cases)
        chosen = selected[index:index + 1]
        print(f" > {name}: case {index} of {len(selected)}: {chosen[0] if chosen else 'none'}", flush=True)
        return chosen

    return only


def pytest_collection_modifyitems(session, config, items):
    index = os.environ.get(CASE_ENV)
    if index is None:
        return
    for module in {item.module for item in items if hasattr(item, "module")}:
        sample = getattr(module, "sample_mqa_cases", None)
        if sample is not None and not getattr(sample, "peer_one_case", False):
            only = _one_case(sample, int(index))
            only.peer_one_case = True
            module.sample_mqa_cases = only
