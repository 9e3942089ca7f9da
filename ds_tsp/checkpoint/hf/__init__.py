"""Hugging Face checkpoints in and out by slices: load, save (streamed; collective_save for the gathers), tensors a
rank owns whole (owned_tensors), the name maps of MoE and hybrid layouts, and PEFT adapters (peft_adapter)."""
