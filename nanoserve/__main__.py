"""`python -m nanoserve <command>`."""

from nanoserve.cli import main

main()
