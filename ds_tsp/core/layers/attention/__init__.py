"""TSP attention: the head-block schedule (tsp_attention), the local kernels with log-sum-exp (kernels, aten,
varlen), document and window masks (masked), and the cp axis (cp_ring, cp_window)."""
