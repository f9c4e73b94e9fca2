"""Config parsing is strict and every cross-field constraint has a typed error."""

import pytest

from polyshard.trainer.config import Config, apply_overrides, from_dict, load_config
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError


def _cfg(**sections):
    return from_dict(sections)


def test_toml_file_with_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\nnum_layers = 2\n[parallel]\ndp = 2\ntp = 2\n[training]\nlr = 1e-3\n')
    config = load_config(path, ["training.lr=3e-4", "parallel.sequence_parallel=true", "data.source=shakespeare"])
    assert config.model.hidden == 64 and config.model.num_layers == 2  # preset, then the explicit key
    assert config.optimizer.lr == 3e-4 and config.parallel.sequence_parallel is True
    assert config.data.source == "shakespeare" and config.parallel.world_size == 4
    validate(config, world_size=4)


def test_defaults_are_valid():
    validate(Config(), world_size=1)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"trainig": {}}, "unknown config section 'trainig'; did you mean 'training'?"),
        ({"training": {"learning_rate": 1}}, "unknown key in \\[training\\] 'learning_rate'"),
        ({"model": {"num_head": 4}}, "did you mean 'num_heads'"),
        ({"model": {"kind": "rnn"}}, "model.kind='rnn'; choose one of"),
        ({"model": {"preset": "huge"}}, "model.preset='huge'; choose one of"),
        ({"model": {"hidden": 30, "num_heads": 4}}, "choose num_heads in \\[1, 2, 3, 5, 6, 10, 15, 30\\]"),
        ({"model": {"num_kv_heads": 3}}, "must divide model.num_heads=4"),
        ({"parallel": {"tp": 0}}, "parallel.tp=0 must be an integer >= 1"),
        ({"parallel": {"zero_stage": 4}}, "choose 0, 1, 2 or 3"),
        ({"parallel": {"virtual_stages": 2}}, "needs parallel.schedule='interleaved'"),
        ({"parallel": {"schedule": "zb-v"}}, "two stages on each pipeline rank .a V.; set parallel.virtual_stages=2"),
        ({"training": {"precision": "fp8"}}, "choose one of \\['fp32', 'bf16'\\]"),
        (
            {"optimizer": {"lr": 1e-4}, "lr_schedule": {"min_lr": 1e-3}},
            "need lr_schedule.min_lr .0.001. <= optimizer.lr",
        ),
        ({"optimizer": {"name": "sgd"}}, "optimizer.name='sgd'; choose one of \\['adamw', 'muon'\\]"),
        ({"optimizer": {"muon_momentum": 1.0}}, "optimizer.muon_momentum=1.0 must be in \\[0, 1\\)"),
        ({"optimizer": {"muon_ns_steps": 0}}, "optimizer.muon_ns_steps=0 must be an integer >= 1"),
        # Up to 0.4 these keys were [training]'s: they still read, and an error names today's field.
        ({"training": {"optimizer": "sgd"}}, "optimizer.name='sgd'; choose one of"),
        ({"training": {"lr": 1e-3}, "optimizer": {"lr": 1e-4}}, "training.lr and optimizer.lr are one setting"),
        ({"training": {"lr": 1e-4, "min_lr": 1e-3}}, "need lr_schedule.min_lr .0.001. <= optimizer.lr"),
        ({"data": {"val_fraction": 1.5}}, "strictly between 0 and 1"),
        ({"parallel": {"stage_layers": [2, 0]}}, "must be a list of layer counts >= 1"),
        ({"model": {"norm_eps": 0}}, "model.norm_eps=0.0 must be in \\(0, 1\\)"),
        ({"model": {"norm_eps": "1e-6"}}, "model.norm_eps='1e-6' must be a finite number"),
        ({"model": {"preset": "llama-tiny", "rope": {"factor": 0.5}}}, "model.rope.factor=0.5 must be a finite"),
        ({"model": {"rope": {"scaling": "llama3", "factor": 8}}}, "scales rotary positions, but model.positions='lea"),
        ({"model": {"rope": {"factor": 8}}}, "model.rope.factor=8.0 stretches the context by a rule"),
        ({"model": {"rope": {"low_freq_factor": 4, "high_freq_factor": 1}}}, "need 0 < low < high"),
        ({"model": {"rope": {"original_context": 0}}}, "model.rope.original_context=0 must be >= 1"),
        ({"model": {"rope": {"original_context": 8192.0}}}, "model.rope.original_context=8192.0 must be an integer"),
        ({"model": {"rope": {"theta": 0}}}, r"model.rope.theta=0.0 must be a finite number > 0"),
        ({"model": {"rope": {"base": 5}}}, r"unknown key in \[model.rope\] 'base'"),
        ({"model": {"rope": 5}}, r"model.rope must be a table of key = value pairs \(\[model.rope\]\)"),
        # 0.3's flat spellings still read (with a note): their errors name the new field.
        ({"model": {"preset": "llama-tiny", "rope_scale_factor": 0.5}}, "model.rope.factor=0.5 must be a finite"),
        ({"model": {"rope_theta": 5.0, "rope": {"theta": 6.0}}}, "are one setting; keep model.rope.theta"),
        ({"model": {"kind": "vit", "rope": {"theta": 5.0}}}, "model.rope is not a setting of model.kind='vit'"),
        # An MoE's settings are [model.moe]'s, checked once (polyshard.models.common.moe.MoEConfig's rules, named here).
        ({"model": {"kind": "moe-gpt", "moe": {"score": "relu"}}}, "model.moe: score='relu' is unknown; choose one"),
        ({"model": {"kind": "moe-gpt", "moe": {"bias_update_rate": 0.001}}}, "balances a sigmoid router's selection"),
        ({"model": {"kind": "moe-gpt", "moe": {"bias_update_rate": -0.1}}}, "model.moe.bias_update_rate=-0.1 must be"),
        ({"model": {"kind": "moe-gpt", "moe": {"scale": 0}}}, "model.moe: scale=0.0 must be > 0"),
        ({"model": {"kind": "moe-gpt", "moe": {"num_experts": 8, "groups": 3}}}, "choose groups in \\[1, 2, 4, 8\\]"),
        ({"model": {"kind": "moe-gpt", "moe": {"num_experts": 8, "groups": 4, "group_topk": 5}}}, "group_topk=5 must"),
        ({"model": {"kind": "moe-gpt", "moe": {"num_experts": 8, "top_k": 3, "groups": 4}}}, "top_k=3 exceeds the 2"),
        (
            {"model": {"kind": "moe-gpt", "moe": {"seq_aux_loss_coef": -1}}},
            "must be >= 0, got .*seq_aux_loss_coef=-1.0",
        ),
        ({"model": {"kind": "moe-gpt", "moe": {"top_k": 1.5}}}, "model.moe.top_k=1.5 must be an integer"),
        ({"model": {"kind": "moe-gpt", "moe": {"experts": 4}}}, "unknown key in \\[model.moe\\] 'experts'"),
        # A family holds its own fields only: the ViT has no router, the GPT no image.
        ({"model": {"kind": "vit", "num_experts": 7}}, "model.num_experts is not a setting of model.kind='vit'"),
        ({"model": {"kind": "vit", "rope_theta": 5.0}}, "not a setting of model.kind='vit'.*image_size"),
        ({"model": {"image_size": 8}}, "model.image_size is not a setting of model.kind='gpt'"),
        ({"model": {"moe": {"top_k": 2}}}, "model.moe is not a setting of model.kind='gpt'"),
        ({"model": {"router": "sigmoid"}}, "model.router is not a setting of model.kind='gpt'"),
        ({"model": {"kind": "moe-gpt", "top_k": 2, "moe": {"top_k": 1}}}, "are one setting; keep model.moe.top_k"),
        # The old key first, then the new one as a dotted key: still one setting twice, not the old one winning.
        ({"model": {"kind": "moe-gpt", "top_k": 2, "moe.top_k": 1}}, "are one setting; keep model.moe.top_k"),
    ],
)
def test_bad_fields(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate(from_dict(raw))  # a field's own range when read; the family's (kind, top_k, ...) by validate


@pytest.mark.parametrize(
    "raw, world, message",
    [
        ({"parallel": {"dp": 2, "tp": 2}}, 2, "has 4 ranks but 2 processes were asked for; use --nproc 4"),
        ({"model": {"num_heads": 6, "hidden": 48}, "parallel": {"tp": 4}}, 4, "choose tp in \\[1, 2, 3, 6\\]"),
        (
            {"model": {"num_heads": 6, "hidden": 48, "num_kv_heads": 3}, "parallel": {"tp": 2}},
            2,
            "neither divides model.num_kv_heads=3 nor is a multiple of it \\(which replicates each kv head\\); "
            "choose tp in \\[1, 3, 6\\]",
        ),
        ({"model": {"context_length": 30}, "parallel": {"tp": 4, "sequence_parallel": True}}, 4, "sequence parallel"),
        ({"model": {"num_layers": 2}, "parallel": {"pp": 8}}, 8, "use at most 4 stages"),
        (
            {"model": {"context_length": 30}, "parallel": {"cp": 2}},
            2,
            r"2 x cp = 4 chunks .* choose cp in \[1, 3, 5, 15\]",
        ),
        ({"model": {"kind": "vit"}, "parallel": {"cp": 2}}, 2, "parallel.cp=2 is not supported for model.kind='vit'"),
        ({"model": {"dropout": 0.1}, "parallel": {"cp": 2}}, 2, "no attention dropout; set model.dropout=0"),
        (
            {"model": {"context_length": 36}, "parallel": {"cp": 2, "tp": 4, "sequence_parallel": True}},
            8,
            "splits each cp rank's 18 positions over tp=4",
        ),
        (
            {"parallel": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 3}},
            2,
            "multiple of parallel.pp",
        ),
        (
            {"parallel": {"pp": 2, "schedule": "dualpipev", "virtual_stages": 2, "microbatches": 3}},
            2,
            "needs parallel.microbatches \\(3\\) >= 2 x parallel.pp \\(4\\)",
        ),
        # Only sizes that pass every tp check: 25 positions, 6 heads -> 5 and 25 would fail on the heads.
        (
            {
                "model": {"num_heads": 6, "hidden": 48, "context_length": 25},
                "parallel": {"tp": 2, "sequence_parallel": True},
            },
            2,
            "choose tp in \\[1\\] or turn",
        ),
        ({"parallel": {"ep": 2}}, 2, "needs experts"),
        (
            {"model": {"kind": "moe-gpt", "moe": {"num_experts": 6}}, "parallel": {"ep": 4}},
            4,
            "choose ep in \\[1, 2, 3, 6\\]",
        ),
        ({"parallel": {"dp": 2, "microbatches": 3}, "training": {"global_batch_size": 16}}, 2, "multiple of 6"),
        ({"parallel": {"pp": 2, "stage_layers": [3, 2]}}, 2, "layer counts that add up to 6"),
        ({"parallel": {"pp": 2, "stage_layers": [6]}}, 2, "must give 2 pipeline stages"),
        (
            {"model": {"kind": "moe-gpt"}, "parallel": {"ep": 2, "zero_stage": 3}},
            2,
            "zero_stage=3 with parallel.ep=2 is not supported",
        ),
        ({"model": {"kind": "vit"}}, 1, "set data.source='digits'"),
        ({"data": {"source": "digits"}}, 1, "needs model.kind='vit'"),
    ],
)
def test_cross_field_constraints(raw, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(from_dict(raw), world_size=world)


def test_override_syntax_errors(tmp_path):
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        apply_overrides({}, ["training.lr"])
    with pytest.raises(ConfigError, match="must name section.key"):
        apply_overrides({}, ["lr=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
    assert _cfg(training={"steps": 5}).training.steps == 5


@pytest.mark.parametrize(
    "override, message",
    [
        ('optimizer.lr="fast"', r"optimizer.lr='fast' must be a finite number"),
        ("optimizer.lr=fast", r"optimizer.lr='fast' must be a finite number"),
        ("training.lr=fast", r"optimizer.lr='fast' must be a finite number"),  # 0.4's spelling, today's name
        ("optimizer.lr=nan", r"optimizer.lr=nan must be a finite number"),
        ("optimizer.lr=inf", r"optimizer.lr=inf must be a finite number"),
        ("optimizer.grad_clip=nan", r"optimizer.grad_clip=nan must be a finite number"),
        ("optimizer.weight_decay=-1", r"optimizer.weight_decay=-1.0 must be >= 0"),
        ("lr_schedule.warmup_steps=1.5", r"lr_schedule.warmup_steps=1.5 must be an integer"),
        ("optimizer.beta1=1.5", r"optimizer.beta1=1.5 must be in \[0, 1\)"),
        ("eval.batches=-1", r"eval.batches=-1 must be >= 0"),
        ("logging.every=0", r"logging.every=0 must be an integer >= 1"),
        (("model.kind=moe-gpt", "model.moe.capacity_factor=-1"), r"capacity_factor=-1.0 must be > 0"),
        (("model.kind=vit", "model.patch_size=0"), r"model.patch_size=0 must be an integer >= 1"),
        ("parallel.dp=2.0", r"parallel.dp=2.0 must be an integer"),
        ("parallel.stage_layers=[1,true]", r"parallel.stage_layers=\[1, True\] must be a list of integers"),
        ("model.tie_embeddings=maybe", r"model.tie_embeddings='maybe' must be true or false"),
        ("parallel.timeout_s=0", r"parallel.timeout_s=0.0 must be in \(0, 604800\] seconds"),
    ],
)
def test_every_field_is_checked_for_type_and_range(override, message):
    # Before: "lr=fast" failed inside the workers with "'<=' not supported ...", nan/inf and a
    # negative weight decay trained to the end, and warmup_steps=1.5 was taken as is.
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override] if isinstance(override, str) else list(override))


def test_overrides_parse_with_the_fields_type():
    # Before: "False" was not TOML, stayed the string "False", and a non-empty string is true.
    for text, expected in [("False", False), ("false", False), ("0", False), ("True", True), ("1", True)]:
        config = load_config(None, [f"model.tie_embeddings={text}", f"data.shuffle={text}"])
        assert config.model.tie_embeddings is expected and config.data.shuffle is expected
    assert load_config(None, ["training.lr=1"]).optimizer.lr == 1.0 and isinstance(
        load_config(None, ["training.lr=1"]).optimizer.lr, float
    )


def test_a_key_outside_any_section_is_named(tmp_path):
    (tmp_path / "c.toml").write_text("steps = 5\n[training]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"steps = 5 stands outside any \[section\]; put it under \[training\]"):
        load_config(tmp_path / "c.toml")
