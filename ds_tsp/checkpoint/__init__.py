"""Every load and save: HF safetensors in (by slices) and out (streamed), consolidated checkpoints, per-rank local
state, ds_tsp training checkpoints. Works on any model that answers the sharded-piece protocol of
ds_tsp.model.sharded_modules, without importing the model classes."""
