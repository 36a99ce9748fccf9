"""`python -m benchmarks.peerbench`."""

from benchmarks.peerbench.bench import main

main()
