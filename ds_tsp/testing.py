"""What checks a TSP run against one device: the single-device reference model with the same parameter names as
the HF Llama family, its weights as one state dict, verify's tolerances, and built-in data and tiny checkpoints (no
download).

    from ds_tsp.testing import ReferenceCausalLM, full_state_dict, init_weights_, RepeatingPatterns
"""
from __future__ import annotations

from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_
from ds_tsp.tools.synthetic import RepeatingPatterns, save_tiny_llama
from ds_tsp.tools.verify import TOLERANCE

__all__ = ["ReferenceCausalLM", "full_state_dict", "init_weights_", "RepeatingPatterns", "save_tiny_llama",
           "TOLERANCE"]
