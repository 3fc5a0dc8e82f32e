"""What a --ft script calls: ft.DistributedDataParallel, ft.Optimizer, ft.DataLoader, ft.epochs(), a sharded
replica's wrapper, and the script's own init_process_group() under --ft."""
