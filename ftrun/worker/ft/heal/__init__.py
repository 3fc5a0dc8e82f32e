"""What a heal moves (a replica's registered state) and how it moves (over a process group)."""
