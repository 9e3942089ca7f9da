"""`ds-tsp bench`: TSP against its peers on one model, per rank, measured (not estimated).

Layouts (ds_tsp.tools.bench.config.LAYOUTS), each in its own spawned process group so one failure is reported and the
others still run:

    single          HF Llama on one process (baseline)           single.py
    tsp, tsp_speed  TSP memory-optimal / keep gathered K/V       tsp.py
    tsp_kept_projections  TSP without recompute, K/V re-gathered (runs when named)   tsp.py
    dtensor_tp_sp   PyTorch DTensor TP + sequence parallel       dtensor_tp_sp.py
    ulysses_zero3   DeepSpeed Ulysses (ALST) + ZeRO-3            ulysses.py
    ulysses_zero1   DeepSpeed Ulysses (ALST) + ZeRO-1            ulysses.py
    autotp_zero1    DeepSpeed AutoTP + ZeRO-1                    autotp.py

measure.py runs the same protocol on every rank (warm-up, timed steps, one MemTracker-tracked step);
comm_count.py counts collective bytes at the dispatcher; runner.py spawns groups and aggregates ranks;
report.py writes results.json / results.md / PNG plots; cli.py is the command line.
"""
