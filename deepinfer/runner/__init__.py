"""Running the model: a scheduled step -> forward (eager or CUDA graph) -> samples; SequenceCache for direct use."""
