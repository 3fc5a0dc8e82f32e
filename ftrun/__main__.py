"""`python -m ftrun` is the `ftrun` console script."""

from ftrun.cli import main

if __name__ == "__main__":
    main()
