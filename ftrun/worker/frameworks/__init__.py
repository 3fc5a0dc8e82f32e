"""A framework's own training loop under --ft, with no change to the script: the parts every
framework shares (loop.py: the loop's rounds, redone steps and the framework's whole state in
heals; sampler.py: the data's steps; imports.py: putting ftrun's pieces in as the framework is
imported), and each framework's part beside them (lightning.py). Worker-side only; never imports
the supervisor.
"""
