"""A Megatron-style mpu for DeepSpeed whose model/tensor-parallel group IS the TSP group.

DeepSpeed reads these methods to size ZeRO's data-parallel group (which must exclude the TSP ranks: they hold
different shards), to name checkpoint files per model-parallel rank, and to count sharded params on every
model-parallel rank in the grad norm. Deliberately absent: initialize_sequence_parallel and
get_sequence_parallel_*, whose presence switches DeepSpeed into its own Ulysses sequence-parallel mode.
"""
from __future__ import annotations

import torch.distributed as dist

from ds_tsp.core.parallel.topology import ProcessGroups


class TSPModelParallelUnit:
    def __init__(self, groups: ProcessGroups):
        self.groups = groups

    # model / tensor parallel == the TSP axis
    def get_model_parallel_group(self):
        return self.groups.tsp_group

    def get_model_parallel_rank(self) -> int:
        return self.groups.tsp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.tsp_size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.layout.tsp_group_ranks(self.groups.rank)[0]

    # data parallel: the ranks holding the same shards (data x cp: the cp groups of a sequence hold them too, so
    # ZeRO partitions and averages over both; ds_tsp.core.parallel.topology)
    def get_data_parallel_group(self):
        return self.groups.data_group

    def get_data_parallel_rank(self) -> int:
        return self.groups.data_rank * self.groups.cp_size + self.groups.cp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.data_size * self.groups.cp_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.groups.layout.data_group_ranks(self.groups.rank)

    # pipeline
    def get_pipe_parallel_group(self):
        return self.groups.pipe_group

    def get_pipe_parallel_rank(self) -> int:
        return self.groups.pipe_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.groups.pipe_size

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def __repr__(self) -> str:
        return (f"TSPModelParallelUnit(rank={dist.get_rank()}, tsp={self.groups.tsp_rank}/{self.groups.tsp_size}, "
                f"data={self.groups.data_rank}/{self.groups.data_size}, pipe={self.groups.pipe_rank}/"
                f"{self.groups.pipe_size})")
