"""``polyshard plan``: choose a layout before launch, from a cost model calibrated on this machine.

polyshard plan --calibrate                               # measure this machine (a few minutes)
polyshard plan tiny --devices 4 --global-batch 16        # rank the layouts of the tiny GPT on 4 processes
polyshard plan CONFIG.toml --devices 16384 --devices-per-node 8 --memory-gb 80 --profile h100-nvlink-ib
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from polyshard.cli.errors import fail
from polyshard.cli.outputs import report_file

DEFAULT_PROFILE = Path.home() / ".cache" / "polyshard" / "profile.json"


def plan_command(
    model: str | None = typer.Argument(
        None, help="A preset (tiny, llama-3-8b, ...), a TOML config, or a Hugging Face folder or its config.json."
    ),
    devices: int | None = typer.Option(None, "--devices", min=1, help="Processes (devices) to lay out."),
    devices_per_node: int | None = typer.Option(
        None, "--devices-per-node", min=1, help="Devices per node (default: the profile's)."
    ),
    memory_gb: float | None = typer.Option(None, "--memory-gb", help="Memory per device, GB (default: the profile's)."),
    global_batch: int | None = typer.Option(
        None, "--global-batch", min=1, help="Sequences per step (default: the config's)."
    ),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="Tokens per sequence (default: the model's)."),
    precision: str | None = typer.Option(None, "--precision", help="fp32 or bf16 (default: the config's)."),
    dp: int | None = typer.Option(None, "--dp", min=1, help="Fix the data-parallel size."),
    dp_shard: int | None = typer.Option(
        None, "--dp-shard", min=1, help="Fix hybrid sharding: ZeRO over groups of this many data ranks."
    ),
    tp: int | None = typer.Option(None, "--tp", min=1, help="Fix the tensor-parallel size."),
    pp: int | None = typer.Option(None, "--pp", min=1, help="Fix the pipeline size."),
    ep: int | None = typer.Option(None, "--ep", min=1, help="Fix the expert-parallel size."),
    cp: int | None = typer.Option(None, "--cp", min=1, help="Fix the context-parallel size."),
    cp_style: str | None = typer.Option(
        None, "--cp-style", help="Fix how cp splits attention: ring, allgather, ulysses or ulysses+ring."
    ),
    cp_ulysses: int | None = typer.Option(
        None, "--cp-ulysses", min=1, help="Fix the all-to-all group of cp style ulysses+ring (a divisor of --cp)."
    ),
    sequence_parallel: bool | None = typer.Option(
        None, "--sequence-parallel/--no-sequence-parallel", help="Fix sequence parallelism on or off (with tp)."
    ),
    virtual_stages: int | None = typer.Option(
        None, "--virtual-stages", min=1, help="Fix the pipeline stages per rank (interleaved: any; V schedules: 2)."
    ),
    activation_checkpointing: str | None = typer.Option(
        None, "--activation-checkpointing", help="Fix activation checkpointing: none, full or selective."
    ),
    zero: int | None = typer.Option(None, "--zero", min=0, max=3, help="Fix the ZeRO stage."),
    microbatches: int | None = typer.Option(None, "--microbatches", min=1, help="Fix the microbatches per step."),
    schedule: str | None = typer.Option(None, "--schedule", help="Fix the pipeline schedule."),
    profile_name: str | None = typer.Option(
        None,
        "--profile",
        help="h100-nvlink-ib, h100-96gb-nvlink-ib, h200-nvlink-ib, a100-nvlink-ib or a profile file (default: "
        "this machine's, from --calibrate).",
    ),
    top: int = typer.Option(10, "--top", min=1, help="Layouts to print."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the estimates to this JSON file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json file (or --calibrate's --out)."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Measure this machine and save its profile."),
    quick: bool = typer.Option(False, "--quick", help="With --calibrate: one short round (rougher)."),
    out: Path = typer.Option(DEFAULT_PROFILE, "--out", help="With --calibrate: where to write the profile."),
) -> None:
    """Rank the layouts of a model on N devices by estimated step time (or --calibrate this machine)."""
    from polyshard.planner.calibrate import FULL, QUICK
    from polyshard.planner.calibrate import calibrate as measure
    from polyshard.planner.profile import load_profile
    from polyshard.planner.report import flops_line, table
    from polyshard.planner.search import Request, search
    from polyshard.trainer import ConfigError, sequence_length

    if calibrate:
        if out == DEFAULT_PROFILE:  # ours: its folder is made on a fresh machine, and it is refreshed in place
            out.parent.mkdir(parents=True, exist_ok=True)
        report_file("plan", "--out", out, overwrite or out == DEFAULT_PROFILE)
        profile = measure(sweep=QUICK if quick else FULL, log=typer.echo)
        out.write_text(profile.to_json())
        typer.echo(f"profile written to {out} ({profile.source})")
        return
    given: dict[str, int | str | None] = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "zero_stage": zero}
    given |= {"microbatches": microbatches, "schedule": schedule, "dp_shard": dp_shard, "cp": cp}
    given |= {"sequence_parallel": sequence_parallel, "virtual_stages": virtual_stages}
    given |= {"cp_style": cp_style, "cp_ulysses": cp_ulysses}
    if activation_checkpointing is not None:  # the config's spelling: false for none
        given["activation_checkpointing"] = False if activation_checkpointing == "none" else activation_checkpointing
    fixed = {key: value for key, value in given.items() if value is not None}
    report = report_file("plan", "--json", json_path, overwrite)
    try:
        if model is None or devices is None:
            raise ConfigError("give a model and --devices, e.g. `polyshard plan tiny --devices 4` (or --calibrate)")
        config = load_model(model, global_batch=global_batch, seq_len=seq_len, precision=precision)
        profile = load_profile(profile_name or default_profile())
        memory = memory_gb if memory_gb is not None else profile.memory_gb
        if not memory > 0:
            raise ConfigError(f"--memory-gb {memory} must be > 0 (the profile {profile.name!r} does not say)")
        per_node = devices_per_node or min(devices, profile.devices_per_node)
        request = Request(devices=devices, devices_per_node=per_node, memory_gb=memory, fixed=fixed)
        _check_fixed(fixed, devices)
        plan = search(config, request, profile)
    except (ConfigError, ValueError) as err:
        fail("plan", err)
    tokens = sequence_length(config.model)
    typer.echo(
        f"{config.model.kind} on {devices} devices ({per_node} per node, {memory:g} GB each), global batch "
        f"{config.training.global_batch_size} x {tokens} tokens, {config.training.precision}; "
        f"profile {profile.name}: {profile.source}"
    )
    typer.echo(flops_line(config.model, tokens))
    typer.echo(f"{plan.considered} layouts considered, {plan.fitting} fit; the best {len(plan.ranked)} simulated:")
    if not plan.ranked:
        typer.echo("no layout fits: give more devices or memory, a smaller batch, or fewer fixed axes", err=True)
        raise typer.Exit(1)
    typer.echo(table(plan.ranked[:top]))
    if report is not None:
        report.write_text(json.dumps(plan_json(plan, profile.name), indent=2))


def plan_json(plan: Any, profile: str) -> dict[str, Any]:
    """``{"per_rank_gb", "comm_bytes", "step_s"}`` of the best layout, and the ranked layouts."""
    best = plan.ranked[0].as_dict()
    return {
        "per_rank_gb": best["per_rank_gb"],
        "comm_bytes": best["comm_bytes"],
        "step_s": best["step_s"],
        "layout": best["layout"],
        "profile": profile,
        "considered": plan.considered,
        "fitting": plan.fitting,
        "layouts": [c.as_dict() for c in plan.ranked],
    }


def load_model(spec: str, *, global_batch: int | None, seq_len: int | None, precision: str | None) -> Any:
    """A Config for a preset name, a TOML config, or a Hugging Face folder (or its config.json)."""
    from polyshard.trainer import PRESETS, ConfigError, from_dict, load_config

    overrides = []
    if global_batch is not None:
        overrides.append(f"training.global_batch_size={global_batch}")
    if seq_len is not None:
        overrides.append(f"model.context_length={seq_len}")
    if precision is not None:
        overrides.append(f"training.precision={json.dumps(precision)}")
    path = Path(spec)
    if spec in PRESETS:
        return load_config(None, [f'model.preset="{spec}"', *overrides])
    if path.is_dir() or path.name == "config.json":
        from polyshard.trainer import apply_overrides, model_settings

        folder = path if path.is_dir() else path.parent
        return from_dict(apply_overrides({"model": dict(model_settings(folder))}, overrides))
    if path.suffix == ".toml":
        return load_config(path, overrides)
    raise ConfigError(f"model {spec!r} is not a preset ({', '.join(PRESETS)}), a .toml config or a Hugging Face folder")


def default_profile() -> Path:
    from polyshard.planner.profile import BUILTIN
    from polyshard.trainer import ConfigError

    if not DEFAULT_PROFILE.is_file():
        raise ConfigError(
            f"no profile of this machine at {DEFAULT_PROFILE}: run `polyshard plan --calibrate`, or give "
            f"--profile with one of {', '.join(BUILTIN)} or a profile file"
        )
    return DEFAULT_PROFILE


def _check_fixed(fixed: dict[str, Any], devices: int) -> None:
    from polyshard.trainer import SCHEDULES, ConfigError
    from polyshard.trainer.config.sections import CP_STYLES

    if fixed.get("cp_style", "ring") not in CP_STYLES:
        raise ConfigError(f"--cp-style {fixed['cp_style']!r}; choose one of {list(CP_STYLES)}")
    if "schedule" in fixed and fixed["schedule"] not in SCHEDULES:
        raise ConfigError(f"--schedule {fixed['schedule']!r}; choose one of {list(SCHEDULES)}")
    if fixed.get("activation_checkpointing", False) not in (False, "full", "selective"):
        raise ConfigError(
            f"--activation-checkpointing {fixed['activation_checkpointing']!r}; choose none, full or selective"
        )
    product = 1
    for axis in ("dp", "tp", "pp", "ep", "cp"):
        product *= fixed.get(axis, 1)
    if devices % product:
        raise ConfigError(f"the fixed axes multiply to {product}, which do not divide --devices {devices}")
