"""The replica's member of --ft: its decisions without IO (core.py), the one driver that carries
them out over a small effects interface (driver.py, effects.py), and the worker's effects over
torch and the TCPStore (torch_effects.py). The simulator (ftrun/sim) runs the same driver over
its own effects."""
