"""The ``dsa-indexer`` command: demo agreement, JSON output, bad flags, info."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsa_indexer.cli import main


@pytest.mark.parametrize("config, fmt", [("v32", "fp8"), ("v41", "mxfp4"), ("v32", "mxfp4")])
def test_demo_agrees_with_the_oracle_and_writes_json(tmp_path, config, fmt):
    path = tmp_path / "demo.json"
    args = ["demo", "--config", config, "--fmt", fmt, "--requests", "3", "--prompt-len", "200",
            "--decode-steps", "3", "--json", str(path)]
    assert main(args) == 0
    numbers = json.loads(path.read_text())
    assert numbers["agreement"] == 1.0 and numbers["fmt"] == fmt
    assert 0.8 < numbers["recall_vs_fp32"] <= 1.0
    assert numbers["tokens_per_s"] > 0
    assert any(step["padded"] for step in numbers["steps"])
    assert any(step["decode_tokens"] and step["prefill_tokens"] for step in numbers["steps"])


@pytest.mark.parametrize(
    "flags",
    [["demo", "--bogus"], ["demo", "--requests", "0"], ["demo", "--config", "v4"], ["demo", "--next-n", "x"], []],
)
def test_bad_flags_give_one_line_and_nonzero_exit(flags):
    result = subprocess.run([sys.executable, "-m", "dsa_indexer", *flags], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("dsa-indexer: error:")
    assert "Traceback" not in result.stderr


def test_train_demo_learns_and_writes_the_plot_and_json(tmp_path):
    plot, numbers_path = tmp_path / "train.png", tmp_path / "train.json"
    args = ["train-demo", "--steps", "12", "--sequences", "2", "--seq-len", "48", "--topk", "8", "--lr", "0.05",
            "--plot", str(plot), "--json", str(numbers_path)]
    assert main(args) == 0
    numbers = json.loads(numbers_path.read_text())
    losses, recalls = numbers["losses"], numbers["recalls"]
    assert len(losses) == len(recalls) == 12
    assert losses[-1] < 0.7 * losses[0]
    assert recalls[-1] > recalls[0] + 0.1
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags", [["train-demo", "--lr", "0"], ["train-demo", "--steps", "-1"],
                                   ["train-demo", "--device", "tpu"]])
def test_train_demo_bad_flags_are_one_line_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("dsa-indexer: error:") and err.count("\n") == 1


def test_info_lists_versions_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "backend: reference" in out


def test_info_shows_the_install_hint_with_its_extra(capsys, monkeypatch):
    from dsa_indexer import backend

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert main(["info"]) == 0
    assert "pip install 'dsa-indexer[triton]'" in capsys.readouterr().out


def test_demo_json_to_stdout_names_the_resolved_format(capsys, monkeypatch):
    from dsa_indexer import demo
    from dsa_indexer.indexer import IndexerConfig

    # The serving loop itself is the other tests' subject: here an empty run (every check vacuously met).
    monkeypatch.setattr(demo, "run_demo", lambda options, progress=None: demo.DemoResult(options))
    assert main(["demo", "--config", "v41", "--json", "-"]) == 0
    captured = capsys.readouterr()
    numbers = json.loads(captured.out)  # only the JSON: the tables went to stderr
    assert numbers["config"] == "v41" and numbers["fmt"] == IndexerConfig.deepseek_v41().fmt
    assert "agreement with the exact oracle" in captured.err
    assert not (Path.cwd() / "-").exists()


@pytest.mark.distributed
def test_demo_with_dcp_matches_the_single_process_run(tmp_path):
    path = tmp_path / "dcp.json"
    args = ["demo", "--config", "v41", "--dcp", "2", "--requests", "2", "--prompt-len", "150", "--decode-steps", "2",
            "--json", str(path)]
    assert main(args) == 0
    numbers = json.loads(path.read_text())
    assert numbers["dcp"] == 2 and numbers["dcp_agreement"] == 1.0


def test_near_tie_rows_accept_only_swaps_within_kernel_rounding():
    from dsa_indexer.demo import _near_tie_rows

    logits = torch.tensor([[5.0, 1.0, 1.0 + 1e-7, 0.5], [5.0, 1.0, 1.5, 0.5], [5.0, 1.0, 1.0 + 1e-7, 0.5]])
    expected = torch.tensor([[0, 2], [0, 2], [0, 2]], dtype=torch.int32)
    got = torch.tensor([[0, 1], [0, 1], [0, 3]], dtype=torch.int32)
    assert _near_tie_rows(logits, got, expected).tolist() == [True, False, False]


def test_bench_on_cpu_writes_results_and_a_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    plot_path = tmp_path / "bench.png"
    assert main(["bench", "--suite", "cpu", "--out", str(tmp_path), "--plot", str(plot_path)]) == 0
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert {r["op"] for r in results["records"]} >= {"mqa_logits", "paged_mqa_logits", "topk"}
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in results["records"])
    assert plot_path.read_bytes()[:4] == b"\x89PNG"
    # A CPU's rates are far below 1 T: they show in giga units, never as blank or 0.0 cells.
    assert all((r["tflops"] or r["tbs"]) > 0 for r in results["records"])
    lines = capsys.readouterr().out.splitlines()
    assert any("GFLOP/s" in line and "GB/s" in line for line in lines)
    for record in results["records"]:
        row = next(line for line in lines if f" {record['op']} " in line)
        cells = [cell.strip() for cell in row.strip("│┃ ").split("│")]
        assert cells[5] or cells[6], row


def test_bench_plot_without_matplotlib_fails_before_running(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec then reports it missing
    assert main(["bench", "--suite", "cpu", "--out", str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no suite ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of GPU suites without CUDA")
@pytest.mark.parametrize("suite", ["logits", "train"])
def test_bench_gpu_suite_without_cuda_is_a_one_line_error(capsys, suite):
    assert main(["bench", "--suite", suite, "--out", "/tmp/unused"]) == 2
    assert "need a CUDA device" in capsys.readouterr().err


def test_bench_list_names_every_suite(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["bench", "--list"]) == 0  # imports every suite and checks that it has run(ceilings)
    out = capsys.readouterr().out
    for suite in ("quant_cache", "seq_candidates", "logits", "topk", "step", "sparse_logits", "distributed", "train",
                  "cpu"):
        assert f" {suite} " in out
