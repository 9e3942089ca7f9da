"""Who is where: the rank layout and process groups (topology), the TSP axis held inside a node (placement),
starting ranks (launch) and the one setup path from a "tsp" block to a runtime (runtime)."""
