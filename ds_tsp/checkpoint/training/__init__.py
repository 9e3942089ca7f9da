"""ds_tsp's own training checkpoints: weights AND optimizer state per TSP shard, resumable on another layout.

    DIR/step-00000100/manifest.json          layout, model shape, step, versions, sha256 + size of every file
    DIR/step-00000100/tsp00-00001.safetensors  TSP rank 0's shards: fp32 weights, "<name>::exp_avg", ...
    DIR/step-00000100/rng.safetensors        every rank's RNG states

Only safetensors and JSON: loading never unpickles, so no code runs from a checkpoint. A step directory appears
only complete (written under a temporary name, fsync'd, renamed into place; manifest last), so a kill -9 at any
moment of a save leaves the previous checkpoints loadable; the last K are kept. Each file's checksum is verified
before its tensors are used. On another TSP degree the shards are re-cut one module at a time (reshard.py).
Only trainable parameters are saved: frozen ones (a LoRA run's base) have no optimizer state and come from the
model the resuming run loads, so a LoRA checkpoint is its adapter's factors and their optimizer state.

The format and the store know nothing of DeepSpeed: an optimizer adapter (state.py's OptimizerAccess) reads and
writes weights and optimizer state per parameter; ds_tsp.checkpoint.training.deepspeed_access adapts an engine.
"""
from ds_tsp.checkpoint.training.manifest import FORMAT, Manifest, verify_checkpoint
from ds_tsp.checkpoint.training.store import CheckpointStore

__all__ = ["FORMAT", "CheckpointStore", "Manifest", "verify_checkpoint"]
