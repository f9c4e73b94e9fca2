"""Bad configurations and command lines: each stops `polyshard train` with exit code 2 and a one-line
message naming the field, before any worker starts, nothing written; also under `python -O` (no check
relies on `assert`). Before: some were accepted and failed in the workers with tracebacks after
8-20 s, some ran to the end with a wrong result (lr=inf, grad_clip=nan, warmup_steps=1.5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "apps/configs"
DP = "gpt-tiny-dp.toml"

# (config, extra arguments, environment, text the message must hold)
CASES = [
    (DP, ["--set", "model.tie_embeddings=maybe"], {}, "model.tie_embeddings='maybe' must be true or false"),
    (DP, ["--set", "data.shuffle=2"], {}, "data.shuffle=2 must be true or false"),
    (DP, ["--set", "optimizer.lr=fast"], {}, "optimizer.lr='fast' must be a finite number"),
    (DP, ["--set", "optimizer.lr=nan"], {}, "optimizer.lr=nan must be a finite number"),
    (DP, ["--set", "optimizer.lr=inf"], {}, "optimizer.lr=inf must be a finite number"),
    (DP, ["--set", "optimizer.lr=-1"], {}, "optimizer.lr=-1.0 must be > 0"),
    (DP, ["--set", "optimizer.beta1=1.5"], {}, "optimizer.beta1=1.5 must be in [0, 1)"),
    (DP, ["--set", "optimizer.beta2=-0.1"], {}, "optimizer.beta2=-0.1 must be in [0, 1)"),
    (DP, ["--set", "logging.every=0"], {}, "logging.every=0"),
    (DP, ["--set", "eval.batches=-1"], {}, "eval.batches=-1"),
    (DP, ["--set", "model.context_length=2000000"], {}, "model.context_length+1=2000001"),
    (DP, ["--set", "model.vocab_size=100"], {}, "past model.vocab_size=100; use vocab_size >= "),
    (DP, ["--set", "optimizer.grad_clip=nan"], {}, "optimizer.grad_clip=nan"),
    (DP, ["--set", "optimizer.weight_decay=-1"], {}, "optimizer.weight_decay=-1"),
    (DP, ["--set", "lr_schedule.warmup_steps=1.5"], {}, "lr_schedule.warmup_steps=1.5 must be an integer"),
    (DP, ["--set", "training.steps=0"], {}, "training.steps=0"),
    (DP, ["--set", "training.global_batch_size=3"], {}, "training.global_batch_size=3 does not split"),
    (DP, ["--set", "parallel.tp=3"], {}, "parallel.tp=3 does not divide model.num_heads=4"),
    (DP, ["--set", "parallel.dp=0"], {}, "parallel.dp=0"),
    (DP, ["--set", "parallel.dp_shard=3", "--set", "parallel.zero_stage=1"], {}, "parallel.dp_shard=3 must divide"),
    (DP, ["--set", "parallel.dp_shard=1"], {}, "parallel.dp_shard=1 (hybrid sharding) needs parallel.zero_stage"),
    (DP, ["--set", "parallel.dp_shard=two"], {}, "parallel.dp_shard='two' must be an integer"),
    (DP, ["--set", "parallel.pp=100"], {}, "pp=100"),
    (DP, ["--set", "training.precision=fp8"], {}, "training.precision='fp8'"),
    (DP, ["--set", "training.on_nonfinite=ignore"], {}, "training.on_nonfinite='ignore'"),
    (DP, ["--set", "training.stop_at=1000"], {}, "training.stop_at=1000"),
    (DP, ["--set", "parallel.timeout_s=0"], {}, "parallel.timeout_s=0"),
    (DP, ["--set", "parallel.timeout_s=nan"], {}, "parallel.timeout_s=nan"),
    (DP, ["--set", "checkpoint.keep=0"], {}, "checkpoint.keep >= 1"),
    (DP, ["--set", "data.val_fraction=1.5"], {}, "data.val_fraction=1.5"),
    (DP, ["--set", "optimizer.lrr=1"], {}, "did you mean 'lr'"),
    (DP, ["--set", "foo.bar=1"], {}, "unknown config section 'foo'"),
    (DP, ["--set", "optimizer.lr"], {}, "must look like section.key=value"),
    (DP, ["--set", "model.preset=huge"], {}, "model.preset='huge'"),
    (DP, ["--set", "data.source=/nonexistent/file.txt"], {}, "data.source='/nonexistent/file.txt': no such file"),
    (DP, ["--set", "training.seed=-1"], {}, "training.seed=-1"),
    (DP, ["--set", "model.num_heads=0"], {}, "model.num_heads=0"),
    (DP, ["--set", "model.dropout=1.5"], {}, "model.dropout=1.5"),
    (DP, ["--set", "training.consistency_every=-2"], {}, "training.consistency_every=-2"),
    (DP, ["--nproc", "3"], {}, "use --nproc 2"),
    (DP, ["--stop-at", "-1"], {}, "training.stop_at=-1"),
    (DP, ["--torchrun=--nnodes=1:x"], {}, "--nnodes=1:x"),
    (DP, [], {"POLYSHARD_FAULT": "explode@3:1"}, "POLYSHARD_FAULT='explode@3:1'"),
    (DP, ["--set", "parallel.dp=auto"], {}, "parallel.dp='auto' needs the number of processes; give --nproc"),
    (DP, ["--set", "parallel.dp=auto", "--set", "parallel.tp=2", "--nproc", "3"], {}, "do not split into tp x pp"),
    (DP, ["--torchrun=--nnodes=1:2"], {}, "--nnodes=1:2 (elastic) needs parallel.dp='auto'"),
    (DP, ["--nproc", "0"], {}, "--nproc 0"),
    (DP, ["--init-from", "hf:/nonexistent/gpt2"], {}, "/nonexistent/gpt2 holds no config.json"),
    (DP, ["--set", "data.tokenizer=/nonexistent/tok.json"], {}, "data.tokenizer='/nonexistent/tok.json': no"),
    (DP, ["--set", "model.norm=batch"], {}, "model.norm='batch'; choose one of ['layer', 'rms']"),
    (DP, ["--set", "model.positions=rope", "--set", "model.hidden=60", "--set", "model.num_heads=4"], {}, "even"),
    ("moe-gpt-ep.toml", ["--set", "model.moe.capacity_factor=-1"], {}, "model.moe: capacity_factor=-1.0 must be > 0"),
    ("vit-digits-3d.toml", ["--set", "model.patch_size=0"], {}, "model.patch_size=0"),
    ("vit-digits-3d.toml", ["--set", "model.patch_size=5"], {}, "not a multiple of model.patch_size=5"),
    # data: {tmp} is the test's folder, where run_cases writes the files these name
    (DP, ["--set", "data.source={tmp}/empty"], {}, "neither a manifest.json (a prepared dataset) nor .txt files"),
    (DP, ["--set", "data.source={tmp}/version"], {}, "format version 9 is not 1"),
    (DP, ["--set", "data.source={tmp}/short"], {}, "train-00000.tokens holds 10 bytes, the manifest says 4000"),
    (DP, ["--set", "data.source={tmp}/bpe"], {}, "was prepared with the tokenizer 'tokenizer.json'"),
    (DP, ["--set", "data.source={tmp}/tiny"], {}, "gives 8 training examples"),
    (DP, ["--set", "data.source={tmp}/bad.jsonl"], {}, "bad.jsonl, line 2: not JSON"),
    (
        DP,
        ["--set", "data.sources=[{{path='{tmp}/tiny', weight=0}}]"],
        {},
        "data.sources[0].weight=0 must be a positive",
    ),
    (DP, ["--set", "data.val_source={tmp}/nowhere.txt"], {}, "data.val_source='{tmp}/nowhere.txt': no such"),
    # sizes that cannot run (issue 33)
    ("moe-gpt-ep.toml", ["--set", "model.moe.num_experts=1000000000"], {}, "model.moe.num_experts=1000000000 is past"),
    (DP, ["--set", "optimizer.muon_ns_steps=1000000000"], {}, "optimizer.muon_ns_steps=1000000000 is past 100"),
    (DP, ["--set", "data.sources=[{{path='{tmp}/tiny', weight=1e308}}]"], {}, "weight=1e+308 is past 1e+12"),
    (DP, ["--set", "data.sources=[{{path='{tmp}/tiny'}}]", "--set", "data.source=x"], {}, "are both set"),
    (DP, ["--set", "model.hidden=65536", "--set", "model.num_layers=64"], {}, "or pass --force to launch"),
    (DP, ["--set", "model.hidden=1048576", "--dry-run"], {}, "GiB one rank may have on any machine"),
    # prepared folders damaged or pointing outside themselves (issue 33)
    (DP, ["--set", "data.source={tmp}/backwards"], {}, "train-00000.docs: document offset 1 is -5"),
    (DP, ["--set", "data.source={tmp}/linked"], {}, "train-00000.tokens is a link to"),
    (DP, ["--set", "data.source={tmp}/wide"], {}, "train-00000.tokens holds token id 999, past model.vocab_size"),
    ("top-level.toml", [], {}, "lr = 0.1 stands outside any [section]"),
    ("broken.toml", [], {}, "not valid TOML"),
]


def run_cases(tmp: str) -> list[tuple[int, str, bool]]:
    """Each case through the CLI in this process: (exit code, output, whether --out was created)."""
    from typer.testing import CliRunner

    from polyshard.cli.main import app

    tmp_path = Path(tmp)
    (tmp_path / "top-level.toml").write_text('lr = 0.1\n[model]\npreset = "tiny"\n')
    (tmp_path / "broken.toml").write_text("[model\npreset = tiny\n")
    _bad_data(tmp_path)
    results = []
    for i, (config, args, env, _) in enumerate(CASES):
        path = tmp_path / config if (tmp_path / config).exists() else CONFIGS / config
        out = tmp_path / f"run{i}"
        args = [a.format(tmp=tmp) for a in args]
        result = CliRunner().invoke(app, ["train", str(path), "--out", str(out), *args], env=env)
        results.append((result.exit_code, result.output, out.exists()))
    return results


def _bad_data(tmp_path: Path) -> None:
    """Prepared folders and sources, each wrong in one way."""
    from polyshard.data.format import MANIFEST, TokenizerInfo
    from tests.data._folders import write_folder

    (tmp_path / "empty").mkdir()
    documents = {"train": [[[65] * 2000]]}  # 2000 tokens: 29 windows of 65 for the tiny GPT
    for name in ("version", "short", "bpe"):
        write_folder(tmp_path / name, documents, tokenizer=TokenizerInfo("tokenizer.json", "ab" * 32, 256, None))
    write_folder(tmp_path / "tiny", {"train": [[[65] * 600]]})  # 9 windows: 8 train, fewer than a batch of 16
    manifest = json.loads((tmp_path / "version" / MANIFEST).read_text())
    (tmp_path / "version" / MANIFEST).write_text(json.dumps({**manifest, "version": 9}))
    (tmp_path / "short" / "train-00000.tokens").write_bytes(b"\0" * 10)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    for name in ("backwards", "linked", "wide"):
        write_folder(tmp_path / name, {"train": [[[65] * 2000, [66] * 2000]]})
    np.asarray([0, -5], "<i8").tofile(tmp_path / "backwards" / "train-00000.docs")
    (tmp_path / "linked" / "train-00000.tokens").rename(tmp_path / "outside.tokens")
    (tmp_path / "linked" / "train-00000.tokens").symlink_to(tmp_path / "outside.tokens")
    wide = np.full(4000, 65, "<u2")
    wide[3000] = 999
    wide.tofile(tmp_path / "wide" / "train-00000.tokens")


def _check(results, tmp) -> None:
    assert len(results) == len(CASES) >= 30
    for (config, args, env, expected), (code, output, created) in zip(CASES, results):
        case = f"{config} {args} {env}"
        assert code == 2, f"{case}: exit {code}\n{output}"
        assert expected.format(tmp=tmp) in output, f"{case}: {output!r} does not name the field"
        # One line of ours, or typer's usage box for a malformed option.
        assert "Traceback" not in output and len(output.strip().splitlines()) <= 8, f"{case}: {output}"
        assert not created, f"{case}: the run folder was created"


def test_every_bad_input_stops_before_launch_naming_the_field(tmp_path):
    _check(run_cases(str(tmp_path)), str(tmp_path))


@pytest.mark.system
def test_the_same_checks_hold_under_python_O(tmp_path):
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from tests.reliability.test_bad_input import run_cases; print(json.dumps(run_cases(sys.argv[2])))"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", code, str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    _check(json.loads(done.stdout.strip().splitlines()[-1]), str(tmp_path))
