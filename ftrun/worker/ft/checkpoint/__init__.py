"""Durable replica state for --ft: the save schedule, the folder, the writer thread, the resume."""
