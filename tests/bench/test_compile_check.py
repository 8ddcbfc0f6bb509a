"""nvfp4_train.bench.compile_check: the recorder writes what a launch was (types, constexprs, divisibility, options)
and the compile step builds such a record for sm_90 with the GPU-path flags on, reporting Triton's message when
the kernel does not compile."""

from __future__ import annotations

import json

import pytest
import torch

from nvfp4_train.bench import compile_check
from nvfp4_train.bench.sass import have_nvidia_tools


@pytest.mark.triton
def test_recorder_writes_each_distinct_launch_once(tmp_path, monkeypatch, triton_device):
    if triton_device != "cpu":
        pytest.skip("the recorder wraps the interpreter's launches")
    from triton.runtime import interpreter

    from nvfp4_train.kernels.fp8.quantize import quantize_fp8_blockwise_triton

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run)  # restored after
    out = tmp_path / "launches.jsonl"
    compile_check.install_recorder(out)
    x = torch.randn(128, 256).bfloat16()
    for _ in range(2):  # the same launch twice: one line
        quantize_fp8_blockwise_triton(x, (1, 128), write_row=True, write_col=True)
    quantize_fp8_blockwise_triton(x.float(), (1, 128), write_row=True, write_col=True)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["name"] for r in recs] == ["_fp8_rowcol_grouped_kernel"] * 2
    bf16, f32 = recs
    assert bf16["types"]["x_ptr"] == "*i16" and f32["types"]["x_ptr"] == "*fp32"  # bf16 goes in as its bits
    assert bf16["types"]["M"] == "i32" and "M" in bf16["div"] and "K" in bf16["div"]
    assert bf16["consts"]["TABLE"] is True and f32["consts"]["TABLE"] is False and bf16["consts"]["NATIVE"] is False
    assert bf16["opts"]["num_warps"] == 8 and bf16["opts"]["enable_fp_fusion"] is False


RECORD = dict(module="nvfp4_train.kernels.fp8.quantize", name="_fp8_rowcol_grouped_kernel",
              types=dict(x_ptr="*i16", row_ptr="*i32", row_sinv_ptr="*fp32", col_ptr="*i32", col_sinv_ptr="*fp32",
                         tab_ptr="*i64", M="i32", K="i32", stride_m="i32"),
              consts=dict(stride_k=1, BF16_BITS=True, NATIVE=False, TABLE=True, CM=32),
              div=["x_ptr", "row_ptr", "row_sinv_ptr", "col_ptr", "col_sinv_ptr", "tab_ptr", "M", "K", "stride_m"],
              opts=dict(num_warps=4, enable_fp_fusion=False, enable_reflect_ftz=False))


@pytest.mark.skipif(not have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_compile_builds_a_record_for_sm90_and_reports_a_failure():
    assert compile_check.compile_launch(json.dumps(RECORD)) == ("_fp8_rowcol_grouped_kernel", None)
    bad = dict(RECORD, consts=dict(RECORD["consts"], CM=30))  # 30 rows in groups of 4: [7.5, 128] tiles
    name, msg = compile_check.compile_launch(json.dumps(bad))
    assert name == "_fp8_rowcol_grouped_kernel" and msg and '"CM": 30' in msg and '"NATIVE": true' in msg
    unknown = dict(RECORD, module="nvfp4_train.no_such_module")
    lines = [json.dumps(RECORD), json.dumps(RECORD), json.dumps(bad), json.dumps(unknown)]
    per_kernel, failed = compile_check.compile_all(lines, 90, 1)
    assert per_kernel == {"_fp8_rowcol_grouped_kernel": 3} and len(failed) == 2
    assert "ModuleNotFoundError" in failed[1][1]
