"""`python -m nanoserve <command>`."""

from nanoserve.serving.cli import main

main()
