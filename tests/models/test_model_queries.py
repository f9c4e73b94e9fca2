"""The rest of polyshard asks the model's spec, never its class (issue 45): no ``isinstance`` against a
class of ``packages/models`` and no ``getattr(model, ...)`` in the planner, trainer or checkpoint sources;
no family's config derives from another's; and MFU's FLOPs per token are the planner's, for every preset
of every family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from polyshard.models.flops import layer_flops
from polyshard.models.registry import SPECS
from polyshard.models.settings import model_config, presets
from polyshard.planner.cost import stage_flops
from polyshard.planner.model_states import stage_bounds
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop.metrics import model_flops_per_token

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "packages" / "models" / "src"
ASKERS = [ROOT / "packages" / name / "src" for name in ("planner", "trainer", "checkpoint")]
GETATTR_OF_MODEL = ("model", "config.model", "self.config.model", "engine.config.model")


def _model_classes() -> set[str]:
    """Every class defined in packages/models, by name."""
    names = set()
    for path in MODELS.rglob("*.py"):
        names |= {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    return names


def _named(node: ast.expr) -> list[str]:
    """The class names an isinstance's second argument names: ``A``, ``m.A``, ``(A, B)``, ``A | B``."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _named(element)]
    if isinstance(node, ast.BinOp):
        return _named(node.left) + _named(node.right)
    return []


def _bound_elsewhere(tree: ast.Module) -> set[str]:
    """Names a file imports from outside polyshard.models or defines itself (its own class of that name)."""
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("polyshard.models"):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def offences(source: str, where: str, model_classes: set[str]) -> list[str]:
    """``where:line`` of each isinstance against a models class and each getattr on a model (config)."""
    tree = ast.parse(source)
    ours = model_classes - _bound_elsewhere(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        if node.func.id == "isinstance":
            named = sorted(set(_named(node.args[1])) & ours)
            if named:
                found.append(f"{where}:{node.lineno}: isinstance against {', '.join(named)}")
        elif node.func.id == "getattr" and ast.unparse(node.args[0]) in GETATTR_OF_MODEL:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_what_it_forbids() -> None:
    """The scan itself: each forbidden form is found, an isinstance on another package's class is not."""
    source = (
        "from polyshard.models.common import Block\nfrom polyshard.dp import ZeroOptimizer\n"
        "isinstance(m, Block)\nisinstance(m, (int, x.MLA))\nisinstance(o, ZeroOptimizer)\n"
        "getattr(model, 'mtp_depth', 0)\ngetattr(config.model, 'moe')\ngetattr(other, 'a')\n"
    )
    found = offences(source, "f.py", {"Block", "MLA", "ZeroOptimizer"})
    assert [line.split(":")[1] for line in found] == ["3", "4", "6", "7"]


def test_planner_trainer_and_checkpoint_ask_the_spec_not_the_class() -> None:
    classes = _model_classes()
    assert {"Block", "MoELayer", "MLA", "Attention", "DeepSeekV3Config", "GPTConfig", "GroupedAttention"} <= classes
    found = [
        line
        for root in ASKERS
        for path in sorted(root.rglob("*.py"))
        for line in offences(path.read_text(), str(path.relative_to(ROOT)), classes)
    ]
    found.sort()
    assert not found, "ask polyshard.models (its anatomy, shape or flops) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_no_family_config_derives_from_another_familys(kind: str) -> None:
    """A family's config is parts (polyshard.models.decoder) with its defaults, never another family's
    config with fields refused: no other family's config class is among its bases."""
    cls = SPECS[kind].config
    others = {spec.config for other, spec in SPECS.items() if other != kind and spec.config is not cls}
    assert not others & set(cls.__mro__[1:]), f"{cls.__name__} derives from {others & set(cls.__mro__)}"


@pytest.mark.parametrize("preset", sorted(presets()))
def test_mfu_and_the_planner_count_the_same_flops_per_token(preset: str) -> None:
    """The planner charges each stage its forward (matmuls + attention), a backward of the input gradients
    (the matmuls again, attention twice) and the weight gradients (the matmuls): 3 x the forward. Summed
    over a two-stage pipeline on tp2 x cp2 and brought back to one token of the whole model, that is
    MFU's model_flops_per_token."""
    config = from_dict(
        {
            "model": {"preset": preset},
            "parallel": {"pp": 2, "tp": 2, "cp": 2, "microbatches": 2},
            "training": {"global_batch_size": 4},
        }
    )
    tokens = 2 * config.model.context_length / 2  # a microbatch of 2 rows, this cp rank's half of each
    charged = sum(sum(stage_flops(config, layers)) for layers in stage_bounds(config))
    planner = 3 * charged * 2 / tokens  # x tp: every tp rank computes its share
    assert planner == pytest.approx(model_flops_per_token(config.model), rel=1e-12)


def test_a_small_gpt_counted_by_hand() -> None:
    """hidden 32, 2 blocks of 4 heads, 16 tokens, 256 words: each block's q, k, v, o (4 x 32 x 32) and MLP
    (2 x 32 x 128) weights, and the head's 256 x 32; the embedding and position tables are lookups.
    Causal attention: 2 x 8 keys on average x 4 heads x (8 + 8) dims per block."""
    model = model_config({"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16, "vocab_size": 256})
    weights = 2 * (4 * 32 * 32 + 2 * 32 * 128) + 256 * 32
    attention = 2 * (2 * 8 * 4 * (8 + 8))
    assert model_flops_per_token(model) == 6 * weights + 3 * attention


def test_mla_and_windows_count_their_own_widths() -> None:
    """DeepSeek's heads multiply q·k over Dn + Dr = 24 dims and values over Dv = 16 (its hidden, 64, is not
    the width); gpt-oss's sliding blocks (window 16 of 64 tokens) see 16 - 16²/128 = 14 keys on average."""
    deepseek = layer_flops(model_config({"preset": "deepseek-v3-tiny"}))
    assert [layer.attention for layer in deepseek[1:-1]] == [2 * 32 * 4 * (24 + 16)] * 3
    oss = layer_flops(model_config({"preset": "gpt-oss-tiny"}))
    assert [layer.attention for layer in oss[1:-1]] == [2 * k * 4 * (16 + 16) for k in (14, 32, 14, 32)]
