"""Live run state: written by the supervisor, read by `ftrun status`. No torch here."""
