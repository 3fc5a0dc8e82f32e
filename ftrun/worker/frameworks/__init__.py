"""A framework's own training loop under --ft, with no change to the script: the parts every
framework shares, and each framework's part beside them (lightning.py, hf.py); and a script's
own loop over a framework's objects, with a drop-in (accelerate.py, fabric.py, sharing
script_loop.py: the loop's position through epochs() and the prepared loaders, a discarded
step's batches given again).

Shared:
- loop.py, FrameworkLoop: the loop as a member of the run: start() (join; a restarted replica
  heals here, before the framework builds its data iterator), step_top() at each step's top,
  until_committed() around the framework's optimizer step (a discarded round is made again, so
  the framework's counters count committed steps), finish(); the framework's whole state as
  registered state (one torch.save blob, in heals and --checkpoint-dir checkpoints alike); a heal
  in place mid-loop restarts the process instead (a framework's loop cannot go back a step).
  across() makes a framework's own collective (a metric's reduce, a barrier) over the live
  replicas where they are in step, and this replica's own value elsewhere.
- sampler.py, StepBatchSampler: the training loader's batches, a fixed number of steps an epoch
  whoever is away, each step split over the live workers; fix() says when a prefetched batch must
  be loaded again for the membership of its step.
- imports.py, after_import(): ftrun's code run as the script imports the framework.

A framework's part supplies: where a step begins and the optimizer step to wrap, capture() and
restore() of its state (its own checkpoint format without the model and optimizer, which ft's
DDP and ft.Optimizer register), the loader rebuilt over StepBatchSampler with position() read
from its loop, and its injection (a registry entry, a callback). Worker-side only; never imports
the supervisor.
"""
