"""The models are plain PyTorch whose ordered layers compose to the forward pass."""

import torch
import torch.nn.functional as F

from polyshard.models import GPT, ViT, build_model, sequence_length
from polyshard.trainer.config import from_dict


def _gpt2_by_hand(weights, tokens, num_heads):
    """GPT-2's forward written out from the weights with plain tensor ops (no module of the model runs):
    learned positions, pre-norm blocks with causal attention and a tanh-GELU MLP, final norm, head."""
    w, seq = weights, tokens.shape[1]
    last = max(int(name.split(".")[1]) for name in w)

    def norm(x, name):
        centred = x - x.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def heads(x):  # (B, S, H) -> (B, N, S, D)
        return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)

    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    x = w["layers.0.tok.weight"][tokens] + w["layers.0.pos.weight"][:seq]
    for i in range(1, last):
        h = norm(x, f"layers.{i}.norm1")
        q, k, v = (heads(linear(h, f"layers.{i}.attn.{n}_proj")) for n in "qkv")
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(future, float("-inf"))
        x = x + linear((scores.softmax(-1) @ v).transpose(1, 2).flatten(2), f"layers.{i}.attn.o_proj")
        h = linear(norm(x, f"layers.{i}.norm2"), f"layers.{i}.mlp.fc_in")
        h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
        x = x + linear(h, f"layers.{i}.mlp.fc_out")
    return norm(x, f"layers.{last}.norm") @ w[f"layers.{last}.proj.weight"].T


def test_gpt_forward_is_gpt2_written_out_and_causal():
    torch.manual_seed(0)
    config = from_dict({"model": {"preset": "tiny", "num_layers": 2}}).model
    model = build_model(config)
    assert isinstance(model, GPT) and len(model.layers) == 4  # embedding, 2 blocks, head
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb every tensor so that each one counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    # float32 in another order of operations (SDPA, fused LayerNorm): round-off only
    torch.testing.assert_close(logits, _gpt2_by_hand(weights, tokens, config.num_heads), rtol=1e-5, atol=1e-5)
    # Changing a later token leaves earlier positions' logits untouched (causal attention).
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10], rtol=0, atol=0)
    assert not torch.equal(model(changed)[:, 10:], logits[:, 10:])


def test_gpt_tied_embeddings_and_gqa_train():
    torch.manual_seed(0)
    model = GPT(
        vocab_size=32, context_length=8, hidden=32, num_layers=1, num_heads=4, num_kv_heads=2, tie_embeddings=True
    )
    assert model.layers[-1].proj.weight is model.layers[0].tok.weight
    assert model.layers[1].attn.k_proj.out_features == 16  # 2 kv heads x head dim 8
    tokens = torch.randint(0, 32, (4, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # memorising 4 short sequences is easy
    out = model.generate(tokens[:1, :3], 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and torch.equal(out[:, :3], tokens[:1, :3])


def test_vit_shapes():
    torch.manual_seed(0)
    config = from_dict({"model": {"kind": "vit", "hidden": 32, "num_layers": 2, "num_heads": 4}}).model
    model = build_model(config)
    assert isinstance(model, ViT) and sequence_length(config) == 17  # 16 patches + class token
    images = torch.randn(3, 1, 8, 8)
    assert model.layers[0](images).shape == (3, 17, 32)
    assert model(images).shape == (3, 10)


def _saved_bytes(model, tokens):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).sum().backward()
    return sum(total)


def test_activation_checkpointing_keeps_less_and_computes_the_same():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, context_length=32, hidden=64, num_layers=3, num_heads=4)
    tokens = torch.randint(0, 64, (4, 32))
    plain_bytes = _saved_bytes(model, tokens)
    plain_grads = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)  # the same weights again
    recomputing = GPT(
        vocab_size=64, context_length=32, hidden=64, num_layers=3, num_heads=4, checkpoint_activations=True
    )
    checkpointed_bytes = _saved_bytes(recomputing, tokens)
    assert checkpointed_bytes < 0.5 * plain_bytes  # only block inputs survive the forward
    for p, g in zip(recomputing.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)  # the recomputation repeats the same ops


def test_each_layer_is_seeded_alone_so_a_stage_builds_only_its_own():
    config = from_dict({"model": {"kind": "moe-gpt", "preset": "tiny", "num_layers": 3}}).model
    full = build_model(config, seed=5)
    part = build_model(config, seed=5, layers=[1, 3])
    for i, (whole, alone) in enumerate(zip(full.layers, part.layers)):
        for (name, a), (_, b) in zip(whole.named_parameters(), alone.named_parameters(), strict=True):
            if i in (1, 3):
                assert torch.equal(a, b), (i, name)  # the same numbers without building layers 0 and 2
            else:
                assert b.is_meta and b.shape == a.shape, (i, name)  # shapes only, no memory
    assert not torch.equal(full.layers[1].attn.q_proj.weight, build_model(config, seed=6).layers[1].attn.q_proj.weight)
    experts = full.layers[2].mlp.moe.experts.requires_grad_(False)
    assert 0.015 < float(experts.w1.std()) < 0.025  # N(0, 0.02); the down projection is scaled down
    assert float(experts.w2.std()) < 0.6 * float(experts.w1.std())
    tied = build_model(from_dict({"model": {"preset": "tiny", "tie_embeddings": True}}).model)
    assert tied.layers[-1].proj.weight is tied.layers[0].tok.weight
