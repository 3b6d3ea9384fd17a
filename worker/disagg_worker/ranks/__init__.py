"""How the ranks of one instance work together.

A multi-rank instance runs one scheduler process per tensor rank per pipeline stage (`instance/` starts
them). `dist` is how they talk (torch.distributed: gloo on CPU, NCCL on CUDA); the driver (tensor rank 0 of
stage 0) schedules and steps every rank through `group`, and the others follow it; in a P/D role the ranks
agree on each KV transfer's state (`consensus`, `kv`); under DP attention the attention groups' drivers wake
each other (`peers`). The engine (`engine/engine.py`) knows nothing of how many ranks there are: its steps
run on an executor, and `engine/assemble.py` gives a multi-rank driver's engine the one over `group`
(`engine/executor.py`'s `RankExecutor`).
"""
