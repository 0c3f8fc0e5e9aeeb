"""Benchmarks: `supermem bench alloc` and `supermem bench train`.

Every configuration runs in a fresh process (an allocator swap or an OOM is process-global), and each
table prints the native baseline that ran in the same invocation beside supermem's rows. Adding a row
to the training benchmark is adding a `Mode` (train_modes.py) and, for a new memory saver, an entry in
`train_worker.SAVERS`.
"""
