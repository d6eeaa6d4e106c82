"""`python -m flows.cli`: the same command line (the scheduler starts its runner this way)."""

from flows.cli import main

main()
