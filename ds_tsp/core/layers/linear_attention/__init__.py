"""Linear attention under TSP: the Gated DeltaNet layer (gated_deltanet), the chunked delta rule (delta_rule, and
FLA's kernel in delta_rule_fla), and what crosses the zigzag split (scan)."""
