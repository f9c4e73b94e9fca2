"""Hugging Face GPT-2 in and out. A tiny GPT-2 is built with `transformers` (random weights, saved
with save_pretrained; nothing is downloaded), imported onto several meshes, scored, saved, and
written back in the Hugging Face format.

Tolerances: the import itself is exact (a copy of regions), so weights compare bitwise. Logits and
losses are float32 computations done in another order than transformers' (fused vs separate q/k/v
matmuls, SDPA kernels, vocab-parallel softmax), so they agree to float32 round-off: 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyshard.checkpoint import CheckpointError
from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.hugging_face import HFSource, hf_state, model_settings, write_hf
from polyshard.trainer.config import from_dict

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# float32 logits of O(1)-O(10) against transformers': the same matmuls (fan-ins of a tiny model's width,
# <= 64, through a few layers) in another order: reordered_sum(4 layers x 2 x 64) ~ 6e-5 worst case,
# ~1e-6 in practice; a wrong weight layout or rotary convention moves logits by ~1e-1.
ROUND_OFF = 1e-5


def _save_gpt2(folder: Path, tie: bool) -> Path:
    config = transformers.GPT2Config(
        vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=tie,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # GPT-2 starts its biases and norms at 0 and 1; make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {tie: _save_gpt2(tmp_path_factory.mktemp("gpt2"), tie=tie) for tie in (True, False)}


@pytest.fixture(scope="module")
def gpt2(folders):
    return folders[True]


def _config(folder: Path, corpus: str, **parallel):
    return from_dict(
        {
            "model": model_settings(folder),
            "parallel": parallel,
            "training": {"steps": 3, "global_batch_size": 4},
            "eval": {"every": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _tokens() -> torch.Tensor:
    return torch.randint(0, 300, (4, 13), generator=torch.Generator().manual_seed(1))


def _hf_logits_and_loss(folder: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return logits, float(loss)


def _import_score_save(config, folder, out):
    from polyshard.checkpoint import save_checkpoint
    from polyshard.trainer.checkpointing.run_reshard import load_into
    from polyshard.trainer.checkpointing.state import state_tensors
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import evaluate_batches

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    load_into(engine, HFSource(folder, config))
    tokens = _tokens()
    data_ranks = config.parallel.dp * config.parallel.ep
    part = tokens.chunk(data_ranks)[mesh.group_rank(("dp", "ep"))]
    loss, _ = evaluate_batches(engine, [(part[:, :-1], part[:, 1:])])
    save_checkpoint(out, 0, state_tensors(engine), mesh_axes=config.parallel.mesh_axes, config=_asdict(config))
    return loss


def _asdict(config):
    import dataclasses

    return dataclasses.asdict(config)


LAYOUTS = {
    "one": (True, {}),
    "tp2": (True, {"tp": 2}),
    "pp2": (True, {"pp": 2}),
    "dp2xtp2": (True, {"dp": 2, "tp": 2}),
    "tp2xpp2": (True, {"tp": 2, "pp": 2}),
    "dp2-zero3": (True, {"dp": 2, "zero_stage": 3}),
    "untied-one": (False, {}),
    "untied-tp2xpp2": (False, {"tp": 2, "pp": 2}),  # the head's own weight, vocab-parallel on the last stage
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_lays_gpt2_out_on_any_mesh(distributed, folders, corpus, tmp_path, layout):
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate

    tie, parallel = LAYOUTS[layout]
    gpt2 = folders[tie]
    config = _config(gpt2, corpus, **parallel)
    losses = distributed.run(config.parallel.world_size, _import_score_save, config, gpt2, tmp_path)
    hf_logits, hf_loss = _hf_logits_and_loss(gpt2)
    assert losses == pytest.approx([hf_loss] * len(losses), rel=ROUND_OFF)  # every rank, every layout
    state = consolidate(next(tmp_path.glob("step_*")))
    # Import then export, with no training between: the original tensors, bit for bit.
    from safetensors.torch import load_file

    original = {k: v for k, v in load_file(gpt2 / "model.safetensors").items() if not k.endswith(".attn.bias")}
    exported = hf_state(state, config.model)
    assert exported.keys() == original.keys() - ({"lm_head.weight"} if config.model.tie_embeddings else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    model = build_model(config.model)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(_tokens()[:, :-1])
    torch.testing.assert_close(logits, hf_logits, rtol=ROUND_OFF, atol=ROUND_OFF)


@pytest.mark.long
def test_train_then_export_loads_in_transformers(gpt2, corpus, tmp_path):
    """polyshard train --init-from hf:DIR on dp2 x tp2, then export --format hf: transformers loads it
    with no missing or unexpected keys, and its logits are polyshard's."""
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.data.tokenizer import ByteTokenizer
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate

    settings = model_settings(gpt2)
    toml = "[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    toml += "[parallel]\ndp = 2\ntp = 2\n[training]\nsteps = 3\nglobal_batch_size = 4\n[eval]\nevery = 0\n"
    toml += f"sample_tokens = 0\n[data]\nsource = {json.dumps(corpus)}\n"
    (tmp_path / "c.toml").write_text(toml)
    polyshard = [sys.executable, "-m", "polyshard.cli.main"]
    run = tmp_path / "run"
    train = [*polyshard, "train", str(tmp_path / "c.toml"), "--out", str(run), "--init-from", f"hf:{gpt2}"]
    done = subprocess.run(train, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "initialised from the Hugging Face model" in done.stdout
    out = tmp_path / "hf-out"
    exported = subprocess.run(
        [*polyshard, "export", str(run), str(out), "--format", "hf"], capture_output=True, text=True
    )
    assert exported.returncode == 0, exported.stderr
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = consolidate(latest_checkpoint(run / "checkpoints"))
    ours = build_model(from_dict({"model": settings}).model)
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        theirs = loaded.eval()(_tokens()[:, :-1]).logits
        mine = ours.eval()(_tokens()[:, :-1])
    torch.testing.assert_close(theirs, mine, rtol=ROUND_OFF, atol=ROUND_OFF)
    assert not torch.equal(state["layers.0.tok.weight"], _hf_weight(gpt2, "transformer.wte.weight"))  # it trained
    # polyshard generate gathers the same weights: greedy (top-k 1) sampling is the model's argmax path.
    generate = [*polyshard, "generate", str(run), "--prompt", "the king", "--tokens", "6", "--top-k", "1"]
    sampled = subprocess.run(generate, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr
    tokens = torch.tensor([list(b"the king")])
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, ours(tokens)[:, -1:].argmax(-1)], dim=1)
    assert sampled.stdout.rstrip("\n") == ByteTokenizer().decode(tokens[0].tolist())


def _hf_weight(folder: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")[name]


def test_a_folder_that_does_not_fit_is_refused_naming_what(gpt2, corpus, tmp_path):
    config = _config(gpt2, corpus)
    other = from_dict({**_asdict(config), "model": {**_asdict(config)["model"], "hidden": 64}})
    with pytest.raises(CheckpointError, match="--set model.hidden=32"):
        HFSource(gpt2, other)
    # A folder missing a tensor and holding a stray one: both are listed.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((gpt2 / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(gpt2 / "model.safetensors")
    tensors.pop("transformer.h.1.mlp.c_fc.bias")
    tensors["transformer.h.1.extra"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"missing \['transformer.h.1.mlp.c_fc.bias'\].*\['transformer.h.1.extra'\]"
    ):
        HFSource(broken, config)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    readable = (
        r"model_type 'mistral' is not supported; polyshard reads \['deepseek_v2', 'deepseek_v3', 'gpt2', 'gpt_oss'"
    )
    with pytest.raises(CheckpointError, match=readable):
        model_settings(mistral)
    with pytest.raises(CheckpointError, match="exists"):
        write_hf({}, config.model, gpt2)  # never over an existing folder


def test_a_sharded_folder_reads_like_one_file(gpt2, corpus, tmp_path):
    """save_pretrained above max_shard_size writes model.safetensors.index.json and several files;
    every region read from them equals the single file's."""
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    config = _config(gpt2, corpus)
    whole, sharded = HFSource(gpt2, config), HFSource(tmp_path, config)
    for name in whole.locations:
        key = "model/" + name
        shape = whole.global_shape(key)
        assert sharded.global_shape(key) == shape
        start = tuple(n // 3 for n in shape)  # an inner region, as a tp or ZeRO rank would read
        size = tuple(max(1, n // 2) for n in shape)
        assert torch.equal(sharded.read(key, start, size, torch.float32), whole.read(key, start, size, torch.float32))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["transformer.wte.weight"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="must be a bare name"):
        HFSource(tmp_path, config)


def test_export_shards_above_the_size_limit_and_transformers_loads_it(gpt2, corpus, tmp_path):
    from safetensors.torch import load_file

    config = _config(gpt2, corpus)
    source = HFSource(gpt2, config)
    state = {name: source.read("model/" + name, (0,) * len(s), s, torch.float32) for name, s in _shapes(source)}
    state["layers.3.proj.weight"] = state["layers.0.tok.weight"]  # the tied head, as consolidate gives it
    out = write_hf(state, config.model, tmp_path / "sharded", max_shard_bytes=20_000)
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2 and (out / "model.safetensors.index.json").exists()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = load_file(gpt2 / "model.safetensors")
    for name, tensor in loaded.state_dict().items():
        if name in original:
            assert torch.equal(tensor, original[name]), name


def _shapes(source):
    return [(name, source.global_shape("model/" + name)) for name in source.locations]


def test_the_hubs_gpt2_model_names_read_like_the_lm_head_models(gpt2, corpus, tmp_path):
    """The Hub's "gpt2" holds GPT2Model's names (h.0..., wte, ln_f: no "transformer." prefix)."""
    from safetensors.torch import load_file, save_file

    bare = {k.removeprefix("transformer."): v for k, v in load_file(gpt2 / "model.safetensors").items()}
    bare.pop("lm_head.weight", None)
    (tmp_path / "config.json").write_text((gpt2 / "config.json").read_text())
    save_file(bare, str(tmp_path / "model.safetensors"))
    config = _config(gpt2, corpus)
    whole, hub = HFSource(gpt2, config), HFSource(tmp_path, config)
    for name, shape in _shapes(whole):
        key = "model/" + name
        assert torch.equal(
            hub.read(key, (0,) * len(shape), shape, torch.float32),
            whole.read(key, (0,) * len(shape), shape, torch.float32),
        )


def _damaged(source: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of the folder ``source`` whose model.safetensors ``change`` rewrote (bytes -> bytes, or tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / name
    shutil.copytree(source, folder)
    weights = folder / "model.safetensors"
    if name in ("truncated", "header"):
        weights.write_bytes(change(weights.read_bytes()))
    else:
        save_file(change(load_file(weights)), str(weights), metadata={"format": "pt"})
    return folder


def test_a_damaged_folder_is_named_with_its_file_and_tensor(gpt2, corpus, tmp_path):
    """Hugging Face folders are untrusted: a truncated file, an absurd header length and an integer
    tensor where a weight belongs are refused when the folder is opened (before launch, by the
    launcher's checks); NaN weights when a rank reads its region (exit 2 in one line, not a run that
    trains until the non-finite policy stops it)."""
    import struct

    config = _config(gpt2, corpus)
    ln = "transformer.h.0.ln_1.weight"
    fc = "transformer.h.1.mlp.c_fc.weight"

    def with_nan(tensors):
        tensors[fc] = tensors[fc].clone()
        tensors[fc][3, 5] = float("nan")
        return tensors

    cases = {
        "truncated": (lambda data: data[:-100], "truncated/model.safetensors is not a readable safetensors file"),
        "header": (lambda data: struct.pack("<Q", 1 << 60) + data[8:], "header/model.safetensors is not a readable"),
        "int32": (lambda t: {**t, ln: t[ln].to(torch.int32)}, f"'{ln}' is stored as I32; a weight must be floating"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(CheckpointError, match=message):
            HFSource(_damaged(gpt2, tmp_path, name, change), config)
    source = HFSource(_damaged(gpt2, tmp_path, "nan", with_nan), config)  # the header is fine
    key = "model/layers.2.mlp.fc_in.weight"  # c_fc, transposed: rows 3 and 5 of ours are columns there
    with pytest.raises(CheckpointError, match=f"nan/model.safetensors: '{fc}' holds NaN or infinite values"):
        source.read(key, (0, 0), source.global_shape(key), torch.float32)
    torch.testing.assert_close(  # a region without the NaN reads as it is stored
        source.read(key, (6, 0), (2, 2), torch.float32), HFSource(gpt2, config).read(key, (6, 0), (2, 2), torch.float32)
    )


@pytest.mark.long
def test_a_damaged_folder_stops_before_any_process_starts(gpt2, corpus, tmp_path):
    settings = model_settings(gpt2)
    toml = "[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    toml += f"[training]\nsteps = 2\nglobal_batch_size = 4\n[data]\nsource = {json.dumps(corpus)}\n"
    (tmp_path / "c.toml").write_text(toml)
    broken = _damaged(gpt2, tmp_path, "truncated", lambda data: data[:-100])
    run = tmp_path / "run"
    train = [sys.executable, "-m", "polyshard.cli.main", "train", str(tmp_path / "c.toml"), "--out", str(run)]
    done = subprocess.run([*train, "--init-from", f"hf:{broken}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("checkpoint error:"), done.stderr
    assert "Traceback" not in done.stderr and not run.exists()  # nothing started, nothing written


def test_gpt2_trains_on_a_shorter_context_than_its_folder(gpt2, corpus, tmp_path):
    """As nanoGPT crops GPT-2's 1,024 positions to train on 256: a model with context_length 8 takes
    the first 8 rows of a 16-position table; its logits on 8 tokens are transformers' (float32
    round-off, see the top of the file), and the export writes the table at the 8 positions trained."""
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.hugging_face import export_note

    settings = {**model_settings(gpt2), "context_length": 8}
    config = from_dict({"model": settings, "data": {"source": corpus}})
    source = HFSource(gpt2, config)  # 8 <= 16: accepted ("or less")
    ours = build_model(config.model)
    ours.load_state_dict(
        {n: source.read(f"model/{n}", (0,) * p.dim(), tuple(p.shape), p.dtype) for n, p in ours.named_parameters()}
        | {"layers.3.proj.weight": source.read("model/layers.0.tok.weight", (0, 0), (300, 32), torch.float32)},
        strict=True,
    )
    tokens = _tokens()[:, :8]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(gpt2).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, rtol=ROUND_OFF, atol=ROUND_OFF)
        state = {n: p.detach() for n, p in ours.named_parameters()}
    written = write_hf(state, config.model, tmp_path / "short")
    assert json.loads((written / "config.json").read_text())["n_positions"] == 8
    assert "written at the 8 positions the model trained on" in (export_note(config.model) or "")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(written).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, theirs(tokens).logits, rtol=ROUND_OFF, atol=ROUND_OFF)
    longer = from_dict({"model": {**settings, "context_length": 32}})
    with pytest.raises(CheckpointError, match=r"--set model.context_length=16 \(or less\)"):
        HFSource(gpt2, longer)


def _train_with_hf_folders(config, out):
    from polyshard.trainer.loop import train

    train(config, Mesh(config.parallel.mesh_axes), Path(out))


def test_checkpoint_hf_every_writes_folders_transformers_loads(distributed, gpt2, corpus, tmp_path):
    """checkpoint.hf_every = 2 on dp2: the checkpoints of steps 2 and 4 also become Hugging Face folders,
    each the same model as the checkpoint (logits to float32 round-off)."""
    import dataclasses

    from polyshard.checkpoint import Checkpoint
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate

    base = _config(gpt2, corpus, dp=2)
    config = dataclasses.replace(
        base,
        training=dataclasses.replace(base.training, steps=4),
        eval=dataclasses.replace(base.eval, sample_tokens=0),
        checkpoint=dataclasses.replace(base.checkpoint, every=2, hf_every=2, keep=4),
    )
    distributed.run(2, _train_with_hf_folders, config, str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run" / "hf").iterdir()) == ["step_00000002", "step_00000004"]
    ours = build_model(config.model)
    ours.load_state_dict(consolidate(Checkpoint(tmp_path / "run" / "checkpoints" / "step_00000004")), strict=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf" / "step_00000004").eval()
    tokens = _tokens()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), theirs(tokens).logits, rtol=ROUND_OFF, atol=ROUND_OFF)


def test_checkpoint_hf_every_is_checked_before_launch(gpt2, corpus):
    from polyshard.trainer.engine.constraints import validate
    from polyshard.trainer.errors import ConfigError

    settings = {"model": model_settings(gpt2), "checkpoint": {"every": 2, "hf_every": 3}}
    with pytest.raises(ConfigError, match="hf_every=3 must be a multiple of checkpoint.every=2"):
        validate(from_dict(settings))
    vit = {"model": {"kind": "vit", "hidden": 32, "num_layers": 2, "num_heads": 4}, "checkpoint": {"hf_every": 5}}
    with pytest.raises(ConfigError, match="checkpoint.hf_every=5: model.kind='vit' has no Hugging Face counterpart"):
        validate(from_dict(vit))
