"""MXFP4 weights that cannot be weights are refused (issue 46): scale byte 255 is e8m0's NaN and dequantized
to NaN or infinity, which trained until the learning rate was blamed at step 2; blocks whose header says F32
passed the dry run. Now the header and the scales are checked before launch (naming the file and the
tensor), and any non-finite value a worker dequantizes (a scale that overflows float32) stops its read."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from polyshard.checkpoint import CheckpointError, mxfp4
from polyshard.trainer.checkpointing.hugging_face import HFSource
from tests.models.test_hf_gpt_oss import folder  # noqa: F401  (the module's tiny gpt-oss folder)
from tests.models.test_hf_llama import _broken, _config

NAME = "model.layers.1.mlp.experts.gate_up_proj"


def test_dequantize_refuses_what_is_not_finite():
    blocks = torch.full((1, 1, 16), 0x77, dtype=torch.uint8)  # every code 6.0
    assert torch.isfinite(mxfp4.dequantize(blocks, torch.full((1, 1), 252, dtype=torch.uint8))).all()
    for scale, named in ((255, "up to 255: 2^128, the NaN code)"), (253, "up to 253: 2^126)")):
        with pytest.raises(ValueError, match=re.escape(named)):
            mxfp4.dequantize(blocks, torch.full((1, 1), scale, dtype=torch.uint8))
    assert mxfp4.nan_scales(torch.tensor([[1, 255], [255, 0]], dtype=torch.uint8)) == 2


def _packed(folder, tmp_path, name, scale=None, blocks_dtype=torch.uint8, code=0x22):  # noqa: F811
    """``folder`` with layer 1's gate_up_proj as MXFP4: every value the byte ``code`` holds twice (0x22: 1.0),
    at scale 2^0, but ``scale`` in the last expert's last block."""
    blocks = torch.full((4, 48, 1, 16), code, dtype=torch.uint8)  # (E, 2F, H/32, 16)
    scales = torch.full((4, 48, 1), 127, dtype=torch.uint8)
    if scale is not None:
        scales[3, 47, 0] = scale  # the last expert's last row: an ep rank's region that holds it
    packed = {f"{NAME}_blocks": blocks.to(blocks_dtype), f"{NAME}_scales": scales}

    def quantize(tensors):
        return {k: v for k, v in tensors.items() if k != NAME} | packed

    return _broken(folder, tmp_path, name, tensors_edit=quantize)


def test_a_nan_scale_and_float32_blocks_are_refused_before_launch(folder, corpus, tmp_path):  # noqa: F811
    fine = _packed(folder, tmp_path, "fine")
    HFSource(fine, _config(fine, corpus))  # what every check below differs from
    nan = _packed(folder, tmp_path, "nan", scale=255)
    with pytest.raises(
        CheckpointError, match=rf"nan/model.safetensors: '{NAME}_scales' holds 1 scale byte\(s\) of 255"
    ):
        HFSource(nan, _config(nan, corpus))
    f32 = _packed(folder, tmp_path, "f32", blocks_dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"f32/model.safetensors: .*gate_up_proj: .*the header says F32 and U8"):
        HFSource(f32, _config(f32, corpus))


def test_the_cli_refuses_them_in_one_line_with_no_process(folder, corpus, tmp_path, monkeypatch):  # noqa: F811
    from polyshard.cli import train as train_cli
    from polyshard.cli.main import app

    started: list[int] = []
    monkeypatch.setattr(train_cli, "run_local", lambda nproc, *args, **kwargs: started.append(nproc) or 0)
    toml = tmp_path / "c.toml"
    toml.write_text(f"[training]\nsteps = 2\nglobal_batch_size = 4\n[data]\nsource = {json.dumps(str(corpus))}\n")
    for name, edit in (("nan", {"scale": 255}), ("f32", {"blocks_dtype": torch.float32})):
        packed = _packed(folder, tmp_path, name, **edit)
        for dry in ([], ["--dry-run"]):
            args = ["train", str(toml), "--init-from", f"hf:{packed}", "--out", str(tmp_path / "run"), *dry]
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2, result.output
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"checkpoint error: {packed}/model.safetensors: ")
    assert started == [] and not (tmp_path / "run").exists()


def test_a_scale_that_overflows_stops_the_worker_that_reads_it(folder, corpus, tmp_path):  # noqa: F811
    big = _packed(folder, tmp_path, "big", scale=254, code=0x77)  # codes of 6.0: 6 x 2^127 overflows float32
    source = HFSource(big, _config(big, corpus, ep=2))  # 254 is no NaN code: only the values can say
    key = "model/layers.2.mlp.moe.experts.w1"
    assert torch.isfinite(source.read(key, (0, 0, 0), (2, 32, 48), torch.float32)).all()  # ep rank 0's experts
    with pytest.raises(CheckpointError, match=rf"big/model.safetensors: {NAME}_blocks with its _scales dequantizes"):
        source.read(key, (2, 0, 0), (2, 32, 48), torch.float32)  # ep rank 1's hold the overflowing block
