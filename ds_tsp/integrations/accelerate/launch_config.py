"""What `accelerate launch --config_file ...` asked for, read before the Accelerator exists: the TSP mode and degree.

`accelerate launch` turns the YAML into environment variables for every process. Two configs turn TSP on:

- DeepSpeed plugin (ds_configs/accelerate_tsp.yaml): `deepspeed_config_file` names a DeepSpeed JSON whose "tsp"
  block gives the degree; ZeRO runs on the data axis (the JSON is validated like `ds_tsp.initialize`'s).
- FSDP2 (ds_configs/accelerate_tsp_fsdp2.yaml, fsdp_version 2): Accelerate's loader rejects unknown keys, so the
  degree is written with keys it knows: `parallelism_config_tp_size` is the TSP degree and
  `parallelism_config_dp_shard_size` the data degree. Accelerate orders its mesh [dp_replicate, dp_shard, cp, sp,
  tp] with tp innermost and leaves tp to the model, exactly the TSP axis; TSPAccelerator claims that axis for TSP,
  turns Accelerate's own FSDP / parallelism setup off, and runs fully_shard on the data sub-mesh itself (Accelerate
  has no FSDP on CPU at all, so this keeps CPU and GPU on one path). `parallelism_config_cp_size` sits between
  dp_shard and tp in that mesh, where ds_tsp's cp axis sits: it is read as tsp.cp_size (C TSP groups split each
  sequence; FSDP2 shards over data x cp).

Without either (plain `python script.py`, or torchrun) the whole world is one TSP group, or, with
TSPAccelerator(cp_size=C), C TSP groups of WORLD_SIZE / C ranks that split each sequence.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping

from ds_tsp.core.config import TSPConfig, check_tsp_key, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError

_PC = "PARALLELISM_CONFIG_"


@dataclass(frozen=True)
class TSPAccelerateSetup:
    mode: str  # "deepspeed" | "fsdp2" | "plain"
    tsp: TSPConfig
    mixed_precision: str = "no"  # fsdp2: the MixedPrecisionPolicy to build ("no", "bf16", "fp16")
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False


def _flag(env, key: str) -> bool:
    return env.get(key, "false").lower() == "true"


def _size(env, key: str) -> int:
    return int(env.get(_PC + key, "1") or 1)


def _tsp_block_of(ds_config_file: str | None, deepspeed_plugin) -> TSPConfig:
    if deepspeed_plugin is not None:
        config = getattr(deepspeed_plugin, "hf_ds_config", None)
        config = deepspeed_plugin.deepspeed_config if config is None or isinstance(config, str) else config.config
        check_tsp_key(config)  # a misspelt "tsp" would train silently without TSP
        return parse_tsp_config(config.get("tsp"))
    if not ds_config_file:
        raise TSPConfigError("the Accelerate config uses DeepSpeed but names no deepspeed_config_file: put the "
                             'DeepSpeed JSON with its "tsp" block under deepspeed_config: deepspeed_config_file')
    path = Path(ds_config_file)
    if not path.is_file():
        raise TSPConfigError(f"deepspeed_config_file {ds_config_file!r} does not exist")
    config = json.loads(path.read_text())
    check_tsp_key(config)
    return parse_tsp_config(config.get("tsp"))


def resolve_setup(env: MutableMapping[str, str] = os.environ, *, tsp_size: int | None = None,
                  cp_size: int | None = None, deepspeed_plugin=None, fsdp_plugin=None,
                  parallelism_config=None) -> TSPAccelerateSetup:
    """Read (and, for FSDP2, edit) the launcher's environment; one error naming the setting for each conflict.
    tsp_size / cp_size: the plain setup's degrees (TSPAccelerator's keyword arguments, the "tsp" block's size and
    cp_size); DeepSpeed and FSDP2 take them from their own configs."""
    if fsdp_plugin is not None or parallelism_config is not None:
        raise TSPConfigError("TSPAccelerator builds its own data x tsp layout: pass no fsdp_plugin / "
                             "parallelism_config objects; use ds_configs/accelerate_tsp_fsdp2.yaml instead")
    use_pc = _flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG")
    launched = deepspeed_plugin is not None or any(_flag(env, k) for k in ("ACCELERATE_USE_DEEPSPEED",
                                                                            "ACCELERATE_USE_FSDP"))
    if launched and (tsp_size is not None or cp_size is not None):
        given = "tsp_size" if tsp_size is not None else "cp_size"
        raise TSPConfigError(f"TSPAccelerator({given}=...) with a DeepSpeed or FSDP2 launch config: the degrees come "
                             'from that config (DeepSpeed: the JSON\'s "tsp" block size / cp_size; FSDP2: '
                             "parallelism_config_tp_size / parallelism_config_cp_size); drop the keyword argument")
    if deepspeed_plugin is not None or _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        tsp = _tsp_block_of(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"), deepspeed_plugin)
        if use_pc:
            own = {k: _size(env, k) for k in ("TP_SIZE", "CP_SIZE", "SP_SIZE") if _size(env, k) > 1}
            if own:
                key, value = next(iter(own.items()))
                raise TSPConfigError(
                    f"parallelism_config_{key.lower()}={value} together with the DeepSpeed \"tsp\" block "
                    f"(size {tsp.size}): Accelerate's own tp/cp/sp and TSP would both shard the model or the sequence;"
                    " remove the parallelism_config block (the TSP degree lives in the DeepSpeed JSON)")
        return TSPAccelerateSetup("deepspeed", tsp)
    if _flag(env, "ACCELERATE_USE_FSDP"):
        return _fsdp2_setup(env, use_pc)
    cp_size = 1 if cp_size is None else cp_size
    if tsp_size is None:
        parse_tsp_config({"cp_size": cp_size})  # a bad cp_size is named before it divides anything
        world = int(env.get("WORLD_SIZE", "1"))
        if world % cp_size:
            raise TSPConfigError(f"cp_size={cp_size} does not divide the {world} processes: launch cp_size x tsp_size "
                                 "processes, or pass tsp_size")
        tsp_size = world // cp_size
    return TSPAccelerateSetup("plain", parse_tsp_config({"size": tsp_size, "cp_size": cp_size}))


def _fsdp2_setup(env: MutableMapping[str, str], use_pc: bool) -> TSPAccelerateSetup:
    if env.get("FSDP_VERSION", "1") != "2":
        raise TSPConfigError(f"fsdp_version={env.get('FSDP_VERSION', '1')}: TSP composes with FSDP2 only; set "
                             "fsdp_config: fsdp_version: 2")
    if not use_pc or _size(env, "TP_SIZE") < 1:
        raise TSPConfigError("the FSDP2 config gives no TSP degree: set parallelism_config: "
                             "parallelism_config_tp_size: <TSP degree> and parallelism_config_dp_shard_size: <data "
                             "degree> (see ds_configs/accelerate_tsp_fsdp2.yaml)")
    for key in ("SP_SIZE", "DP_REPLICATE_SIZE"):
        if _size(env, key) > 1:
            raise TSPConfigError(f"parallelism_config_{key.lower()}={_size(env, key)} with TSP: only "
                                 "parallelism_config_dp_shard_size (the data axis, FSDP2), "
                                 "parallelism_config_cp_size (tsp.cp_size) and parallelism_config_tp_size (the TSP "
                                 "degree) are supported")
    if _flag(env, "FSDP_OFFLOAD_PARAMS"):
        raise TSPConfigError("fsdp_offload_params=true is not supported with TSP yet; set it to false")
    tsp, cp, data = _size(env, "TP_SIZE"), _size(env, "CP_SIZE"), _size(env, "DP_SHARD_SIZE")
    world = int(env.get("WORLD_SIZE", "1"))
    if world > 1 and tsp * cp * data != world:
        raise TSPConfigError(f"parallelism_config_tp_size={tsp} x parallelism_config_cp_size={cp} x "
                             f"parallelism_config_dp_shard_size={data} != {world} processes: launch tsp x cp x data "
                             f"processes (--num_processes {tsp * cp * data})")
    setup = TSPAccelerateSetup("fsdp2", parse_tsp_config({"size": tsp, "cp_size": cp}),
                               mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no"),
                               reshard_after_forward=env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true",
                               activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING"))
    # Accelerate's own FSDP / parallelism setup must not run: it would wrap or shard the model a second time.
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        env[key] = "false"
    env["ACCELERATE_MIXED_PRECISION"] = "no"  # the FSDP2 MixedPrecisionPolicy does it, not autocast
    return setup
