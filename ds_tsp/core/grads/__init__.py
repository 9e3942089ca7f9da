"""Gradients of a TSP model: replicated weights summed over the TSP group (replicated), averaging over the data
axis for a plain loop (data_parallel), the full model's grad norm and clipping from shards (clip)."""
