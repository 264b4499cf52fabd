"""Tensor parallelism over torch.distributed: one executor across several devices and hosts.

shard.py     which slice of each weight and adapter a rank holds
comm.py      the process groups, and what a failed collective means
protocol.py  the messages rank 0 sends the other ranks, as tensors
rank.py      what every rank does alike, and the loop of ranks 1..N-1
executor.py  rank 0: the executor the gRPC server serves
launch.py    spawning the ranks, or joining torchrun's world
"""
