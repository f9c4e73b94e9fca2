"""`polyshard bench peers`: the composed GPT against the torch-native composition (losses matched
step by step), a strategy group's rows, the report and the command's checks. Timings are not asserted."""

import json
import math

import pytest
from typer.testing import CliRunner

from polyshard.bench import peers
from polyshard.cli.main import app


def _composed(layout, grad_clip=1.0, preset="tiny"):
    peers.quiet_peer_warnings()
    return peers.composed_case(layout, steps=1, check_steps=3, warmup=0, grad_clip=grad_clip, preset=preset)


@pytest.mark.parametrize(
    ("preset", "layout"),
    [("tiny", {"dp": 2}), ("tiny", {"tp": 2}), ("tiny", {"pp": 2}), ("llama-tiny", {"tp": 2})],
    ids=["dp2", "tp2", "pp2", "llama-tp2-sp"],  # the last: torchtitan's Llama plan, SP norms and loss parallel
)
def test_composed_gpt_matches_the_torch_native_composition(distributed, preset, layout):
    # A clip far below the gradients' norm, so both sides scale every step's gradients: Adam's first
    # update ignores a gradient's scale, the second does not (a peer that skipped the clip differed
    # from the third loss on).
    records = distributed.run(2, _composed, layout, 0.01, preset)
    assert records[0]["case"] == records[1]["case"]
    r = records[0]
    assert "peer_unavailable" not in r, r.get("peer_unavailable")
    assert r["outputs_match"] is True, r
    assert len(r["ours_losses"]) == len(r["peer_losses"]) == 3
    for ours, peer in zip(r["ours_losses"], r["peer_losses"]):
        assert math.isclose(ours, peer, rel_tol=peers.LOSS_RTOL)
    # ~ln(256) = 5.5: random tokens on a fresh byte-level model (the Llama's depth init starts near 6.0)
    assert 5.0 < r["ours_losses"][0] < 6.5
    assert len(set(r["ours_losses"])) == 3  # each a new batch after an optimizer step
    assert r["ours_s"] > 0 and r["peer_s"] > 0 and r["ratio"] == pytest.approx(r["ours_s"] / r["peer_s"])
    # Parameters, gradients and AdamW's two moments, float32: 16 bytes per parameter unsharded.
    config = peers.composed_config(layout, preset)
    assert config.parallel.sequence_parallel == (preset == "llama-tiny")
    if config.parallel.sequence_parallel:  # the case names it, so a table row says which plan ran
        assert " SP " in r["case"]
    from polyshard.models import parameter_count

    unsharded = 16 * parameter_count(config.model)
    for held in (r["ours_held_bytes"], r["peer_held_bytes"]):
        if "dp" in layout:  # ZeRO-3 and fully_shard: about half on each of two ranks
            assert 0.45 * unsharded < held < 0.6 * unsharded
        else:  # tp or pp: each rank holds part of the model, all of its states
            assert 0.3 * unsharded < held < 0.8 * unsharded


@pytest.mark.long
def test_fsdp_tp_sp_matches_torchtitans_two_d_composition(distributed):
    # torchtitan's 2-D layout: fully_shard over a DTensor tp + SP mesh against our ZeRO-3 with tp + SP, on
    # 4 processes; the same clip as above, so every step's gradients are scaled on both sides.
    records = distributed.run(4, _composed, {"dp": 2, "tp": 2}, 0.01, "llama-tiny")
    r = records[0]
    assert "peer_unavailable" not in r, r.get("peer_unavailable")
    assert " ZeRO-3 SP " in r["case"] and r["outputs_match"] is True, r
    for ours, peer in zip(r["ours_losses"], r["peer_losses"], strict=True):
        assert math.isclose(ours, peer, rel_tol=peers.LOSS_RTOL)


def _tp_rows():
    return peers.measure(["tp"], steps=1)


def test_a_strategy_group_gives_its_package_benchmark_rows(distributed):
    rows = distributed.run(2, _tp_rows)[0]
    assert [r["group"] for r in rows] == ["tp", "tp"] and all(r["world_size"] == 2 for r in rows)
    assert all(r["outputs_match"] and r["ours_held_bytes"] > 0 and r["peer_held_bytes"] > 0 for r in rows)
    assert rows[0]["case"].startswith("mlp fwd+bwd tp=2")


def test_report_lists_unavailable_peers_and_summarises():
    rows = [
        {"case": "a", "ours_s": 0.01, "peer_s": 0.02, "ratio": 0.5, "outputs_match": True, "ours_held_bytes": 2**20,
         "peer_held_bytes": 2**21},
        {"case": "b", "ours_s": 0.03, "peer_s": 0.02, "ratio": 1.5, "outputs_match": False},
        {"case": "c", "ours_s": 0.01, "peer_s": None, "ratio": None, "outputs_match": None,
         "peer_unavailable": "RuntimeError: no"},
        peers.skipped_row("dp", "not measured on cuda: why"),
    ]  # fmt: skip
    lines = peers.format_report(rows).splitlines()
    assert lines[0].split() == ["case", "ours", "(ms)", "peer", "(ms)", "ratio", "ours", "MiB", "peer", "MiB", "match"]
    assert lines[1].split() == ["a", "10.00", "20.00", "0.50", "1.00", "2.00", "yes"]
    assert lines[2].split()[-1] == "NO" and lines[3].split()[1:] == ["10.00", "–", "–", "–", "–", "n/a"]
    assert lines[4].split() == ["dp", "(package", "benchmark)", "–", "–", "–", "–", "–", "n/a"]
    assert lines[5] == "peer unavailable for c: RuntimeError: no"
    assert lines[6] == "skipped for dp (package benchmark): not measured on cuda: why"
    assert lines[7] == "2 comparisons: ratio median 1.50, 1 above 1.0 (b); 1 mismatched (b)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "3"], "choose one of [2, 4, 8]"),
        (["--only", "dp,zz"], "unknown ['zz']; choose from ['dp', 'tp', 'pp', 'ep', 'cp', 'composed']"),
        (["--steps", "0"], "--steps 0: give a whole number of at least 1"),
        (["--preset", "tiny,huge"], "unknown ['huge']; choose from ['tiny', 'small', 'llama-tiny'"),
        (["--modes", "fast"], "unknown ['fast']; choose from ['eager', 'compiled']"),
    ],
)
def test_command_rejects_bad_options(args, message):
    result = CliRunner().invoke(app, ["bench", "peers", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.replace("│", " ").split())


@pytest.mark.bench  # the bench command run to its end: make test-bench
def test_command_runs_the_composed_jobs_on_two_processes(tmp_path):
    out = tmp_path / "peers.json"
    result = CliRunner().invoke(app, ["bench", "peers", "--nproc", "2", "--only", "composed", "--steps", "2",
                                      "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [r["layout"] for r in rows] == [{"dp": 2}, {"tp": 2}, {"pp": 2}]
    assert all(r["outputs_match"] and r["world_size"] == 2 for r in rows)


def _composed_compiled(layouts):
    peers.quiet_peer_warnings()
    records = [peers.composed_case(layout, steps=1, check_steps=3, warmup=0, compiled=True) for layout in layouts]
    from polyshard.trainer.engine.compiling import compile_stats

    return records, compile_stats().frames  # the last layout's: dynamo was reset when its engine was built


@pytest.mark.bench  # the bench's compiled case, minutes of compiles: make test-bench
def test_compiled_composed_gpt_matches_the_compiled_torch_native_composition(distributed):
    # Both sides' blocks compiled (ours through training.compile, the peer's as torchtitan does, DTensor's
    # collectives traced); all three layouts in one job on the live workers.
    layouts = [{"dp": 2}, {"tp": 2}, {"pp": 2}]
    for records, frames in distributed.run(2, _composed_compiled, layouts, timeout_s=1200):
        assert frames > 0  # dynamo compiled something on this rank
        for r in records:
            assert r["case"].endswith(" compiled") and "peer_unavailable" not in r, r.get("peer_unavailable")
            assert r["outputs_match"] is True, r
            for ours, peer in zip(r["ours_losses"], r["peer_losses"]):
                assert math.isclose(ours, peer, rel_tol=peers.COMPILED_LOSS_RTOL)
