"""Helpers of Lightning's training loop under MeshStrategy: mixed precision and the fp16 scaler (`precision`),
clipping by the global norm of sharded gradients (`grad_norm`), which steps log (`log_steps`), and the progress
bar that counts optimizer steps (`progress`).

Nothing is imported here: each module is imported by its own name."""
