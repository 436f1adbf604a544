"""torch.library registration: opcheck of every op, torch.compile(fullgraph=True) equals eager, the import graph."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import dsa_indexer as dsa

ops = torch.ops.dsa_indexer

D, H = 128, 2


def small_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, D, generator=gen)
    q = torch.randn(4, H, D, generator=gen).bfloat16()
    positions = torch.tensor([0, 3, 7, 1])
    cos_sin = torch.randn(16, 64, generator=gen)
    weights = torch.randn(4, H, generator=gen)
    q8, _, w8 = dsa.rope_quant_q(q, positions, cos_sin, weights, 0.1, 0.5)
    k8, k_scale = dsa.quantize_fp8(torch.randn(6, D, generator=gen))
    k_scale = k_scale.squeeze(1)
    ks = torch.tensor([0, 0, 2, 1], dtype=torch.int32)
    ke = torch.tensor([1, 6, 4, 1], dtype=torch.int32)
    cache = dsa.IndexerKCache(3, block_size=4)
    cache.insert(torch.randn(12, D, generator=gen), torch.arange(12))
    logits = torch.randn(4, 10, generator=gen)
    return dict(x=x, q=q, positions=positions, cos_sin=cos_sin, weights=weights, q8=q8, w8=w8, k8=k8,
                k_scale=k_scale, ks=ks, ke=ke, cache=cache, logits=logits)


def op_cases():
    i = small_inputs()
    cache = i["cache"]
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([[9, 10], [3, 4]], dtype=torch.int32)
    fmt = (cache.buffer, cache.block_size, cache.head_dim, cache.fmt)
    blocks = torch.tensor([[0, 2, -1], [1, 1, 1], [0, 1, 4], [-1, -1, -1]], dtype=torch.int32)
    return {
        "quantize_fp8": (ops.quantize_fp8.default, (i["x"],)),
        "dequantize_fp8": (ops.dequantize_fp8.default, dsa.quantize_fp8(i["x"])),
        "quantize_mxfp4": (ops.quantize_mxfp4.default, (i["x"],)),
        "dequantize_mxfp4": (ops.dequantize_mxfp4.default, dsa.quantize_mxfp4(i["x"])),
        "rope_quant_q": (ops.rope_quant_q.default, (i["q"], i["positions"], i["cos_sin"], i["weights"], 0.1, 0.5,
                                                    "neox", "first", "fp8", "auto")),
        "insert_k": (ops.insert_k.default, (i["x"], cache.buffer.clone(), 4, D, "fp8", torch.tensor([0, 5, -1]),
                                           "ue8m0", 1e-4, "auto")),
        "gather_k": (ops.gather_k.default, (*fmt, table, torch.tensor([0, 5, 8], dtype=torch.int32), 8, "auto")),
        "mqa_logits": (ops.mqa_logits.default, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"], i["ke"], True,
                                        torch.float32, "auto")),
        "mqa_logits_out": (ops.mqa_logits_out.default, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"], i["ke"],
                                                       True, torch.empty(4, 6), torch.float32, "auto")),
        "paged_mqa_logits": (ops.paged_mqa_logits.default, (i["q8"].view(2, 2, H, D), None, *fmt, i["w8"], lens, table,
                                                           12, True, torch.float32, "auto")),
        "topk": (ops.topk.default, (i["logits"], 3, i["ks"], i["ke"] + 2, "auto")),
        "topk_out": (ops.topk_out.default, (i["logits"], 3, None, None, torch.empty(4, 3, dtype=torch.int32), "auto")),
        "topk_decode": (ops.topk_decode.default, (i["logits"], torch.tensor([9, 4], dtype=torch.int32), 2, 3, "auto")),
        "topk_decode_slots": (ops.topk_decode_slots.default, (i["logits"], torch.tensor([9, 4], dtype=torch.int32), 2, 3,
                                                             torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32), 4,
                                                             "auto")),
        "indices_to_slots": (ops.indices_to_slots.default, (torch.tensor([[0, 5, -1]], dtype=torch.int32), table, 4,
                                                           torch.tensor([1], dtype=torch.int32), "auto")),
        "pack_seq": (ops.pack_seq.default, (i["x"], torch.tensor([1, 2]), 0.0, 2, "auto")),
        "unpack_seq": (ops.unpack_seq.default, (i["x"].view(3, 1, D), torch.tensor([1, 0, 1]), 2, "auto")),
        "select_candidate_blocks": (ops.select_candidate_blocks.default, (i["logits"], None, i["ke"], 2, 2, 1, "auto")),
        "sparse_mqa_logits": (ops.sparse_mqa_logits.default, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"],
                                                             i["ke"], blocks, 2, torch.bfloat16, "auto")),
        "sparse_paged_mqa_logits": (ops.sparse_paged_mqa_logits.default, (i["q8"].view(2, 2, H, D), None, *fmt, i["w8"],
                                                                         lens, table, blocks, 2, torch.float32, "auto")),
        "topk_sparse": (ops.topk_sparse.default, (i["logits"][:, :6], blocks, 2, 4, "auto")),
        "apply_candidate_mask": (ops.apply_candidate_mask.default, (i["logits"].clone(), None, i["ke"],
                                                                   torch.tensor([[0], [1], [0], [2]], dtype=torch.int32),
                                                                   2, 1, "auto")),
    }


def takes_fp8(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)


@pytest.mark.parametrize("name", sorted(op_cases()))
def test_opcheck(name):
    op, args = op_cases()[name]
    # opcheck's schema test compares inputs with arithmetic that CPU float8 lacks; for those ops the
    # declared mutations are checked by hand below instead.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if takes_fp8(args) else (
        "test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(op, args, test_utils=utils)
    if takes_fp8(args):
        before = [a.view(torch.uint8).clone() if a.dtype == torch.float8_e4m3fn else a.clone()
                  for a in args if isinstance(a, torch.Tensor)]
        op(*args)
        after = [a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a for a in args if isinstance(a, torch.Tensor)]
        mutated = set(op._schema.arguments[i].name for i, a in enumerate(op._schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write)
        names = [a.name for a, v in zip(op._schema.arguments, args) if isinstance(v, torch.Tensor)]
        for name_, b, a in zip(names, before, after):
            if name_ not in mutated:
                assert torch.equal(b, a), f"{name} wrote its input {name_}"


def indexer_step(q8, w8, k8, k_scale, ks, ke, cache, table, lens):
    prefill = dsa.mqa_logits(q8, None, k8, k_scale, w8, ks, ke)
    picks = dsa.topk(prefill, 3, starts=ks, ends=ke)
    decode = dsa.paged_mqa_logits(q8.view(2, 2, H, D), None, cache, w8, lens, table, 12)
    decode_picks = dsa.topk_decode(decode, lens, 2, 3)
    owners = torch.tensor([0, 0, 1, 1], dtype=torch.int32, device=table.device)
    blocks = torch.tensor([[0, 2, -1], [1, 1, 1], [0, 1, 4], [-1, -1, -1]], dtype=torch.int32, device=table.device)
    sparse = dsa.sparse_paged_mqa_logits(q8.view(2, 2, H, D), None, cache, w8, lens, table, blocks, 2)
    sparse_picks = dsa.topk_sparse(sparse, blocks, 2, 3)
    return picks, decode_picks, dsa.indices_to_slots(decode_picks, table, 4, owners), sparse, sparse_picks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_function_equals_eager(compiler, device):
    i = small_inputs()
    cache = dsa.IndexerKCache(3, block_size=4, device=device)
    cache.buffer.copy_(i["cache"].buffer)
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([[9, 10], [3, 4]], dtype=torch.int32)
    tensors = (i["q8"], i["w8"], i["k8"], i["k_scale"], i["ks"], i["ke"])
    args = (*(t.to(device) for t in tensors), cache, table.to(device), lens.to(device))
    eager = indexer_step(*args)
    compiled = torch.compile(indexer_step, fullgraph=True, backend=compiler)(*args)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def test_compiled_sizes_that_depend_on_values_must_be_given():
    def pack(x, lengths):
        return dsa.pack_seq(x, lengths, pad_value=0.0)

    with pytest.raises(Exception, match="max_len must be given"):
        torch.compile(pack, fullgraph=True, backend="aot_eager")(torch.randn(3, 4), torch.tensor([1, 2]))


def test_compiled_keyword_arguments():
    logits = torch.randn(4, 10)
    compiled = torch.compile(lambda values: dsa.topk(values, k=3), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits), dsa.topk(logits, 3))


def test_compiled_out_arguments_are_written():
    def step(logits, out):
        dsa.topk(logits, 3, out=out)
        return out

    logits = torch.randn(4, 10)
    out = torch.empty(4, 3, dtype=torch.int32)
    torch.compile(step, fullgraph=True, backend="aot_eager")(logits, out)
    assert torch.equal(out, dsa.topk(logits, 3))


def out_form_calls():
    """Every op with an ``out=`` destination: (function, arguments, keyword arguments) on small inputs."""
    from dsa_indexer.ops.sparse_logits import columns_to_positions

    i = small_inputs()
    cache = i["cache"]
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([[9, 10], [3, 4]], dtype=torch.int32)
    blocks = torch.tensor([[0, 2, -1], [1, 1, 1], [0, 1, 4], [-1, -1, -1]], dtype=torch.int32)
    q_paged = i["q8"].view(2, 2, H, D)
    return {
        "topk": (dsa.topk, (i["logits"], 3), dict(starts=i["ks"], ends=i["ke"] + 2)),
        "topk_decode": (dsa.topk_decode, (i["logits"], torch.tensor([9, 4], dtype=torch.int32), 2, 3), {}),
        "topk_decode_slots": (dsa.topk_decode_slots, (i["logits"], torch.tensor([9, 4], dtype=torch.int32), 2, 3,
                                                      table, 4), {}),
        "pack_seq": (dsa.pack_seq, (i["x"], torch.tensor([1, 2])), dict(pad_value=0.0, max_len=2)),
        "unpack_seq": (dsa.unpack_seq, (i["x"].view(3, 1, D), torch.tensor([1, 0, 1])), dict(total=2)),
        "mqa_logits": (dsa.mqa_logits, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"], i["ke"]), {}),
        "paged_mqa_logits": (dsa.paged_mqa_logits, (q_paged, None, cache, i["w8"], lens, table, 12), {}),
        "sparse_mqa_logits": (dsa.sparse_mqa_logits, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"], i["ke"],
                                                      blocks, 2), dict(logits_dtype=torch.bfloat16)),
        "sparse_paged_mqa_logits": (dsa.sparse_paged_mqa_logits, (q_paged, None, cache, i["w8"], lens, table, blocks,
                                                                  2), {}),
        "topk_sparse": (dsa.topk_sparse, (i["logits"][:, :6], blocks, 2, 4), {}),
        "columns_to_positions": (columns_to_positions, (torch.tensor([[0, 3], [5, -1], [1, 2], [-1, -1]],
                                                                     dtype=torch.int32), blocks, 2), {}),
        "select_candidate_blocks": (dsa.select_candidate_blocks, (i["logits"], None, i["ke"], 2, 2), {}),
    }


@pytest.mark.parametrize("name", sorted(out_form_calls()))
def test_out_forms_compile_and_write_what_eager_returns(name):
    """Each op's two registrations (``<op>`` and ``<op>_out``): compiled with a poisoned ``out=``, the destination
    holds what the eager call returns, bit for bit, and the call returns the destination itself."""
    torch._dynamo.reset()  # one closure compiled per op: each case starts without the others' guards
    function, args, kwargs = out_form_calls()[name]
    expected = function(*args, **kwargs)
    out = torch.full_like(expected, -7 if not expected.dtype.is_floating_point else float("nan"))

    def with_out(*values):
        return function(*values, **kwargs, out=out)

    result = torch.compile(with_out, fullgraph=True, backend="aot_eager")(*args)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    compiled = torch.compile(lambda *values: function(*values, **kwargs), fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(compiled.view(torch.uint8), expected.view(torch.uint8))


def test_cache_ops_compile_and_match_eager():
    i = small_inputs()
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)

    def insert_then_gather(cache, keys, slots):
        cache.insert(keys, slots)
        return cache.gather(table, cu, num_tokens=8)

    keys, slots = torch.randn(3, D), torch.tensor([0, 5, -1])
    eager_cache, compiled_cache = dsa.IndexerKCache(3, block_size=4), dsa.IndexerKCache(3, block_size=4)
    eager_cache.buffer.copy_(i["cache"].buffer)
    compiled_cache.buffer.copy_(i["cache"].buffer)
    eager = insert_then_gather(eager_cache, keys, slots)
    compiled = torch.compile(insert_then_gather, fullgraph=True, backend="aot_eager")(compiled_cache, keys, slots)
    assert torch.equal(eager_cache.buffer, compiled_cache.buffer)
    for got, want in zip(compiled, eager):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(Exception, match="num_tokens must be given"):
        torch.compile(lambda c: c.gather(table, cu), fullgraph=True, backend="aot_eager")(compiled_cache)


def _module_imports(path, package_root):
    """Modules of the package that ``path`` imports (at any level, ``TYPE_CHECKING`` blocks included)."""
    import ast

    relative = path.relative_to(package_root.parent).with_suffix("")
    parts = list(relative.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("dsa_indexer"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("dsa_indexer"):
                continue
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_package_has_no_import_cycle():
    from pathlib import Path

    root = Path(dsa.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {name: {m for m in _module_imports(path, root) if m in modules and m != name}
             for name, path in modules.items()}
    for name in modules:  # a package's submodule imports the package's __init__ first: not an edge we follow
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_import_needs_only_torch():
    import subprocess
    import sys

    code = "import sys, dsa_indexer; assert 'triton' not in sys.modules, 'importing dsa_indexer imported triton'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _layer_of(module: str) -> int:
    """The layer of ``module`` in docs/architecture.md's dependency diagram (imports only go to lower or equal layers)."""
    name = module.removeprefix("dsa_indexer").removeprefix(".")
    top = name.split(".")[0]
    if name in ("ops.common", "ops.common.runtime", "ops.common.registration"):
        return 0
    if top in ("formats", "_validation", "cache_layout", "dcp_positions"):
        return 1
    if name.startswith("ops.common") or top == "backend":
        return 2
    if top == "ops":
        return 3
    if top in ("cache", "metadata", "distributed", "train"):
        return 4
    if top == "layer":
        return 5
    return 6


def test_imports_run_one_way():
    from pathlib import Path

    root = Path(dsa.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    upward = [f"{name} -> {target}" for name, path in sorted(modules.items())
              for target in sorted(_module_imports(path, root))
              if target in modules and target != "dsa_indexer" and _layer_of(target) > _layer_of(name)]
    assert not upward, "imports against the layering of docs/architecture.md:\n" + "\n".join(upward)
