"""`python -m benchmarks.peerbench`."""

from benchmarks.peerbench.cli import main

main()
