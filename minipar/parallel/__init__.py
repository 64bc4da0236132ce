"""The parallel mechanisms, one per file: grid, data_parallel (tensor_parallel, pipeline, zero to come)."""
