"""How the ranks of one instance work together.

A multi-rank instance runs one scheduler process per tensor rank per pipeline stage (`instance/` starts
them). `dist` is how they talk (torch.distributed: gloo on CPU, NCCL on CUDA); the driver (tensor rank 0 of
stage 0) schedules and steps every rank through `group`, and the others follow it; in a P/D role the ranks
agree on each KV transfer's state (`consensus`, `kv`). The engine of an instance (`engine/`) knows nothing of
how many ranks there are beyond the `Comm` it is given.
"""
