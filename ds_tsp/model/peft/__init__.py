"""PEFT LoRA on a TSP model: adapters sharded like the weights they adapt (lora), and what MoE refuses (lora_moe)."""
