"""Mixture-of-experts under TSP: the layer (layer), routing, the expert GEMMs (experts), the two dispatch schedules
(ring, all_to_all), their cost and the auto choice (cost), and the global load-balancing loss (aux_loss)."""
