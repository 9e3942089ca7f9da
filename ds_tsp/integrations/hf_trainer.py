"""`TSPTrainer`: the HF Trainer with TSP, one line changed: `TSPTrainer(...)` in place of `Trainer(...)`.

    args = TrainingArguments(output_dir=..., deepspeed="ds_configs/tsp.json")   # its "tsp" block turns TSP on
    trainer = TSPTrainer(model=hf_llama, args=args, train_dataset=..., data_collator=...)
    trainer.train(); trainer.evaluate(); trainer.save_model()

What it changes, and why (the Trainer's own logic does the rest):
- the model becomes a ds_tsp.hf.TSPForCausalLM on this rank's TSP group before the Trainer sees it, so the
  optimizer it creates steps the shards, and the Accelerator is a ds_tsp TSPAccelerator (data-axis sampling,
  zigzag batches, the TSP mpu for DeepSpeed, TSP-aware clipping and gathering);
- num_items_in_batch (labelled tokens of the whole accumulated global batch, as transformers intends) is counted
  over the TSP group, the cp groups and the data axis, and the model divides by it; `get_tp_size()` reports the
  TSP degree, so the Trainer's loss scaling counts the ranks that share a batch once (it stays data x cp, what
  DeepSpeed averages gradients over); `get_cp_size()` reports tsp.cp_size for the global batch size;
- "cp_size": C (DeepSpeed): batches are cut over cp then TSP by the accelerator's loaders; eval_loss is averaged
  over the cp groups (each holds a part of every sequence); predictions / compute_metrics (full logits) and the
  TRL compositions are refused under cp, naming cp_size;
- evaluation runs UNDER TSP, sharded like training (no switch-off in eval, so an eval at the training length fits);
  evaluate / predict / compute_metrics get what the plain Trainer gives them: the full logits [B, S, V] of each
  eval batch (built from the vocab shards; preprocess_logits_for_metrics runs on them) and the batch's labels,
  full length and unshifted, in the original order (eval loaders carry the unsharded ids); prediction_loss_only
  builds neither;
- `class X(TSPTrainer, SFTTrainer)`: TRL's SFTTrainer on TSP (ds_tsp.integrations.trl.sft; ds_tsp.hf.TSPSFTTrainer);
  `class G(TSPTrainer, GRPOTrainer)`: TRL's GRPO on TSP (ds_tsp.integrations.trl.grpo; ds_tsp.hf.TSPGRPOTrainer);
  `class R(TSPTrainer, RewardTrainer)`: a reward model (ds_tsp.hf.TSPForSequenceClassification, full batches on
  every TSP rank) trained by TRL's RewardTrainer (ds_tsp.integrations.trl.reward; ds_tsp.hf.TSPRewardTrainer);
  `class D(TSPTrainer, DPOTrainer)`: TRL's DPO, policy and reference on TSP (ds_tsp.integrations.trl.dpo;
  ds_tsp.hf.TSPDPOTrainer);
  `class R(TSPTrainer, RLOOTrainer)`: TRL's RLOO on GRPO's machinery (ds_tsp.integrations.trl.rloo;
  ds_tsp.hf.TSPRLOOTrainer);
  other TRL trainers are refused by name when the class is defined;
- save_model writes the HF layout, streamed, from every rank's shards (a collective).
- a vision-language model (transformers' Qwen3.5 / Qwen3-VL ...ForConditionalGeneration, its directory, or a
  ds_tsp.hf.TSPForConditionalGeneration) becomes a TSPForConditionalGeneration that takes the collator's full batch
  (pixels whole) on every TSP rank: its loaders are sampled over the data axis and never cut, the loss is the plain
  Trainer's for that class, saves are in the ForConditionalGeneration layout (ds_tsp.integrations.multimodal);
On CPU the launcher's process group (which TrainingArguments sets up as a 1-process accelerate state) is
re-registered with gloo, so the same command runs on CPU and GPU.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ds_tsp.core.config import check_tsp_key, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.runtime import build_runtime
from ds_tsp.core.shape.hf_config import import_transformers
from ds_tsp.core.tokens.input_check import check_cp_integration
from ds_tsp.integrations.accelerate.dataloaders import TSPShardedLoader, guarded_batches, shard_hf_batch
from ds_tsp.model.convert import to_tsp_model

_transformers = import_transformers()


def _tsp_block(args):
    config = getattr(args, "hf_deepspeed_config", None)
    if config is None:
        return None
    check_tsp_key(config.config)  # a misspelt "tsp" would train silently without TSP
    return parse_tsp_config(config.config.get("tsp"))


def _check_parallelism_config(args, tsp_size: int) -> None:
    pc = getattr(args, "parallelism_config", None)
    if pc is None:
        return
    for key in ("tp_size", "cp_size", "sp_size"):
        if (getattr(pc, key, 1) or 1) > 1:
            raise TSPConfigError(f"TrainingArguments(parallelism_config={key}={getattr(pc, key)}) together with the "
                                 f'"tsp" block (size {tsp_size}): Accelerate\'s {key[:2]} and TSP would both shard '
                                 "the model or the sequence; remove parallelism_config")


def _register_cpu_world() -> None:
    """TrainingArguments created a 1-process accelerate state over a real multi-process group (no CUDA: Accelerate
    chose no backend); re-register it with gloo so world size and barriers are the launcher's."""
    from accelerate import PartialState

    if torch.cuda.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    state = PartialState()
    if state.num_processes == dist.get_world_size():
        return
    PartialState._reset_state()
    PartialState(backend="gloo")


_FULL_BATCH = "tsp_full_batch"  # an eval batch's unsharded input_ids / labels, for predictions and metrics


class _EvalShardedLoader(TSPShardedLoader):
    """TSPShardedLoader for evaluate / predict: each shard also carries the batch's full input_ids and labels
    (token ids: small), so predictions and compute_metrics get them whole and in the original order."""

    def __iter__(self):
        for batch in guarded_batches(self.loader, self.comm):
            sharded = shard_hf_batch(batch, self.comm)
            if isinstance(batch, dict) and "tsp_shard" not in batch:
                sharded[_FULL_BATCH] = {k: batch[k] for k in ("input_ids", "labels", "shift_labels")
                                        if batch.get(k) is not None}
            yield sharded


def _with_full_batch(loader):
    if isinstance(loader, TSPShardedLoader) and not isinstance(loader, _EvalShardedLoader):
        return _EvalShardedLoader(loader.loader, loader.comm, batch_size=loader.batch_size)
    return loader


class TSPTrainer(_transformers.Trainer):
    """transformers' Trainer with TSP: the model becomes this rank's TSP shards, the Accelerator a TSPAccelerator,
    and token counts, evaluation and saving are counted over the whole sequence. TrainingArguments(deepspeed=...)
    gives the "tsp" block; `class X(TSPTrainer, SFTTrainer)` and `(TSPTrainer, GRPOTrainer)` compose with TRL."""

    _tsp_with_sft = False  # composed with TRL's SFTTrainer (ds_tsp.integrations.trl.sft)
    _tsp_with_grpo = False  # composed with TRL's GRPOTrainer (ds_tsp.integrations.trl.grpo)
    _tsp_with_reward = False  # composed with TRL's RewardTrainer (ds_tsp.integrations.trl.reward)
    _tsp_with_dpo = False  # composed with TRL's DPOTrainer (ds_tsp.integrations.trl.dpo)
    _tsp_with_rloo = False  # composed with TRL's RLOOTrainer (ds_tsp.integrations.trl.rloo)
    _tsp_online_rl = None  # "grpo" / "rloo": the online-RL kind, run on ds_tsp.integrations.trl.grpo's machinery
    _tsp_vlm = False  # a vision-language model, full batches on every TSP rank (ds_tsp.integrations.multimodal)

    def __init_subclass__(cls, **kwargs):
        """`class X(TSPTrainer, SFTTrainer)` / `(TSPTrainer, GRPOTrainer)` / `(TSPTrainer, RewardTrainer)` /
        `(TSPTrainer, DPOTrainer)`: TRL's SFT / GRPO / reward modelling / DPO on TSP (and `(TSPTrainer,
        RLOOTrainer)`: RLOO); any other TRL trainer is refused here, by name."""
        super().__init_subclass__(**kwargs)
        from ds_tsp.integrations.trl.sft import check_composition

        kind = check_composition(cls, TSPTrainer)
        cls._tsp_with_sft, cls._tsp_with_grpo, cls._tsp_with_reward = kind == "sft", kind == "grpo", kind == "reward"
        cls._tsp_with_dpo = kind == "dpo"
        cls._tsp_with_rloo = kind == "rloo"
        cls._tsp_online_rl = kind if kind in ("grpo", "rloo") else None

    def __init__(self, model=None, args=None, *more, **kwargs):
        if self._tsp_online_rl:  # GRPOTrainer(model, reward_funcs, args, ...): everything by name from here on
            from ds_tsp.integrations.trl import grpo as trl_grpo
            from ds_tsp.integrations.trl import sft as tsp_trl

            model, args, kwargs = trl_grpo.keyword_arguments(super().__init__, model, args, more, kwargs,
                                                             self._tsp_online_rl)
            more = ()
        if self._tsp_with_dpo:  # DPOTrainer(model, ref_model, args, ...): everything by name from here on
            from ds_tsp.integrations.trl import dpo as trl_dpo
            from ds_tsp.integrations.trl import sft as tsp_trl

            model, args, kwargs = trl_dpo.keyword_arguments(super().__init__, model, args, more, kwargs)
            more = ()
        if args is None:
            raise TSPConfigError("TSPTrainer needs TrainingArguments(deepspeed=<config with a \"tsp\" block>)")
        if kwargs.get("model_init") is not None:
            raise TSPConfigError("model_init is not supported by TSPTrainer: pass the model")
        from ds_tsp.integrations import multimodal as tsp_vlm

        self._tsp_vlm = tsp_vlm.is_vision_language(model)
        if self._tsp_vlm:
            tsp_vlm.check_vlm_trainer("TSPSFTTrainer" if self._tsp_with_sft else
                                      trl_grpo.PUBLIC_NAMES[self._tsp_online_rl] if self._tsp_online_rl else
                                      "TSPDPOTrainer" if self._tsp_with_dpo else
                                      "TSPRewardTrainer" if self._tsp_with_reward else None, model)
            tsp_vlm.check_vlm_arguments(args, kwargs)
        if self._tsp_with_sft:
            from ds_tsp.integrations.trl import sft as tsp_trl

            tsp_trl.check_sft_arguments(super().__init__, model, args, more, kwargs)
        if self._tsp_online_rl:
            trl_grpo.check_grpo_arguments(model, args, kwargs, self._tsp_online_rl)
        if self._tsp_with_rloo:
            from ds_tsp.integrations.trl.rloo import check_rloo_arguments

            check_rloo_arguments(model, args, kwargs)
        if self._tsp_with_reward:
            from ds_tsp.integrations.trl import reward as trl_reward

            trl_reward.check_reward_arguments(super().__init__, model, args, more, kwargs)
        if self._tsp_with_dpo:
            trl_dpo.check_dpo_arguments(model, args, kwargs)
        _ = args.device  # sets the process group up (TrainingArguments does it lazily)
        _register_cpu_world()
        tsp = _tsp_block(args)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if tsp is None:
            if world > 1:
                raise TSPConfigError(f"TSPTrainer on {world} processes needs TrainingArguments(deepspeed=...) whose "
                                     'DeepSpeed config has a "tsp" block, e.g. ds_configs/tsp.json')
            tsp = parse_tsp_config({"size": 1})
        _check_parallelism_config(args, tsp.size)
        if self._tsp_with_sft or self._tsp_online_rl or self._tsp_with_reward or self._tsp_with_dpo:
            # counts, metrics: not cut over cp
            check_cp_integration(tsp.cp_size, "TSPSFTTrainer" if self._tsp_with_sft else
                                 trl_grpo.PUBLIC_NAMES[self._tsp_online_rl] if self._tsp_online_rl else
                                 "TSPDPOTrainer" if self._tsp_with_dpo else "TSPRewardTrainer")
        ds_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
        runtime = build_runtime(tsp, ds_config=ds_config)  # DeepSpeed's cpu_checkpointing: offload_activations
        self.tsp_config = tsp = runtime.config
        self.tsp_groups = runtime.groups
        self.tsp_comm = runtime.comm  # its timeout_s bounds the trainer's own collectives (token counts, loss)
        ref_model = trl_grpo.reference_model(model, args, runtime, to_tsp_model) if self._tsp_online_rl else None
        if self._tsp_with_dpo:  # a LoRA policy with ref_model=None: the reference is its own adapter-off pass
            model, dpo_adapter = trl_dpo.peft_policy(model, kwargs, args)
            ref_model = kwargs["ref_model"] = trl_dpo.reference_model(model, kwargs, args, runtime, to_tsp_model,
                                                                      dpo_adapter)
        if self._tsp_with_reward:
            model = trl_reward.to_reward_model(model, runtime)
        elif self._tsp_vlm:
            model = tsp_vlm.to_vlm_model(model, runtime)
        else:
            model = to_tsp_model(model, runtime.comm, options=runtime.options, data_group=runtime.data_group,
                                 hf_face=True)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self._tsp_with_sft:
            tsp_trl.prepare_model(model)
            with tsp_trl.sft_init():
                super().__init__(model, args, *more, **kwargs)
        elif self._tsp_online_rl:
            trl_grpo.data_axis_batches(args, getattr(runtime.groups, "data_size", 1))
            tsp_trl.prepare_model(model)
            with trl_grpo.grpo_init(ref_model, self._tsp_online_rl):
                super().__init__(model=model, args=args, **kwargs)
            trl_grpo.after_init(self)
        elif self._tsp_with_dpo:
            ref_model = kwargs["ref_model"] = trl_dpo.adapter_reference(model, ref_model, dpo_adapter)
            tsp_trl.prepare_model(model)
            with trl_dpo.dpo_init(ref_model):
                super().__init__(model=model, args=args, **kwargs)
            trl_dpo.after_init(self)
        else:
            super().__init__(model, args, *more, **kwargs)
        if self._tsp_with_reward or self._tsp_with_dpo or self._tsp_vlm:  # no token labels (TRL's label_names),
            return  # or full batches (a VLM: its unshifted labels)
        if set(self.label_names) != {"shift_labels"} and self.label_names in (["labels"], ["labels", "shift_labels"]):
            self.label_names = ["shift_labels"]  # TSP batches carry pre-shifted labels, sharded

    # --- the accelerator -------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own setup, with the TSP accelerator (on this trainer's groups) in place of Accelerator."""
        import transformers.trainer as trainer_module  # it builds `Accelerator(**args)` by this module name

        from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

        original = trainer_module.Accelerator
        trainer_module.Accelerator = partial(TSPAccelerator, tsp_groups=self.tsp_groups)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    def get_tp_size(self) -> int:
        """The ranks that share one batch: the TSP degree (the Trainer divides its token counts and loss scale)."""
        return self.tsp_config.size

    def get_cp_size(self) -> int:
        """The cp groups that share one sequence (tsp.cp_size): the Trainer counts the global batch over the data
        axis alone (world / tsp / cp). Its loss scale reads get_tp_size only, so it stays data x cp: what DeepSpeed
        averages the gradients over (the mpu's data-parallel group spans data x cp)."""
        return self.tsp_config.cp_size

    # --- loss normalisation ------------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """Labelled tokens of the whole accumulated batch, each sample counted once: summed over the micro-batches,
        the TSP group (each rank holds a zigzag part of every sample), the cp groups (each holds a part of every
        sequence) and, with average_tokens_across_devices, the data replicas (the data group spans data x cp, so
        one all-reduce over it covers both)."""
        if self._tsp_vlm:  # as the plain Trainer: the transformers VLM classes take no loss kwargs (multimodal.py)
            return None
        if not batch_samples or "shift_labels" not in batch_samples[0]:
            return None
        local = sum((b["shift_labels"] != -100).sum() for b in batch_samples).to(device=device, dtype=torch.int64)
        groups, comm = self.tsp_groups, self.tsp_comm
        if groups is not None and groups.layout.tsp_enabled:
            with comm.guard("token count all_reduce", group=groups.tsp_group, poll=local.device):
                dist.all_reduce(local, group=groups.tsp_group)
        across_data = self.args.average_tokens_across_devices and groups is not None and \
            (groups.layout.data_enabled or groups.layout.cp_enabled)
        if across_data:
            with comm.guard("token count all_reduce over data", group=groups.data_group, poll=local.device):
                dist.all_reduce(local, group=groups.data_group)
        elif groups is not None and groups.layout.cp_enabled:
            with comm.guard("token count all_reduce over cp", group=groups.cp_group, poll=local.device):
                dist.all_reduce(local, group=groups.cp_group)
        return local

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's (or TRL's SFTTrainer's) compute_loss; with SFT, its num_tokens metric counts the whole
        sequence, not this rank's shard."""
        if not self._tsp_with_sft:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            cp_size = self.tsp_config.cp_size
            if cp_size == 1 or num_items_in_batch is None or self.args.average_tokens_across_devices:
                return result
            # Without average_tokens_across_devices the Trainer does not scale the loss, but DeepSpeed still
            # averages the gradients over data x cp: the cp parts of one replica's mean are summed back (x cp).
            if return_outputs:
                return result[0] * cp_size, result[1]
            return result * cp_size
        from ds_tsp.integrations.trl.sft import count_train_tokens

        before = getattr(self, "_total_train_tokens", 0)
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        count_train_tokens(self, inputs, before)
        return result

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's count (6 x tokens x parameters); store_flos sums it over every process, so under the
        reward and DPO trainers, whose TSP ranks each see the full batch, each rank counts its 1/D of it."""
        flops = super().floating_point_ops(inputs)
        if self._tsp_with_dpo:  # with a PEFT model, TRL's "ref" adapter copy counts as parameters too
            from ds_tsp.integrations.trl.dpo import reference_adapter_flops

            flops += reference_adapter_flops(self, inputs)
        return flops // self.tsp_config.size if self._tsp_with_reward or self._tsp_with_dpo else flops

    # --- evaluation and prediction -------------------------------------------------------------------------------
    def get_eval_dataloader(self, eval_dataset=None):
        if self._tsp_online_rl or self._tsp_with_reward or self._tsp_with_dpo or self._tsp_vlm:  # full batches
            from ds_tsp.integrations.trl.grpo import unsharded

            return unsharded(super().get_eval_dataloader(eval_dataset))
        return _with_full_batch(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        if self._tsp_with_reward or self._tsp_with_dpo or self._tsp_vlm:  # reward, DPO, VLM: full batches
            from ds_tsp.integrations.trl.grpo import unsharded

            return unsharded(super().get_test_dataloader(test_dataset))
        return _with_full_batch(super().get_test_dataloader(test_dataset))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """What the plain Trainer gives evaluate / predict / compute_metrics, under TSP: logits [B, S, V] of every
        position, built from the vocab shards once per eval batch (as the plain Trainer materialises them; with
        preprocess_logits_for_metrics its output on those full logits), and the batch's own labels, full length,
        in the original order (unshifted). prediction_loss_only builds and gathers neither."""
        if self._tsp_with_dpo and not prediction_loss_only:
            raise TSPConfigError("TSPDPOTrainer.predict (or evaluate with prediction_loss_only=False): DPOTrainer "
                                 "would recompute the full [B, S, V] logits of every batch, which TSP never builds; "
                                 "use evaluate() (its loss and rewards/*, logps/*, logits/* metrics) or set "
                                 "DPOConfig(prediction_loss_only=True)")
        if self._tsp_online_rl or self._tsp_with_reward or self._tsp_with_dpo:  # TRL's own (DPO: its loss)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if self._tsp_vlm:  # the full batch: its loss, and with predictions the logits of every position
            keep = {} if prediction_loss_only else {"logits_to_keep": inputs["input_ids"].shape[1]}
            return super().prediction_step(model, {**inputs, **keep}, prediction_loss_only, ignore_keys)
        full = inputs.pop(_FULL_BATCH, None) if isinstance(inputs, dict) else None
        if prediction_loss_only:
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return self._cp_complete(loss), logits, labels
        if self.tsp_config.cp_size > 1:
            raise TSPConfigError(f"tsp.cp_size={self.tsp_config.cp_size}: TSPTrainer evaluates the loss only under "
                                 "cp (the full logits of a sequence split over cp groups are not built); set "
                                 "TrainingArguments(prediction_loss_only=True) and no compute_metrics, or cp_size 1")
        if full is None:
            raise TSPConfigError("TSPTrainer.prediction_step with predictions needs batches from its own "
                                 "get_eval_dataloader / get_test_dataloader (they carry the unsharded labels)")
        seq_len = int(inputs.get("seq_len") or full["input_ids"].shape[1])
        if self._tsp_with_sft:  # TRL's loss and metrics (fused head), then the logits alone
            loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys)
            scoring = {k: v for k, v in self._prepare_inputs(inputs).items() if k not in ("labels", "shift_labels")}
            with torch.no_grad(), self.compute_loss_context_manager():
                logits = model(**scoring, logits_to_keep=seq_len).logits
        else:  # one forward: the loss and the logits of every position
            loss, logits, _ = super().prediction_step(model, {**inputs, "logits_to_keep": seq_len}, False,
                                                      ignore_keys)
        labels = full.get("labels", full.get("shift_labels"))
        if "inputs" in self.args.include_for_metrics:  # evaluation_loop reads the caller's batch: the full ids
            inputs[getattr(self.model, "main_input_name", "input_ids")] = full["input_ids"]
        return loss, logits, None if labels is None else self._prepare_input(labels)

    def _cp_complete(self, loss):
        """Under cp each cp group's loss carries its part of every sequence, scaled by cp (compute_loss: the loss
        scale counts data x cp), so the mean over the cp group is the replica's loss; evaluation gathers the data
        axis only (TSPAccelerator.gather keeps one cp copy), so the cp groups agree on it first."""
        groups = self.tsp_groups
        if loss is None or groups is None or not groups.layout.cp_enabled:
            return loss
        total = loss.detach().clone()
        with self.tsp_comm.guard("evaluation loss all_reduce over cp", group=groups.cp_group, poll=total.device):
            dist.all_reduce(total, group=groups.cp_group)
        return total / groups.cp_size

    # --- TRL's GRPOTrainer / RLOOTrainer steps under TSP (ds_tsp.integrations.trl.grpo; inert otherwise) --------
    def get_train_dataloader(self):  # (the reward trainer's loader too)
        loader = super().get_train_dataloader()
        if not (self._tsp_online_rl or self._tsp_with_reward or self._tsp_with_dpo or self._tsp_vlm):
            return loader
        from ds_tsp.integrations.trl.grpo import unsharded

        return unsharded(loader)  # GRPO's prompt rows, reward / DPO / VLM full batches: data-axis sampled, never cut

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """The completion tokens' log-probs (and entropies) from TSP's streaming head, whole on every rank."""
        from ds_tsp.integrations.trl import grpo as trl_grpo

        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            raise TSPConfigError(f"{trl_grpo.trainer_name(self)} scores text only: {given or 'the MoE aux loss'} is "
                                 "not supported")
        logps, entropies = trl_grpo.completion_logps(self, model, input_ids, attention_mask, logits_to_keep,
                                                     batch_size, compute_entropy)
        return logps, entropies, None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations=None,
                              has_tool_images=False):
        """Without vLLM: the full model gathered on TSP rank 0 of the group generates; completions broadcast.
        (RLOOTrainer's takes no num_generations and returns the completions alone.)"""
        from ds_tsp.integrations.trl import grpo as trl_grpo

        if images is not None or multimodal_fields:
            raise TSPConfigError(f"{trl_grpo.trainer_name(self)} generates text only: the dataset has images")
        if self._tsp_with_rloo:
            if self.use_vllm:
                completion_ids = super()._generate_single_turn(prompt_ids, images, multimodal_fields)
                return trl_grpo.broadcast_vllm_completions(self, completion_ids, None)[0]
            return trl_grpo.generate(self, prompt_ids)
        if self.use_vllm:
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                     num_generations, has_tool_images)
            return trl_grpo.broadcast_vllm_completions(self, completion_ids, logprobs)
        return trl_grpo.generate(self, prompt_ids), None

    def _generate_and_score_completions(self, inputs):
        from ds_tsp.integrations.trl.grpo import data_axis

        with data_axis(self):
            return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs, *return_outputs):
        if self._tsp_with_dpo:  # DPOTrainer._compute_loss(model, inputs, return_outputs)
            from ds_tsp.integrations.trl.dpo import trl_shaped_models

            with trl_shaped_models(self, model) as shaped:
                return super()._compute_loss(shaped, inputs, *return_outputs)
        from ds_tsp.integrations.trl.grpo import data_axis

        with data_axis(self):
            return super()._compute_loss(model, inputs, *return_outputs)

    # --- TRL's DPOTrainer under TSP (ds_tsp.integrations.trl.dpo; only DPOTrainer calls these) ----------------
    def compute_ref_log_probs(self, model, inputs):
        """DPOTrainer's reference log-probs of one batch (precompute_ref_log_probs), the fused head in TRL's shape."""
        from ds_tsp.integrations.trl.dpo import trl_shaped_models

        with trl_shaped_models(self, model) as shaped:
            return super().compute_ref_log_probs(shaped, inputs)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """DPOTrainer's pass over a dataset with the reference, its batches whole on every TSP rank."""
        from ds_tsp.integrations.trl.dpo import unsharded_loaders

        with unsharded_loaders(self):
            return super()._precompute_ref_logps(dataset, name, batch_size)

    # --- saving ------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF layout from every rank's shards (collective: every rank calls it, global rank 0 writes)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.unwrap_model(self.model_wrapped if self.is_deepspeed_enabled else self.model) \
            .save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, f"{output_dir}/training_args.bin")  # as the Trainer does
        with self._world_guard("save_model barrier"):
            self.accelerator.wait_for_everyone()

    # --- the Trainer's own collectives, bounded by tsp.timeout_s -------------------------------------------------
    def _world_guard(self, what: str, comm_errors_only: bool = False):
        """The watchdog around collectives the Trainer (and DeepSpeed under it) posts on the world: a stalled or
        dead peer ends this rank within timeout_s with the one line naming `what` and the peers. comm_errors_only:
        the block's other errors (a bad checkpoint file) propagate as they are (watchdog.Guard)."""
        return self.tsp_comm.guard(what, group=dist.group.WORLD if dist.is_initialized() else None,
                                   context=f"step {self.state.global_step}", comm_errors_only=comm_errors_only)

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        """Logging (the loss all-gather, the flos broadcast) and a checkpoint save (below) are bounded by
        timeout_s; an evaluation is not bounded as a whole (it may outlast timeout_s; its model calls and gathers
        are guarded one by one), so a step that evaluates logs first, guarded, then evaluates and saves."""
        control = self.control
        evaluate, save = control.should_evaluate, control.should_save
        if evaluate:
            control.should_evaluate = control.should_save = False
        try:
            with self._world_guard("the Trainer's loss logging (all_gather, flos broadcast)"):
                super()._maybe_log_save_evaluate(*args, **kwargs)
        finally:
            if evaluate:
                control.should_evaluate, control.should_save = evaluate, save
        if evaluate:  # logged already: this call evaluates and saves only
            super()._maybe_log_save_evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        """The Trainer's checkpoint (the model by save_model, DeepSpeed's or the optimizer's state, RNG, barriers):
        its collectives bounded by timeout_s as one block, so a save must take less than timeout_s. Earlier
        checkpoints stay untouched (the Trainer rotates them only after a complete save)."""
        with self._world_guard("the Trainer's checkpoint save (its and DeepSpeed's collectives)"):
            return super()._save_checkpoint(model, trial)

    def _load_best_model(self):
        """load_best_model_at_end: DeepSpeed's checkpoint load (its barriers and ZeRO gathers) or the model's load,
        bounded by timeout_s as one block, like a checkpoint save."""
        with self._world_guard("the Trainer's best-model load (its and DeepSpeed's collectives)"):
            return super()._load_best_model()

    def store_flos(self):
        """The Trainer's flos broadcast over the world (at a log, a save and the end of training), guarded."""
        with self._world_guard("the Trainer's flos broadcast"):
            return super().store_flos()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The Trainer's one-time setup (accelerator.prepare: deepspeed.initialize under DeepSpeed) and, when
        resuming, its checkpoint load (DeepSpeed's load_checkpoint: barriers, ZeRO gathers; the optimizer's and the
        scheduler's): their collectives bounded by timeout_s as one block, like a checkpoint save."""
        what = "the Trainer's setup (accelerator.prepare, deepspeed.initialize)"
        if resume_from_checkpoint is not None:
            what += " and resume load (DeepSpeed's checkpoint load, the optimizer's)"
        with self._world_guard(what, comm_errors_only=True):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The Trainer's model load on resume (before prepare outside DeepSpeed), bounded like the setup."""
        with self._world_guard("the Trainer's resume load (the model's checkpoint)", comm_errors_only=True):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    # --- resuming ------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's train; a resume_from_checkpoint (True or a path) naming a checkpoint-N whose save was
        interrupted (no trainer_state.json) is refused by name, with the previous complete one to use
        (ds_tsp.integrations.trainer_resume)."""
        from ds_tsp.integrations.trainer_resume import check_resume

        check_resume(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)
