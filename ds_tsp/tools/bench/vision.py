"""`ds-tsp bench --hf-config <multimodal config> --images N --image-tokens T --videos M --video-tokens F`: a step of
a vision-language model (Qwen3.5 / Qwen3-VL ForConditionalGeneration) with long videos or images, TSP against the
same model under DeepSpeed ZeRO-3 (hf_zero3_dp) or FSDP2 (hf_fsdp2_dp) data parallel, and the vision tower's share
of each rank's peak.

The batch (every layout the same tokens; the data-parallel peers each a batch of their own, seeded per rank, as for
the language models): --batch rows of S tokens; the N images then the M videos dealt round-robin over the rows,
each framed by vision start / end tokens, a video's frames with a timestamp (text) token between them, random text
around; labels the ids, -100 on the vision tokens. An item of T tokens is a grid of frames of (a x b) merged tokens
(a <= b, a x b = the largest divisor of T up to FRAME_TOKENS for a video, T for an image), so a video of F tokens
has F / (a x b) frames (temporal patches); pixels are random, whole on every rank (the model takes the full batch).

Layouts: tsp and tsp_speed (ds_tsp.hf.TSPForConditionalGeneration on the D ranks: the tower replicated, each rank
encoding 1/D of the items), hf_zero3_dp and hf_fsdp2_dp (transformers' model; under FSDP2 the tower's blocks and
the language model's layers are each a fully_shard unit). The tower's share: MemTracker's statistics of the tower
module in the tracked step (ds_tsp.tools.bench.measure.tower_share): the rank's total when the tower's forward
starts and ends and its peak inside the tower (forward and backward), so `activation_bytes` = what the tower's
forward leaves alive for backward (its saved tensors and its output) and `peak_rise_bytes` = how far above its
entry the rank climbs inside it; plus the tower's parameter bytes on the rank (a ZeRO-3 partition, an FSDP2 shard).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

FRAME_TOKENS = 256  # merged tokens per video frame at most (a 448 x 448 frame at patch 14, merge 2)
PEERS = ("tsp", "tsp_speed", "hf_zero3_dp", "hf_fsdp2_dp")


@dataclass(frozen=True)
class VisionBench:
    """The multimodal part of a BenchConfig (plain: sent to spawned ranks)."""

    config_json: str  # the multimodal config.json values (text layers cut to --layers)
    images: int = 0
    image_tokens: int = 0
    videos: int = 0
    video_tokens: int = 0

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)

    def tokens_needed(self, batch: int) -> int:
        """The shortest S that holds the items: per row one leading text token, per item its tokens, per frame the
        start / end tokens and a timestamp (or trailing text) token."""
        rows = [0] * batch
        for i, (tokens, frames) in enumerate(self.items()):
            rows[i % batch] += tokens + 3 * frames
        return 1 + max(rows)

    def items(self) -> list[tuple[int, int]]:
        """(vision tokens, frames) per item: images then videos."""
        return [(self.image_tokens, 1)] * self.images + \
            [(self.video_tokens, self.video_tokens // frame_grid(self.video_tokens, FRAME_TOKENS)[2])] * self.videos


def frame_grid(tokens: int, cap: int) -> tuple[int, int, int]:
    """(a, b, a x b): one frame of a x b merged tokens, a x b the largest divisor of `tokens` up to `cap`, a <= b
    as square as it divides."""
    per_frame = max(d for d in range(1, min(tokens, cap) + 1) if tokens % d == 0)
    a = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    return a, per_frame // a, per_frame


def vision_bench(config: dict, layers: int | None, images: int, image_tokens: int, videos: int,
                 video_tokens: int) -> VisionBench:
    """Checked flags -> VisionBench; ValueError naming the flag."""
    if "vision_config" not in config:
        raise ValueError("--images / --videos: --hf-config has no vision_config (a multimodal Qwen3.5 / Qwen3-VL "
                         "config.json is needed)")
    from ds_tsp.model.hf_conditional_generation import ARCHITECTURES

    if config.get("model_type") not in ARCHITECTURES:
        raise ValueError(f"--hf-config model_type={config.get('model_type')!r}: the vision benchmark runs "
                         f"{', '.join(ARCHITECTURES)}")
    if not images and not videos:
        raise ValueError("--image-tokens / --video-tokens: give --images N or --videos M (N, M >= 1)")
    for count, tokens, flag in ((images, image_tokens, "--image-tokens"), (videos, video_tokens, "--video-tokens")):
        if count and not tokens:
            raise ValueError(f"{flag}: the vision tokens per item are needed with {count} items")
    config = json.loads(json.dumps(config))
    text = config.setdefault("text_config", {})
    if layers is not None:
        text["num_hidden_layers"] = layers
        if text.get("layer_types"):
            text["layer_types"] = text["layer_types"][:layers]
    return VisionBench(json.dumps(config), images, image_tokens if images else 0, videos,
                       video_tokens if videos else 0)


def check_layouts(layouts: list[str]) -> None:
    other = [name for name in layouts if name not in PEERS]
    if other:
        raise ValueError(f"--layouts {other}: with --images / --videos the benchmark runs {', '.join(PEERS)} "
                         "(TSPForConditionalGeneration against transformers' own model under ZeRO-3 or FSDP2 data "
                         "parallel); the other layouts build a text-only model")


def vlm_batch(vision: VisionBench, batch: int, seq: int, seed: int) -> dict:
    """The processor-style batch of the module docstring (float32 pixels)."""
    config = vision.config
    v = config["vision_config"]
    m = v.get("spatial_merge_size", 2)
    pixels_per_patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 16) ** 2
    vocab = config["text_config"]["vocab_size"]
    ids_of = {k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                     "vision_end_token_id")}
    if vision.tokens_needed(batch) > seq:
        raise ValueError(f"--seq {seq}: the images and videos over --batch {batch} rows need S >= "
                         f"{vision.tokens_needed(batch)}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    text = min(set(range(vocab)) - set(ids_of.values()))
    for token in ids_of.values():  # random text never looks like a placeholder
        ids[ids == token] = text
    at = [1] * batch
    grids = {"image": [], "video": []}
    for i, (tokens, frames) in enumerate(vision.items()):
        kind = "image" if i < vision.images else "video"
        a, b, per_frame = frame_grid(tokens, tokens if kind == "image" else FRAME_TOKENS)
        row = i % batch
        for _ in range(frames):
            s = at[row]
            ids[row, s], ids[row, s + 1:s + 1 + per_frame], ids[row, s + 1 + per_frame] = \
                ids_of["vision_start_token_id"], ids_of[f"{kind}_token_id"], ids_of["vision_end_token_id"]
            at[row] = s + per_frame + 3
        grids[kind].append((frames, a * m, b * m))
    images, videos = ids == ids_of["image_token_id"], ids == ids_of["video_token_id"]
    out = {"input_ids": ids, "labels": ids.masked_fill(images | videos, -100),
           "mm_token_type_ids": images.int() + 2 * videos.int()}
    for kind, pixels_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                       ("video", "pixel_values_videos", "video_grid_thw")):
        if grids[kind]:
            grid = torch.tensor(grids[kind])
            out[grid_key] = grid
            out[pixels_key] = torch.randn(int(grid.prod(dim=1).sum()), pixels_per_patch, generator=g)
    return out


def hf_vlm_model(vision: VisionBench, seed: int, checkpointing: bool):
    """transformers' own ForConditionalGeneration of the config (fp32, SDPA), seeded."""
    from ds_tsp.core.shape.hf_config import import_transformers

    transformers = import_transformers()
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**vision.config)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa",
                                                                 dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def tower_of(model) -> torch.nn.Module:
    """The vision tower module of a TSPForConditionalGeneration or transformers' model (an engine unwrapped)."""
    model = getattr(model, "module", model)
    return model.visual if hasattr(model, "visual") else model.model.visual


class TSPSession:
    """Layout tsp: TSPForConditionalGeneration on the D ranks (memory-optimal options), torch AdamW, the full batch
    on every rank."""

    SETUP = ("ds_tsp TSPForConditionalGeneration on one TSP group of D ranks (the tower replicated, 1/D of the "
             "items encoded per rank); torch.optim.AdamW")

    def __init__(self, cfg, options: dict):
        import torch.distributed as dist

        from ds_tsp.core.comm.communicator import TSPComm
        from ds_tsp.core.shape.hf_config import import_transformers
        from ds_tsp.model.hf_conditional_generation import TSPForConditionalGeneration
        from ds_tsp.tools.bench.common import tsp_options

        self.cfg = cfg
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        weights = dist.new_group(list(range(dist.get_world_size()))) if group is not None else None
        self.comm = TSPComm(group, weight_group=weights)
        self.options = tsp_options(options["mode"], cfg.activation_checkpointing == "all", cfg.moe_dispatch)
        torch.manual_seed(cfg.seed)  # the tower's init, identical on every rank (replicated)
        config = import_transformers().AutoConfig.for_model(**cfg.vision.config)
        self.model = TSPForConditionalGeneration(config, self.comm, options=self.options)
        self.model.tsp.init_weights_(cfg.seed)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    def workload(self, seq: int):
        from ds_tsp.tools.bench.common import options_record
        from ds_tsp.tools.bench.measure import Workload

        batch = vlm_batch(self.cfg.vision, self.cfg.batch, seq, self.cfg.seed + 1)

        def step():
            loss = self.model(**batch).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.detach()  # the batch's loss on every rank

        return Workload(step=step, tokens_per_step=batch["input_ids"].numel(), modules=[self.model],
                        optimizers=[self.optimizer], tsp_counter=self.comm.counter, tower=self.model.visual,
                        info={"tsp_options": options_record(self.options), **vision_info(self.cfg.vision, batch)})


class HFSession:
    """Layouts hf_zero3_dp / hf_fsdp2_dp: transformers' own model, every rank a batch of its own (seed + rank)."""

    def __init__(self, cfg, options: dict, engine: str):
        from ds_tsp.tools.bench.common import rank_and_world

        self.cfg = cfg
        self.SETUP = ("transformers' ForConditionalGeneration from the config (SDPA) + " +
                      ("deepspeed.initialize with ZeRO-{stage}" if engine == "zero3" else
                       "torch FSDP2 (fully_shard per vision block, per decoder layer and the root)") +
                      " data parallel over D ranks, each rank a batch of its own; torch AdamW")
        model = hf_vlm_model(cfg.vision, cfg.seed, cfg.checkpointing())
        if engine == "zero3":
            from ds_tsp.tools.bench.deepspeed_common import ds_config, init_distributed

            deepspeed = init_distributed()
            self.rank, self.world = rank_and_world()
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(cfg, zero_stage=int(options["zero_stage"])))
            self.model, self.optimizer = self.engine, None
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            self.rank, self.world = rank_and_world()
            mesh = init_device_mesh("cpu", (self.world,))
            for block in [*tower_of(model).blocks, *model.model.language_model.layers]:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.engine, self.model = None, model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def workload(self, seq: int):
        from ds_tsp.tools.bench.deepspeed_common import torch_optimizers
        from ds_tsp.tools.bench.measure import Workload

        batch = vlm_batch(self.cfg.vision, self.cfg.batch, seq, self.cfg.seed + 1 + self.rank)

        def step():
            loss = self.model(**batch, use_cache=False).loss
            if self.engine is not None:
                self.engine.backward(loss)
                self.engine.step()
            else:
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        module = self.engine.module if self.engine is not None else self.model
        optimizers = torch_optimizers(self.engine) if self.engine is not None else [self.optimizer]
        return Workload(step=step, tokens_per_step=self.world * batch["input_ids"].numel(), modules=[module],
                        optimizers=optimizers, framework_state=[self.engine.optimizer] if self.engine else [],
                        tower=tower_of(module), info=vision_info(self.cfg.vision, batch))


def vision_info(vision: VisionBench, batch: dict) -> dict:
    """What results.json records of the vision workload."""
    out = {"images": vision.images, "image_tokens": vision.image_tokens, "videos": vision.videos,
           "video_tokens": vision.video_tokens}
    for key in ("image_grid_thw", "video_grid_thw"):
        if key in batch:
            out[key] = batch[key].tolist()
    return out
