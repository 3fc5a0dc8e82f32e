"""Import torch, join the gloo group, leave: the launch-overhead benchmark's workload."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
